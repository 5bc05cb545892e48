"""``lorakit synth``: write random checkpoints and adapters of real shapes (see lorakit.synth)."""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Dict, List, Optional

from ..errors import ArgumentError
from . import flags
from .written import FORCE_HELP, wrote

__all__ = []


def _value(text: str) -> Any:
    """A --set value: JSON if it parses (numbers, true, null, lists), else a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _overrides(pairs: Optional[List[str]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, val = pair.partition("=")
        if not sep or not key:
            raise ArgumentError.bad("--set", pair, "KEY=VALUE, e.g. --set num_hidden_layers=4")
        out[key.strip()] = _value(val.strip())
    return out


def _layers(text: str) -> Any:
    """'16' (the last 16 layers) or '0,5,7' / '20-27' (these layers)."""
    if "," not in text and "-" not in text:
        return int(text)
    layers: List[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        layers.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return layers


def _size(path) -> str:
    total = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return f"{total / 1e9:.3f} GB" if total >= 1e8 else f"{total / 1e6:.2f} MB"


def _checkpoint(args: argparse.Namespace) -> int:
    from ..io.formats.checkpoint import Checkpoint
    from ..synth import synth_checkpoint

    if (args.preset is None) == (args.config is None):
        expected = "exactly one: --preset qwen3-1.7b or --config path/to/config.json"
        raise ArgumentError.bad("--preset, --config", (args.preset, args.config), expected)
    t0 = time.perf_counter()
    picked = flags(args, "layout", "dtype", "shard_size", "seed", "std", "force")
    extra = {"overrides": _overrides(args.set), "progress": not args.quiet}
    out = synth_checkpoint(args.path, args.preset or args.config, **picked, **extra)
    wrote(args, out)
    ck = Checkpoint(out)
    params = sum(t.numel for t in ck.tensors.values())
    print(f"Wrote {out}\n  model_type  {ck.model_type} ({args.layout} layout, {args.dtype})\n"
          f"  tensors     {len(ck.tensors)} in {len(ck.shards)} shard(s), "
          f"{params / 1e9:.3f}B parameters\n  size        {_size(out)}\n"
          f"  time        {time.perf_counter() - t0:.1f} s")
    return 0


def _adapter(args: argparse.Namespace) -> int:
    from ..io.adapters.load import load_adapter
    from ..synth import synth_adapter

    t0 = time.perf_counter()
    picked = flags(args, "rank", "scale", "format", "seed", "delta_std", "force")
    kind = "dora" if args.dora else "lora"
    layers, keys = _layers(args.layers), args.keys.split(",")
    out = synth_adapter(args.path, args.model, layers=layers, keys=keys, kind=kind, **picked)
    wrote(args, out)
    ad = load_adapter(out)
    print(f"Wrote {out}\n  {ad!r}\n  size  {_size(out)}\n"
          f"  time  {time.perf_counter() - t0:.1f} s")
    return 0


def _presets(args: argparse.Namespace) -> int:
    from ..synth import PRESETS

    for name, cfg in PRESETS.items():
        extra = f", {cfg['num_experts']} experts" if "num_experts" in cfg else ""
        print(f"{name:<14} {cfg['model_type']:<10} hidden {cfg['hidden_size']}, "
              f"{cfg['num_hidden_layers']} layers{extra}")
    return 0


def add(sub) -> None:
    """Add ``lorakit synth {checkpoint,adapter,presets}``."""
    p = sub.add_parser("synth", help="write random checkpoints/adapters of real shapes",
                       description="Write shape-faithful random checkpoints and adapters, to "
                       "time a model's shape without downloading it.")
    ss = p.add_subparsers(dest="synth_command", metavar="WHAT")
    ss.required = True

    c = ss.add_parser("checkpoint", help="a random checkpoint from a preset or config.json")
    c.add_argument("path", help="output directory")
    c.add_argument("--preset", help="named shape (see `lorakit synth presets`)")
    c.add_argument("--config", help="a config.json (or its directory) instead of a preset")
    c.add_argument("--layout", choices=("mlx", "hf"), default="mlx",
                   help="mlx: as mlx-lm saves (stacked experts); hf: as transformers saves")
    c.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    c.add_argument("--shard-size", default="2GB", help="largest shard (default 2GB)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--std", type=float, default=0.02, help="std of weight entries")
    c.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field (repeatable), e.g. num_hidden_layers=4")
    c.add_argument("--force", action="store_true", help=FORCE_HELP)
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c.set_defaults(run=_checkpoint)

    a = ss.add_parser("adapter", help="a random LoRA/DoRA adapter for a checkpoint")
    a.add_argument("path", help="output directory")
    a.add_argument("--model", required=True, help="base checkpoint directory")
    a.add_argument("--rank", type=int, default=8)
    a.add_argument("--scale", type=float, default=None,
                   help="default 20 (mlx-lm), 2 (PEFT: lora_alpha = 2r)")
    a.add_argument("--layers", default="16",
                   help="last N layers (16), or indices: 0,4,8 / 20-27")
    a.add_argument("--keys", default="q,k,v,o,gate,up,down",
                   help="modules per block, comma-separated (default all 7 projections)")
    a.add_argument("--dora", action="store_true", help="DoRA instead of LoRA")
    a.add_argument("--format", choices=("mlx-lm", "peft"), default="mlx-lm")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--delta-std", type=float, default=1e-3,
                   help="std of each element of scale * B @ A (default 1e-3)")
    a.add_argument("--force", action="store_true", help=FORCE_HELP)
    a.set_defaults(run=_adapter)

    pr = ss.add_parser("presets", help="list the named shapes")
    pr.set_defaults(run=_presets)
