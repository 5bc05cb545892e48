"""On the embedded tiny model, a fused checkpoint generates like the unfused adapter.

Greedy decoding is a chain of argmax decisions, so bits that differ in the last
place can change a token only where two candidates were nearly tied. Per prompt we
record where the fused model first parts from the unfused adapter (if it does) and
the logit gap there, and show that gap is of the size that rounding the fused
weights to bf16 moves logits by, far below the typical margin of a greedy choice.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import lorakit
from lorakit.inspect.generation import compare_generations

DATA = Path(__file__).resolve().parents[2] / "data"
BASE = DATA / "tiny-qwen3"
LORA = DATA / "adapters" / "lora"

pytestmark = pytest.mark.skipif(not (LORA / "adapters.safetensors").exists(),
                                reason="embedded adapter not built")


def prompts() -> list:
    return json.loads((DATA / "prompts.json").read_text())


@pytest.mark.slow  # three models generate on every prompt
def test_fused_follows_unfused_adapter(tmp_path: Path) -> None:
    fused = lorakit.fuse(BASE, LORA, tmp_path / "fused", progress=False).output
    rep = compare_generations({"unfused": (str(BASE), str(LORA)), "fused": (str(fused), None),
                               "base": (str(BASE), None)}, prompts(), max_tokens=24)
    margins = []
    gaps = []
    for i, prompt in enumerate(prompts()):
        margins.extend(rep.generations[i]["unfused"].margin)
        d = rep.first_divergence(i, "unfused", "fused")
        if d is None:
            continue
        gap = d.gap_a if d.a == "unfused" else d.gap_b
        gaps.append(abs(gap))
        # where they part, the unfused adapter itself barely preferred its token
        assert abs(gap) < 0.25, (prompt, d)
    typical = float(np.median(margins))
    assert typical > 4 * max(gaps, default=0.0)
    # the fused model reproduces the adapter's text on most prompts outright
    assert len(gaps) <= len(prompts()) // 2
    # and the adapter really changes the text relative to the base
    changed = sum(rep.first_divergence(i, "unfused", "base") is not None
                  for i in range(len(prompts())))
    assert changed >= len(prompts()) // 2
