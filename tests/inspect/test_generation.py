"""Greedy output comparison: identical models agree, an adapter that matters diverges,
and the recorded logit gaps are what the models compute."""
from __future__ import annotations

import mlx.core as mx
import model_factory as mf
import numpy as np
import pytest

import lorakit
from lorakit.inspect.generation import compare_generations

PROMPTS = ["w1 w2 w3", "w40 w7"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gen")
    # float32 weights: cached decode and a plain forward agree to ~1e-7, so the gaps
    # recorded during decoding can be checked against an independent forward pass
    base = mf.make_model(root / "base", "llama", dtype=mx.float32)
    strong = mf.make_adapter(base, root / "strong", scale=40.0, b_std=0.05,
                             keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj",
                                   "mlp.up_proj"))
    fused = lorakit.fuse(base, strong, root / "fused", progress=False).output
    return {"base": base, "strong": strong, "fused": fused}


def full_logits(model, ids) -> np.ndarray:
    """Last-position logits of a plain forward pass (no cache)."""
    return np.array(model(mx.array(ids)[None])[0, -1].astype(mx.float32))


def test_same_model_twice_is_identical_and_reproducible(models: dict) -> None:
    from mlx_lm import load

    pair = load(str(models["base"]))
    spec = {"a": pair, "b": (models["base"], None)}
    r1 = compare_generations(spec, PROMPTS, max_tokens=8)
    r2 = compare_generations(spec, PROMPTS, max_tokens=8)
    assert all(not d for d in r1.divergences)
    assert r1.summary["prompts with identical outputs"] == "2 of 2"
    for g1, g2 in zip(r1.generations, r2.generations):
        assert g1["a"].tokens == g1["b"].tokens == g2["a"].tokens
        n = len(g1["a"].tokens)
        assert 1 <= n <= 8 and len(g1["a"].margin) == n
        assert n == 8 or g1["a"].tokens[-1] == 2  # stopped early only on </s>
    assert all(r["diverges_at"] is None for r in r1.rows)


def test_divergence_and_gaps(models: dict) -> None:
    from mlx_lm import load

    rep = compare_generations({"base": (models["base"], None),
                               "adapter": (models["base"], models["strong"]),
                               "fused": (models["fused"], None)}, PROMPTS, max_tokens=10)
    divs = [d for p in rep.divergences for d in p if (d.a, d.b) == ("base", "adapter")]
    assert divs, "a scale-40 adapter should change some greedy token"
    base_model, _ = load(str(models["base"]))
    ad_model, _ = load(str(models["base"]), adapter_path=str(models["strong"]))
    for p, prompt_divs in enumerate(rep.divergences):
        for d in prompt_divs:
            if (d.a, d.b) != ("base", "adapter"):
                continue
            ga, gb = rep.generations[p]["base"], rep.generations[p]["adapter"]
            s = d.step
            assert ga.tokens[:s] == gb.tokens[:s] and ga.tokens[s] != gb.tokens[s]
            assert (d.token_a, d.token_b) == (ga.tokens[s], gb.tokens[s])
            ids = ga.prompt_ids + ga.tokens[:s]
            la, lb = full_logits(base_model, ids), full_logits(ad_model, ids)
            assert int(la.argmax()) == d.token_a and int(lb.argmax()) == d.token_b
            assert d.gap_a == pytest.approx(la[d.token_a] - la[d.token_b], abs=1e-4)
            assert d.gap_b == pytest.approx(lb[d.token_b] - lb[d.token_a], abs=1e-4)
            assert d.gap_a >= 0 and d.gap_b >= 0
            top2 = np.sort(la)[-2]
            assert d.margin_a == pytest.approx(la.max() - top2, abs=1e-4)
            row = next(r for r in rep.rows if r["prompt"] == p and r["model"] == "adapter")
            assert row["diverges_at"] == s and row["gap"] == d.gap_b
    text = str(rep)
    assert "diverges_at" in text and rep.generations[0]["base"].text in text
    from matplotlib.figure import Figure

    assert isinstance(rep.plot(), Figure)


def test_needs_two_models(models: dict) -> None:
    with pytest.raises(lorakit.LorakitError):
        compare_generations({"only": models["base"]}, PROMPTS)
