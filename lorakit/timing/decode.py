"""Decode timing: base vs unfused adapter vs fused checkpoints, one table.

``time_decode`` answers "what does fusing cost or save at generation time?" for a
user's own model and adapter. Each variant runs in a fresh process
(``lorakit.timing._worker``), so its peak memory is its own; decoding is greedy
through ``mlx_lm.generate.stream_generate``, so the tok/s figures are those
``mlx_lm generate`` prints. Variants:

- ``base``: the checkpoint as it is.
- ``unfused``: the checkpoint with the adapter's LoRA layers attached, as
  ``mlx_lm.load(model, adapter_path=...)`` builds it.
- ``promoted``: ``lorakit.fuse(..., dtype="promote")``, the float32 weights a fuse
  that forgets the cast writes (the bug this project exists to fix).
- ``fused``: ``lorakit.fuse(...)``, dtypes kept.
- ``mlx-lm-fused``: the output of the ``mlx_lm fuse`` command.

Each fused checkpoint is written into a temporary directory just before its variant
is timed and removed right after, so at most one fused copy is on disk at a time.

>>> import lorakit
>>> t = lorakit.time_decode("data/tiny-qwen3", "data/adapters/lora", variants=["base", "fused"],
...                         tokens=4, repeats=1, warmup=0, progress=False)
>>> [v.variant for v in t.variants if v.ok], len(t.plot().axes)
(['base', 'fused'], 2)
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .._progress import progress_bar
from ..errors import LorakitError
from ..inspect.report import Report
from ..io.checkpoint import Checkpoint
from ..io.safetensors import read_header
from ._protocol import MARK, TOKENIZER_FILES

PathLike = Union[str, Path]
VARIANTS = ("base", "unfused", "promoted", "fused", "mlx-lm-fused")
FUSED_VARIANTS = ("promoted", "fused", "mlx-lm-fused")
# the goal a dtype-kept fuse should meet against the base checkpoint
DECODE_TOLERANCE = 0.97
PEAK_TOLERANCE = 1.02
ADAPTER_FILES = ("adapters.safetensors", "adapter_model.safetensors")


@dataclass
class VariantTiming:
    """One variant's measurements (raw numbers; lists hold one value per repeat).

    Attributes:
        variant: one of ``VARIANTS``.
        prefill_tps / decode_tps: mlx-lm's ``prompt_tps`` and ``generation_tps``.
        ttft_s: seconds from the call to the first token (prefill included).
        peak_bytes: MLX's peak memory on a GPU, the process's peak RSS on CPU
            (``peak_source`` says which).
        weight_bytes: bytes on disk by dtype code; for ``unfused``, base plus adapter.
        param_bytes: bytes of the parameters in memory, by MLX dtype.
        lora_modules: LoRA/DoRA layers in the model that ran (0 unless unfused).
        tokens: the greedy tokens of the last repeat.
        device: which device ran, backend flags and versions.
        note: how the variant's checkpoint was made.
        error: why the variant could not run (then the numbers are empty).
    """

    variant: str
    prefill_tps: List[float] = field(default_factory=list)
    decode_tps: List[float] = field(default_factory=list)
    ttft_s: List[float] = field(default_factory=list)
    peak_bytes: int = 0
    peak_source: str = ""
    mlx_peak_bytes: int = 0
    rss_peak_bytes: int = 0
    weight_bytes: Dict[str, int] = field(default_factory=dict)
    param_bytes: Dict[str, int] = field(default_factory=dict)
    lora_modules: int = 0
    generated: int = 0
    tokens: List[int] = field(default_factory=list)
    load_s: float = 0.0
    prepare_s: float = 0.0
    device: Dict[str, Any] = field(default_factory=dict)
    note: str = ""
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.decode_tps)

    @property
    def decode_median(self) -> float:
        return statistics.median(self.decode_tps) if self.decode_tps else math.nan

    @property
    def prefill_median(self) -> float:
        return statistics.median(self.prefill_tps) if self.prefill_tps else math.nan

    @property
    def ttft_median(self) -> float:
        return statistics.median(self.ttft_s) if self.ttft_s else math.nan

    @property
    def weights_total(self) -> int:
        return sum(self.weight_bytes.values())

    def merge(self, other: "VariantTiming") -> "VariantTiming":
        """Pool another round of the same variant into this one (in place): its runs
        join these, peaks are the larger, an error in either is kept."""
        if other.variant != self.variant:
            raise ValueError(f"cannot pool {other.variant!r} into {self.variant!r}")
        error, prepare_s = self.error or other.error, self.prepare_s + other.prepare_s
        if other.decode_tps and not self.decode_tps:  # this one never ran: take the other
            self.__dict__.update(other.__dict__)
        elif other.decode_tps:
            self.prefill_tps = self.prefill_tps + other.prefill_tps
            self.decode_tps = self.decode_tps + other.decode_tps
            self.ttft_s = self.ttft_s + other.ttft_s
            for k in ("peak_bytes", "mlx_peak_bytes", "rss_peak_bytes"):
                setattr(self, k, max(getattr(self, k), getattr(other, k)))
            self.tokens = other.tokens or self.tokens
        self.error, self.prepare_s = error, prepare_s
        return self

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "VariantTiming":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def __repr__(self) -> str:  # cheap
        if not self.ok:
            return f"VariantTiming({self.variant!r}, error={self.error!r})"
        return (f"VariantTiming({self.variant!r}, decode {self.decode_median:.1f} tok/s, "
                f"peak {self.peak_bytes / 1e9:.2f} GB)")


def _gb(n: float) -> float:
    return n / 1e9


def _dtypes_text(by_dtype: Dict[str, int]) -> str:
    return " + ".join(f"{k} {v / 1e9:.3g}G" for k, v in
                      sorted(by_dtype.items(), key=lambda kv: -kv[1]))


def _prefix_match(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(repr=False)
class DecodeTiming(Report):
    """The decode timing table: one row per variant, ratios to ``base``.

    ``str()`` is the text table, notebooks render HTML, ``plot()`` draws decode tok/s
    and peak memory as bars, ``to_json()`` / ``DecodeTiming.from_json()`` round-trip.
    ``variants`` holds the raw :class:`VariantTiming` objects.
    """

    variants: List[VariantTiming] = field(default_factory=list)
    settings: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.refresh()

    # -- building ----------------------------------------------------------------------
    def add(self, v: VariantTiming) -> None:
        """Add one variant's result (replacing an earlier row of the same variant, e.g.
        the pooled result of another round) and rebuild the table (for live displays)."""
        for i, old in enumerate(self.variants):
            if old.variant == v.variant:
                self.variants[i] = v
                break
        else:
            self.variants.append(v)
        self.refresh()

    def variant(self, name: str) -> VariantTiming:
        for v in self.variants:
            if v.variant == name:
                return v
        raise KeyError(name)

    def ratio(self, name: str, what: str = "decode") -> float:
        """``name``'s median decode tok/s (``what="decode"``) or peak memory
        (``"peak"``) divided by base's; nan when either is missing."""
        try:
            base, v = self.variant("base"), self.variant(name)
        except KeyError:
            return math.nan
        if not (base.ok and v.ok):
            return math.nan
        if what == "decode":
            return v.decode_median / base.decode_median
        if what == "peak":
            return v.peak_bytes / base.peak_bytes if base.peak_bytes else math.nan
        if what == "prefill":
            return v.prefill_median / base.prefill_median
        raise ValueError(f"what must be decode, peak or prefill, not {what!r}")

    def refresh(self) -> None:
        """Recompute the table rows, summary and flags from ``variants``."""
        s = self.settings
        self.title = (f"Decode timing: {Path(s.get('model', '?')).name}"
                      + (f" + {Path(s['adapter_path']).name}" if s.get("adapter_path") else ""))
        dev = next((v.device for v in self.variants if v.device), {})
        self.summary = {
            "model": s.get("model", ""), "adapter": s.get("adapter_path") or "-",
            "prompt / decode tokens": f"{s.get('prompt_tokens')} / {s.get('tokens')}",
            "repeats": f"{s.get('repeats')} after {s.get('warmup')} warm-up",
            "device": _device_text(dev),
            "peak memory": ("MLX peak (mx.get_peak_memory)" if dev.get("kind") == "gpu"
                            else "process peak RSS") if dev else "",
            "versions": (f"mlx {dev.get('mlx')}, mlx-lm {dev.get('mlx_lm')}, "
                         f"python {dev.get('python')}") if dev else "",
        }
        ref = next((v.tokens for v in self.variants if v.variant == "unfused" and v.ok), None)
        rows: List[Dict[str, Any]] = []
        flagged: List[int] = []
        for i, v in enumerate(self.variants):
            if not v.ok:
                rows.append({"variant": v.variant, "note": f"error: {v.error}"})
                flagged.append(i)
                continue
            dr, pr = self.ratio(v.variant, "decode"), self.ratio(v.variant, "peak")
            row = {
                "variant": v.variant,
                "prefill tok/s": v.prefill_median,
                "decode tok/s": v.decode_median,
                "decode min-max": f"{min(v.decode_tps):.4g}-{max(v.decode_tps):.4g}",
                "decode x base": dr,
                "TTFT ms": v.ttft_median * 1e3,
                "peak GB": _gb(v.peak_bytes),
                "peak x base": pr,
                "weights GB": _gb(v.weights_total),
                "weight dtypes": _dtypes_text(v.weight_bytes),
            }
            if ref is not None:
                row["= unfused tokens"] = f"{_prefix_match(v.tokens, ref)}/{len(ref)}"
            rows.append(row)
            if v.variant != "base" and ((dr < DECODE_TOLERANCE) or (pr > PEAK_TOLERANCE)):
                flagged.append(i)
        self.rows = rows
        self.flagged = flagged
        cols = ["variant", "prefill tok/s", "decode tok/s", "decode min-max", "decode x base",
                "TTFT ms", "peak GB", "peak x base", "weights GB", "weight dtypes"]
        if ref is not None:
            cols.append("= unfused tokens")
        if any(not v.ok for v in self.variants):
            cols.append("note")
        self.columns = cols

    # -- serialising -------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        d = super().to_dict()
        d["settings"] = dict(self.settings)
        d["variants"] = [v.to_dict() for v in self.variants]
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DecodeTiming":
        return cls(title="", settings=dict(d.get("settings") or {}),
                   variants=[VariantTiming.from_dict(v) for v in d.get("variants", [])])

    @classmethod
    def from_json(cls, text: str) -> "DecodeTiming":
        """Rebuild a result from ``to_json()``'s text."""
        return cls.from_dict(json.loads(text))

    # -- figure ------------------------------------------------------------------------
    def plot(self, ax=None):
        """Bar charts of decode tok/s (min-max whiskers) and peak memory per variant.

        Returns the matplotlib Figure (made without pyplot, so it shows once in a
        notebook and is safe to draw from a background thread).
        """
        from matplotlib.figure import Figure

        ok = [v for v in self.variants if v.ok]
        names = [v.variant for v in ok]
        colors = [_COLORS.get(n, "#888888") for n in names]
        fig = Figure(figsize=(9, 3.4), layout="constrained")
        a1, a2 = fig.subplots(1, 2)
        med = [v.decode_median for v in ok]
        lo = [m - min(v.decode_tps) for m, v in zip(med, ok)]
        hi = [max(v.decode_tps) - m for m, v in zip(med, ok)]
        a1.bar(names, med, yerr=[lo, hi], color=colors, capsize=3)
        a1.set_ylabel("decode tok/s (median)")
        a2.bar(names, [_gb(v.peak_bytes) for v in ok], color=colors)  # no spread: one peak
        a2.set_ylabel("peak memory GB" + (" (RSS)" if ok and ok[0].peak_source == "rss"
                                          else ""))
        peaks = [_gb(v.peak_bytes) for v in ok]
        tops = [max(v.decode_tps) for v in ok]  # labels sit above the whiskers
        for a, vals, at in ((a1, med, tops), (a2, peaks, peaks)):
            a.tick_params(axis="x", labelrotation=20)
            a.margins(y=0.12)
            base = next((x for n, x in zip(names, vals) if n == "base"), None)
            for i, (x, y) in enumerate(zip(vals, at)):
                label = f"{x / base:.2f}x" if base else f"{x:.3g}"
                a.annotate(label, (i, y), ha="center", va="bottom", fontsize=8,
                           xytext=(0, 2), textcoords="offset points")
        dev = next((v.device for v in ok if v.device), {})
        where = " ".join(x for x in (dev.get("backend", ""), dev.get("device_info", {})
                                     .get("device_name", "")) if x)
        fig.suptitle(f"{Path(self.settings.get('model', '')).name}"
                     + (f" on {where}" if where else ""), fontsize=10)
        return fig


