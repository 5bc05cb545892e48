"""``lorakit combine`` and ``lorakit convert``, and the combination flags of ``lorakit fuse``
(thin callers of :mod:`lorakit.algebra.combine`)."""
from __future__ import annotations

import argparse
import json
from typing import Any, List, Optional

from ..errors import ArgumentError
from . import flags
from .written import FORCE_HELP, wrote

__all__ = []

_METHODS = ("exact", "cat", "linear", "svd", "ties", "ties_svd", "magnitude_prune",
            "dare_linear", "dare_ties")


def _weights(text: Optional[str]) -> Optional[List[float]]:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        expected = "numbers separated by commas, e.g. --weights 0.7,0.3 or --weights 1,-1"
        raise ArgumentError.bad("--weights", text, expected) from None


def add_combination_flags(p: argparse.ArgumentParser, method_flag: str) -> None:
    """The flags shared by ``combine`` and ``fuse`` (``--method`` / ``--combine``)."""
    p.add_argument("--weights", metavar="W1,W2,...",
                   help="one weight per --adapter-path, negative allowed (default: 1 each)")
    p.add_argument(method_flag, dest="method", choices=_METHODS, default="exact",
                   help="exact (default): the exact weighted sum of the deltas (with DoRA adapters: "
                   "fused only, not saved); cat: the same stored as one concatenated adapter; "
                   "svd: truncated to --rank; linear, ties, magnitude_prune, dare_linear, "
                   "dare_ties: PEFT's add_weighted_adapter definitions (factors merged "
                   "separately: cross terms); ties_svd. DoRA adapters: exact, or svd (evaluated "
                   "on the base)")
    p.add_argument("--rank", type=int,
                   help="rank of svd / ties_svd (default: the largest input rank)")
    p.add_argument("--density", type=float,
                   help="fraction kept by ties, magnitude_prune, dare_*")
    p.add_argument("--seed", type=int, help="random seed of dare_* (required)")
    p.add_argument("--majority-sign-method", choices=("total", "frequency"), default="total",
                   help="ties' sign election (PEFT's majority_sign_method)")
    p.add_argument("--svd-clamp", type=float, metavar="Q",
                   help="with --like peft --method svd: PEFT's svd_clamp quantile")
    p.add_argument("--like", choices=("peft",),
                   help="reproduce PEFT's add_weighted_adapter (+ merge_and_unload, which fuse "
                   "then does with --rounding round-once) bit for bit: linear, cat, ties, "
                   "magnitude_prune; svd, ties_svd within 1 ulp (bf16/fp16) on a few elements")


def options_of(args: argparse.Namespace, base_dtype: str = "BF16") -> Any:
    """The :class:`~lorakit.algebra.combine.CombineOptions` the flags ask for."""
    from ..algebra.combine import CombineOptions

    names = ("method", "rank", "density", "seed", "like", "majority_sign_method", "svd_clamp")
    return CombineOptions(base_dtype=base_dtype, **flags(args, *names))


def combination_of(args: argparse.Namespace, base_dtype: str = "BF16") -> Any:
    """The combined adapter (a Combination) the flags ask for."""
    from ..algebra.combine import combine

    weights, options = _weights(args.weights), options_of(args, base_dtype)
    return combine(args.adapter_path, weights, options=options, base=getattr(args, "model", None))


def fuse_adapter(args: argparse.Namespace) -> Any:
    """What ``lorakit fuse`` fuses: the one --adapter-path, or the combination of several."""
    paths = args.adapter_path or ["adapters"]
    args.adapter_path = paths
    if len(paths) == 1 and args.weights is None and args.method == "exact" \
            and args.like is None:
        return paths[0]
    if args.like == "peft":
        from ..io.formats import source

        if args.rounding not in ("nearest", "round-once"):
            expected = "round-once (implied by --like peft: it merges as PEFT does)"
            raise ArgumentError.bad("--rounding", args.rounding, expected)
        args.rounding = "round-once"  # PEFT's merge_and_unload
        dtype = source.open(args.model).dtype  # PEFT builds cat's factors in it (else F32)
        return combination_of(args, dtype if dtype in ("BF16", "F16") else "F32").adapter
    comb = combination_of(args)
    if args.method == "exact" and args.rounding != "nearest":
        hint = "the other orders are those of one adapter's runtime" + (
            ": fuse DoRA adapters one at a time" if "dora_modules" in comb.summary
            else "; use --combine cat to fuse the stored concatenated adapter with them")
        expected = "nearest: an exact combination of adapters is fused correctly rounded only"
        raise ArgumentError.bad("--rounding", args.rounding, expected, hint=hint)
    return comb.adapter


