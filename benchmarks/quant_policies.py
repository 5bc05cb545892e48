"""Quantization policies on the weak 4-bit adapter (issue 15): bytes, survival, KL.

For each policy of ``lorakit fuse --quant-policy`` (requant, same-grid, bits:8,
float, auto at its default budget 1.15, learned: mlx-lm's GPTQ) the weak QLoRA adapter
``data/adapters/lora-4bit-weak`` is fused into ``data/tiny-qwen3-4bit``; each output is
loaded with ``mlx_lm.load`` and generates, and is scored against the unfused adapter
on the quantized base (the QLoRA reference: what the user trained and evaluated)
with :func:`lorakit.compare_outputs` on the embedded validation text. Also scored:
the base itself (the adapter gone entirely) and ``--float-base data/tiny-qwen3``
(the adapter fused into the float original instead). The weak adapter's delta is
measured against the quantization step (per module and overall) and written to
``data/logs/lora-4bit-weak-ratio.json``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quant_policies.py \\
        --tokens 512 --json benchmarks/results/quant_policies.json

``--only learned`` reruns only the named policies' rows and merges them into the JSON
(the other rows kept; KL ratios recomputed against the stored requant row).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lorakit  # noqa: E402
from lorakit import numerics as nm  # noqa: E402
from lorakit.fusion.quant import dequantize_raw, intended_change  # noqa: E402
from lorakit.io.adapters.load import load_adapter  # noqa: E402
from lorakit.io.adapters.naming import bind, bindings_by_tensor  # noqa: E402

BASE = "data/tiny-qwen3-4bit"
FLOAT = "data/tiny-qwen3"
ADAPTER = "data/adapters/lora-4bit-weak"
POLICIES = [("requant", None), ("same-grid", None), ("bits:8", None), ("float", None),
            ("auto", 1.15), ("learned", None)]
COMMAND = ("PYTHONPATH=$PWD .venv/bin/python benchmarks/quant_policies.py "
           "--tokens 512 --json benchmarks/results/quant_policies.json")


def delta_to_step(base: str = BASE, adapter: str = ADAPTER) -> dict:
    """RMS of each adapted module's intended delta over the RMS of its quantization
    step (the group scale: one code apart), per module and over all of them."""
    ck = lorakit.open(ROOT / base, checkpoint=True)
    by = bindings_by_tensor(bind(load_adapter(ROOT / adapter), ck))
    rows, dd, ss = {}, 0.0, 0.0
    for name, binds in sorted(by.items()):
        module = name[: -len(".weight")]
        q = ck.quant_params(module)
        code = ck.tensors[f"{module}.scales"].dtype
        old = nm.to_float32(dequantize_raw(ck, module, None), nm.float_format(code))
        d = intended_change(old, binds)
        s = nm.to_float32(ck.read(f"{module}.scales"), nm.float_format(code)).astype(np.float64)
        rd, rs = float(np.sqrt((d * d).mean())), float(np.sqrt((s * s).mean()))
        rows[module] = {"delta_rms": rd, "step_rms": rs, "ratio": rd / rs, "bits": q.bits,
                        "group_size": q.group_size}
        dd += float((d * d).sum())
        ss += float((s * s).sum()) * q.group_size  # one step per weight
    n = sum(int(np.prod(ck.tensors[f"{m}.weight"].shape[:-1])) * ck.tensors[f"{m}.weight"]
            .shape[-1] * 32 // rows[m]["bits"] for m in rows)
    ratios = np.array([r["ratio"] for r in rows.values()])
    return {"adapter": adapter, "base": base, "modules": rows,
            "overall_ratio": float(np.sqrt(dd / n) / np.sqrt(ss / n)),
            "median_ratio": float(np.median(ratios)), "min_ratio": float(ratios.min()),
            "max_ratio": float(ratios.max()),
            "definition": "RMS(intended delta) / RMS(group scale), the scale being the "
                          "distance between two neighbouring codes"}


def _generates(path: Path) -> str:
    from mlx_lm import generate, load
    model, tok = load(str(path))
    return generate(model, tok, "The LORD", max_tokens=8)


def run(tokens: int, context: int, only: Optional[List[str]] = None) -> dict:
    from mlx_lm import load
    ref = load(str(ROOT / BASE), adapter_path=str(ROOT / ADAPTER))  # the QLoRA reference
    base_bytes = (ROOT / BASE / "model.safetensors").stat().st_size
    rows = []

    def score(label: str, path: Path, extra: dict) -> None:
        rep = lorakit.compare_outputs(ref, str(path), tokens=tokens, context=context)
        row = {"policy": label, "mean_kl": rep.mean_kl, "median_kl": rep.median_kl,
               "p99_kl": rep.p99_kl, "top1_agreement": rep.top1_agreement,
               "top1_agreement_strict": rep.top1_agreement_strict,
               "ppl_ref": rep.ppl_ref, "ppl_test": rep.ppl_test, "tokens": rep.tokens}
        row.update(extra)
        rows.append(row)
        print(f"{label:<14} bytes x{row.get('bytes_ratio', float('nan')):.3f}  "
              f"survived median {row.get('survived_median', float('nan')):.3f}  "
              f"mean KL {rep.mean_kl:.5f}  top-1 {rep.top1_agreement:.4f}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        if not only:
            score("base (no adapter)", ROOT / BASE, {"bytes": base_bytes, "bytes_ratio": 1.0})
        for policy, budget in POLICIES:
            label = policy if budget is None else f"{policy} {budget}"
            if only and policy not in only:
                continue
            out = Path(tmp) / label.replace(":", "_").replace(" ", "_")
            t0 = time.perf_counter()
            r = lorakit.fuse(str(ROOT / BASE), str(ROOT / ADAPTER), str(out), progress=False,
                             quant_policy=policy, quant_budget=budget)
            secs = time.perf_counter() - t0
            surv = np.array([s.survived for s in r.requant])
            counts: dict = {}
            for s in r.requant:
                counts[s.policy] = counts.get(s.policy, 0) + 1
            score(label, out, {"bytes": r.bytes_written,
                               "bytes_ratio": r.bytes_written / base_bytes,
                               "survived_median": float(np.median(surv)),
                               "survived_min": float(surv.min()),
                               "survived_mean": float(surv.mean()), "choices": counts,
                               "fuse_seconds": secs, "generates": _generates(out)})
        out = Path(tmp) / "float-base"
        if only:
            return {"rows": rows}
        r = lorakit.fuse(str(ROOT / BASE), str(ROOT / ADAPTER), str(out), progress=False,
                         float_base=str(ROOT / FLOAT))
        score("float-base", out, {"bytes": r.bytes_written,
                                  "bytes_ratio": r.bytes_written / base_bytes,
                                  "generates": _generates(out)})
    _ratios(rows)
    return {"command": COMMAND, "base": BASE, "adapter": ADAPTER, "reference":
            f"mlx_lm.load({BASE!r}, adapter_path={ADAPTER!r}) (unfused)",
            "corpus": "embedded validation text", "tokens": tokens, "context": context,
            "rows": rows}


def _ratios(rows: List[dict]) -> None:
    req = next(r for r in rows if r["policy"] == "requant")["mean_kl"]
    for r in rows:
        r["kl_vs_requant"] = r["mean_kl"] / req


def merge(res: dict, new_rows: List[dict], command: str) -> dict:
    """``--only``: the new rows replace those of the same policy (or go before
    float-base); ratios recomputed."""
    order = [p if b is None else f"{p} {b}" for p, b in POLICIES]
    rows = [r for r in res["rows"] if r["policy"] not in {n["policy"] for n in new_rows}]
    for n in new_rows:
        n["command"] = command
        after = [i for i, r in enumerate(rows) if r["policy"] in order and
                 order.index(r["policy"]) < order.index(n["policy"])]
        rows.insert((max(after) + 1) if after else len(rows), n)
    res["rows"] = rows
    _ratios(rows)
    return res


def markdown_table(res: dict) -> str:
    """The table docs/quantized.md and BENCHMARKS.md carry, from the JSON (a test checks it)."""
    lines = ["| policy | bytes / 4-bit base | delta survived (median, min) | mean KL vs unfused "
             "| KL / requant's | top-1 agreement |", "| --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        surv = (f"{r['survived_median']:.1%}, {r['survived_min']:.1%}"
                if "survived_median" in r else "-")
        lines.append(f"| {r['policy']} | {r['bytes_ratio']:.3f} | {surv} | {r['mean_kl']:.4f} "
                     f"| {r['kl_vs_requant']:.2f} | {r['top1_agreement']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/quant_policies.json")
    ap.add_argument("--ratio-json", default="data/logs/lora-4bit-weak-ratio.json")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--only", nargs="+", default=None, metavar="POLICY",
                    help="rerun only these policies' rows, merged into the existing --json")
    a = ap.parse_args()
    if a.only:
        res = json.loads(Path(ROOT / a.json).read_text())
        if res["tokens"] != a.tokens or res["context"] != a.context:
            raise SystemExit(f"--only: the JSON was measured at tokens={res['tokens']} "
                             f"context={res['context']}; pass the same")
        cmd = (f"PYTHONPATH=$PWD .venv/bin/python benchmarks/quant_policies.py --tokens "
               f"{a.tokens} --json {a.json} --only {' '.join(a.only)}")
        res = merge(res, run(a.tokens, a.context, a.only)["rows"], cmd)
        Path(ROOT / a.json).write_text(json.dumps(res, indent=2) + "\n")
        print(markdown_table(res))
        print(f"wrote {a.json}")
        return
    ratio = delta_to_step()
    ratio["command"] = COMMAND
    print(f"weak adapter: delta RMS / quantization step = {ratio['overall_ratio']:.4f} "
          f"(per module {ratio['min_ratio']:.4f} .. {ratio['max_ratio']:.4f})")
    Path(ROOT / a.ratio_json).write_text(json.dumps(ratio, indent=2) + "\n")
    res = run(a.tokens, a.context)
    res["delta_to_step"] = {k: ratio[k] for k in ("overall_ratio", "median_ratio",
                                                  "min_ratio", "max_ratio")}
    Path(ROOT / a.json).write_text(json.dumps(res, indent=2) + "\n")
    print(markdown_table(res))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
