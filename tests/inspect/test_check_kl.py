"""``lorakit check --kl`` / ``lorakit.check(..., behaviour=...)``: the behaviour line of
a merge check (fused vs base + unfused adapter on the embedded corpus) sees a right
fuse as near-identical and an adapter left out as far off, and never moves the exit
status."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import DATA

BASE = DATA / "tiny-qwen3"
LORA = DATA / "adapters" / "lora"

pytestmark = pytest.mark.skipif(not (LORA / "adapters.safetensors").exists(),
                                reason="embedded assets not built")


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    import lorakit

    out = tmp_path_factory.mktemp("check_kl") / "fused"
    return lorakit.fuse(BASE, LORA, out, progress=False).output


@pytest.mark.slow  # runs two models over the corpus
def test_right_fuse_behaves_like_the_unfused_adapter(fused) -> None:
    import lorakit

    rep = lorakit.check(fused, BASE, LORA, check_untouched=False, behaviour=True,
                        progress=False)
    b = rep.behaviour
    assert rep.ok and b["tokens"] == 4 * 255
    assert b["mean_kl"] < 1e-3 and b["top1_agreement"] >= 0.99, b
    line = rep.summary["fused vs unfused"]
    assert line.startswith("mean KL ") and "1020 tokens)" in line
    assert "fused vs unfused: mean KL" in str(rep)
    assert rep.to_dict()["behaviour"]["mean_kl"] == b["mean_kl"]


@pytest.mark.slow  # spawns the CLI, runs two models over the corpus
def test_cli_base_as_fused_is_far_and_exit_status_unchanged(tmp_path) -> None:
    """The adapter not applied: the per-tensor verdict says wrong (exit 1, as without
    --kl) and the behaviour line says far (mean KL > 0.1)."""
    cmd = [sys.executable, "-m", "lorakit", "check", "--save-path", str(BASE), "--model",
           str(BASE), "--adapter-path", str(LORA), "--skip-untouched", "--json"]
    plain = subprocess.run(cmd, capture_output=True, text=True)
    kl = subprocess.run(cmd + ["--kl", "--tokens", "512"], capture_output=True, text=True)
    assert plain.returncode == kl.returncode == 1, kl.stderr[-2000:]
    assert "behaviour" not in json.loads(plain.stdout)["check"]
    b = json.loads(kl.stdout)["check"]["behaviour"]
    assert b["mean_kl"] > 0.1 and b["top1_agreement"] < 0.9 and b["tokens"] == 2 * 255, b


def test_behaviour_tokens_rules() -> None:
    from lorakit.errors import LorakitError
    from lorakit.inspect.check import DEFAULT_TOKENS, behaviour_tokens

    assert behaviour_tokens(False) is None and behaviour_tokens(None) is None
    assert behaviour_tokens(True) == DEFAULT_TOKENS and behaviour_tokens(300) == 300
    with pytest.raises(LorakitError):
        behaviour_tokens(1)
