"""False alarms and misses of ``lorakit check``'s files section, on the embedded data.

Correct fuses: every embedded adapter with the options that change what a fuse writes
(rounding, dtype, MoE layout, quantization policy, dequantize), a base with a
``generation_config.json`` and an inline chat template, an adapter folder shipping its
tokenizer and chat template, one shipping a template alone; and two PEFT fixtures'
``merge_and_unload`` folders (written by transformers, not lorakit). A finding on any of them is
a false alarm. Defective folders: copies of those fuses with one thing changed (a chat
template replaced, an EOS id changed in each place it lives, a stale or missing
quantization block, a tokenizer file missing, the adapter's tokenizer ignored, ...).
Missing the one named finding (file, field, kind) is a miss.

    python benchmarks/files_check.py --json benchmarks/results/files_check.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import lorakit  # noqa: E402

DATA = REPO / "data"
BASE, BASE_Q4, BASE_MOE = DATA / "tiny-qwen3", DATA / "tiny-qwen3-4bit", DATA / "tiny-qwen3-moe"
AD = DATA / "adapters"
PEFT = REPO / "tests" / "fixtures" / "peft"
TEMPLATE = "{% for m in messages %}<|startoftext|>{{ m.role }}\n{{ m.content }}{% endfor %}"


def _edit(path: Path, **fields) -> None:
    d = json.loads(path.read_text())
    d.update(fields)
    path.write_text(json.dumps(d, indent=2))


def inputs(root: Path) -> Dict[str, Path]:
    """A base with a generation config and an inline template, and two adapter folders
    shipping a tokenizer (with a template) and a template alone."""
    base = root / "base-files"
    shutil.copytree(BASE, base)
    gen = {"bos_token_id": 1, "eos_token_id": [0], "pad_token_id": 2, "do_sample": True,
           "temperature": 0.7, "transformers_version": "4.57.6"}
    (base / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _edit(base / "tokenizer_config.json", chat_template=TEMPLATE)
    tok = root / "lora-tokenizer"
    shutil.copytree(AD / "lora", tok)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(BASE / name, tok / name)
    _edit(tok / "tokenizer_config.json", eos_token="<|pad|>")
    (tok / "chat_template.jinja").write_text(TEMPLATE.replace("role", "role | upper"))
    tpl = root / "lora-template"
    shutil.copytree(AD / "lora", tpl)
    (tpl / "chat_template.jinja").write_text(TEMPLATE + "{{ eos_token }}")
    mlx = root / "mlx-lm-fused"  # mlx-lm's own fuse: its tokenizer re-saved by transformers
    subprocess.run([sys.executable, "-m", "mlx_lm", "fuse", "--model", str(BASE),
                    "--adapter-path", str(AD / "lora"), "--save-path", str(mlx)],
                   check=True, capture_output=True)
    return {"base-files": base, "lora-tokenizer": tok, "lora-template": tpl, "mlx-lm": mlx}


#: correct fuses: name -> (base, adapter, fuse keywords, or the folder another tool wrote)
def correct(x: Dict[str, Path]) -> Dict[str, Tuple[Path, Path, dict]]:
    return {
        "lora nearest": (BASE, AD / "lora", {}),
        "lora mlx-lm": (BASE, AD / "lora", {"rounding": "mlx-lm"}),
        "lora round-once float16": (BASE, AD / "lora", {"rounding": "round-once",
                                                        "dtype": "float16"}),
        "lora promote": (BASE, AD / "lora", {"dtype": "promote"}),
        "dora": (BASE, AD / "dora", {}),
        "lora-embed": (BASE, AD / "lora-embed", {}),
        "peft-lora": (BASE, AD / "peft-lora", {}),
        "moe-lora mlx-lm layout": (BASE_MOE, AD / "moe-lora", {}),
        "moe-lora transformers layout": (BASE_MOE, AD / "moe-lora", {"layout": "transformers"}),
        "4-bit requant": (BASE_Q4, AD / "lora-4bit", {}),
        "4-bit bits:8": (BASE_Q4, AD / "lora-4bit-weak", {"quant_policy": "bits:8"}),
        "4-bit float policy": (BASE_Q4, AD / "lora-4bit-weak", {"quant_policy": "float"}),
        "4-bit dequantized": (BASE_Q4, AD / "lora-4bit", {"dequantize": True}),
        "base with generation config": (x["base-files"], AD / "lora", {}),
        "adapter ships tokenizer": (BASE, x["lora-tokenizer"], {}),
        "adapter ships template": (x["base-files"], x["lora-template"], {}),
        "mlx_lm fuse": (BASE, AD / "lora", x["mlx-lm"]),
        **{f"PEFT merge_and_unload: {n}": (PEFT / n / "base", PEFT / n / "adapter",
                                           PEFT / n / "merged")
           for n in ("llama_lora_bf16", "qwen3_rslora_patterns")},
    }


def _json(name: str, **fields) -> Callable[[Path], None]:
    return lambda d: _edit(d / name, **fields)


def _drop(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


def _base_tokenizer(d: Path) -> None:  # what a fuse that ignores the adapter's files writes
    (d / "chat_template.jinja").unlink()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(BASE / name, d / name)


def _added_token(d: Path) -> None:
    t = json.loads((d / "tokenizer.json").read_text())
    t["added_tokens"].append(dict(t["added_tokens"][-1], id=2047, content="<|im_end|>"))
    (d / "tokenizer.json").write_text(json.dumps(t))


#: defective folders: name -> (the correct fuse mutated, mutation, (file, field, finding))
DEFECTS: Dict[str, Tuple[str, Callable[[Path], None], Tuple[str, str, str]]] = {
    "chat template file replaced": (
        "adapter ships tokenizer", lambda d: (d / "chat_template.jinja").write_text(TEMPLATE),
        ("chat_template.jinja", "", "chat template")),
    "inline chat template replaced": (
        "base with generation config", _json("tokenizer_config.json", chat_template="{{ x }}"),
        ("tokenizer_config.json", "chat_template", "chat template")),
    "chat template file missing": (
        "adapter ships template", _drop("chat_template.jinja"),
        ("chat_template.jinja", "", "missing")),
    "EOS id in config.json": ("lora nearest", _json("config.json", eos_token_id=2),
                              ("config.json", "eos_token_id", "EOS")),
    "EOS id in generation_config.json": (
        "base with generation config", _json("generation_config.json", eos_token_id=[0, 2]),
        ("generation_config.json", "eos_token_id", "EOS")),
    "EOS token in tokenizer_config.json": (
        "lora nearest", _json("tokenizer_config.json", eos_token="<|pad|>"),
        ("tokenizer_config.json", "eos_token", "EOS")),
    "EOS token in special_tokens_map.json": (
        "lora nearest", _json("special_tokens_map.json", eos_token="<|pad|>"),
        ("special_tokens_map.json", "eos_token", "EOS")),
    "EOS token in mlx_lm fuse's tokenizer_config.json": (
        "mlx_lm fuse", _json("tokenizer_config.json", eos_token="<|pad|>"),
        ("special_tokens_map.json", "eos_token", "EOS")),
    "generation config changed": (
        "base with generation config", _json("generation_config.json", temperature=1.0),
        ("generation_config.json", "temperature", "generation config")),
    "pad token changed": ("lora nearest", _json("tokenizer_config.json", pad_token="<|endoftext|>"),
                          ("tokenizer_config.json", "pad_token", "special token")),
    "stale quantization block": ("4-bit dequantized",
                                 _json("config.json", quantization={"group_size": 64, "bits": 4}),
                                 ("config.json", "quantization", "stale quantization")),
    "stale quantization_config block": (
        "4-bit dequantized", _json("config.json", quantization_config={"bits": 4}),
        ("config.json", "quantization_config", "stale quantization")),
    "tokenizer.json missing": ("lora nearest", _drop("tokenizer.json"),
                               ("tokenizer.json", "", "missing")),
    "generation_config.json missing": ("base with generation config",
                                       _drop("generation_config.json"),
                                       ("generation_config.json", "", "missing")),
    "adapter tokenizer ignored": ("adapter ships tokenizer", _base_tokenizer,
                                  ("chat_template.jinja", "", "missing")),
    "token added to the vocabulary": ("lora nearest", _added_token,
                                      ("tokenizer.json", "added_tokens", "tokenizer")),
    "EOS id in a PEFT merge's generation_config.json": (
        "PEFT merge_and_unload: llama_lora_bf16", _json("generation_config.json", eos_token_id=5),
        ("generation_config.json", "eos_token_id", "EOS")),
    "extra file": ("lora nearest", lambda d: (d / "notes.txt").write_text("x"),
                   ("notes.txt", "", "extra")),
    "rope_theta changed": ("lora nearest", _json("config.json", rope_theta=1e6),
                           ("config.json", "rope_theta", "config")),
}


def findings(rep) -> List[Tuple[str, str, str]]:
    return [(r["file"], r["field"], r["finding"]) for r in rep.files.rows]


def run(root: Path, only: Optional[List[str]] = None) -> dict:
    """Fuse, mutate and check every case (``only``: these names and what they need)."""
    x = inputs(root)
    ok = correct(x)
    want = set(only or list(ok) + list(DEFECTS))
    need = {n for n in want if n in ok} | {DEFECTS[n][0] for n in want if n in DEFECTS}
    fused: Dict[str, Path] = {}
    rows = []
    for name in [n for n in ok if n in need]:
        base, ad, kw = ok[name]
        t0 = time.perf_counter()
        fused[name] = kw if isinstance(kw, Path) else lorakit.fuse(
            base, ad, root / f"ok-{len(fused)}", progress=False, **kw).output
        rep = lorakit.check(fused[name], base, ad, check_untouched=False, progress=False)
        rows.append({"case": name, "kind": "correct", "expected": None, "found": findings(rep),
                     "exit code": rep.exit_code(), "false alarm": bool(rep.files.rows),
                     "seconds": time.perf_counter() - t0})
    for k, name in enumerate(n for n in DEFECTS if n in want):
        src, mutate, expected = DEFECTS[name]
        d = root / f"bad-{k}"
        shutil.copytree(fused[src], d)
        mutate(d)
        base, ad, _ = ok[src]
        t0 = time.perf_counter()
        rep = lorakit.check(d, base, ad, check_untouched=False, progress=False)
        found = findings(rep)
        rows.append({"case": name, "kind": "defect", "expected": list(expected),
                     "found": found, "exit code": rep.exit_code(), "miss": expected not in found,
                     "seconds": time.perf_counter() - t0})
    good = [r for r in rows if r["kind"] == "correct"]
    bad = [r for r in rows if r["kind"] == "defect"]
    return {"command": "python benchmarks/files_check.py --json benchmarks/results/files_check.json",
            "correct": len(good), "defects": len(bad),
            "false alarms": sum(r["false alarm"] for r in good),
            "misses": sum(r["miss"] for r in bad),
            "false alarm rate": sum(r["false alarm"] for r in good) / max(1, len(good)),
            "miss rate": sum(r["miss"] for r in bad) / max(1, len(bad)), "cases": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = run(Path(tmp))
    for r in res["cases"]:
        bad = r.get("false alarm") or r.get("miss")
        print(f"{'!' if bad else ' '} {r['kind']:<8} {r['case']:<36} exit {r['exit code']}  "
              f"{r['found']}")
    print(f"false alarms {res['false alarms']}/{res['correct']}, "
          f"misses {res['misses']}/{res['defects']}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
