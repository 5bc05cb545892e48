"""Inspection: report objects that read checkpoints, adapters and models.

The verbs ``lorakit.check``, ``diff``, ``compare_outputs`` and ``extract`` live here, and
the helpers below (dtypes, delta norms, adapter against adapter, generations, ulps),
and the adapter lab (``lab.py``: ``scale_sweep``, ``layer_effects``).
"""
from __future__ import annotations

from ..lazy import lazy_exports

__all__ = ["dtype_map", "delta_norms", "compare_adapters", "compare_generations",
           "ulp_vs_reference", "scale_sweep", "layer_effects"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "dtype_map": ("lorakit.inspect.dtypes", "dtype_map"),
    "delta_norms": ("lorakit.inspect.deltas", "delta_norms"),
    "compare_adapters": ("lorakit.inspect.adapters", "compare_adapters"),
    "compare_generations": ("lorakit.inspect.generation", "compare_generations"),
    "ulp_vs_reference": ("lorakit.inspect.diff", "ulp_vs_reference"),
    "scale_sweep": ("lorakit.inspect.lab", "scale_sweep"),
    "layer_effects": ("lorakit.inspect.lab", "layer_effects"),
})
