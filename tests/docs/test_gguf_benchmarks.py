"""BENCHMARKS.md's "GGUF in llama.cpp" section states the committed run
(benchmarks/results/clients_gguf.json): its command, its bounds, and every number in its
tables, rebuilt here from the JSON and parsed back row by row."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RES = json.loads((ROOT / "benchmarks" / "results" / "clients_gguf.json").read_text())
TEXT = (ROOT / "BENCHMARKS.md").read_text()


def _bench():
    spec = importlib.util.spec_from_file_location(
        "clients_gguf", ROOT / "benchmarks" / "clients_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports nothing heavy at module level
    return mod


def _section() -> str:
    start = TEXT.index("## GGUF in llama.cpp")
    end = TEXT.find("\n## ", start + 1)
    return TEXT[start:end if end > 0 else None]


def test_committed_run_passed_its_bounds() -> None:
    b = _bench()
    assert RES["failures"] == [] and b.failures(RES) == []
    assert (RES["rel_bound"], RES["lora_bound"], RES["top1_bound"]) == \
        (b.REL_BOUND, b.LORA_BOUND, b.TOP1_BOUND) and RES["lora_bound"] == 4 * 2.0 ** -8
    for _, r, bound in b._rows(RES):
        assert r["rel_max_diff"] <= bound and r["top1_agreement"] >= RES["top1_bound"]
        assert r["top1_unexplained"] == 0
    assert set(RES["families"]) >= {"llama", "mistral", "mixtral", "qwen2", "qwen3",
                                    "qwen3_moe"}
    for v in RES["controls"].values():
        assert v["rel_max_diff"] > RES["control_factor"] * RES["rel_bound"]
    assert all(v["identical"] and v["round_trip"] for v in RES["tokenizer"].values())
    assert {v["pre"] for v in RES["tokenizer"].values()} == {"gpt-2", "qwen2", "llama-bpe"}


def test_section_states_the_command_and_the_json_tables() -> None:
    b = _bench()
    s = _section()
    assert "benchmarks/clients_gguf.py --out benchmarks/results/clients_gguf.json" in s
    assert b.markdown(RES) in s  # every table and line, word for word
    for label, r, bound in b._rows(RES):  # and parsed back, independently of markdown()
        m = re.search(rf"\| {re.escape(label)} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                      rf"([\d.]+)% \|", s)
        assert m, label
        assert float(m.group(1)) == round(r["max_abs_diff"], 4), label
        assert float(m.group(2)) == round(r["rel_max_diff"], 5), label
        assert float(m.group(3)) == bound, label
        assert float(m.group(4)) == round(100 * r["top1_agreement"], 1), label


def test_section_prose_numbers_are_the_json() -> None:
    s = " ".join(_section().split())
    assert f"llama-cpp-python {RES['llama_cpp_python']}" in s
    assert f"same {RES['tokens']} positions" in s
    assert f"bound against MLX is {RES['rel_bound']} of the largest logit" in s
    assert f"(4 x 2**-8 = {RES['lora_bound']})" in s
    assert f"q/k weights std {RES['qk_std']}" in s and f"routers std {RES['router_std']}" in s
    assert f"more than {RES['control_factor']} bounds off" in s
