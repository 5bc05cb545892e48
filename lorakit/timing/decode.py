"""Decode timing: base vs unfused adapter vs fused checkpoints, one table.

Each variant (``base``, ``unfused`` = LoRA layers attached as ``mlx_lm.load`` does,
``promoted`` = ``fuse(dtype="promote")``, ``fused``, ``mlx-lm-fused`` = the ``mlx_lm fuse``
command's output) runs in a fresh worker process (:mod:`lorakit.timing.worker`), so its
peak memory is its own; tok/s are mlx-lm's ``stream_generate`` figures. A fused checkpoint
is written just before its variant runs and removed after it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

from ..errors import ArgumentError, LorakitError, PathLike
from ..fusion.fuse import fuse
from ..io.formats import source
from ..io.formats.safetensors import read_header
from ..progress import ProgressBar, progress_bar
from .kl_column import kl_tokens, kl_vs_unfused
from .table import ADAPTER_FILES, FUSED_VARIANTS, VARIANTS, DecodeTiming, VariantTiming
from .worker import MARK, TOKENIZER_FILES

__all__ = ["weight_bytes", "auto_rounds", "DecodeOptions", "time_decode"]

_NOTES = {"base": "the checkpoint", "unfused": "mlx_lm load_model + load_adapters (LoRA layers)"}
#: what a worker's spec takes from the options
_SPEC = ("prompt_tokens", "tokens", "repeats", "warmup", "seed", "device")
#: the least value of each int option
_MINIMA = dict(prompt_tokens=1, tokens=1, repeats=1, warmup=0, rounds=1, seed=0)


def weight_bytes(model: PathLike, adapter_path: Optional[PathLike] = None) -> Dict[str, int]:
    """Bytes by dtype of a checkpoint's tensors (plus an adapter's), from the headers only."""
    c: Counter = Counter()
    for t in source.open(model, checkpoint=True).tensors.values():
        c[t.dtype] += t.nbytes
    if adapter_path is not None:
        # the file mlx-lm / PEFT load (training checkpoints beside it are not counted)
        for name in ADAPTER_FILES:
            f = Path(adapter_path) / name
            if f.is_file():
                for t in read_header(f).tensors.values():
                    c[t.dtype] += t.nbytes
                break
    return dict(c)


def auto_rounds(weight_bytes: int) -> int:
    """Default interleaved rounds: more for small checkpoints, fewer for large ones."""
    return 5 if weight_bytes < 1e9 else 3 if weight_bytes < 20e9 else 2


def _child_env() -> Dict[str, str]:
    # the worker must import this lorakit, also from a source tree that is not installed
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _make_mlx_lm_fused(model: Path, adapter: Path, out: Path, python: str) -> str:
    """Run the ``mlx_lm fuse`` command; if it cannot run, say why and fall back."""
    if any((model / f).exists() for f in TOKENIZER_FILES):
        args = ["--model", str(model), "--adapter-path", str(adapter), "--save-path", str(out)]
        cmd = [python, "-m", "mlx_lm", "fuse", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_child_env())
        if proc.returncode == 0:
            return "made by `mlx_lm fuse`"
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        reason = f"`mlx_lm fuse` failed ({tail[0]})"
        shutil.rmtree(out, ignore_errors=True)
    else:
        reason = "`mlx_lm fuse` needs tokenizer files, the checkpoint has none"

    fuse(model, adapter, out, rounding="mlx-lm", progress=False)
    # mlx-lm's LoRALinear.fuse casts the f32 delta to the weight dtype and adds there;
    # rounding="mlx-lm" is that order, bit for bit, so the weights are the same.
    return f"{reason}; made by lorakit.fuse(rounding='mlx-lm'), bit-identical for LoRA"


def _prepare(variant: str, model: Path, adapter: Path, work: Path, python: str) -> str:
    out = work / variant
    if variant == "promoted":
        fuse(model, adapter, out, dtype="promote", progress=False)
        return "lorakit.fuse(dtype='promote'): f32 fused weights"
    if variant == "fused":
        fuse(model, adapter, out, progress=False)
        return "lorakit.fuse(): dtypes kept"
    return _make_mlx_lm_fused(model, adapter, out, python)


def _run_worker(spec: Dict[str, Any], python: str, on_run: Callable[[Dict[str, Any]], None],
                cancel: Any, timeout: Optional[float]) -> Dict[str, Any]:
    with tempfile.TemporaryFile(mode="w+") as err:
        cmd = [python, "-m", "lorakit.timing.worker", json.dumps(spec)]
        env, out = _child_env(), subprocess.PIPE
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        result: Optional[Dict[str, Any]] = None
        t0 = time.monotonic()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not line.startswith(MARK):
                    continue
                ev = json.loads(line[len(MARK):])
                if ev["event"] in ("result", "error"):
                    result = ev
                else:
                    on_run(ev)
                if (cancel is not None and cancel.is_set()) or (
                        timeout is not None and time.monotonic() - t0 > timeout):
                    proc.kill()
                    break
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if result is None:
            err.seek(0)
            tail = err.read().strip().splitlines()[-3:]
            why = f"worker exited with status {proc.returncode}"
            if timeout is not None and time.monotonic() - t0 > timeout:
                why = "timed out"
            if cancel is not None and cancel.is_set():
                why = "cancelled"
            return {"event": "error", "message": why + (": " + " | ".join(tail) if tail
                                                        else "")}
        return result


def _time_variant(n: str, model: Path, adapter: Optional[Path], work: Path,
                  spec: Dict[str, Any], python: str, bar: ProgressBar, cancel: Any,
                  timeout: Optional[float], keep: Optional[Dict[str, str]] = None
                  ) -> VariantTiming:
    """Make a fused variant's checkpoint, time it in a worker and remove it again (with
    ``keep``, variant -> note, fused checkpoints stay for the next round)."""
    runs = spec["warmup"] + spec["repeats"]
    v = VariantTiming(variant=n, note=_NOTES.get(n, ""))
    path = model
    if keep is not None and n in keep:
        v.note, path = keep[n], work / n
    elif n in FUSED_VARIANTS:
        bar.set_postfix_str(f"making {n}")
        t0 = time.perf_counter()
        try:
            assert adapter is not None, "a fused variant needs an adapter"
            v.note = _prepare(n, model, adapter, work, python)
            path = work / n
            if keep is not None:
                keep[n] = v.note
        except LorakitError as e:
            v.error = e.message
        v.prepare_s = time.perf_counter() - t0
        bar.update(1)
    try:
        if v.error is None:
            bar.set_postfix_str(n)
            done = [0]

            def on_run(ev: Dict[str, Any]) -> None:
                if ev["event"] == "run":
                    done[0] += 1
                    bar.update(1)

            job = dict(spec, model=str(path), adapter_path=str(adapter) if n == "unfused" else None)
            ev = _run_worker(job, python, on_run, cancel, timeout)
            bar.update(runs - done[0])
            if ev["event"] == "error":
                v.error = ev.get("message") or ev.get("type") or "worker failed"
            else:
                for k, x in ev.items():
                    if k != "event" and k in VariantTiming.__dataclass_fields__:
                        setattr(v, k, x)
                v.weight_bytes = weight_bytes(path, adapter if n == "unfused" else None)
        else:
            bar.update(runs)
    finally:
        if path != model and keep is None:
            shutil.rmtree(path, ignore_errors=True)
    return v


@dataclass(frozen=True)
class DecodeOptions:
    """What a decode timing measures, checked once. ``variants`` default to all (``base``
    alone without an adapter); ``rounds`` (None: :func:`auto_rounds`) rotated rounds, runs
    pooled; ``behaviour``: True (512 tokens) or a token count adds "KL vs unfused"."""

    variants: Optional[Tuple[str, ...]] = None
    prompt_tokens: int = 128
    tokens: int = 128
    repeats: int = 3
    warmup: int = 1
    rounds: Optional[int] = None
    device: Optional[str] = None
    seed: int = 0
    timeout: Optional[float] = None
    workdir: Optional[PathLike] = None
    behaviour: Union[bool, int] = False

    def __post_init__(self) -> None:
        if self.variants is not None:
            v = tuple(self.variants)
            object.__setattr__(self, "variants", v)
            if not v or len(set(v)) != len(v) or any(n not in VARIANTS for n in v):
                raise ArgumentError.bad("variants", list(v), "one or more distinct names "
                                        "among " + ", ".join(VARIANTS))
        for name, low in _MINIMA.items():
            x = getattr(self, name)
            if x is None and name == "rounds":
                continue
            if not isinstance(x, int) or isinstance(x, bool) or x < low:
                raise ArgumentError.bad(name, x, f"an int >= {low}"
                                        + (" or None (auto)" if name == "rounds" else ""))
        if self.device not in (None, "cpu", "gpu", "default"):
            raise ArgumentError.bad("device", self.device, "cpu, gpu or None")
        t = self.timeout
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0):
            raise ArgumentError.bad("timeout", t, "seconds > 0, or None")
        kl_tokens(self.behaviour)

    def settings(self) -> Dict[str, Any]:
        """What a :class:`DecodeTiming` records (variants and rounds as resolved)."""
        keys = ("prompt_tokens", "tokens", "repeats", "warmup", "device", "seed", "rounds")
        return {"variants": list(self.variants or ()), **{k: getattr(self, k) for k in keys}}


def time_decode(model: PathLike, adapter_path: Optional[PathLike] = None, *,
                options: Optional[DecodeOptions] = None, progress: bool = True,
                on_result: Optional[Callable[[VariantTiming], None]] = None,
                cancel: Any = None, python: Optional[str] = None,
                **settings: Any) -> DecodeTiming:
    """Time greedy decoding of a checkpoint (directory or hub id) and its adapter, fused
    and unfused; a :class:`DecodeTiming` (a failed variant carries its ``error``).

    ``**settings`` replace ``options``' fields (:class:`DecodeOptions`). ``on_result``
    gets each :class:`VariantTiming` as it is measured; ``cancel`` (anything with
    ``is_set()``) stops the running worker; ``python``: the workers' interpreter.
    Safe in a background thread: all MLX work happens in the workers.

    >>> t = time_decode("data/tiny-qwen3", variants=["base"], tokens=4, repeats=1, warmup=0,
    ...                 rounds=1, progress=False)
    >>> print(str(t).splitlines()[0])
    Decode timing: tiny-qwen3
    """
    opts = replace(options or DecodeOptions(), **settings)
    model = Path(model)
    adapter = Path(adapter_path) if adapter_path is not None else None
    names = list(opts.variants or (VARIANTS if adapter is not None else ["base"]))
    n_kl = kl_tokens(opts.behaviour)
    if adapter is None and (n_kl is not None or any(n != "base" for n in names)):
        need = [n for n in names if n != "base"] + (["behaviour"] if n_kl else [])
        raise ArgumentError.bad("adapter_path", None, "an adapter directory: "
                                f"{', '.join(need)} need an adapter",
                                hint="pass adapter_path (--adapter-path)")
    ckpt = source.open(model, checkpoint=True)  # a bad model fails here, before any work
    model = ckpt.path  # a hub id resolved to its snapshot
    opts = replace(opts, variants=tuple(names), rounds=opts.rounds or auto_rounds(
        sum(t.nbytes for t in ckpt.tensors.values())))
    rounds, runs = opts.rounds or 1, opts.warmup + opts.repeats  # rounds: resolved above
    python = python or sys.executable
    adapter_s = str(adapter) if adapter else None
    settings = {"model": str(model), "adapter_path": adapter_s, **opts.settings()}
    result = DecodeTiming(title="", settings=settings)
    steps = sum(n in FUSED_VARIANTS for n in names) + len(names) * runs * rounds
    bar = progress_bar(progress, steps, "decode timing", unit="step", leave=True)
    spec = {k: getattr(opts, k) for k in _SPEC}
    workdir = str(opts.workdir) if opts.workdir is not None else None
    work = Path(tempfile.mkdtemp(prefix="lorakit-timing-", dir=workdir))
    keep: Optional[Dict[str, str]] = {} if rounds > 1 or n_kl is not None else None
    pooled: Dict[str, VariantTiming] = {}
    try:
        for r in range(rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                if cancel is not None and cancel.is_set():
                    break
                if n in pooled and pooled[n].error and not pooled[n].decode_tps:
                    continue  # could not be made or run: not retried every round
                v = _time_variant(n, model, adapter, work, spec, python, bar, cancel,
                                  opts.timeout, keep)
                v.run_rounds = [r] * len(v.decode_tps)
                v = pooled[n].merge(v) if n in pooled else v
                pooled[n] = v
                result.add(v)
                if on_result is not None:
                    on_result(v)
        if n_kl is not None and not (cancel is not None and cancel.is_set()):
            assert adapter is not None and keep is not None
            paths = {n: model if n == "base" else work / n for n, v in pooled.items()
                     if v.ok and (n in ("base", "unfused") or n in keep)}
            bar.set_postfix_str("KL vs unfused")
            result.settings["kl_tokens"] = n_kl
            try:  # the timing is kept whatever happens to the KL column
                kls = kl_vs_unfused(model, adapter, paths, n_kl)
            except (LorakitError, ValueError, RuntimeError) as e:
                kls, result.settings["kl_error"] = {}, str(e)
            for n, kl in kls.items():
                pooled[n].kl_vs_unfused = kl
                result.add(pooled[n])
            result.refresh()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        bar.close()
    return result
