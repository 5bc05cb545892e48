"""Real clients read lorakit's outputs (benchmarks/clients.py, its quick run): transformers
loads a fused bf16 checkpoint with bf16 kept and MLX's logits, and a fused MoE checkpoint
in ``--layout transformers`` with no missing keys; PEFT's ``merge_and_unload()`` equals
``--rounding round-once`` bit for bit; mlx-lm reads every mlx-lm-format adapter lorakit
writes with lorakit's logits.

torch, transformers and peft are never lorakit's dependencies: they live in another
interpreter (``LORAKIT_CLIENTS_PYTHON``, default /work/scratch-clients/bin/python, else
this one), and the test skips, saying so, where none has them (CI)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = [os.environ.get("LORAKIT_CLIENTS_PYTHON"), "/work/scratch-clients/bin/python",
              sys.executable]


def _clients_python() -> str:
    for py in filter(None, CANDIDATES):
        if not os.path.exists(py):
            continue
        ok = subprocess.run([py, "-c", "import torch, transformers, peft, safetensors"],
                            capture_output=True)
        if ok.returncode == 0:
            return py
    pytest.skip("torch, transformers and peft (the 'clients' extra) are in no interpreter "
                "here: set LORAKIT_CLIENTS_PYTHON to a Python that has them "
                f"(tried {', '.join(filter(None, CANDIDATES))})")


@pytest.mark.slow
def test_real_clients_read_every_output():
    py = _clients_python()
    spec = importlib.util.spec_from_file_location("clients_bench", ROOT / "benchmarks/clients.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.run(py, quick=True)
    dense = res["transformers_dense"]["qwen3"]
    assert dense["param_dtypes"] == ["bfloat16"] and not dense["missing_keys"]
    assert not dense["unexpected_keys"]
    assert dense["f32"]["rel"] <= bench.F32_BOUND and dense["bf16"]["rel"] <= bench.BF16_BOUND
    assert dense["f32"]["top1_agree"]
    moe = res["transformers_moe"]
    assert moe["transformers"]["n_missing"] == moe["transformers"]["n_unexpected"] == 0
    assert moe["transformers"]["f32"]["rel"] <= bench.F32_BOUND
    assert moe["transformers"]["f32"]["top1_agree"]
    assert moe["stacked"]["n_missing"] > 0 and not moe["stacked"]["f32"]["within"]
    assert res["peft"]["all_identical"] and res["peft"]["bit_identical"] == res["peft"]["tensors"]
    assert not res["peft"]["missing_in_peft"] and not res["peft"]["extra_in_peft"]
    assert len(res["mlx_lm_adapters"]) == 4
    for label, c in res["mlx_lm_adapters"].items():
        assert c["rel"] <= bench.F32_BOUND and c["top1_agree"], label
