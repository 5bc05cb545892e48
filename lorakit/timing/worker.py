"""One variant's decode timing, run in a process of its own
(``python -m lorakit.timing.worker SPEC_JSON``), so its peak memory starts from an empty
process. It loads the checkpoint as ``mlx_lm.load`` does (lorakit's loader for a PEFT
adapter), decodes greedily through ``stream_generate`` and prints JSON events
(``loaded``, ``run`` per generation, then ``result`` or ``error``), each line prefixed
with ``MARK`` so nothing a library prints can be taken for one.
"""
from __future__ import annotations

import json
import platform
import resource
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..fusion.model import load_unfused
from ..inspect.moe_cpu import float32_if_refused, moe_float32_on_cpu

__all__ = []

# mlx_lm's modules are imported inside the functions that use them: mlx_lm.generate
# creates its generation stream on the default device when imported, and the device
# must be chosen first (select_device)


MARK = "@@lorakit-timing "
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

def emit(event: str, **data: Any) -> None:
    sys.stdout.write(MARK + json.dumps(dict(event=event, **data)) + "\n")
    sys.stdout.flush()


def rss_peak_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def select_device(name: Optional[str]):
    """Set MLX's default device before mlx-lm creates its generation stream."""
    if name in (None, "", "default"):
        return mx.default_device()
    if name == "cpu":
        mx.set_default_device(mx.cpu)
    elif name == "gpu":
        if not (mx.metal.is_available() or _cuda_available()):
            raise RuntimeError("device 'gpu' asked for, but this MLX build has neither "
                               "Metal nor CUDA")
        mx.set_default_device(mx.gpu)
    else:
        raise RuntimeError(f"unknown device {name!r} (cpu, gpu or default)")
    return mx.default_device()


def _cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def device_facts() -> Dict[str, Any]:
    """Which device ran, with the backend flags and versions needed to read a table."""
    try:
        import mlx_lm  # lazy: after select_device (see the note at the top)

        mlx_lm_version = getattr(mlx_lm, "__version__", "?")
    except Exception:  # pragma: no cover - mlx_lm is a dependency
        mlx_lm_version = "?"
    dev = mx.default_device()
    try:
        info = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                for k, v in mx.device_info().items()}
    except Exception:
        info = {}
    kind = "gpu" if dev.type == mx.gpu else "cpu"
    backend = "cpu" if kind == "cpu" else "metal" if mx.metal.is_available() else (
        "cuda" if _cuda_available() else "gpu")
    return {"device": str(dev), "kind": kind, "backend": backend,
            "metal": bool(mx.metal.is_available()), "cuda": _cuda_available(),
            "device_info": info, "mlx": mx.__version__, "mlx_lm": mlx_lm_version,
            "python": platform.python_version(), "platform": platform.platform()}


class _NullDetokenizer:
    """Streaming detokenizer that keeps no text (for checkpoints without a tokenizer)."""

    offset = 0
    last_segment = ""
    text = ""

    def reset(self, *_: Any) -> None:
        pass

    add_token = finalize = reset


