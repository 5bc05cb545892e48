"""``lorakit extract`` and ``lorakit resize``: thin callers of :func:`lorakit.extract` and
:func:`lorakit.algebra.extract.resize`, printing the report (or ``--json``)."""
from __future__ import annotations

import argparse
import json
import os

from . import flags
from .written import wrote

__all__ = []


def _rank_or_energy(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rank", type=int, help="keep this rank in every module")
    g.add_argument("--energy", type=float,
                   help="per module, the fewest singular values holding this fraction of "
                   "||delta||_F^2 (e.g. 0.99; per-module ranks)")


def _save_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-path", required=True, help="output adapter directory")
    p.add_argument("--format", choices=("peft", "mlx-lm"), default="peft",
                   help="adapter format written (default peft: per-module ranks and "
                   "full copies fit)")
    p.add_argument("--force", action="store_true",
                   help="replace a previous lorakit output at --save-path")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--max-rows", type=int, default=60, help="rows shown in the text report")


def _print(args: argparse.Namespace, rep) -> None:
    wrote(args, args.save_path)  # required: the adapter is written before the report
    rep.max_rows = args.max_rows
    print(json.dumps(rep.to_dict(), indent=2) if args.json else rep)


def _extract(args: argparse.Namespace) -> int:
    # one BLAS thread per module in flight, set before numpy loads (BENCHMARKS.md, "Extract")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from ..algebra.extract import ExtractOptions
    from ..inspect.extraction import extract

    picked = flags(args, "rank", "energy", "modules", "format", "threads")
    opts = ExtractOptions(**picked, behaviour=not args.no_behaviour)
    out = flags(args, "save_path", "force")
    rep = extract(args.base, args.tuned, opts, **out, progress=not args.quiet)
    _print(args, rep)
    return 0


def _resize(args: argparse.Namespace) -> int:
    from ..algebra.extract import resize

    picked = flags(args, "rank", "energy", "base", "save_path", "format", "force")
    rep = resize(args.adapter, **picked)
    _print(args, rep)
    return 0


def add(sub) -> None:
    p = sub.add_parser("extract", help="a LoRA adapter from two checkpoints (tuned - base)",
                       description="Extract a LoRA from a fused or fine-tuned checkpoint and "
                       "its base by a truncated SVD per module (exact f64 where small, "
                       "randomized f32 where large), one tensor at a time; other changed "
                       "tensors (embeddings, norms) are saved in full as modules_to_save. "
                       "The report gives each module's kept energy, residual and the share "
                       "a re-fuse reproduces, and the tuned model against base + the "
                       "adapter on the embedded corpus (KL, top-1).")
    p.add_argument("--base", required=True, help="base checkpoint directory or hub id")
    p.add_argument("--tuned", required=True, help="fused or fine-tuned checkpoint directory or hub id")
    _rank_or_energy(p)
    p.add_argument("--modules", nargs="+", default=None, metavar="NAME",
                   help="only these modules (q_proj, self_attn.o_proj, model.layers.1*)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="low-rank modules worked on at once (default min(2, cores)); "
                   "memory grows with it, the result does not change")
    p.add_argument("--no-behaviour", action="store_true",
                   help="skip the behaviour line (the tuned model against base + the "
                   "extracted adapter on the embedded corpus: KL, top-1)")
    _save_flags(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_extract)

    p = sub.add_parser("resize", help="an adapter at a lower rank (SVD of its factors)",
                       description="Resize a LoRA/DoRA adapter by the SVD of its factors "
                       "(never forming the full delta); the error per module is exact.")
    p.add_argument("adapter", help="adapter directory (mlx-lm or PEFT)")
    _rank_or_energy(p)
    p.add_argument("--base", default=None,
                   help="base checkpoint: DoRA rows also report the DoRA-normalised error")
    _save_flags(p)
    p.set_defaults(run=_resize)
