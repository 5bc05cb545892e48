"""Adapter vs adapter: inner products and subspace angles from the factors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import model_factory as mf
import numpy as np
import pytest

from lorakit.algebra.lowrank import factor_svd
from lorakit.inspect.adapters import compare_adapters, delta_inner, principal_angles


def test_delta_inner_matches_explicit() -> None:
    rng = np.random.default_rng(0)
    for r1, r2 in ((1, 1), (4, 8), (8, 3)):
        A1, B1 = rng.normal(size=(r1, 30)), rng.normal(size=(20, r1))
        A2, B2 = rng.normal(size=(r2, 30)), rng.normal(size=(20, r2))
        want = float(np.sum((1.5 * B1 @ A1) * (-0.25 * B2 @ A2)))
        assert delta_inner(A1, B1, 1.5, A2, B2, -0.25) == pytest.approx(want, rel=1e-10)


def test_principal_angles_known() -> None:
    e = np.eye(5)
    assert principal_angles(e[:, :2], e[:, :2]).tolist() == [0.0, 0.0]
    assert np.allclose(principal_angles(e[:, :2], e[:, 2:4]), [90.0, 90.0])
    c, s = np.cos(np.radians(30)), np.sin(np.radians(30))
    v = (c * e[:, 0] + s * e[:, 2])[:, None]
    assert np.allclose(principal_angles(e[:, :1], v), [30.0])
    # a rotation inside the same span changes nothing
    rot = e[:, :2] @ np.array([[c, -s], [s, c]])
    assert np.allclose(principal_angles(e[:, :2], rot), [0.0, 0.0], atol=1e-6)


def rescaled(src: Path, dst: Path, factor: float, negate_b: bool = False) -> Path:
    """Copy of an mlx-lm adapter with its scale multiplied (and lora_b negated)."""
    import mlx.core as mx

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["lora_parameters"]["scale"] *= factor
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if negate_b:
        w = mx.load(str(dst / "adapters.safetensors"))
        w = {k: (-v if k.endswith("lora_b") else v) for k, v in w.items()}
        mx.save_safetensors(str(dst / "adapters.safetensors"), w)
    return dst


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("adapters")
    base = mf.make_model(root / "base", "qwen3")
    a = mf.make_adapter(base, root / "a", seed=1)
    b = mf.make_adapter(base, root / "b", seed=2,
                        keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"))
    return {"root": root, "base": base, "a": a, "b": b,
            "a3": rescaled(a, root / "a3", 3.0), "neg": rescaled(a, root / "neg", 1.0, True)}


def test_same_directions(adapters: dict) -> None:
    rep = compare_adapters(adapters["a"], adapters["a3"], adapters["base"])
    for r in rep.rows:
        assert r["status"] == "both"
        assert r["cosine"] == pytest.approx(1.0, abs=1e-9)
        assert r["fro_b"] == pytest.approx(3 * r["fro_a"], rel=1e-9)
        assert r["rel_b"] == pytest.approx(3 * r["rel_a"], rel=1e-9)
        assert r["col_angle"] == pytest.approx(0.0, abs=1e-3)
        assert r["col_overlap"] == pytest.approx(1.0, abs=1e-9)
        assert r["row_overlap"] == pytest.approx(1.0, abs=1e-9)
    assert rep.summary["overall cosine"] == pytest.approx(1.0)
    neg = compare_adapters(adapters["a"], adapters["neg"])
    assert all(r["cosine"] == pytest.approx(-1.0, abs=1e-9) for r in neg.rows)
    assert all(r["col_overlap"] == pytest.approx(1.0, abs=1e-9) for r in neg.rows)


def test_different_adapters(adapters: dict) -> None:
    from lorakit.io.adapters.load import load_adapter

    rep = compare_adapters(adapters["a"], adapters["b"])
    st = {r["module"]: r["status"] for r in rep.rows}
    assert st["layers.0.self_attn.q_proj"] == "both"
    assert st["layers.0.mlp.down_proj"] == "only in A"
    assert st["layers.0.mlp.up_proj"] == "only in B"
    assert rep.summary["only in A"] == 2 and rep.summary["only in B"] == 2
    ta = {t.module: t for t in load_adapter(adapters["a"]).targets}
    tb = {t.module: t for t in load_adapter(adapters["b"]).targets}
    for r in rep.rows:
        if r["status"] != "both":
            continue
        m = "model." + r["module"]
        da = ta[m].scale * ta[m].B.astype(np.float64) @ ta[m].A
        db = tb[m].scale * tb[m].B.astype(np.float64) @ tb[m].A
        cos = float(np.sum(da * db) / (np.linalg.norm(da) * np.linalg.norm(db)))
        assert r["cosine"] == pytest.approx(cos, abs=1e-9)
        Ua = np.linalg.svd(da)[0][:, :4]
        Ub = np.linalg.svd(db)[0][:, :4]
        cosines = np.linalg.svd(Ua.T @ Ub, compute_uv=False)
        want = np.degrees(np.arccos(np.clip(cosines, 0, 1)))
        i = rep.rows.index(r)
        assert np.allclose(rep.col_angles[i], want, atol=1e-5)
    from matplotlib.figure import Figure

    assert isinstance(rep.plot(), Figure) and isinstance(rep.plot("cosine"), Figure)


def test_factor_svd_subspace_is_exact() -> None:
    rng = np.random.default_rng(5)
    A, B = rng.normal(size=(3, 12)), rng.normal(size=(9, 3))
    U, S, Vt = factor_svd(A, B, 2.0)
    assert np.allclose(U.T @ U, np.eye(3)) and np.allclose(Vt @ Vt.T, np.eye(3))