def load_tokenizer(model_path: Path, config: Dict[str, Any]):
    """The checkpoint's tokenizer as mlx-lm loads it, with no end-of-sequence ids (a
    timing decodes exactly ``tokens`` steps); without tokenizer files, one that keeps no
    text."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper  # lazy: after select_device

    if any((model_path / f).exists() for f in TOKENIZER_FILES):
        from mlx_lm.utils import load_tokenizer as mlx_load  # lazy: after select_device

        tok = mlx_load(model_path, eos_token_ids=config.get("eos_token_id"))
        tok.eos_token_ids = []
        return tok, True

    class _NoTextTokenizer(TokenizerWrapper):
        def __init__(self) -> None:  # deliberately skips the HF tokenizer set-up
            self._detokenizer = _NullDetokenizer()
            self._eos_token_ids = set()

    return _NoTextTokenizer(), False


def vocab_size(config: Dict[str, Any], model: Any) -> int:
    for c in (config, config.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int):
            return int(c["vocab_size"])
    return int(model.model.embed_tokens.weight.shape[0])


def param_bytes(model: Any) -> Dict[str, int]:
    """Bytes of the parameters in memory, by dtype (what the variant really runs)."""
    c: Counter = Counter()
    for _, v in tree_flatten(model.parameters()):
        c[str(v.dtype).replace("mlx.core.", "")] += int(v.nbytes)
    return dict(c)


def one_run(model: Any, tok: Any, prompt: Any, tokens: int) -> Dict[str, Any]:
    """One greedy generation through mlx-lm's stream_generate; its own tok/s figures."""
    from mlx_lm.generate import stream_generate  # lazy: after select_device

    out: List[int] = []
    t0, ttft, last = time.perf_counter(), None, None
    for resp in stream_generate(model, tok, prompt, max_tokens=tokens):
        if ttft is None:
            ttft = time.perf_counter() - t0
        out.append(int(resp.token))
        last = resp
    if last is None or ttft is None:
        raise RuntimeError("stream_generate produced no tokens")
    return {"prefill_tps": float(last.prompt_tps), "decode_tps": float(last.generation_tps),
            "ttft_s": float(ttft), "generated": int(last.generation_tokens),
            "finish_reason": last.finish_reason, "tokens": out,
            "seconds": time.perf_counter() - t0}


def main(spec: Dict[str, Any]) -> Dict[str, Any]:
    select_device(spec.get("device"))
    from mlx_lm.utils import load_model  # lazy: after select_device

    t0 = time.perf_counter()
    model_path = Path(spec["model"])
    model, config = load_model(model_path)
    if spec.get("adapter_path"):  # mlx-lm's load_adapters, or lorakit's for PEFT adapters
        model = load_unfused(model, spec["adapter_path"])
    moe_f32 = moe_float32_on_cpu(model)  # MLX's CPU GatherMM: float32 only
    f32_note = float32_if_refused(model)  # any other op MLX's CPU refuses in this dtype
    mx.eval(model.parameters())
    tok, has_tokenizer = load_tokenizer(model_path, config)
    load_s = time.perf_counter() - t0
    kinds = [type(m).__name__ for _, m in model.named_modules()]
    lora_modules = sum(1 for k in kinds if k.startswith(("LoRA", "DoRA")))
    emit("loaded", load_s=load_s, lora_modules=lora_modules)

    # the same synthetic prompt in every variant's process
    rng = np.random.default_rng(int(spec.get("seed", 0)))
    prompt = mx.array(rng.integers(0, vocab_size(config, model), int(spec["prompt_tokens"]))
                      .astype(np.int32))
    runs: List[Dict[str, Any]] = []
    for i in range(int(spec.get("warmup", 1)) + int(spec["repeats"])):
        warm = i < int(spec.get("warmup", 1))
        r = one_run(model, tok, prompt, int(spec["tokens"]))
        emit("run", warmup=warm, index=i, decode_tps=r["decode_tps"])
        if not warm:
            runs.append(r)
    facts = device_facts()
    mlx_peak = int(mx.get_peak_memory())
    rss_peak = rss_peak_bytes()
    on_gpu = facts["kind"] == "gpu"
    last = runs[-1] if runs else {"generated": 0, "tokens": []}
    return {**{k: [r[k] for r in runs] for k in ("prefill_tps", "decode_tps", "ttft_s")},
            "generated": last["generated"], "tokens": last["tokens"],
            "peak_bytes": mlx_peak if on_gpu else rss_peak,
            "peak_source": "mlx" if on_gpu else "rss",
            "mlx_peak_bytes": mlx_peak, "rss_peak_bytes": rss_peak,
            "param_bytes": param_bytes(model), "lora_modules": lora_modules,
            "moe_f32_blocks": len(moe_f32), "float32_note": f32_note,
            "has_tokenizer": has_tokenizer, "load_s": load_s, "device": facts}


if __name__ == "__main__":
    try:
        emit("result", **main(json.loads(sys.argv[1])))
    except BaseException as e:  # report every failure to the parent as one event
        tb = traceback.format_exc(limit=8)
        emit("error", type=type(e).__name__, message=str(e), traceback=tb)
        raise SystemExit(1)
