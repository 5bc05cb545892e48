"""The adapter lab's cost and its effect-kept readings, on the embedded model.

Cost: ``layer_effects`` by layer, kind and module and ``scale_sweep`` (8 scales) on one
loaded model, against one plain forward pass of the same windows (``mx.eval(model(x))``,
the whole batch): each verb's median time over ``--repeats`` runs, in units of that
forward pass, beside the passes it states (2 * groups + 2; one per distinct scale).

Effect kept (``compare_outputs(..., base=...)``, reference = base + adapter unfused):
a right in-memory fuse (should read >= 0.99: a lower reading is a false alarm) and
two wrong ones, the fuse at half the scale and with layer 0's deltas dropped (a
reading >= 0.99 would be a miss).

  python benchmarks/lab.py --model data/tiny-qwen3 --adapter data/adapters/lora \\
      --tokens 256 --context 128 --repeats 3 --out benchmarks/results/lab.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="data/tiny-qwen3")
    p.add_argument("--adapter", default="data/adapters/lora")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args(argv)

    import mlx.core as mx
    import mlx_lm

    import lorakit
    from lorakit.fusion import attach_adapter
    from lorakit.fusion.model import fuse_model
    from lorakit.inspect import layer_effects, scale_sweep
    from lorakit.inspect.behaviour import windows
    from lorakit.io.formats.corpus import encode_text, read_corpus

    pair = mlx_lm.load(a.model)[:2]
    wins = mx.array(windows(encode_text(pair[1], read_corpus(None)[0]), a.context, a.tokens))

    def timed(f) -> float:
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    runs = {
        "forward": (lambda: mx.eval(pair[0](wins)), 1),
        "layer_effects by layer": (lambda: layer_effects(pair, a.adapter, tokens=a.tokens,
                                                         context=a.context, by="layer"), None),
        "layer_effects by kind": (lambda: layer_effects(pair, a.adapter, tokens=a.tokens,
                                                        context=a.context, by="kind"), None),
        "layer_effects by module": (lambda: layer_effects(pair, a.adapter, tokens=a.tokens,
                                                          context=a.context, by="module"), None),
        "scale_sweep (8 scales)": (lambda: scale_sweep(pair, a.adapter, tokens=a.tokens,
                                                       context=a.context), 8),
    }
    for f, _ in runs.values():  # warm-up (compilation, allocations)
        f()
    times = {k: [] for k in runs}
    for r in range(a.repeats):  # rotated order: a slow moment hits every verb
        keys = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
        for k in keys:
            times[k].append(timed(runs[k][0]))
    fwd = statistics.median(times["forward"])
    cost = {}
    for k, (f, passes) in runs.items():
        if passes is None:
            passes = 2 * f().summary["groups"] + 2
        med = statistics.median(times[k])
        cost[k] = {"runs_s": times[k], "median_s": med, "forward_passes": passes,
                   "in_forward_passes": med / fwd}

    def fused(edit=None):
        model, tok = mlx_lm.load(a.model)[:2]
        attach_adapter(model, a.adapter)
        for name, m in model.named_modules():
            if edit is not None and "lora_a" in m:
                m.scale = edit(name, m.scale)
        return fuse_model(model), tok

    kept = {}
    for name, edit in (("right fuse", None), ("half the scale", lambda n, s: s / 2),
                       ("layer 0 dropped",
                        lambda n, s: 0.0 if ".layers.0." in f".{n}." else s)):
        rep = lorakit.compare_outputs((a.model, a.adapter), fused(edit), tokens=2 * a.tokens,
                                      context=a.context, base=a.model)
        kept[name] = {"effect_kept": rep.effect_kept, "interval": rep.effect_kept_interval,
                      "mean_kl": rep.mean_kl, "mean_kl_base": rep.mean_kl_base,
                      "tokens": rep.tokens}
    out = {
        "command": "python " + " ".join(["benchmarks/lab.py"] + (argv or sys.argv[1:])),
        "model": a.model, "adapter": a.adapter, "tokens": a.tokens, "context": a.context,
        "windows": int(wins.shape[0]), "device": str(mx.default_device()),
        "mlx": mx.__version__, "platform": platform.platform(),
        "python": platform.python_version(), "cost": cost, "effect_kept": kept,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
