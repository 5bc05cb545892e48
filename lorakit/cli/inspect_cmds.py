"""``lorakit inspect``, ``diff`` and ``check``: thin callers of :mod:`lorakit.inspect`
printing a report (or ``--json``). Exit status: ``diff`` 1 when the checkpoints differ,
``check`` 1 for a wrong merge, 3 for a right but promoted one, 4 for right tensors in a
folder whose other files are not, 2 for bad input."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

from ..errors import ArgumentError

__all__ = []


def _emit(args: argparse.Namespace, reports: Dict[str, Any]) -> None:
    if args.json:
        print(json.dumps({k: r.to_dict() for k, r in reports.items()}, indent=2))
        return
    parts: List[str] = []
    for r in reports.values():
        r.max_rows = args.max_rows
        if not getattr(args, "all", True):  # text only: list the tensors that are not fine
            r.rows = [r.rows[i] for i in r.flagged]
            r.flagged = list(range(len(r.rows)))
        parts.append(str(r))
    print("\n\n".join(parts))


def _inspect(args: argparse.Namespace) -> int:
    from ..inspect.dtypes import dtype_map

    path = Path(args.path)
    reports: Dict[str, Any] = {"dtype_map": dtype_map(path)}
    if reports["dtype_map"].summary.get("kind") == "adapter":  # numpy only for an adapter
        from ..inspect.deltas import delta_norms

        reports["delta_norms"] = delta_norms(path, args.base)
    _emit(args, reports)
    return 0


def _diff(args: argparse.Namespace) -> int:
    from ..inspect.diff import diff

    if bool(args.adapter) != bool(args.base):
        both = "both or neither: --adapter-path and --model go together"
        hint = "give both to measure each side against the exact fuse"
        found = (args.adapter, args.base)
        raise ArgumentError.bad("--adapter-path, --model", found, both, hint=hint)
    # a bar only on a terminal: a pipe or log need not import tqdm
    rep = diff(args.a, args.b, progress=bool(sys.stderr and sys.stderr.isatty()))
    reports: Dict[str, Any] = {"diff": rep}
    if args.adapter:
        from ..inspect.diff import ulp_vs_reference

        reports["reference_a"] = ulp_vs_reference(args.a, args.base, args.adapter)
        reports["reference_b"] = ulp_vs_reference(args.b, args.base, args.adapter)
    _emit(args, reports)
    return 0 if rep.identical else 1


def _check(args: argparse.Namespace) -> int:
    from ..inspect.check import check

    rep = check(args.fused, args.base, args.adapter,
                      check_untouched=not args.skip_untouched,
                      behaviour=(args.tokens or True) if args.kl else False,
                      initial_adapter=args.initial_adapter)
    _emit(args, {"check": rep})
    return rep.exit_code()


def add(sub) -> None:
    """Register ``inspect``, ``diff`` and ``check`` on the main parser's subparsers."""
    p = sub.add_parser("inspect", help="dtype map of a checkpoint; dtypes and delta norms "
                       "of an adapter",
                       description="Per-tensor dtypes and bytes from the safetensors headers "
                       "(tensors whose dtype differs from the majority are marked with !). "
                       "For an adapter directory, also each delta's norms and ranks.")
    p.add_argument("path", help="checkpoint or adapter (directory or hub id) or .safetensors file")
    p.add_argument("--model", dest="base",
                   help="adapter only: base model, for ||dW|| / ||W|| (as fuse's --model)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--max-rows", type=int, default=60, help="table rows shown (text)")
    p.set_defaults(run=_inspect, all=True)

    p = sub.add_parser("diff", help="two checkpoints tensor by tensor, to the ulp (exit 1 if they differ)",
                       description="Compare two checkpoints tensor by tensor: first the "
                       "relative error rms(A - B) / rms(A) and the largest ulp distance at "
                       "typical magnitudes, then elements differing, near zero (where ulp "
                       "distances are large but mean little), zero on one side and changing "
                       "sign, max ulp and abs difference, dtype/shape mismatches, "
                       "tensors on one side only. With --adapter-path and --model, also each "
                       "side's ulp error against the exact float64 fuse.")
    p.add_argument("a", help="first checkpoint (directory, hub id or .safetensors file)")
    p.add_argument("b", help="second checkpoint (the same)")
    p.add_argument("--adapter-path", dest="adapter",
                   help="adapter both were fused with (as fuse's --adapter-path)")
    p.add_argument("--model", dest="base",
                   help="base both were fused from (as fuse's --model)")
    p.add_argument("--all", action="store_true", help="list identical tensors too")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--max-rows", type=int, default=60, help="table rows shown (text)")
    p.set_defaults(run=_diff)

    p = sub.add_parser("check", help="did the merge work? verdict per tensor "
                       "(exit 0 ok, 1 wrong merge, 3 right but promoted, 4 files differ)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Check a fused checkpoint against its base and adapter: "
                       "per adapted tensor the distance\nfrom the exact intended result "
                       "(float64), in units of what rounding to the stored dtype can\n"
                       "explain (<= 1 is right, whichever correct order fused it), and "
                       "a verdict naming the\ncause of a wrong merge (not applied, applied "
                       "twice, wrong scale, another adapter,\ntransposed, DoRA magnitude "
                       "missing, different base, missing / extra tensor, untouched\n"
                       "tensor changed). Then the folder's other files against what the fuse\n"
                       "writes (the base's, or the tokenizer and chat template the adapter "
                       "ships): tokenizer,\nspecial tokens, chat template, EOS ids, "
                       "generation_config.json, a stale quantization\nblock, a missing or "
                       "extra file; each finding names file, field, expected and found.",
                       epilog="exit status:\n"
                       "  0  ok: every tensor is the intended merge (or its documented "
                       "conversion)\n"
                       "  1  a wrong merge\n"
                       "  2  bad input (unreadable checkpoint or adapter)\n"
                       "  3  right but promoted: numerically the intended merge, stored "
                       "in a wider dtype\n"
                       "     than the base (bytes doubled)\n"
                       "  4  the tensors are right (0) but a file of the folder is not what "
                       "it should be\n     (the files section names each finding)")
    # fuse's vocabulary: --model (the base), --adapter-path, --save-path (the fused output)
    p.add_argument("--save-path", dest="fused", required=True,
                   help="the fused checkpoint, directory or hub id (as fuse's --save-path)")
    p.add_argument("--model", dest="base", required=True,
                   help="the base checkpoint, directory or hub id (as fuse's --model)")
    p.add_argument("--adapter-path", dest="adapter", required=True,
                   help="the adapter directory (as fuse's --adapter-path)")
    p.add_argument("--initial-adapter", default=None, metavar="DIR",
                   help="as fuse's --initial-adapter: the adapter a PiSSA/OLoRA/CorDA/"
                   "LoRA-GA adapter was saved as before training (without it such an adapter "
                   "fails the check: residual-base adapter)")
    p.add_argument("--skip-untouched", action="store_true",
                   help="do not verify that unadapted tensors are bit-identical")
    p.add_argument("--kl", action="store_true",
                   help="also run the fused model against base + adapter (unfused) on the "
                   "embedded corpus: one line 'fused vs unfused: mean KL, top-1 agreement' "
                   "(numbers under 'behaviour' in --json); does not change the exit status")
    p.add_argument("--tokens", type=int, default=None,
                   help="with --kl: corpus tokens scored (default 1024)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--max-rows", type=int, default=60, help="table rows shown (text)")
    p.set_defaults(run=_check, all=True)
