"""``--quant-policy learned``: mlx-lm's GPTQ re-quantizes the fused weights (issue 15)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import lorakit
from lorakit.errors import FuseError
from lorakit.fusion.quant import calibration_tokens, parse_method, parse_policy
from lorakit.io.checkpoint import open_checkpoint

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "data/tiny-qwen3-4bit"
WEAK = ROOT / "data/adapters/lora-4bit-weak"


def test_learned_parses_to_gptq_and_refuses_what_cannot_run():
    assert parse_policy("learned").kind == "learned"
    assert parse_policy("learned:gptq").kind == "learned"
    assert parse_method("learned") == "gptq"
    for method in ("dwq", "awq"):
        with pytest.raises(FuseError, match="backprop|folds per-channel"):
            parse_policy(f"learned:{method}")
    with pytest.raises(FuseError, match="unknown learned"):
        parse_policy("learned:fancy")


def test_calibration_is_the_training_text_not_the_scored_validation_text(tmp_path):
    class Tok:  # one id per character: enough to check the windows
        def encode(self, text):
            return [ord(c) % 97 for c in text]
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "abcdef"}\n{"text": "ghij"}\n', encoding="utf-8")
    x = np.array(calibration_tokens(Tok(), f, sequence_length=4, samples=8))
    assert x.shape == (2, 4)  # "abcdef\nghij" = 11 ids -> two windows, partial dropped
    assert x[0].tolist() == [ord(c) % 97 for c in "abcd"]
    with pytest.raises(FuseError, match="shorter than one window"):
        calibration_tokens(Tok(), f, sequence_length=64)


@pytest.mark.slow
def test_learned_loads_generates_and_beats_requant_on_kl(tmp_path, capsys):
    from mlx_lm import generate, load

    ref = load(str(BASE), adapter_path=str(WEAK))  # the QLoRA reference, unfused
    res, kl = {}, {}
    for policy in ("requant", "learned"):
        out = tmp_path / policy
        res[policy] = lorakit.fuse(str(BASE), str(WEAK), str(out), progress=False,
                                   quant_policy=policy)
        kl[policy] = lorakit.compare_outputs(ref, str(out), tokens=512, context=256)
    out = tmp_path / "learned"
    model, tok = load(str(out))
    text = generate(model, tok, "The LORD", max_tokens=4)
    assert isinstance(text, str) and text.strip()
    # same layout and bytes as the 4-bit base: one grid, untouched tensors copied
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert res["learned"].bytes_written == res["requant"].bytes_written
    b, o = open_checkpoint(BASE), open_checkpoint(out)
    assert np.array_equal(o.read("model.embed_tokens.weight"), b.read("model.embed_tokens.weight"))
    # GPTQ chose other codes than round-to-nearest of the same fused weights
    name = "model.layers.0.mlp.down_proj.weight"
    r = open_checkpoint(tmp_path / "requant")
    assert not np.array_equal(o.read(name), r.read(name))
    # survival is reported like the other policies
    assert {s.policy for s in res["learned"].requant} == {"learned"}
    surv = np.array([s.survived for s in res["learned"].requant])
    ratio = kl["learned"].mean_kl / kl["requant"].mean_kl
    with capsys.disabled():
        print(f"\nlearned: mean KL vs unfused {kl['learned'].mean_kl:.6f}, requant "
              f"{kl['requant'].mean_kl:.6f} (x{ratio:.3f}); top-1 "
              f"{kl['learned'].top1_agreement:.4f} vs {kl['requant'].top1_agreement:.4f}; "
              f"survived median {np.median(surv):.3f}")
    assert ratio < 0.5  # measured 0.11 (benchmarks/results/quant_policies.json)
    assert kl["learned"].top1_agreement >= kl["requant"].top1_agreement
