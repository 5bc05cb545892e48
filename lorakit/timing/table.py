"""The decode-timing table: one :class:`VariantTiming` per variant (base, unfused,
promoted, fused, mlx-lm-fused), gathered in a :class:`DecodeTiming` report with ratios
against the base, flags where a variant decodes slower or peaks higher, a figure, and
JSON in and out. :func:`lorakit.timing.decode.time_decode` fills it.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from ..inspect.report import Report

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

    column_help = {
        "variant": "base (no adapter), unfused (adapter attached), fused, promoted "
                   "(fused into float32), mlx-lm-fused (mlx_lm fuse's output)",
        "prefill tok/s": "prompt tokens processed per second (median)",
        "decode tok/s": "generated tokens per second (median)",
        "decode min-max": "slowest-fastest decode tok/s over the repeats",
        "decode x base": "decode tok/s over base's (< 0.97 is flagged)",
        "TTFT ms": "time to first token, milliseconds (median)",
        "peak GB": "the process's peak memory (RSS)",
        "peak x base": "peak GB over base's (> 1.02 is flagged)",
        "weights GB": "size of the model's weights in memory",
        "weight dtypes": "weight bytes per dtype",
        "= unfused tokens": "generated tokens equal to the unfused model's, counted "
                            "from the start",
        "note": "why a variant has no numbers",
    }

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
        from matplotlib.figure import Figure  # lazy: matplotlib only when a figure is drawn

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