_COLORS = {"base": "#4c72b0", "unfused": "#8172b2", "promoted": "#c44e52",
           "fused": "#55a868", "mlx-lm-fused": "#64b5cd"}


def _device_text(dev: Dict[str, Any]) -> str:
    if not dev:
        return ""
    name = dev.get("device_info", {}).get("device_name", "")
    return f"{dev.get('device')} [{dev.get('backend')}]" + (f" {name}" if name else "")


# -- running ---------------------------------------------------------------------------

def weight_bytes(model: PathLike, adapter_path: Optional[PathLike] = None) -> Dict[str, int]:
    """Bytes by dtype code of a checkpoint's tensors (plus an adapter's, if given),
    read from the safetensors headers only."""
    c: Counter = Counter()
    for t in Checkpoint(model).tensors.values():
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


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in TOKENIZER_FILES)


def _child_env() -> Dict[str, str]:
    # the worker must import this lorakit, also from a source tree that is not installed
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _make_mlx_lm_fused(model: Path, adapter: Path, out: Path, python: str) -> str:
    """Run the ``mlx_lm fuse`` command; if it cannot run, say why and fall back."""
    if _has_tokenizer(model):
        proc = subprocess.run([python, "-m", "mlx_lm", "fuse", "--model", str(model),
                               "--adapter-path", str(adapter), "--save-path", str(out)],
                              capture_output=True, text=True, env=_child_env())
        if proc.returncode == 0:
            return "made by `mlx_lm fuse`"
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        reason = f"`mlx_lm fuse` failed ({tail[0]})"
        shutil.rmtree(out, ignore_errors=True)
    else:
        reason = "`mlx_lm fuse` needs tokenizer files, the checkpoint has none"
    from ..fusion.stream import fuse

    fuse(model, adapter, out, rounding="mlx-lm", progress=False)
    # mlx-lm's LoRALinear.fuse casts the f32 delta to the weight dtype and adds there;
    # rounding="mlx-lm" is that order, bit for bit, so the weights are the same.
    return f"{reason}; made by lorakit.fuse(rounding='mlx-lm'), bit-identical for LoRA"


