"""``lorakit compare-outputs REF TEST``: behaviour on a corpus (per-token KL, top-1 agreement,
perplexity), a thin caller of :func:`lorakit.compare_outputs`."""
from __future__ import annotations

import argparse
import json

from . import flags

__all__ = []


def _run(args: argparse.Namespace) -> int:
    from ..inspect.behaviour import compare_outputs

    picked = flags(args, "tokens", "context", "ref_adapter", "test_adapter", "base")
    quiet = args.json or args.quiet
    rep = compare_outputs(args.reference, args.test, args.corpus, **picked, progress=not quiet)
    if args.json:
        print(json.dumps(rep.to_dict(per_token=args.per_token), indent=1))
    else:
        print(rep)
    return 0


def add(sub) -> None:
    """Add ``lorakit compare-outputs``."""
    p = sub.add_parser("compare-outputs", help="KL divergence, top-1 agreement and perplexity of two "
                       "models on a corpus",
                       description="Per-token KL(P_ref || P_test) of two models' next-token "
                       "distributions over a corpus (as llama-perplexity --kl-divergence): "
                       "mean, median, p90, p99, p99.9, max; top-1 agreement; both "
                       "perplexities. The corpus is tokenized once with the reference's "
                       "tokenizer and cut into consecutive windows (a last partial one dropped).")
    p.add_argument("reference", help="reference checkpoint directory or hub id")
    p.add_argument("test", help="test checkpoint directory or hub id")
    p.add_argument("--ref-adapter", help="adapter attached unfused to the reference")
    p.add_argument("--test-adapter", help="adapter attached unfused to the test model")
    p.add_argument("--base", help="the model without the adapter: also report the effect "
                   "kept, 1 - KL(ref || test) / KL(ref || base)")
    p.add_argument("--corpus", help="UTF-8 text or .jsonl (each line's text field); "
                   "default: the embedded validation text")
    p.add_argument("--tokens", type=int, default=None, help="use only the first N tokens")
    p.add_argument("--context", type=int, default=512, help="window length (default 512)")
    p.add_argument("--json", action="store_true", help="the summary as JSON")
    p.add_argument("--per-token", action="store_true", help="with --json: the per-token arrays too")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_run)
