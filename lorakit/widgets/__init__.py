"""Jupyter widgets over lorakit's library calls (imported explicitly; needs ipywidgets
and matplotlib, the ``notebook`` extra).

Each widget is a thin form: it calls one library function and shows the report or
figure it returns, so every number a widget shows can be had without it.

- :class:`FusePanel`: :func:`lorakit.fuse` with its options, a progress bar, the
  result and the fused checkpoint's dtype map.
- :class:`DtypeMapView`: :func:`lorakit.inspect.dtype_map` as a grid with hover and click.
- :class:`DiffExplorer`: :func:`lorakit.diff` / the exact-fuse reference.
- :class:`DecodeRace`: :func:`lorakit.time_decode` live, in a background thread.
- :class:`GenerationCompare`: :func:`lorakit.inspect.compare_generations` side by side.
- :class:`AdapterCompare`: :func:`lorakit.inspect.compare_adapters`.
- :class:`AdapterMixer`: two or three adapters mixed by weight sliders, live norms.
- :class:`KLTextView`: a :func:`lorakit.compare_outputs` report's text shaded by KL.

>>> from lorakit.widgets import FusePanel
>>> panel = FusePanel()  # choices from the repository's data/
"""
from __future__ import annotations

from ._assets import find_data
from .adapters import AdapterCompare
from .decode_race import DecodeRace
from .diff_explorer import DiffExplorer
from .dtype_view import DtypeMapView
from .fuse_panel import FusePanel
from .generation import GenerationCompare
from .kl_view import KLTextView
from .mixer import AdapterMixer

__all__ = ["AdapterCompare", "AdapterMixer", "DecodeRace", "DtypeMapView", "FusePanel",
           "GenerationCompare", "KLTextView", "DiffExplorer", "find_data"]
