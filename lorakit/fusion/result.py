"""What a fuse did: :class:`FuseResult`, a report with an HTML view and a text twin."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Tuple

from .._html import escape, facts_table, table
from .quant import RequantStat, survival_overall, survival_rows, survival_text
from .quant_policy import policy_summary

__all__ = ["FuseResult"]


@dataclass
class FuseResult:
    """What a fuse did. Renders as a table in notebooks; ``str()`` is the text twin."""

    output: Path
    base: Path
    adapter: Path
    rounding: str
    dtype_policy: str
    tensors_fused: int
    tensors_total: int
    dtypes_written: Dict[str, int]
    bytes_written: int
    seconds: float
    dequantized: bool = False
    requant: List[RequantStat] = field(default_factory=list)
    fused_names: List[str] = field(default_factory=list)
    #: tensors written from the adapter's own copies (PEFT modules_to_save)
    replaced_names: List[str] = field(default_factory=list)
    quant_policy: str = "requant"

    def to_dict(self) -> Dict[str, Any]:
        d = {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}
        d["requant"] = [r.__dict__ for r in self.requant]
        d["survival"] = survival_overall(self.requant) if self.requant else None
        return d

    def _rows(self) -> List[Tuple[str, str]]:
        rows = [("output", str(self.output)), ("base", str(self.base)),
                ("adapter", str(self.adapter)), ("rounding", self.rounding),
                ("dtype policy", self.dtype_policy),
                ("tensors fused", f"{self.tensors_fused} of {self.tensors_total}"),
                ("dtypes written", ", ".join(f"{k}: {v}" for k, v in
                                             sorted(self.dtypes_written.items()))),
                ("bytes written", f"{self.bytes_written / 1e9:.3f} GB"),
                ("time", f"{self.seconds:.2f} s")]
        if self.requant:
            o = survival_overall(self.requant)
            rows += [("codes changed", f"{o['codes_changed']:.1%} of {o['codes']:,} codes "
                      f"({o['tensors']} re-quantized tensors)"),
                     ("delta survived", f"{o['survived']:.1%} of the intended delta "
                      "(projection on it, all tensors)")]
            rows += policy_summary(self.quant_policy, self.requant)
        if self.replaced_names:
            rows.append(("replaced (modules_to_save)", ", ".join(self.replaced_names)))
        if self.dequantized:
            rows.append(("quantization", "dequantized (float weights written)"))
        return rows

    def __str__(self) -> str:
        rows = self._rows()
        w = max(len(k) for k, _ in rows)
        lines = [f"Fused {self.adapter.name} into {self.base.name}"] + \
            [f"  {k:<{w}}  {v}" for k, v in rows]
        if self.requant:
            lines += ["  re-quantized tensors:"] + survival_text(self.requant, "    ")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        per = ""
        if self.requant:
            per = ("<details><summary>survival per re-quantized tensor</summary>" +
                   table(survival_rows(self.requant),
                         head=["tensor", "codes changed", "delta survived"]) + "</details>")
        return (f"<div><b>lorakit fuse</b>: {escape(self.adapter.name)} &rarr; "
                f"{escape(self.output.name)}{facts_table(self._rows())}{per}</div>")

    def __repr__(self) -> str:
        return (f"FuseResult({str(self.output)!r}, {self.tensors_fused} fused, "
                f"{self.rounding}, {self.dtype_policy})")
