"""Per-layer dtype maps, from headers only.

:func:`dtype_map` lists every tensor of a source (:func:`lorakit.open`) with its layer,
kind, dtype and bytes, flagging float tensors whose dtype is not the checkpoint's
majority: where a fuse that forgot its cast lights up.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from ..errors import FormatError
from ..io.formats import source as sources
from ..io.formats.dtypes import QUANT_SUFFIXES, config_dtype
from ..io.formats.safetensors import FLOAT_CODES
from ..layers import LORA_PARTS, layer_kind_cells, split_name
from ..report import Report
from .plots import dtype_heatmap

__all__ = ["DtypeMap", "dtype_map"]


@dataclass(repr=False)
class DtypeMap(Report):
    """Per-tensor dtypes and bytes of one source (:meth:`grid`: the layer x kind table)."""

    column_help = {
        "tensor": "the tensor's name in the checkpoint",
        "layer": "transformer block number (None: outside the blocks, e.g. embeddings)",
        "kind": "what it is: q/k/v/o, gate/up/down, norm_in (input norm), norm_attn "
                "(post-attention norm), embed, head, ...",
        "expert": "expert number in a mixture-of-experts layer (None: not an expert)",
        "part": "weight, bias, or a quantized weight's scales / biases",
        "dtype": "the dtype stored on disk",
        "shape": "the tensor's shape",
        "bytes": "bytes the tensor takes on disk",
        "flag": "why its dtype is unexpected (empty: as expected)",
    }

    bytes_by_dtype: Dict[str, int] = field(default_factory=dict)

    def flagged_names(self) -> List[str]:
        return [self.rows[i]["tensor"] for i in self.flagged]

    def grid(self, part: str = "weight") -> Tuple[List[str], List[str], List[List[str]]]:
        """(row labels, kinds, cells): each cell the dtype of that layer's tensor of that
        kind (``"Q4"``, ``"mixed"``, ``""`` when absent); layer-less tensors in row ``"-"``."""
        labels, ks, groups = layer_kind_cells(r for r in self.rows if r["part"] in (part, ""))
        cells = {key: {r.get("stored_as") or r["dtype"] for r in rs} for key, rs in groups.items()}

        def cell(lab: str, k: str) -> str:
            v = cells.get((lab, k)) or {""}
            return "mixed" if len(v) > 1 else next(iter(v))

        return labels, ks, [[cell(lab, k) for k in ks] for lab in labels]

    def flag_grid(self, part: str = "weight") -> List[List[bool]]:
        """Same shape as :meth:`grid`: True where a flagged tensor sits."""
        labels, ks, _ = self.grid(part)
        hit = {("-" if self.rows[i]["layer"] is None else str(self.rows[i]["layer"]),
                self.rows[i]["kind"]) for i in self.flagged}
        return [[(lab, k) in hit for k in ks] for lab in labels]

    def plot(self, ax=None, part: str = "weight"):
        """Heatmap of dtypes, layers x tensor kinds; flagged cells outlined. Returns a Figure."""
        return dtype_heatmap(self, ax=ax, part=part)


def dtype_map(source: Any) -> DtypeMap:
    """Dtype and bytes of every tensor of ``source`` (anything :func:`lorakit.open` takes),
    per layer and kind, from headers only. A float tensor whose dtype differs from the
    majority is flagged; quantization scales and biases only when they differ from the
    other scales' (a DoRA fuse of a quantized model that wrote float32 scales).

    >>> dm = dtype_map("data/tiny-qwen3")
    >>> dm.summary["expected dtype"], dm.summary["flagged"]
    ('BF16', 0)
    """
    src = sources.open(source)
    metas = list(src.tensors.values())
    names = src.tensors
    # config.json's dtype, else the majority (a careless fuse's f32 may be the majority)
    majority = config_dtype(src.config) or src.dtype
    # a module is quantized when it has .scales next to an integer .weight
    qmods = {n[: -len(".scales")] for n in names if n.endswith(".scales")
             and names.get(n[: -len(".scales")] + ".weight") is not None
             and names[n[: -len(".scales")] + ".weight"].dtype not in FLOAT_CODES}
    scale_major = Counter(t.dtype for t in metas if t.name.endswith(QUANT_SUFFIXES)
                          and t.name.rsplit(".", 1)[0] in qmods).most_common(1)
    scale_dtype = scale_major[0][0] if scale_major else None
    rows: List[Dict[str, Any]] = []
    flagged: List[int] = []
    by_dtype: Counter = Counter()
    qbits = (src.config.get("quantization") or {}).get("bits") if isinstance(
        src.config.get("quantization"), dict) else None
    for i, t in enumerate(metas):
        layer, kind, expert, part = split_name(t.name)
        module = t.name.rsplit(".", 1)[0]
        nbytes = int(t.nbytes)
        by_dtype[t.dtype] += nbytes
        flag = ""
        stored = ""
        if module in qmods:
            if part == "weight":
                try:
                    q = src.quant_params(module)
                except FormatError:
                    q = None
                bits = q.bits if q is not None else qbits
                stored = f"Q{bits}" if bits else "Q"
            elif scale_dtype is not None and t.dtype != scale_dtype:
                flag = f"{t.dtype} scales, others {scale_dtype}"
        elif t.dtype in FLOAT_CODES and t.dtype != majority and (
                src.kind == "adapter" or part not in LORA_PARTS):
            # LoRA factors attached to a loaded model are float32 by design: no flag
            flag = f"{t.dtype}, majority {majority}"
        if flag:
            flagged.append(i)
        rows.append({"tensor": t.name, "layer": layer, "kind": kind, "expert": expert,
                     "part": part, "dtype": t.dtype, "stored_as": stored or t.dtype,
                     "shape": list(t.shape), "bytes": nbytes, "flag": flag})
    total = sum(by_dtype.values())
    summary: Dict[str, Any] = {
        "source": str(src.path) if src.path is not None else src.label,
        "kind": src.kind,
        "tensors": len(rows),
        "bytes": total,
        "expected dtype": majority,
        "bytes by dtype": ", ".join(f"{k} {v / 1e6:.1f} MB ({v / total:.1%})" if total else k
                                    for k, v in by_dtype.most_common()),
        "flagged": len(flagged),
    }
    if qmods:
        summary["quantized modules"] = len(qmods)
    if flagged:
        summary["flagged bytes"] = sum(rows[i]["bytes"] for i in flagged)
    return DtypeMap(title=f"dtype map of {src.label}", rows=rows,
                    columns=["tensor", "layer", "kind", "dtype", "shape", "bytes", "flag"],
                    summary=summary, flagged=flagged, bytes_by_dtype=dict(by_dtype))
