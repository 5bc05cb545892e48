"""Inspection: report objects that read checkpoints, adapters and models.

The top-level verbs ``lorakit.check``, ``lorakit.diff``, ``lorakit.compare_outputs`` and
``lorakit.extract`` live here (``check.py``, ``diff.py``, ``behaviour.py``,
``extraction.py``: the algebra's extract with its behaviour line), and so do these:

``dtype_map``            per-layer dtypes and bytes, from headers only
``delta_norms``          norms, spectra and ranks of an adapter's deltas
``compare_adapters``     two adapters of one base, module by module
``compare_generations``  greedy text of several models side by side
``ulp_vs_reference``     a fused checkpoint against the exact fuse, in ulps
``scale_sweep``          the adapter at several scales against base and adapter (lab.py)
``layer_effects``        the behaviour each layer / kind / module of an adapter carries
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
