"""Delta norms from the factors, checked against forming dW explicitly."""
from __future__ import annotations

import json
import math
from pathlib import Path

import model_factory as mf
import numpy as np
import pytest

from lorakit import numerics as nm
from lorakit.algebra.lowrank import factor_svd
from lorakit.inspect.deltas import delta_norms, effective_rank, numerical_rank
from lorakit.io.formats.checkpoint import Checkpoint


def orthonormal(rng, n: int, k: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.normal(size=(n, k)))
    return q


@pytest.mark.parametrize("seed", range(5))
def test_factor_svd_matches_explicit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    out, inn, r = rng.integers(5, 60, size=2).tolist() + [int(rng.integers(1, 9))]
    A = rng.normal(size=(r, inn)).astype(np.float32)
    B = rng.normal(size=(out, r)).astype(np.float32)
    scale = float(rng.uniform(0.1, 4))
    U, S, Vt = factor_svd(A, B, scale)
    dW = scale * B.astype(np.float64) @ A.astype(np.float64)
    S_ref = np.linalg.svd(dW, compute_uv=False)
    k = S.size
    assert np.allclose(S, S_ref[:k], rtol=1e-10, atol=1e-12 * S_ref[0])
    assert np.allclose(U * S @ Vt, dW, atol=1e-10 * S_ref[0])
    assert math.isclose(math.sqrt((S ** 2).sum()), np.linalg.norm(dW), rel_tol=1e-10)


def test_planted_rank_and_singular_values() -> None:
    """dW = U diag(s) V^T with s = (3, 3, 0, 0) through rank-4 factors: rank 2, erank 2."""
    rng = np.random.default_rng(7)
    s = np.array([3.0, 3.0, 0.0, 0.0])
    U, V = orthonormal(rng, 40, 4), orthonormal(rng, 30, 4)
    B = U * s  # (out, r)
    A = V.T  # (r, in)
    _, S, _ = factor_svd(A, B, 1.0)
    assert np.allclose(S, s, atol=1e-12)
    assert numerical_rank(S, (40, 30)) == 2
    assert effective_rank(S) == pytest.approx(2.0)
    # decaying spectrum: entropy rank strictly between 1 and the count
    assert 1 < effective_rank(np.array([4.0, 2.0, 1.0])) < 3


def write_adapter(path: Path, targets: dict, scale: float) -> Path:
    """mlx-lm adapter from {module: (A (r, in), B (out, r))}."""
    import mlx.core as mx

    path.mkdir(parents=True)
    tensors = {}
    for m, (A, B) in targets.items():
        tensors[f"{m}.lora_a"] = mx.array(A.T.astype(np.float32))
        tensors[f"{m}.lora_b"] = mx.array(B.T.astype(np.float32))
    mx.save_safetensors(str(path / "adapters.safetensors"), tensors)
    r = next(iter(targets.values()))[0].shape[0]
    (path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2,
         "lora_parameters": {"rank": r, "scale": scale, "dropout": 0.0}}))
    return path


def test_delta_norms_on_planted_adapter(tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "base", "llama")
    rng = np.random.default_rng(3)
    q = "model.layers.0.self_attn.q_proj"
    d = "model.layers.1.mlp.down_proj"
    sq = np.array([0.5, 0.25, 0.0, 0.0])  # rank 2 of 4
    Aq, Bq = orthonormal(rng, 64, 4).T, orthonormal(rng, 64, 4) * sq
    Ad, Bd = rng.normal(size=(4, 96)) * 0.1, rng.normal(size=(64, 4)) * 0.1
    ad = write_adapter(tmp_path / "ad", {q: (Aq, Bq), d: (Ad, Bd)}, scale=2.0)
    rep = delta_norms(ad, base)
    rows = {r["module"]: r for r in rep.rows}
    ck = Checkpoint(base)
    for m, (A, B) in ((q, (Aq, Bq)), (d, (Ad, Bd))):
        dW = 2.0 * B.astype(np.float32).astype(np.float64) @ A.astype(np.float32).astype(
            np.float64)
        W = nm.to_float64(ck.read(f"{m}.weight"), "bf16")
        r = rows[m]
        assert r["fro"] == pytest.approx(np.linalg.norm(dW), rel=1e-9)
        assert r["spectral"] == pytest.approx(np.linalg.norm(dW, 2), rel=1e-9)
        assert r["w_fro"] == pytest.approx(np.linalg.norm(W), rel=1e-12)
        assert r["rel"] == pytest.approx(np.linalg.norm(dW) / np.linalg.norm(W), rel=1e-9)
    assert rows[q]["nrank"] == 2 and rows[d]["nrank"] == 4
    assert rows[q]["fro"] == pytest.approx(2.0 * math.sqrt(0.5 ** 2 + 0.25 ** 2), rel=1e-6)
    i = [r["module"] for r in rep.rows].index(q)
    assert np.allclose(rep.singular_values[i][:2], [1.0, 0.5], rtol=1e-6)
    assert rep.summary["max rel"] == max(r["rel"] for r in rep.rows)
    assert q in str(rep)


def test_switch_targets_per_expert(tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "moe", "qwen3_moe")
    ad = mf.make_adapter(base, tmp_path / "ad", keys=("mlp.switch_mlp.gate_proj",))
    rep = delta_norms(ad, base)
    from lorakit.io.adapters.load import load_adapter

    t = load_adapter(ad).targets[0]
    experts = [r for r in rep.rows if r["module"] == t.module]
    assert [r["expert"] for r in experts] == list(range(t.A.shape[0]))
    ck = Checkpoint(base)
    W = nm.to_float64(ck.read(f"{t.module}.weight"), "bf16")
    for e, r in enumerate(experts):
        dW = t.scale * t.B[e].astype(np.float64) @ t.A[e].astype(np.float64)
        assert r["fro"] == pytest.approx(np.linalg.norm(dW), rel=1e-9)
        assert r["w_fro"] == pytest.approx(np.linalg.norm(W[e]), rel=1e-12)


def test_plots(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    base = mf.make_model(tmp_path / "base", "qwen3")
    ad = mf.make_adapter(base, tmp_path / "ad")
    rep = delta_norms(ad, base)
    assert isinstance(rep.plot(), Figure) and isinstance(rep.plot("spectra"), Figure)
    assert isinstance(delta_norms(ad).plot(), Figure)  # no base: ||dW||_F map