def _combine(args: argparse.Namespace) -> int:
    from ..algebra.combine import combine

    picked = flags(args, "base", "save_path", "format", "force")
    options = options_of(args, args.model_dtype)
    rep = combine(args.adapter_path, _weights(args.weights), options=options, **picked)
    wrote(args, args.save_path)
    print(json.dumps(rep.to_dict(), indent=2) if args.json else rep)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from ..algebra.combine import convert

    picked = flags(args, "to", "force", "num_layers", "base", "outtype", "experts")
    out = convert(args.adapter, args.save_path, **picked)
    wrote(args, out)
    done = {"output": str(out), "format": args.to}
    print(json.dumps(done) if args.json else f"wrote {args.to} adapter {out}")
    return 0


def add(sub) -> None:
    p = sub.add_parser("combine", help="combine adapters with weights into one adapter",
                       description="Combine N adapters (mlx-lm or PEFT) with weights into one "
                       "adapter: exactly (default), or by PEFT's methods.")
    p.add_argument("--adapter-path", action="append", required=True,
                   help="an adapter directory (repeat for each adapter)")
    add_combination_flags(p, "--method")
    p.add_argument("--format", choices=("mlx-lm", "peft"), default="mlx-lm",
                   help="format of the written adapter (default: mlx-lm)")
    p.add_argument("--model-dtype", choices=("BF16", "F16", "F32"), default="BF16",
                   help="with --like peft: the dtype of the model PEFT would build cat's "
                   "factors in (default: BF16)")
    p.add_argument("--base", help="with --method svd and DoRA adapters: the "
                   "checkpoint their W-dependent change is evaluated on")
    p.add_argument("--save-path", required=True, help="output adapter directory")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_combine)

    c = sub.add_parser("convert", help="convert an adapter between mlx-lm and PEFT, or to "
                       "llama.cpp's LoRA GGUF",
                       description="Write an adapter in the other format, bit for bit (LoRA, "
                       "DoRA magnitudes, embeddings, per-module ranks, scales as alpha); or, "
                       "with --to gguf-lora, as the LoRA GGUF file llama.cpp applies unfused "
                       "(llama-cli --lora; Linear LoRA targets of llama, mistral, mixtral, "
                       "qwen2, qwen3, qwen3_moe bases).")
    c.add_argument("adapter", help="adapter directory (mlx-lm or PEFT)")
    c.add_argument("--to", choices=("peft", "mlx-lm", "gguf-lora"), required=True)
    c.add_argument("--save-path", required=True, help="output adapter directory (a .gguf "
                   "file with --to gguf-lora)")
    c.add_argument("--base", help="with --to gguf-lora: the base model "
                   "directory (its config.json; default: the adapter's recorded model)")
    c.add_argument("--outtype", choices=("f32", "f16"), default="f32",
                   help="with --to gguf-lora: the factors' GGUF type (default: f32, exact)")
    c.add_argument("--experts", choices=("modules", "parameters"), default="modules",
                   help="with --to peft: MoE experts as per-expert modules (transformers 4; "
                   "default) or as target_parameters on the fused 3-D expert parameters "
                   "(transformers 5)")
    c.add_argument("--num-layers", type=int,
                   help="mlx-lm's num_layers (default: the source's, or lowest to highest "
                   "adapted block)")
    c.add_argument("--force", action="store_true", help=FORCE_HELP)
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c.set_defaults(run=_convert)
