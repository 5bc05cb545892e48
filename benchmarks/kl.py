"""KL evaluation overhead: ``score_windows`` (both forward passes + the KL, top-1, NLL
and top-candidate math) against the two models' plain forward passes over the same
windows (``mx.eval(ref(x), test(x))`` per window, logits materialised).

Reference: the base with an adapter attached unfused; test: the same base alone.
``--model`` is a checkpoint folder, or ``--synth PRESET`` writes a random one of a real
shape (lorakit.synth: checkpoint + a rank-8 adapter on the last 16 layers). Each
repeat times both ways in alternating order after a warm-up; the ratio of medians is
reported.

  python benchmarks/kl.py --model data/tiny-qwen3 --adapter data/adapters/lora \\
      --tokens 4096 --context 512 --repeats 5 --out benchmarks/results/kl_cpu.json
  python benchmarks/kl.py --synth qwen3-1.7b --tokens 8192 --context 1024 ...
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--adapter")
    p.add_argument("--synth", help="preset name: write a random checkpoint + adapter")
    p.add_argument("--corpus", default=None)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--top-k", type=int, default=5, help="top candidates kept (detail)")
    p.add_argument("--cpu", action="store_true", help="run on MLX's CPU device")
    p.add_argument("--dtype", default="bfloat16",
                   help="--synth's weight dtype (float32: MLX's CPU matmul is far faster)")
    p.add_argument("--out")
    a = p.parse_args(argv)

    import mlx.core as mx
    import mlx_lm
    import numpy as np

    if a.cpu:
        mx.set_default_device(mx.cpu)
    from lorakit.fusion.model import attach_adapter
    from lorakit.inspect.behaviour import read_corpus, score_windows, windows

    tmp = None
    if a.synth:
        from lorakit.synth import synth_adapter, synth_checkpoint

        tmp = Path(tempfile.mkdtemp(prefix="klbench"))
        a.model = str(synth_checkpoint(tmp / "base", a.synth, dtype=a.dtype, progress=False))
        a.adapter = str(synth_adapter(tmp / "adapter", a.model))
    ref, tok = mlx_lm.load(a.model)[:2]
    ref = attach_adapter(ref, a.adapter)
    test = mlx_lm.load(a.model)[:2][0]
    text = read_corpus(a.corpus)[0]
    ids = tok.encode(text)
    if len(ids) < a.tokens:  # a synthetic tokenizer may pack the text short: repeat it
        ids = (ids * (a.tokens // max(len(ids), 1) + 1))
    wins = windows(ids, a.context, a.tokens)

    def plain() -> float:
        t = time.perf_counter()
        for w in wins:
            x = mx.array(w)[None]
            mx.eval(ref(x), test(x))
        return time.perf_counter() - t

    def kl() -> float:
        t = time.perf_counter()
        score_windows(ref, test, wins, top_k=a.top_k)
        return time.perf_counter() - t

    plain(), kl()  # warm-up (compilation, allocations)
    tp, tk = [], []
    for r in range(a.repeats):
        if r % 2:
            tk.append(kl()); tp.append(plain())
        else:
            tp.append(plain()); tk.append(kl())
    res = score_windows(ref, test, wins)
    mp, mk = statistics.median(tp), statistics.median(tk)
    out = {
        "command": "python " + " ".join(["benchmarks/kl.py"] + (argv or sys.argv[1:])),
        "model": a.synth or a.model, "dtype": a.dtype if a.synth else None, "adapter": None if a.synth else a.adapter,
        "device": str(mx.default_device()), "mlx": mx.__version__,
        "platform": platform.platform(), "python": platform.python_version(),
        "tokens_scored": int(res["kl"].size), "windows": int(wins.shape[0]),
        "context": a.context, "top_k": a.top_k, "vocab": int(ref(mx.array(wins[0][:2])[None]).shape[-1]),
        "plain_forward_s": tp, "kl_eval_s": tk,
        "median_plain_s": mp, "median_kl_s": mk, "overhead": mk / mp,
        "mean_kl": float(np.mean(res["kl"].astype(np.float64))),
        "top1_agreement": float(np.mean(res["top1_agree"])),
        "top1_agreement_strict": float(np.mean(res["ref_top1"] == res["test_top1"])),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
