#!/usr/bin/env python
"""Reproduce the seed decode-timing table on synthetic checkpoints of real shapes.

The seed: Qwen3-1.7B bf16 with a rank-8 f32 adapter on the last 16 layers x 7
projections; a fuse that let the weights promote to float32 decoded at 27 tok/s
where the base ran at 63 and a dtype-kept fuse at 64 (Apple M4 Pro), peak 8.6 GB
vs 5.0 GB. This script builds random-weight checkpoints of that shape (and of
Qwen3-8B, where an H200 shows the effect clearly), the same adapter layout, and
runs :func:`lorakit.time_decode` over base, unfused, promoted, fused and
mlx-lm-fused.

    python benchmarks/decode.py --shape tiny                       # embedded model
    python benchmarks/decode.py --shape qwen3-1.7b --prompt-tokens 16 --tokens 8
    python benchmarks/decode.py --shape qwen3-1.7b,qwen3-8b --device gpu \\
        --prompt-tokens 128 --tokens 256 --repeats 5 --out results/

Each shape writes ``decode-<shape>.json`` / ``.txt`` / ``.png`` under ``--out`` and
prints the text table. Synthetic checkpoints are cached under ``--cache``
(default: a temporary directory, removed at the end).
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, Optional, Tuple  # noqa: E402

ROOT = Path(_HERE).parent


def assets(shape: str, cache: Path, overrides: Optional[Dict[str, Any]] = None
           ) -> Tuple[Path, Path, str]:
    """(model, adapter, how they were made) for one shape."""
    if shape == "tiny":
        model, adapter = ROOT / "data" / "tiny-qwen3", ROOT / "data" / "adapters" / "lora"
        if not (model / "config.json").exists():
            raise SystemExit("data/tiny-qwen3 is missing: run `python data/build.py`")
        return model, adapter, "embedded data/tiny-qwen3 + data/adapters/lora"
    tag = shape + "".join(f"-{k}{v}" for k, v in sorted((overrides or {}).items()))
    model, adapter = cache / tag, cache / f"{tag}-lora-r8-l16"
    from lorakit.synth import synth_adapter, synth_checkpoint

    if not (model / "config.json").exists():
        synth_checkpoint(model, shape, overrides=overrides, force=True, progress=False)
    if not (adapter / "adapter_config.json").exists():
        # rank 8 on the last 16 layers x q, k, v, o, gate, up, down (f32, scale 20)
        synth_adapter(adapter, model, rank=8, layers=16, force=True)
    return model, adapter, (f"lorakit.synth.synth_checkpoint({shape!r}"
                            + (f", overrides={overrides}" if overrides else "")
                            + ") + synth_adapter(rank=8, layers=16)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-1.7b",
                   help="comma-separated: tiny (the embedded model) or lorakit.synth presets "
                   "(qwen3-1.7b, qwen3-8b, ...)")
    p.add_argument("--variants", default="base,unfused,promoted,fused,mlx-lm-fused")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1,
                   help="variant list run this many times, rotated; runs pooled")
    p.add_argument("--device", choices=["cpu", "gpu"], default=None)
    p.add_argument("--cache", type=Path, default=None,
                   help="keep synthetic checkpoints here (default: temporary)")
    p.add_argument("--out", type=Path, default=None, help="write json/txt/png here")
    p.add_argument("--layers", type=int, default=None,
                   help="override num_hidden_layers of the synthetic shape (quick checks)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    from lorakit.timing.decode import time_decode
    from lorakit.timing.table import DecodeTiming

    cache = args.cache or Path(tempfile.mkdtemp(prefix="lorakit-bench-"))
    cache.mkdir(parents=True, exist_ok=True)
    try:
        for shape in [s.strip() for s in args.shape.split(",") if s.strip()]:
            t0 = time.perf_counter()
            model, adapter, made = assets(
                shape, cache, {"num_hidden_layers": args.layers} if args.layers else None)
            synth_s = time.perf_counter() - t0
            partial = DecodeTiming(title="", settings={"model": str(model), "shape": shape})

            def on_result(v, shape=shape, partial=partial) -> None:
                # a line and a JSON file per finished variant: a run cut short keeps them
                print(f"[{shape}] {v!r}", file=sys.stderr, flush=True)
                partial.add(v)
                if args.out is not None:
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / f"decode-{shape}.json").write_text(partial.to_json(indent=1))

            t = time_decode(model, adapter, variants=args.variants.split(","),
                            prompt_tokens=args.prompt_tokens, tokens=args.tokens,
                            repeats=args.repeats, warmup=args.warmup, device=args.device,
                            workdir=cache, progress=not args.quiet, on_result=on_result,
                            rounds=args.rounds)
            t.settings.update(command="python benchmarks/decode.py " + " ".join(
                                  sys.argv[1:] if argv is None else argv),
                              shape=shape, assets=made, synth_s=round(synth_s, 1),
                              total_s=round(time.perf_counter() - t0, 1))
            print(f"## {shape} ({made}; {t.settings['total_s']} s)\n{t}\n", flush=True)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"decode-{shape}.json").write_text(t.to_json(indent=1))
                (args.out / f"decode-{shape}.txt").write_text(str(t) + "\n")
                try:
                    t.plot().savefig(args.out / f"decode-{shape}.png", dpi=110)
                except ImportError:
                    pass
            if args.cache is None and shape != "tiny":
                shutil.rmtree(model, ignore_errors=True)
                shutil.rmtree(adapter, ignore_errors=True)
    finally:
        if args.cache is None:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
