"""``lorakit scale-sweep`` and ``lorakit layer-effects``: thin callers of the adapter lab
(:mod:`lorakit.inspect.lab`)."""
from __future__ import annotations

import argparse
import json

__all__ = []


def _show(rep, args: argparse.Namespace) -> int:
    print(json.dumps(rep.to_dict(), indent=1) if args.json else rep)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from ..inspect.lab import scale_sweep

    return _show(scale_sweep(args.model, args.adapter_path, scales=args.scales,
                             corpus=args.corpus, tokens=args.tokens, context=args.context,
                             prompt=args.prompt, max_tokens=args.max_tokens,
                             progress=not (args.json or args.quiet)), args)


def _effects(args: argparse.Namespace) -> int:
    from ..inspect.lab import layer_effects

    return _show(layer_effects(args.model, args.adapter_path, corpus=args.corpus,
                               tokens=args.tokens, context=args.context, by=args.by,
                               progress=not (args.json or args.quiet)), args)


def _common(p, tokens: int) -> None:
    p.add_argument("--model", required=True, help="base checkpoint (folder or hub id)")
    p.add_argument("--adapter-path", required=True, help="the adapter (mlx-lm or PEFT LoRA)")
    p.add_argument("--corpus", help="UTF-8 text or .jsonl (each line's text field); "
                   "default: the embedded validation text")
    p.add_argument("--tokens", type=int, default=tokens,
                   help=f"corpus tokens scored (default {tokens})")
    p.add_argument("--context", type=int, default=128, help="window length (default 128)")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def add(sub) -> None:
    """Add ``lorakit scale-sweep`` and ``lorakit layer-effects``."""
    p = sub.add_parser("scale-sweep", help="the adapter at several scales against the base "
                       "and the adapter (KL, top-1, perplexity, greedy text)",
                       description="The adapter attached unfused at s times its trained "
                       "scale for each s: KL(base || s) and KL(adapter at 1 || s) per token "
                       "on a corpus, top-1 agreement with each, perplexity, and the greedy "
                       "text of --prompt.")
    _common(p, 512)
    p.add_argument("--scales", type=float, nargs="+",
                   default=[0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2],
                   help="multiples of the trained scale (default 0 0.25 0.5 0.75 1 1.25 1.5 2)")
    p.add_argument("--prompt", help="also decode this prompt greedily at each scale")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per greedy text (24)")
    p.set_defaults(run=_sweep)
    p = sub.add_parser("layer-effects", help="what each layer, kind or module of an adapter "
                       "does: KL without it and KL of it alone",
                       description="Per group g of the adapter's LoRA layers: KL(adapter || "
                       "adapter without g) and KL(base || base with only g) per token on a "
                       "corpus, and the parts' sum against the whole (the interaction gap). "
                       "Costs 2 * groups + 2 forward passes over the tokens.")
    _common(p, 256)
    p.add_argument("--by", choices=("layer", "kind", "module"), default="layer",
                   help="group the LoRA layers by block, projection kind or module "
                   "(default layer)")
    p.set_defaults(run=_effects)
