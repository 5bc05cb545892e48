"""The decode-timing table: one :class:`VariantTiming` per variant in a
:class:`DecodeTiming` report with ratios to base, flags, a figure and JSON in and out."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..errors import ArgumentError
from ..inspect.moe_cpu import cpu_notes
from ..report import Report
from .stats import (
    BYTES_THRESHOLD,
    CONFIDENCE,
    SPEED_THRESHOLD,
    bytes_explain,
    bytes_verdict,
    human_bytes,
    noise_band,
    ratio_interval,
    speed_verdict,
)

__all__ = ["VARIANTS", "VariantTiming", "DecodeTiming"]

VARIANTS = ("base", "unfused", "promoted", "fused", "mlx-lm-fused")
FUSED_VARIANTS = ("promoted", "fused", "mlx-lm-fused")
CPU_NOTE = ("on CPU: bf16 matmuls are not faster than f32 here, so decode speed cannot "
            "show what promoted f32 weights cost on a GPU; the weight bytes (exact) can, "
            "and speed is flagged only beyond the threshold and outside the interval")
TINY_NOTE = ("the model is tiny ({size}): per-token overhead, not weight reads, sets the "
             "speed, so equal bytes decoding at different speeds is noise")
ADAPTER_FILES = ("adapters.safetensors", "adapter_model.safetensors")


def _median(name: str) -> property:
    """A property: the median of a list field, nan when it is empty."""
    return property(lambda self: statistics.median(getattr(self, name) or [math.nan]))


@dataclass
class VariantTiming:
    """One variant's raw measurements (lists: one value per repeat); ``peak_bytes`` is MLX's
    peak on a GPU, peak RSS on CPU (``peak_source``); ``weight_bytes`` are on disk by dtype
    (base plus adapter for ``unfused``); ``error`` says why the variant could not run."""

    variant: str
    prefill_tps: List[float] = field(default_factory=list)
    decode_tps: List[float] = field(default_factory=list)
    ttft_s: List[float] = field(default_factory=list)
    run_rounds: List[int] = field(default_factory=list)
    peak_bytes: int = 0
    peak_source: str = ""
    mlx_peak_bytes: int = 0
    rss_peak_bytes: int = 0
    weight_bytes: Dict[str, int] = field(default_factory=dict)
    param_bytes: Dict[str, int] = field(default_factory=dict)
    lora_modules: int = 0
    moe_f32_blocks: int = 0
    float32_note: str = ""
    generated: int = 0
    tokens: List[int] = field(default_factory=list)
    load_s: float = 0.0
    prepare_s: float = 0.0
    device: Dict[str, Any] = field(default_factory=dict)
    note: str = ""
    error: Optional[str] = None
    kl_vs_unfused: Optional[float] = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.decode_tps)

    decode_median = _median("decode_tps")
    prefill_median = _median("prefill_tps")
    ttft_median = _median("ttft_s")

    @property
    def weights_total(self) -> int:
        return sum(self.weight_bytes.values())

    def merge(self, other: "VariantTiming") -> "VariantTiming":
        """Pool another round of the same variant into this one (in place)."""
        if other.variant != self.variant:
            raise ValueError(f"cannot pool {other.variant!r} into {self.variant!r}")
        error, prepare_s = self.error or other.error, self.prepare_s + other.prepare_s
        if other.decode_tps and not self.decode_tps:  # this one never ran: take the other
            self.__dict__.update(other.__dict__)
        elif other.decode_tps:
            for k in ("prefill_tps", "decode_tps", "ttft_s", "run_rounds"):
                setattr(self, k, getattr(self, k) + getattr(other, k))
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


def verdict_words(vd: Dict[str, Any]) -> str:
    """A variant's verdict cell from :meth:`DecodeTiming.verdicts` (none: the reference)."""
    return "; ".join(w for w in (vd.get("bytes"), vd.get("speed")) if w) if vd else "reference"


