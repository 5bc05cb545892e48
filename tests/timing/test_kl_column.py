"""``lorakit time-decode --kl`` / ``time_decode(behaviour=...)``: the "KL vs unfused" column
(each variant's mean KL against the unfused adapter), shown only when asked for."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import DATA

from lorakit.timing.table import DecodeTiming

BASE = DATA / "tiny-qwen3"
LORA = DATA / "adapters" / "lora"

DEV = {"device": "cpu", "backend": "cpu", "kind": "cpu", "mlx": "0", "mlx_lm": "0",
       "python": "3"}


def _table(kl: bool) -> DecodeTiming:
    variants = [dict(variant=n, prefill_tps=[100.0], decode_tps=[50.0], ttft_s=[0.01],
                     peak_bytes=10, weight_bytes={"BF16": 10}, device=DEV, tokens=[1, 2],
                     **({"kl_vs_unfused": k} if kl else {}))
                for n, k in (("base", 2.2), ("unfused", 0.0), ("fused", 4e-5))]
    settings = {"model": "m", "adapter_path": "a", "prompt_tokens": 8, "tokens": 2,
                "repeats": 1, "warmup": 0, **({"kl_tokens": 512} if kl else {})}
    return DecodeTiming.from_dict({"settings": settings, "variants": variants})


def test_column_only_when_asked_and_round_trips() -> None:
    plain, kl = _table(False), _table(True)
    assert "KL vs unfused" not in plain.cols() and "KL vs unfused" not in str(plain)
    assert kl.cols()[-1] == "KL vs unfused"
    assert [r["KL vs unfused"] for r in kl.rows] == [2.2, 0.0, 4e-5]
    assert "KL vs unfused" in kl.summary and "4.000e-05" in str(kl)
    back = DecodeTiming.from_json(kl.to_json())
    assert [v.kl_vs_unfused for v in back.variants] == [2.2, 0.0, 4e-5]


@pytest.mark.slow  # spawns the timing workers and runs three models over the corpus
@pytest.mark.skipif(not (LORA / "adapters.safetensors").exists(),
                    reason="embedded assets not built")
def test_bench_kl_adds_the_column() -> None:
    cmd = [sys.executable, "-m", "lorakit", "time-decode", "--model", str(BASE), "--adapter-path",
           str(LORA), "--variants", "base,unfused,fused", "--tokens", "2", "--repeats", "1",
           "--warmup", "0", "--rounds", "1", "--kl", "--kl-tokens", "256", "--json", "-q"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    kl = {v["variant"]: v["kl_vs_unfused"] for v in d["variants"]}
    assert kl["unfused"] == 0.0
    assert kl["fused"] < 1e-3 and kl["base"] > 0.1, kl
    assert kl["base"] > 1000 * kl["fused"], kl
    t = DecodeTiming.from_dict(d)
    assert [r["KL vs unfused"] for r in t.rows] == [kl["base"], 0.0, kl["fused"]]


def test_a_failed_kl_is_said_not_hidden() -> None:
    t = _table(False)
    t.settings.update(kl_tokens=512, kl_error="cannot load the test model")
    t.refresh()
    assert "failed: cannot load the test model" in t.summary["KL vs unfused"]
    assert "KL vs unfused" not in t.cols()
