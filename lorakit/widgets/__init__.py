"""Jupyter widgets over lorakit's library calls (the ``notebook`` extra: ipywidgets and
matplotlib; imported explicitly). Each widget is a thin form over one library function
and shows the report or figure it returns, so every number it shows can be had without
it: FusePanel, DtypeMapView, DiffExplorer, DecodeRace, GenerationCompare,
AdapterCompare, AdapterMixer, AdapterLab, KLTextView."""
from __future__ import annotations

from ._assets import find_data
from .adapter_lab import AdapterLab
from .adapters import AdapterCompare
from .decode_race import DecodeRace
from .diff_explorer import DiffExplorer
from .dtype_view import DtypeMapView
from .fuse_panel import FusePanel
from .generation import GenerationCompare
from .kl_view import KLTextView
from .mixer import AdapterMixer

__all__ = ["AdapterCompare", "AdapterLab", "AdapterMixer", "DecodeRace", "DtypeMapView",
           "FusePanel", "GenerationCompare", "KLTextView", "DiffExplorer", "find_data"]