@dataclass(repr=False)
class DecodeTiming(Report):
    """The decode timing table: one row per variant, ratios to ``base``; ``variants``
    holds the raw :class:`VariantTiming` objects, ``to_json()`` / ``from_json()``
    round-trip."""

    column_help = {
        "variant": "base (no adapter), unfused (adapter attached), fused, promoted "
                   "(fused into float32), mlx-lm-fused (mlx_lm fuse's output)",
        "prefill tok/s": "prompt tokens processed per second (median)",
        "decode tok/s": "generated tokens per second (median)",
        "decode min-max": "slowest-fastest decode tok/s over the repeats",
        "decode x base": "decode tok/s over base's (median of the per-round ratios)",
        "TTFT ms": "time to first token, milliseconds (median)",
        "peak GB": "the process's peak memory (RSS)",
        "peak x base": "peak GB over base's",
        "weights GB": "size of the model's weights in memory",
        "weight dtypes": "weight bytes per dtype",
        "= unfused tokens": "generated tokens equal to the unfused model's, counted "
                            "from the start",
        "note": "why a variant has no numbers",
        "KL vs unfused": "mean KL(unfused adapter || this variant) per token on the "
                         "embedded corpus (0 = same next-token distributions)",
        "95% interval": "bootstrap interval of decode x base, paired by round (none for one run)",
        "weights x base": "weight bytes over base's, exact from the headers (> 1.02 is flagged)",
        "bytes predict": "the decode ratio the weight bytes predict (base bytes / these): a "
                         "decode step reads every weight once",
        "weights GB/s": "weight bytes read per second at the median decode speed",
        "why": "bytes explain it (the prediction inside the interval, widened by the base's "
               "noise) or not the bytes (a slower path; or launches/compute bound it)",
        "verdict": "flagged for bytes, or for speed when the ratio is below 0.90, its whole "
                   "interval below 1 and below base-against-itself noise",
    }

    variants: List[VariantTiming] = field(default_factory=list)
    settings: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.refresh()

    # -- building ----------------------------------------------------------------------
    def add(self, v: VariantTiming) -> None:
        """Add (or replace) one variant's result and rebuild the table."""
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

    def ran(self, name: str) -> Optional[VariantTiming]:
        """The variant if it is there and ran, else None."""
        v = next((v for v in self.variants if v.variant == name), None)
        return v if v is not None and v.ok else None

    def ratio(self, name: str, what: str = "decode") -> float:
        """``name``'s median tok/s (or peak memory) over base's; nan when either is missing."""
        base, v = self.ran("base"), self.ran(name)
        if base is None or v is None:
            return math.nan
        if what == "decode":
            return v.decode_median / base.decode_median
        if what == "peak":
            return v.peak_bytes / base.peak_bytes if base.peak_bytes else math.nan
        if what == "prefill":
            return v.prefill_median / base.prefill_median
        raise ArgumentError.bad("what", what, "decode, peak or prefill")

    def interval(self, name: str) -> tuple:
        """The paired bootstrap interval of ``name``'s decode ratio to base (nan if missing)."""
        base, v = self.ran("base"), self.ran(name)
        if base is None or v is None:
            return math.nan, math.nan
        if name == "base":
            return 1.0, 1.0
        return ratio_interval(v.decode_tps, v.run_rounds or None, base.decode_tps,
                              base.run_rounds or None,
                              per_round=self.settings.get("repeats") or None)

    def noise_band(self) -> tuple:
        """The base against itself (:func:`lorakit.timing.stats.noise_band`)."""
        base = self.ran("base")
        if base is None:
            return math.nan, math.nan
        return noise_band(base.decode_tps, base.run_rounds or None,
                          per_round=self.settings.get("repeats") or None)

    def rounds_run(self) -> int:
        """How many rounds the base variant's runs came from (1 without labels)."""
        try:
            base = self.variant("base")
        except KeyError:
            return 0
        return len(set(base.run_rounds)) if base.run_rounds else 1

    def verdicts(self) -> Dict[str, Dict[str, Any]]:
        """Per variant: the ratios, their words and flags (``speed_flag``, ``bytes_flag``)."""
        out: Dict[str, Dict[str, Any]] = {}
        base, band = self.ran("base"), self.noise_band()
        for v in self.variants:
            if not v.ok or base is None or v.variant == "base":
                continue
            dr = self.ratio(v.variant, "decode")
            ci = self.interval(v.variant)
            sf, sw = speed_verdict(dr, ci, rounds=self.rounds_run(), noise=band)
            br = v.weights_total / base.weights_total if base.weights_total else math.nan
            bf, bw = bytes_verdict(br, v.weight_bytes.get("F32", 0))
            if v.variant == "unfused" and bw:  # its extra bytes are the adapter: expected
                bf, bw = False, bw + " (base + adapter)"
            pred, why = bytes_explain(dr, ci, br, noise=band)
            out[v.variant] = {"decode_ratio": dr, "interval": list(ci), "speed_flag": sf,
                              "speed": sw, "bytes_ratio": br, "bytes_flag": bf,
                              "bytes": bw, "f32_bytes": v.weight_bytes.get("F32", 0),
                              "bytes_predicted": pred, "why": why}
        return out

    def refresh(self) -> None:
        """Recompute the table rows, summary and flags from ``variants``."""
        s = self.settings
        self.title = (f"Decode timing: {Path(s.get('model', '?')).name}"
                      + (f" + {Path(s['adapter_path']).name}" if s.get("adapter_path") else ""))
        dev = next((v.device for v in self.variants if v.device), {})
        name = dev.get("device_info", {}).get("device_name", "")
        peak = "MLX peak (mx.get_peak_memory)" if dev.get("kind") == "gpu" else "process peak RSS"
        versions = f"mlx {dev.get('mlx')}, mlx-lm {dev.get('mlx_lm')}, python {dev.get('python')}"
        self.summary = {
            "model": s.get("model", ""), "adapter": s.get("adapter_path") or "-",
            "prompt / decode tokens": f"{s.get('prompt_tokens')} / {s.get('tokens')}",
            "repeats": f"{s.get('repeats')} after {s.get('warmup')} warm-up",
            "device": (f"{dev.get('device')} [{dev.get('backend')}]"
                       + (f" {name}" if name else "")) if dev else "",
            "peak memory": peak if dev else "",
            "versions": versions if dev else "",
        }
        n_rounds, band = self.rounds_run(), self.noise_band()
        self.summary["noise"] = (
            f"{CONFIDENCE:.0%} bootstrap interval of each decode ratio to base, "
            + (f"paired over {n_rounds} interleaved rounds" if n_rounds > 1 else
               "from the runs of one round only (it cannot see noise between processes; "
               "use rounds >= 3)")
            + f"; flagged: ratio < {1 - SPEED_THRESHOLD:.2f} with the whole interval < 1 "
            "and below the base against itself"
            + (" ({:.2f}-{:.2f})".format(*band) if not math.isnan(band[0]) else "")
            + f", or weight bytes > {1 + BYTES_THRESHOLD:.2f}x base")
        if dev and dev.get("kind") == "cpu":
            self.summary["on this device"] = CPU_NOTE
            size = max((v.weights_total for v in self.variants if v.variant == "base"),
                       default=0)
            if 0 < size < 1e9:
                self.summary["on this device"] += "; " + TINY_NOTE.format(size=human_bytes(size))
        if s.get("kl_tokens"):
            self.summary["KL vs unfused"] = (f"mean over the first {s['kl_tokens']} tokens "
                                             "of the embedded corpus, after timing"
                                             + (f"; failed: {s['kl_error']}"
                                                if s.get("kl_error") else ""))
        cpu_notes(self.summary, {v.variant: v.moe_f32_blocks for v in self.variants},
                  {v.variant: v.float32_note for v in self.variants})
        verdicts = self.verdicts()
        ref = next((v.tokens for v in self.variants if v.variant == "unfused" and v.ok), None)
        rows: List[Dict[str, Any]] = []
        flagged: List[int] = []
        for i, v in enumerate(self.variants):
            if not v.ok:
                rows.append({"variant": v.variant, "note": f"error: {v.error}"})
                flagged.append(i)
                continue
            dr, pr = self.ratio(v.variant, "decode"), self.ratio(v.variant, "peak")
            vd = verdicts.get(v.variant, {})
            ci = vd.get("interval", [1.0, 1.0])
            interval = "" if math.isnan(ci[0]) else f"{ci[0]:.2f}-{ci[1]:.2f}"
            row = {
                "variant": v.variant,
                "prefill tok/s": v.prefill_median,
                "decode tok/s": v.decode_median,
                "decode min-max": f"{min(v.decode_tps):.4g}-{max(v.decode_tps):.4g}",
                "decode x base": dr,
                f"{CONFIDENCE:.0%} interval": interval,
                "bytes predict": vd.get("bytes_predicted", 1.0),
                "weights GB/s": v.decode_median * v.weights_total / 1e9,
                "TTFT ms": v.ttft_median * 1e3,
                "peak GB": _gb(v.peak_bytes),
                "peak x base": pr,
                "weights GB": _gb(v.weights_total),
                "weight dtypes": " + ".join(f"{k} {human_bytes(n)}" for k, n in sorted(
                    v.weight_bytes.items(), key=lambda kv: -kv[1])),
                "weights x base": vd.get("bytes_ratio", 1.0),
                "verdict": verdict_words(vd),
                "why": vd.get("why", ""),
            }
            if v.kl_vs_unfused is not None:
                row["KL vs unfused"] = v.kl_vs_unfused
            if ref is not None:
                same = next((i for i, (x, y) in enumerate(zip(v.tokens, ref)) if x != y),
                            min(len(v.tokens), len(ref)))
                row["= unfused tokens"] = f"{same}/{len(ref)}"
            rows.append(row)
            if vd.get("speed_flag") or vd.get("bytes_flag"):
                flagged.append(i)
        self.rows = rows
        self.flagged = flagged
        cols = ["variant", "prefill tok/s", "decode tok/s", "decode min-max", "decode x base"]
        cols += [f"{CONFIDENCE:.0%} interval", "bytes predict", "weights GB/s", "TTFT ms"]
        cols += ["peak GB", "peak x base", "weights GB", "weights x base", "weight dtypes"]
        cols += ["verdict", "why"]
        if ref is not None:
            cols.append("= unfused tokens")
        if any(v.kl_vs_unfused is not None for v in self.variants):
            cols.append("KL vs unfused")
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
        variants = [VariantTiming.from_dict(v) for v in d.get("variants", [])]
        return cls(title="", settings=dict(d.get("settings") or {}), variants=variants)

    @classmethod
    def from_json(cls, text: str) -> "DecodeTiming":
        """Rebuild a result from ``to_json()``'s text."""
        return cls.from_dict(json.loads(text))

    # -- figure ------------------------------------------------------------------------
    def plot(self, ax=None):
        """Decode ratio to base with its interval as a whisker, and weight bytes beside
        peak memory per variant: a matplotlib Figure (no pyplot: thread-safe)."""
        from matplotlib.figure import Figure  # lazy: matplotlib only when drawn

        ok = [v for v in self.variants if v.ok]
        names = [v.variant for v in ok]
        colors = [_COLORS.get(n, "#888888") for n in names]
        fig = Figure(figsize=(9, 3.4), layout="constrained")
        a1, a2 = fig.subplots(1, 2)
        ratios = [self.ratio(n, "decode") for n in names]
        cis = [self.interval(n) for n in names]
        lo = [max(0.0, r - c[0]) if not math.isnan(c[0]) else 0.0 for r, c in zip(ratios, cis)]
        hi = [max(0.0, c[1] - r) if not math.isnan(c[1]) else 0.0 for r, c in zip(ratios, cis)]
        a1.bar(names, ratios, yerr=[lo, hi], color=colors, capsize=3)
        a1.axhline(1.0, color="#444444", lw=0.8, ls="--")
        a1.axhline(1 - SPEED_THRESHOLD, color="#c44e52", lw=0.8, ls=":")
        a1.set_ylabel(f"decode x base ({CONFIDENCE:.0%} interval)")
        x = list(range(len(ok)))
        weights, peaks = [_gb(v.weights_total) for v in ok], [_gb(v.peak_bytes) for v in ok]
        a2.bar([i - 0.2 for i in x], weights, width=0.4, color=colors, label="weights (exact)")
        a2.bar([i + 0.2 for i in x], peaks, width=0.4, color=colors, alpha=0.45,
               label="peak" + (" RSS" if ok and ok[0].peak_source == "rss" else ""))
        a2.set_xticks(x, names)
        a2.set_ylabel("GB")
        # above the axes: inside, it covered the short weight bars and their labels
        a2.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2,
                  frameon=False)
        tops = [r + h for r, h in zip(ratios, hi)]
        for a, vals, at in ((a1, ratios, tops), (a2, weights, weights)):
            a.tick_params(axis="x", labelrotation=20)
            a.margins(y=0.12)
            base = next((y for n, y in zip(names, vals) if n == "base"), None)
            for i, (y, top) in enumerate(zip(vals, at)):
                label = f"{y / base:.2f}x" if base else f"{y:.3g}"
                a.annotate(label, (i - (0.2 if a is a2 else 0), top), ha="center",
                           va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        where = device_where(ok)
        title = Path(self.settings.get("model", "")).name + (f" on {where}" if where else "")
        fig.suptitle(title, fontsize=10)
        return fig


_COLORS = {"base": "#4c72b0", "unfused": "#8172b2", "promoted": "#c44e52",
           "fused": "#55a868", "mlx-lm-fused": "#64b5cd"}


def device_where(variants: Sequence[VariantTiming]) -> str:
    """Backend and device name of the first variant that recorded its device."""
    dev = next((v.device for v in variants if v.device), {})
    name = dev.get("device_info", {}).get("device_name", "")
    return " ".join(x for x in (dev.get("backend", ""), name) if x)
