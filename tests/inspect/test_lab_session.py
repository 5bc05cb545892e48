"""LabSession.point: the adapter at one scale with LoRA layers off (what AdapterLab shows).

Scale 0 and every layer off are the base exactly; scale 1 is the adapter exactly; any
other point agrees with scale_sweep and layer_effects computed from scratch (the session's
kept logits of base and adapter change nothing); text never shows a raw end token.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import DATA

BASE, LORA = str(DATA / "tiny-qwen3"), str(DATA / "adapters" / "lora")
TOKENS = CONTEXT = 32
PROMPT = "In the beginning"

pytestmark = pytest.mark.skipif(not (DATA / "adapters" / "lora" / "adapters.safetensors")
                                .exists(), reason="embedded assets not built")


@pytest.fixture(scope="module")
def lab():
    from lorakit.inspect.lab import LabSession

    with LabSession(BASE, LORA, tokens=TOKENS, context=CONTEXT) as s:
        yield s


def test_ends_are_the_base_and_the_adapter_exactly(lab) -> None:
    zero, one, dark = lab.point(0.0, prompt=PROMPT), lab.point(1.0, prompt=PROMPT), \
        lab.point(1.0, lab.names, prompt=PROMPT)
    for p in (zero, dark):
        assert p.stats["base"]["max_kl"] == 0.0 and p.rows[2]["diverges_at"] is None
        assert p.rows[2]["text"] == p.rows[0]["text"]
    assert one.stats["adapter"]["max_kl"] == 0.0 and one.rows[2]["text"] == one.rows[1]["text"]
    assert one.stats["base"]["mean_kl"] > 0.01  # the adapter does something


@pytest.mark.slow  # a sweep and layer_effects by module from scratch
def test_a_point_is_what_sweep_and_effects_compute_from_scratch(lab) -> None:
    from lorakit.inspect import layer_effects, scale_sweep

    lab.point(1.0)  # the kept logits are in use below
    sw = scale_sweep(BASE, LORA, scales=(0.5,), tokens=TOKENS, context=CONTEXT, prompt=PROMPT,
                     max_tokens=24)
    p = lab.point(0.5, prompt=PROMPT)
    for k in ("base", "adapter"):
        assert p.stats[k]["mean_kl"] == pytest.approx(sw.stats[0][k]["mean_kl"], rel=1e-6)
    assert p.texts["current"].text == sw.texts[0]
    eff = layer_effects(BASE, LORA, tokens=TOKENS, context=CONTEXT, by="module")
    row = max(eff.rows, key=lambda r: r["kl_removed"])
    got = lab.point(1.0, [row["group"]])
    assert got.stats["adapter"]["mean_kl"] == pytest.approx(row["kl_removed"], rel=1e-6)
    # a different layer off is a different point (a miss would pass any layer)
    other = min(eff.rows, key=lambda r: r["kl_removed"])["group"]
    assert lab.point(1.0, [other]).stats["adapter"]["mean_kl"] < 0.5 * row["kl_removed"]


def test_divergence_and_end_mark(lab) -> None:
    from lorakit.inspect.lab import END_MARK

    p = lab.point(1.0, prompt=PROMPT)
    eos = {lab.tokenizer.decode([i]) for i in lab.tokenizer.eos_token_ids}
    for k, (before, mark, after) in p.segments.items():
        assert not any(e and e in before + mark + after for e in eos), k
        g = p.texts[k]
        ends = g.tokens[-1] in lab.tokenizer.eos_token_ids
        assert (before + mark + after).endswith(END_MARK) == ends
    step = p.rows[1]["diverges_at"]
    base, adapter = p.texts["base"].tokens, p.texts["adapter"].tokens
    assert step is not None and base[:step] == adapter[:step] and base[step] != adapter[step]
    assert p.segments["adapter"][0] == lab.tokenizer.decode(adapter[:step])
    assert "current" in str(p) and p.to_dict()["scale"] == 1.0


def test_bad_layer_name_is_refused(lab) -> None:
    from lorakit.errors import ArgumentError

    with pytest.raises(ArgumentError, match="off"):
        lab.point(1.0, ["model.layers.0.nope"])
    assert np.array_equal([m.scale for m in lab.layers], lab.trained)  # nothing moved
