"""``lorakit time-decode``: a thin caller of :func:`lorakit.timing.decode.time_decode`."""
from __future__ import annotations

import argparse
from typing import List

from ..errors import LorakitError
from . import flags

__all__ = []

DEFAULT_VARIANTS = "base,unfused,promoted,fused,mlx-lm-fused"


def _variants(text: str) -> List[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _time_decode(args: argparse.Namespace) -> int:
    from ..timing.decode import DecodeOptions, time_decode

    fields = ("prompt_tokens", "tokens", "repeats", "warmup", "rounds", "device", "seed")
    opts = DecodeOptions(variants=None if args.variants is None else _variants(args.variants),
                         behaviour=(args.kl_tokens or True) if args.kl else False,
                         **flags(args, *fields, "timeout", "workdir"))
    result = time_decode(args.model, args.adapter_path, options=opts, progress=not args.quiet)
    print(result.to_json(indent=2) if args.json else result)
    if args.plot:
        result.plot().savefig(args.plot, dpi=120)
    failed = [v.variant for v in result.variants if not v.ok]
    if failed:
        raise LorakitError("some variants could not be timed", found=", ".join(failed),
                           hint="see the note column (or 'error' in --json) for each")
    return 0


def add(sub) -> None:
    p = sub.add_parser(
        "time-decode", help="time greedy decoding: base vs unfused adapter vs fused checkpoints",
        description="Time greedy decoding (mlx-lm's generation path) of a checkpoint, the "
        "checkpoint with the adapter attached, and fused checkpoints (f32-promoted, dtype "
        "kept, mlx_lm fuse). Each variant runs in its own process; reports prefill and "
        "decode tok/s, time to first token, peak memory and weight bytes by dtype. Each decode "
        "ratio to base comes with a 95% bootstrap interval over interleaved rounds; a row "
        "is flagged only for weight bytes over 1.02x base or a ratio below 0.90 outside "
        "the interval and the base's own noise, from at least 3 rounds.")
    p.add_argument("--model", required=True, help="base model directory or hub id")
    p.add_argument("--adapter-path", help="adapter directory (needed by all but 'base')")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, in run order (default: {DEFAULT_VARIANTS})")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded per run (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="run the variant list this many times in rotated orders and pool "
                   "the runs, so a noisy machine's slow phases hit every variant; the "
                   "interval of each ratio to base is paired by round (default: 5 below "
                   "1 GB of weights, 3 below 20 GB, else 2)")
    p.add_argument("--device", choices=["cpu", "gpu"], default=None,
                   help="MLX device (default: MLX's default device)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompt")
    p.add_argument("--workdir", default=None,
                   help="where fused checkpoints are written for the run (default: temp)")
    p.add_argument("--timeout", type=float, default=None, help="seconds allowed per variant")
    p.add_argument("--kl", action="store_true",
                   help="after timing, add a column 'KL vs unfused': each variant's mean KL "
                   "against the unfused adapter on the embedded corpus (computed in this "
                   "process, each checkpoint loaded once; needs --adapter-path)")
    p.add_argument("--kl-tokens", type=int, default=None,
                   help="with --kl: corpus tokens per variant (default 512)")
    p.add_argument("--plot", default=None, metavar="PNG", help="also save the bar chart")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_time_decode)
