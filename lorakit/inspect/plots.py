"""Every matplotlib figure the inspection reports draw (from their ``plot()`` methods).

matplotlib is imported inside each function and figures are ``matplotlib.figure.Figure``
(no pyplot state); pass ``ax=`` to draw into your own axes (its figure is returned).
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from ..layers import model_order, split_name

if TYPE_CHECKING:
    import numpy as np

__all__ = ["histogram_bars"]

# One fixed colour per dtype, so maps of different checkpoints read the same.
DTYPE_COLORS = {
    "BF16": "#4c72b0", "F16": "#55a868", "F32": "#c44e52", "F64": "#8172b2",
    "mixed": "#dd8452", "": "#ffffff",
}
QUANT_COLOR = "#937860"
OTHER_COLOR = "#8c8c8c"


def dtype_color(code: str) -> str:
    """The colour of a dtype code in every dtype map (figure and widget alike)."""
    return DTYPE_COLORS.get(code, QUANT_COLOR if code.startswith("Q") else OTHER_COLOR)


def _new(ax, size: Tuple[float, float]):
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure  # lazy: matplotlib only when a figure is drawn

    _show_figures_in_notebooks(Figure)
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def _show_figures_in_notebooks(figure_cls) -> None:
    """Let a returned Figure display as a PNG in a running IPython kernel (IPython knows
    pyplot-free figures only after ``%matplotlib inline``: register its PNG formatter)."""
    try:
        from IPython import get_ipython  # lazy: optional, only to register a formatter
    except ImportError:
        return
    ip = get_ipython()
    fmt = ip.display_formatter.formatters.get("image/png") if ip is not None else None
    if fmt is None or figure_cls in fmt:  # IPython formatters: ``in`` looks the type up
        return

    def png(fig) -> bytes:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()

    fmt.for_type(figure_cls, png)


def _fit(n_rows: int, n_cols: int, base: Tuple[float, float] = (4.0, 2.5)) -> Tuple[float, float]:
    return (min(18.0, base[0] + 0.45 * n_cols), min(18.0, base[1] + 0.22 * n_rows))


def dtype_heatmap(dm, ax=None, part: str = "weight"):
    """Layers x kinds, one colour per dtype; flagged tensors outlined in black."""
    import numpy as np  # lazy: the dtype map's header path starts without numpy
    from matplotlib.colors import ListedColormap  # lazy: matplotlib only when drawing
    from matplotlib.patches import Patch, Rectangle  # lazy: matplotlib only when drawing

    labels, kinds, cells = dm.grid(part)
    flags = dm.flag_grid(part)
    names = sorted({c for row in cells for c in row if c},
                   key=lambda c: (c not in DTYPE_COLORS, c))
    colors = ["#ffffff"] + [dtype_color(c) for c in names]
    index = {c: i + 1 for i, c in enumerate(names)}
    grid = np.array([[index.get(c, 0) for c in row] for row in cells], dtype=float)
    fig, ax = _new(ax, _fit(len(labels), len(kinds)))
    if grid.size:
        ax.imshow(grid, cmap=ListedColormap(colors), vmin=-0.5, vmax=len(colors) - 0.5,
                  aspect="auto", interpolation="nearest")
        for i, row in enumerate(flags):
            for j, f in enumerate(row):
                if f:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2,
                                           ec="black"))
    ax.set_xticks(range(len(kinds)), kinds, rotation=60, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylabel("layer")
    ax.set_title(dm.title + (f" ({len(dm.flagged)} flagged)" if dm.flagged else ""))
    ax.legend(handles=[Patch(color=colors[index[c]], label=c) for c in names],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig


def value_heatmap(labels, kinds, values, *, title: str, cbar: str, ax=None, log=False,
                  cmap="viridis", vmin=None, vmax=None):
    """A layer x kind heatmap of numbers (NaN cells left blank)."""
    import numpy as np  # lazy: the dtype map's header path starts without numpy
    from matplotlib.colors import LogNorm  # lazy: matplotlib only when drawing

    fig, ax = _new(ax, _fit(len(labels), len(kinds)))
    v = np.ma.masked_invalid(np.asarray(values, dtype=float))
    scale: Dict[str, Any] = dict(vmin=vmin, vmax=vmax)
    if log and v.count() and (v > 0).any():
        pos = v[v > 0]
        scale = dict(norm=LogNorm(vmin=vmin or float(pos.min()), vmax=vmax or float(pos.max())))
    im = ax.imshow(v, aspect="auto", interpolation="nearest", cmap=cmap, **scale)
    ax.set_xticks(range(len(kinds)), list(kinds), rotation=60, ha="right")
    ax.set_yticks(range(len(labels)), list(labels))
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=cbar)
    return fig


def histogram_bars(labels, series: Dict, *, title: str, xlabel="ulp distance", ax=None, log=True):
    """Bars of binned counts (ulp histograms); several series side by side."""
    import numpy as np  # lazy: the dtype map's header path starts without numpy

    fig, ax = _new(ax, (max(5.0, 0.5 * len(labels) + 2), 3.2))
    n = max(1, len(series))
    width = 0.8 / n
    x = np.arange(len(labels))
    for k, (name, counts) in enumerate(series.items()):
        c = np.asarray(list(counts), dtype=float)
        ax.bar(x + (k - (n - 1) / 2) * width, np.where(c > 0, c, np.nan), width, label=name)
    if log:
        ax.set_yscale("log")
    ax.set_xticks(x, list(labels), rotation=45, ha="right")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("elements")
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize="small")
    return fig


def spectra(curves: List[Tuple[str, np.ndarray]], *, title: str, ax=None, limit: int = 24):
    """Singular value spectra, one line per target (the largest ``limit`` shown)."""
    import numpy as np  # lazy: the dtype map's header path starts without numpy

    fig, ax = _new(ax, (6.0, 3.5))
    shown = sorted(curves, key=lambda c: -(float(c[1][0]) if len(c[1]) else 0.0))[:limit]
    for name, s in shown:
        s = np.asarray(s, dtype=float)
        ax.plot(np.arange(1, len(s) + 1), np.where(s > 0, s, np.nan), marker=".", lw=1,
                label=name)
    ax.set_yscale("log")
    ax.set_xlabel("index")
    ax.set_ylabel("singular value")
    ax.set_title(title + (f" (largest {limit} of {len(curves)})" if len(curves) > limit else ""))
    if len(shown) <= 12:
        ax.legend(fontsize="x-small")
    return fig


def grouped_bars(names, series: Dict, *, title: str, ylabel: str, ax=None, log=False):
    """Side-by-side bars per name (e.g. the delta norms of two adapters per target), in
    model order, labelled short (``L3 up``) at 9 pt, every k-th where all would overlap."""
    import numpy as np  # lazy: the dtype map's header path starts without numpy

    order = model_order(list(names))
    labels = []
    for i in order:
        layer, kind, expert, _ = split_name(names[i])
        labels.append(names[i] if layer is None else f"L{layer} {kind}"
                      + ("" if expert is None else f"[{expert}]"))
    width_in = min(10.0, 3 + 0.22 * len(names) * max(1, len(series)))
    fig, ax = _new(ax, (width_in, 3.8))
    n = max(1, len(series))
    width = 0.8 / n
    x = np.arange(len(names))
    for k, (label, vals) in enumerate(series.items()):
        v = np.asarray(vals, dtype=float)[order] if len(order) else np.asarray(vals)
        ax.bar(x + (k - (n - 1) / 2) * width, v, width, label=label)
    if log:
        ax.set_yscale("log")
    # a 9 pt label rotated 90 degrees takes ~0.17 in of axis: show every step-th
    room = max(1, int((fig.get_figwidth() - 1.2) / 0.17))
    step = -(-len(labels) // room)
    ax.set_xticks(x[::step], labels[::step], rotation=90, fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def margin_lines(series: Dict[str, Sequence[float]], *, title: str, diverge: Optional[int] = None,
                 ax=None):
    """Per-step top1 - top2 logit margins of several models; divergence marked."""
    import numpy as np  # lazy: the dtype map's header path starts without numpy

    fig, ax = _new(ax, (6.5, 3.2))
    for label, vals in series.items():
        ax.plot(np.arange(len(vals)), np.asarray(vals, dtype=float), marker=".", lw=1,
                label=label)
    if diverge is not None:
        ax.axvline(diverge, color="red", ls="--", lw=1, label=f"first divergence ({diverge})")
    ax.set_xlabel("generated token")
    ax.set_ylabel("top1 - top2 logit")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig


def kl_figure(kl: np.ndarray, context: int, *, title: str, ax=None):
    """Per-token KL: its distribution and its course along the text (per-window means);
    with ``ax`` only the course, drawn there."""
    import numpy as np  # lazy: the dtype map's header path starts without numpy

    kl = np.asarray(kl, dtype=np.float64)
    per = max(context - 1, 1)
    n_win = max(kl.size // per, 1)
    means = kl[: n_win * per].reshape(n_win, per).mean(axis=1) if kl.size >= per else kl
    if ax is not None:
        fig, along = ax.figure, ax
    else:
        fig, _ = _new(None, (9.0, 3.0))
        fig.clear()
        hist, along = fig.subplots(1, 2)
        pos = kl[kl > 0]
        if pos.size:
            lo, hi = np.log10(pos.min()), np.log10(pos.max())
            hist.hist(pos, bins=np.logspace(lo, hi + 1e-9, 40), color="#4c72b0")
            hist.set_xscale("log")
        hist.set_xlabel("KL per token (nats)")
        hist.set_ylabel("tokens")
        zeros = int(kl.size - pos.size)
        hist.set_title(f"distribution ({zeros} tokens at 0 or below)" if zeros else "distribution")
    along.plot(np.arange(kl.size), kl, lw=0.4, color="#8c8c8c", label="per token")
    along.plot((np.arange(len(means)) + 0.5) * per, means, "o-", color="#c44e52", ms=3,
               label="window mean")
    along.set_yscale("symlog", linthresh=max(float(np.median(np.abs(kl))), 1e-12))
    along.set_xlabel("scored token")
    along.set_ylabel("KL (nats)")
    along.legend(fontsize="small")
    fig.suptitle(title)
    return fig


def dose_response(scales, kl: Dict, agreement: Dict, *, title: str, ax=None):
    """Mean KL per scale, one line per reference with its (mean, low, high) interval as
    error bars (symlog: 0 at the reference itself), top-1 agreement on a second axis."""
    import numpy as np  # lazy: the dtype map's header path starts without numpy

    fig, ax = _new(ax, (6.5, 3.5))
    x = np.asarray(scales, dtype=float)
    for label, pts in kl.items():
        m, lo, hi = (np.asarray(c, dtype=float) for c in zip(*pts))
        err = np.nan_to_num(np.vstack([m - lo, hi - m]).clip(0))
        ax.errorbar(x, m, yerr=err, marker="o", ms=4, capsize=3, label=label)
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel("scale (times the trained scale)")
    ax.set_ylabel("mean KL per token (nats)")
    right = ax.twinx()
    for label, vals in agreement.items():
        right.plot(x, np.asarray(vals, dtype=float), ls=":", marker=".", label=label)
    right.set_ylim(0, 1.02)
    right.set_ylabel("top-1 agreement")
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize="small",
              loc="upper left", bbox_to_anchor=(1.12, 1.0))
    ax.set_title(title)
    return fig