def _prepare(variant: str, model: Path, adapter: Path, work: Path, python: str) -> str:
    from ..fusion.stream import fuse

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
        proc = subprocess.Popen([python, "-m", "lorakit.timing._worker", json.dumps(spec)],
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env=_child_env())
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
            why = ("cancelled" if cancel is not None and cancel.is_set() else
                   "timed out" if timeout is not None and time.monotonic() - t0 > timeout
                   else f"worker exited with status {proc.returncode}")
            return {"event": "error", "message": why + (": " + " | ".join(tail) if tail
                                                        else "")}
        return result


def _time_variant(n: str, model: Path, adapter: Optional[Path], work: Path,
                  spec: Dict[str, Any], python: str, bar: Any, cancel: Any,
                  timeout: Optional[float], keep: Optional[Dict[str, str]] = None
                  ) -> VariantTiming:
    """Make the variant's checkpoint if it is a fused one, time it in a worker process,
    and remove the checkpoint again (so at most one fused copy is on disk at a time).
    With ``keep`` (variant -> note), fused checkpoints stay for the next round."""
    runs = spec["warmup"] + spec["repeats"]
    v = VariantTiming(variant=n, note={"base": "the checkpoint", "unfused": "mlx_lm "
                                       "load_model + load_adapters (LoRA layers)"}.get(n, ""))
    path = model
    if keep is not None and n in keep:
        v.note, path = keep[n], work / n
    elif n in FUSED_VARIANTS:
        if bar is not None:
            bar.set_postfix_str(f"making {n}")
        t0 = time.perf_counter()
        try:
            v.note = _prepare(n, model, adapter, work, python)  # type: ignore[arg-type]
            path = work / n
            if keep is not None:
                keep[n] = v.note
        except LorakitError as e:
            v.error = e.message
        v.prepare_s = time.perf_counter() - t0
        if bar is not None:
            bar.update(1)
    try:
        if v.error is None:
            if bar is not None:
                bar.set_postfix_str(n)
            done = [0]

            def on_run(ev: Dict[str, Any]) -> None:
                if ev["event"] == "run" and bar is not None:
                    done[0] += 1
                    bar.update(1)

            ev = _run_worker(dict(spec, model=str(path), adapter_path=str(adapter)
                                  if n == "unfused" else None),
                             python, on_run, cancel, timeout)
            if bar is not None:
                bar.update(runs - done[0])
            if ev["event"] == "error":
                v.error = ev.get("message") or ev.get("type") or "worker failed"
            else:
                for k, x in ev.items():
                    if k != "event" and k in VariantTiming.__dataclass_fields__:
                        setattr(v, k, x)
                v.weight_bytes = weight_bytes(path, adapter if n == "unfused" else None)
        elif bar is not None:
            bar.update(runs)
    finally:
        if path != model and keep is None:
            shutil.rmtree(path, ignore_errors=True)
    return v


