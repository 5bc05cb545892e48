"""BENCHMARKS.md's "Real clients" section is what benchmarks/results/clients.json says:
the table is rebuilt here from the JSON and must appear word for word, with the command;
docs/fusing.md's numbers on the MoE layout come from the same JSON."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RES = json.loads((ROOT / "benchmarks" / "results" / "clients.json").read_text())
GGUF = json.loads((ROOT / "benchmarks" / "results" / "clients_gguf.json").read_text())
BENCH = (ROOT / "BENCHMARKS.md").read_text()
README = (ROOT / "README.md").read_text()
FUSING = " ".join((ROOT / "docs" / "fusing.md").read_text().split())


def _e(x: float) -> str:
    return f"{x:.1e}"


def rows() -> str:
    """The section's table, from the JSON."""
    out = ["| client | output | loads | comparison | max abs diff / max logit | bound | top-1 |",
           "|---|---|---|---|---|---|---|"]
    for name, r in RES["transformers_dense"].items():
        kept = "bf16 kept" if r["dtypes_kept"] else "dtype changed: " + ", ".join(
            r["param_dtypes"])
        for mode in ("f32", "bf16"):
            c = r[mode]
            out.append(f"| transformers {RES['versions']['transformers']} | fused {name} "
                       f"(bf16) | {kept}, {len(r['missing_keys'])} missing keys | logits vs "
                       f"MLX, {mode} compute | {_e(c['rel'])} | {_e(c['bound'])} | {c['top1']} |")
    for layout, r in RES["transformers_moe"].items():
        c = r["f32"]
        out.append(f"| transformers {RES['versions']['transformers']} | fused qwen3_moe, "
                   f"`--layout {'mlx-lm' if layout == 'stacked' else layout}` | "
                   f"{r['n_missing']} missing, {r['n_unexpected']} unexpected keys | logits vs "
                   f"MLX, f32 compute | {_e(c['rel'])} | {_e(c['bound'])} | {c['top1']} |")
    p = RES["peft"]
    out.append(f"| PEFT {RES['versions']['peft']} | `convert --to peft` | "
               f"`PeftModel.from_pretrained` | `merge_and_unload()` vs `--rounding round-once`"
               f" | {p['bit_identical']}/{p['tensors']} tensors bit-identical | bits | - |")
    for label, c in RES["mlx_lm_adapters"].items():
        out.append(f"| mlx-lm {RES['versions']['mlx_lm']} | {label} | `load(base, "
                   f"adapter_path=...)` | logits vs lorakit's float32 fuse, f32 compute | "
                   f"{_e(c['rel'])} | {_e(c['bound'])} | {c['top1']} |")
    return "\n".join(out)


def test_section_has_the_command_and_the_table():
    assert "## Real clients" in BENCHMARKS_SECTION
    assert RES["command"] in BENCHMARKS_SECTION
    assert rows() in BENCHMARKS_SECTION


def test_every_check_passed_in_the_committed_run():
    for r in RES["transformers_dense"].values():
        assert r["dtypes_kept"] and not r["missing_keys"] and not r["unexpected_keys"]
        assert r["f32"]["within"] and r["bf16"]["within"]
    moe = RES["transformers_moe"]["transformers"]
    assert moe["n_missing"] == moe["n_unexpected"] == 0 and moe["f32"]["within"]
    assert moe["f32"]["top1_agree"]
    assert RES["transformers_moe"]["stacked"]["n_missing"] > 0  # the failure it fixes
    assert RES["peft"]["all_identical"] and RES["peft"]["tensors"] > 0
    assert all(c["within"] and c["top1_agree"] for c in RES["mlx_lm_adapters"].values())


def test_fusing_md_layout_numbers():
    moe, st = RES["transformers_moe"]["transformers"], RES["transformers_moe"]["stacked"]
    assert f"{st['n_missing']} missing" in FUSING and st["f32"]["top1"] in FUSING
    assert _e(moe["f32"]["rel"]) in FUSING and "benchmarks/results/clients.json" in FUSING


def _read_by() -> dict:
    """README's verb table: verb -> its "read by" cell."""
    lines = README.split("\n")
    head = next(i for i, x in enumerate(lines) if x.startswith("| verb |"))
    assert "read by" in lines[head].split("|")[4]
    out = {}
    for x in lines[head + 2:]:
        if not x.startswith("| "):
            break
        cells = [c.strip() for c in x.split("|")]
        out[cells[1].strip("`")] = cells[4]
    return out


def test_readme_client_column_is_what_the_run_measured():
    col = _read_by()
    claimed = {v: c for v, c in col.items() if c}
    assert set(claimed) == {"fuse", "combine", "extract"}  # nothing claimed unmeasured
    assert claimed["fuse"].startswith("transformers (bf16 kept")
    assert all(r["dtypes_kept"] and r["f32"]["within"] and r["bf16"]["within"]
               for r in RES["transformers_dense"].values())
    assert "`--layout transformers`" in claimed["fuse"]
    assert RES["transformers_moe"]["transformers"]["f32"]["within"]
    ad = RES["mlx_lm_adapters"]
    for verb in ("combine", "extract"):
        assert "mlx-lm" in claimed[verb]
        runs = [c for k, c in ad.items() if k.startswith(verb)]
        assert runs and all(c["within"] for c in runs)
    # convert / resize: "their outputs read by mlx-lm, a PEFT export by PEFT"
    flat = " ".join(README.split())
    assert "read by mlx-lm, a PEFT export by PEFT" in flat
    assert any(k.startswith("convert") for k in ad) and any(k.startswith("resize") for k in ad)
    assert RES["peft"]["all_identical"]


def test_readme_llama_cpp_claims_are_what_the_gguf_run_measured():
    """fuse --export-gguf and convert --to gguf-lora "read by llama.cpp": the committed
    llama.cpp run (benchmarks/results/clients_gguf.json) loaded both and passed."""
    claimed = {v: c for v, c in _read_by().items() if "llama.cpp" in c}
    assert set(claimed) == {"fuse"} and "`--export-gguf`: [llama.cpp](BENCHMARKS.md#gguf-in-"\
        "llamacpp)" in claimed["fuse"]
    flat = " ".join(README.split())
    assert "`convert --to gguf-lora` by [llama.cpp](BENCHMARKS.md#gguf-in-llamacpp)" in flat
    assert flat.count("llama.cpp") == 2  # no other llama.cpp claim unbacked
    assert GGUF["failures"] == []
    fused, lora = GGUF["fused_vs_mlx"], GGUF["lora_vs_fused_gguf"]
    assert fused["rel_max_diff"] <= GGUF["rel_bound"] and fused["top1_unexplained"] == 0
    assert lora["rel_max_diff"] <= GGUF["lora_bound"] and lora["top1_unexplained"] == 0
    assert all(r["model"]["rel_max_diff"] <= GGUF["rel_bound"] and
               r["lora"]["rel_max_diff"] <= GGUF["rel_bound"]
               for r in GGUF["families"].values())
    assert "## GGUF in llama.cpp" in BENCH


_START = BENCH.find("## Real clients")
_END = BENCH.find("\n## ", _START + 3)
BENCHMARKS_SECTION = "" if _START < 0 else BENCH[_START:_END if _END > 0 else None]


if __name__ == "__main__":  # print the table, to paste after a new run
    print(rows())
