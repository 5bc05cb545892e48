"""``--like peft`` against the real PEFT 0.21.2 on every wide fixture case
(tests/fixtures/algebra_wide): elements compared, differing, max ulp distance, max error
in ulps at the operands' scale, or the refusal. No torch.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/algebra_peft_wide.py --json benchmarks/results/algebra_peft_wide.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "algebra"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

import test_peft_like_wide as T  # noqa: E402

from lorakit.errors import LorakitError  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    bases = {k: T.cast_base(k, tmp / k) for k in T.CODE}
    rows = {}
    for name, case in T.CASES.items():
        row = {"base": case["base"], "method": case["combination_type"],
               "adapters": case["adapters"], "weights": case["weights"],
               "kwargs": case["kwargs"]}
        row["peft"] = case["error"]["type"] if "error" in case else "merged"
        try:
            if "error" in case:
                T._combine(case)
                row["lorakit"] = "combined (PEFT raised)"
            else:
                row.update(T.run_case(name, bases, tmp / name)["total"])
                row["lorakit"] = "merged"
        except LorakitError as e:
            row["lorakit"] = "LorakitError: " + str(e).splitlines()[0][:120]
        rows[name] = row
    print("| case | base | method | compared | differing | max ulp | max ulp at operand scale |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "n" in r:
            print(f"| {name} | {r['base']} | {r['method']} | {r['n']:,} | {r['differ']:,} | "
                  f"{r['max_ulps']} | {r['max_operand_ulps']:.3g} |")
        else:
            print(f"| {name} | {r['base']} | {r['method']} | PEFT: {r['peft']} | "
                  f"lorakit: {r['lorakit'].split(':')[0]} | - | - |")
    if args.json:
        Path(args.json).write_text(json.dumps({"peft": T.MANIFEST["peft"],
                                               "torch": T.MANIFEST["torch"],
                                               "cases": rows}, indent=2))


if __name__ == "__main__":
    main()