def time_decode(model: PathLike, adapter_path: Optional[PathLike] = None, *,
                variants: Optional[Sequence[str]] = None, prompt_tokens: int = 128,
                tokens: int = 128, repeats: int = 3, warmup: int = 1,
                device: Optional[str] = None, seed: int = 0,
                workdir: Optional[PathLike] = None, progress: bool = True,
                on_result: Optional[Callable[[VariantTiming], None]] = None,
                cancel: Any = None, timeout: Optional[float] = None,
                python: Optional[str] = None, rounds: int = 1) -> DecodeTiming:
    """Time greedy decoding of a checkpoint and its adapter, fused and unfused.

    Args:
        model: base checkpoint directory (mlx-lm / Hugging Face layout).
        adapter_path: adapter directory; needed by every variant but ``base``.
        variants: which of ``VARIANTS`` to run, in order (default: all, or ``base``
            alone without an adapter).
        prompt_tokens: length of the synthetic prompt (token ids drawn with ``seed``;
            the same in every variant).
        tokens: tokens decoded per run; end-of-sequence never stops a run.
        repeats: timed runs per variant, after ``warmup`` untimed runs.
        device: ``"cpu"``, ``"gpu"`` or None for MLX's default device.
        workdir: where the fused checkpoints are written (a temporary directory
            inside it, removed at the end); default: the system temp directory.
        progress: show a tqdm progress bar over preparation and variants x runs.
        on_result: called with each :class:`VariantTiming` as soon as it is measured
            (a live display's hook; called from the thread running ``time_decode``).
        cancel: an object with ``is_set()`` (e.g. ``threading.Event``); when set, the
            running worker is stopped and the remaining variants are skipped.
        timeout: seconds allowed to one variant's process.
        python: interpreter for the worker processes (default: this one).
        rounds: how many times the whole list of variants runs, each round in a
            rotated order (round r starts at the r-th variant) and every variant in a
            fresh process; each variant's runs are pooled over the rounds (medians over
            ``rounds * repeats`` runs). A slow phase of a shared machine then falls on
            every variant alike instead of on whichever ran at the time. With more
            than one round the fused checkpoints are made once and kept on disk until
            the end (one copy per fused variant).

    Returns:
        A :class:`DecodeTiming`. A variant that failed carries its ``error``.

    Runs in a background thread as well: all MLX work happens in the workers.

    >>> t = time_decode("data/tiny-qwen3", variants=["base"], tokens=4, repeats=1, warmup=0,
    ...                 progress=False)
    >>> print(str(t).splitlines()[0])
    Decode timing: tiny-qwen3
    """
    model = Path(model)
    adapter = Path(adapter_path) if adapter_path is not None else None
    names = list(variants) if variants is not None else (
        list(VARIANTS) if adapter is not None else ["base"])
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names or len(set(names)) != len(names):
        raise LorakitError("unknown, repeated or no decode-timing variants",
                           found=", ".join(names) or "none", expected=", ".join(VARIANTS))
    if adapter is None and any(n != "base" for n in names):
        raise LorakitError("these variants need an adapter",
                           found=", ".join(n for n in names if n != "base"),
                           hint="pass adapter_path (--adapter-path)")
    if min(prompt_tokens, tokens, repeats, rounds) < 1 or warmup < 0:
        raise LorakitError("prompt_tokens, tokens, repeats and rounds must be >= 1, "
                           "warmup >= 0",
                           found=f"{prompt_tokens}, {tokens}, {repeats}, {rounds}, {warmup}")
    if device not in (None, "cpu", "gpu", "default"):
        raise LorakitError("unknown device", found=str(device), expected="cpu, gpu or None")
    Checkpoint(model)  # a bad model directory fails here, before any work
    python = python or sys.executable
    settings = {"model": str(model), "adapter_path": str(adapter) if adapter else None,
                "variants": names, "prompt_tokens": prompt_tokens, "tokens": tokens,
                "repeats": repeats, "warmup": warmup, "device": device, "seed": seed,
                "rounds": rounds}
    result = DecodeTiming(title="", settings=settings)
    to_prepare = [n for n in names if n in FUSED_VARIANTS]
    bar = progress_bar(progress, len(to_prepare) + len(names) * (warmup + repeats) * rounds,
                       "decode timing", unit="step", leave=True) if progress else None
    spec = {"prompt_tokens": prompt_tokens, "tokens": tokens, "repeats": repeats,
            "warmup": warmup, "seed": seed, "device": device}
    work = Path(tempfile.mkdtemp(prefix="lorakit-timing-",
                                 dir=str(workdir) if workdir is not None else None))
    keep: Optional[Dict[str, str]] = {} if rounds > 1 else None
    pooled: Dict[str, VariantTiming] = {}
    try:
        for r in range(rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                if cancel is not None and cancel.is_set():
                    break
                v = _time_variant(n, model, adapter, work, spec, python, bar, cancel,
                                  timeout, keep)
                v = pooled[n].merge(v) if n in pooled else v
                pooled[n] = v
                result.add(v)
                if on_result is not None:
                    on_result(v)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if bar is not None:
            bar.close()
    return result
