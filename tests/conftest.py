"""Shared test setup: tests import their helpers (model_factory) from this folder,
and matplotlib draws off-screen."""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:  # never pop up windows; notebooks keep their own inline backend
    import matplotlib

    matplotlib.use("Agg")
except ImportError:  # pragma: no cover
    pass
