"""``compare_outputs(..., base=...)``: the effect kept, 1 - KL(adapter || test) /
KL(adapter || base), and the bootstrap intervals over windows of every mean.

The intervals are checked for coverage on a case with a known answer (synthetic
per-token numbers of known mean); the effect kept for its two ways to go wrong: a
right fuse must read >= 0.99 (no false alarm), a fuse at half the scale or with one
layer's delta dropped must read clearly below (no miss).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import DATA

BASE, LORA = str(DATA / "tiny-qwen3"), str(DATA / "adapters" / "lora")


def _arrays(kl: np.ndarray, base_kl: np.ndarray = None):
    n = kl.size
    a = {"kl": kl, "top1_agree": kl < 1.0, "ref_top1": np.zeros(n, np.int32),
         "test_top1": np.zeros(n, np.int32), "ref_nll": kl, "test_nll": kl}
    if base_kl is not None:
        a["base_kl"] = base_kl
    return a


def test_intervals_cover_a_known_mean(monkeypatch) -> None:
    """Per-token KL drawn from an exponential of mean 0.5 (top-1 agreement then has
    mean 1 - exp(-2)): the 95% intervals over 20 windows hold the true means in about
    95% of 100 corpora."""
    from lorakit.bootstrap import window_intervals
    from lorakit.inspect.behaviour import kl_stats

    rng = np.random.default_rng(0)
    hits = {"mean_kl": 0, "top1_agreement": 0}
    truth = {"mean_kl": 0.5, "top1_agreement": 1 - math.exp(-2)}
    monkeypatch.setitem(window_intervals.__kwdefaults__, "resamples", 400)  # fast
    for _ in range(100):
        s = kl_stats(_arrays(rng.exponential(0.5, 20 * 31)), 31)
        for k in hits:
            lo, hi = s[f"{k}_interval"]
            assert lo <= s[k] <= hi
            hits[k] += lo <= truth[k] <= hi
    for k, h in hits.items():
        assert 85 <= h <= 100, (k, h)


def test_effect_kept_known_answers() -> None:
    from lorakit.inspect.behaviour import kl_stats

    base = np.full(4 * 9, 2.0)
    arrays = _arrays(np.full(4 * 9, 0.5), base)
    s = kl_stats(arrays, 9)
    assert s["effect_kept"] == pytest.approx(0.75) and s["mean_kl_base"] == 2.0
    assert s["effect_kept_interval"] == pytest.approx([0.75, 0.75])
    assert np.allclose(arrays["effect_kept"], 0.75)
    one = kl_stats(_arrays(np.zeros(9), np.zeros(9)), 9)  # one window: no interval
    assert math.isnan(one["effect_kept"]) and all(map(math.isnan, one["mean_kl_interval"]))


def test_window_intervals_pair_the_columns() -> None:
    """A ratio of two columns that move together has a narrow interval: both are
    drawn from the same windows."""
    from lorakit.bootstrap import window_intervals

    a = [1.0, 10.0, 100.0, 1000.0]
    spans = window_intervals({"a": a, "b": [2 * x for x in a]},
                             {"ratio": lambda t: t["a"] / t["b"], "a": lambda t: t["a"]})
    assert spans["ratio"] == (0.5, 0.5) and spans["a"][0] < spans["a"][1]


@pytest.fixture(scope="module")
def fuses():
    """(model, tokenizer) pairs: the unfused adapter, its right in-memory fuse, a fuse
    at half the scale and one with layer 0's deltas dropped."""
    import mlx_lm

    from lorakit.fusion import attach_adapter
    from lorakit.fusion.model import fuse_model

    def fused(edit=None):
        model, tok = mlx_lm.load(BASE)[:2]
        attach_adapter(model, LORA)
        for name, m in model.named_modules():
            if edit is not None and hasattr(m, "lora_a"):
                m.scale = edit(name, m.scale)
        return fuse_model(model), tok

    return {"right": fused(), "half": fused(lambda n, s: s / 2),
            "no layer 0": fused(lambda n, s: 0.0 if ".layers.0." in f".{n}." else s)}


@pytest.mark.slow  # four models over 512 tokens
def test_effect_kept_no_false_alarm_and_no_miss(fuses) -> None:
    import lorakit

    kept = {}
    for name, pair in fuses.items():
        rep = lorakit.compare_outputs((BASE, LORA), pair, tokens=512, context=128, base=BASE)
        kept[name] = (rep.effect_kept, rep.effect_kept_interval)
        assert rep.summary["base"] == BASE and "effect_kept" in rep.to_dict()
        assert rep.arrays["effect_kept"].shape == rep.arrays["kl"].shape
    assert kept["right"][0] >= 0.99, kept
    for wrong in ("half", "no layer 0"):
        assert kept[wrong][1][1] < 0.95, kept  # the whole interval below
