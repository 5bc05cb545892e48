"""Kill ``lorakit fuse`` with SIGKILL at many points and check what it leaves.

After every kill the output path must hold either nothing or a complete fused
checkpoint (every shard loads with ``mx.load``, ``Checkpoint`` opens it, and its
bytes equal an uninterrupted fuse's), and the next fuse must remove the temporary
directory the killed one left and write the right output. Any other outcome is a
failure and the script exits 1.

Kill points: a third uniform over the whole process life (start-up included), a
half uniform over the write phase (timed from the moment the temporary directory
appears), and the rest during ``--force`` runs replacing an earlier output.

    python benchmarks/kill.py --points 100 [--seed 0] [--json kill.json]

The CI runs the same checks at a few points (tests/io/test_kill.py).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests" / "io"))

from helpers import tree_hash  # noqa: E402
from test_kill import build_kill_inputs, kill_once, timed_run  # noqa: E402

from lorakit.fusion.fuse import fuse  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write every result here")
    ap.add_argument("--workdir", type=Path, help="where to build inputs (default: a temp dir)")
    args = ap.parse_args()

    root = args.workdir or Path(tempfile.mkdtemp(prefix="lorakit-kill-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base, adapter = build_kill_inputs(root / "inputs") if not (root / "inputs").exists() \
        else (root / "inputs" / "base", root / "inputs" / "adapter")
    inputs_before = tree_hash(base) | tree_hash(adapter)
    ref = root / "ref"
    shutil.rmtree(ref, ignore_errors=True)
    fuse(base, adapter, ref, progress=False)
    runs = [timed_run(base, adapter, root / f"timing-{i}") for i in range(3)]
    t_tmp = sorted(r[0] for r in runs)[1]
    t_end = sorted(r[1] for r in runs)[1]
    write = max(t_end - t_tmp, 0.05)
    print(f"inputs built in {time.perf_counter() - t0:.1f} s; uninterrupted CLI fuse: "
          f"{t_end:.2f} s, write phase {write:.2f} s (median of 3)")

    rng = random.Random(args.seed)
    results = []
    failures = 0
    for i in range(args.points):
        kind = ("life", "write", "force")[0 if i % 6 in (0, 3) else 2 if i % 6 == 5 else 1]
        out = root / "out"
        shutil.rmtree(out, ignore_errors=True)
        if kind == "force":
            fuse(base, adapter, out, progress=False)
        delay = rng.uniform(0, 1.1 * (t_end if kind == "life" else write))
        try:
            r = kill_once(base, adapter, out, ref, delay, after_tmp=kind != "life",
                          force=kind == "force")
            r["ok"] = True
        except AssertionError as e:
            failures += 1
            r = {"delay": delay, "kind": kind, "ok": False, "error": str(e)[:300]}
            print(f"FAIL at point {i}: {r}")
        r["kind"] = kind
        results.append(r)
    assert tree_hash(base) | tree_hash(adapter) == inputs_before, "an input changed"

    c = Counter((r["kind"], r.get("outcome", "FAIL"), bool(r.get("stale")))
                for r in results)
    print(f"\n{args.points} kill points, {failures} failures")
    print(f"{'kind':<7} {'at the output path':<18} {'temp dir left':<14} count")
    for (kind, outcome, stale), n in sorted(c.items()):
        print(f"{kind:<7} {outcome:<18} {'yes (cleaned)' if stale else 'no':<14} {n}")
    finished = sum(1 for r in results if r.get("finished"))
    print(f"process had already finished before the kill: {finished}")
    if args.json:
        args.json.write_text(json.dumps({"t_end": t_end, "write": write, "results": results},
                                        indent=1))
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
