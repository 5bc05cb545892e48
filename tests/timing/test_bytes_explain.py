"""``time_decode`` says why: the decode ratio the weight bytes predict beside each
measured ratio, the achieved weight bytes per second, and a verdict (bytes explain
it, or not the bytes) in the table, the JSON and the HTML the widget shows."""
from __future__ import annotations

import math

import pytest

from lorakit.timing.stats import bytes_explain
from lorakit.timing.table import DecodeTiming, VariantTiming


def test_bytes_explain_words() -> None:
    # H200, Qwen3-8B promoted: bytes 1.377x predict 0.73x; measured 0.74x [0.70, 0.78]
    pred, why = bytes_explain(0.74, (0.70, 0.78), 1.377)
    assert pred == pytest.approx(0.726, abs=1e-3) and why.startswith("bytes explain it")
    # 1.7B: bytes predict 0.68x, measured 0.89x: launch-bound, not the bytes
    pred, why = bytes_explain(0.89, (0.86, 0.92), 1 / 0.68)
    assert why.startswith("not the bytes: bound by launches or compute")
    # same bytes, measured 0.6x outside any noise: a slower path
    assert bytes_explain(0.6, (0.55, 0.65), 1.0)[1].startswith("not the bytes: a slower path")
    # the base's own noise widens the interval: 0.6x with the base moving 0.5-2x
    assert bytes_explain(0.6, (0.55, 0.65), 1.0, noise=(0.5, 2.0))[1].startswith("bytes")
    assert bytes_explain(0.9, (math.nan, math.nan), 1.0) == (1.0, "")
    assert math.isnan(bytes_explain(0.9, (0.8, 1.0), math.nan)[0])


def _variant(name: str, tps, f32: int = 0, bf16: int = 1_000_000) -> VariantTiming:
    return VariantTiming(variant=name, decode_tps=list(tps), prefill_tps=[1.0] * len(tps),
                         ttft_s=[0.1] * len(tps), run_rounds=[0, 0, 1, 1, 2, 2],
                         weight_bytes={"BF16": bf16, **({"F32": f32} if f32 else {})})


def test_table_json_and_html_have_the_columns() -> None:
    t = DecodeTiming(title="", settings={"model": "m", "repeats": 2}, variants=[
        _variant("base", [100, 101, 99, 100, 102, 98]),
        _variant("promoted", [55, 56, 54, 55, 56, 54], f32=2_000_000, bf16=0)])
    promoted = t.rows[1]
    assert promoted["bytes predict"] == pytest.approx(0.5)
    assert promoted["weights GB/s"] == pytest.approx(55 * 2e6 / 1e9)
    assert promoted["why"].startswith("not the bytes: bound by launches or compute")
    assert t.rows[0]["bytes predict"] == 1.0 and t.rows[0]["why"] == ""
    d = t.to_dict()
    assert d["rows"][1]["why"] == promoted["why"]
    assert "bytes predict" in t._repr_html_() and "weights GB/s" in str(t)
    assert DecodeTiming.from_dict(d).rows[1]["bytes predict"] == pytest.approx(0.5)
