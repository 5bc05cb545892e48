"""BENCHMARKS.md's "GGUF for llama.cpp" section states the committed run
(benchmarks/results/clients_gguf.json): its command, and every number in its table."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RES = json.loads((ROOT / "benchmarks" / "results" / "clients_gguf.json").read_text())


def _section() -> str:
    text = (ROOT / "BENCHMARKS.md").read_text()
    start = text.index("## GGUF for llama.cpp")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _rows():
    yield "fused GGUF vs MLX", RES["fused_vs_mlx"]
    yield "base GGUF + GGUF-LoRA vs fused GGUF", RES["lora_vs_fused_gguf"]
    yield "base GGUF + GGUF-LoRA vs MLX unfused", RES["lora_vs_mlx_unfused"]
    for fam, r in RES["families"].items():
        yield f"{fam} random model", r["model"]
        yield f"{fam} + q/k/v/o LoRA", r["lora"]


def test_committed_run_passed_its_bounds() -> None:
    assert RES["failures"] == []
    for _, r in _rows():
        assert r["rel_max_diff"] <= RES["rel_bound"] and r["top1_agreement"] >= RES["top1_bound"]
    assert set(RES["families"]) >= {"llama", "mistral", "mixtral", "qwen2", "qwen3"}


def test_section_states_the_command_and_the_json_numbers() -> None:
    s = _section()
    assert "benchmarks/clients_gguf.py" in s and "clients_gguf.json" in s
    for label, r in _rows():
        m = re.search(rf"\| {re.escape(label)} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)% \|", s)
        assert m, label
        assert float(m.group(1)) == round(r["max_abs_diff"], 4), label
        assert float(m.group(2)) == round(r["rel_max_diff"], 5), label
        assert float(m.group(3)) == round(100 * r["top1_agreement"], 1), label
    assert f"llama-cpp-python {RES['llama_cpp_python']}" in s
    assert f"{RES['rel_bound']}" in s and f"{RES['tokens']} positions" in s
