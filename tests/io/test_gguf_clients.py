"""llama.cpp itself (llama-cpp-python) loads the GGUF files lorakit writes and computes
MLX's logits: the fused embedded model, the base plus the GGUF-LoRA, and a random model
of each supported family, tokenization, and the negative controls that must fail
(benchmarks/clients_gguf.py, the committed run's check). Skipped, with the reason, where
llama_cpp is not importable; run it with llama-cpp-python on the path:

  PYTHONPATH=/path/to/site-packages-with-llama_cpp .venv/bin/python -m pytest -m slow \\
      tests/io/test_gguf_clients.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import REPO as ROOT

pytestmark = pytest.mark.slow


def _bench():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                        "'lorakit[clients]'); the llama.cpp check needs it")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import clients_gguf
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return clients_gguf


def test_llama_cpp_logits_match_mlx(tmp_path: Path) -> None:
    import mlx.core as mx

    b = _bench()
    mx.set_default_device(mx.cpu)
    res = b.run(tmp_path, families=("llama", "mixtral", "qwen3", "llama_rope_llama3"))
    assert b.failures(res) == []  # every row within its bound, every control outside
    # the LoRA through llama.cpp is the fused model within 4 bf16 epsilons
    assert res["lora_vs_fused_gguf"]["rel_max_diff"] <= b.LORA_BOUND
    assert res["lora_vs_fused_gguf"]["top1_agreement"] >= b.TOP1_BOUND
    assert all(v["identical"] for v in res["tokenizer"].values())
    assert set(res["controls"]) >= {"llama: q/k rows not permuted",
                                    "llama: LoRA B rows not permuted",
                                    "llama_rope_llama3: rope scaling dropped"}
