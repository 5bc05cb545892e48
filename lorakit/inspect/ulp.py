"""Exact ulp distances between tensors and checkpoints: the names in one place.

The code lives in four modules, one idea each:

- :mod:`~lorakit.inspect.ulp_accumulate`: the histogram accumulator and the
  optional C kernel (:class:`TensorDiff`, :func:`kernel_available`, ``USE_KERNEL``);
- :mod:`~lorakit.inspect.ulp_stream`: two sources compared tensor by tensor,
  streaming (:func:`compare_sources`);
- :mod:`~lorakit.inspect.ulp_report` and :mod:`~lorakit.inspect.parity`: the
  reports (:class:`UlpReport`, :func:`ulp_tensors`, :func:`ulp_compare`);
- :mod:`~lorakit.inspect.ulp_reference`: a fused checkpoint against the exact fuse
  (:class:`RefUlpReport`, :func:`ulp_vs_reference`).

This module re-exports their public names (and keeps ``ulp.USE_KERNEL = False``
switching the numpy path on, as before the split).

>>> error_histogram([0.0, 0.25, 0.75]).tolist()[:3]
[1, 1, 1]
"""
from __future__ import annotations

import sys
import types

from . import ulp_accumulate as _accumulate
from .parity import ulp_compare
from .ulp_accumulate import (CHUNK_BYTES, DEFAULT_MAX_BIN, TensorDiff, _kernel, bin_labels,
                             bits_dtype, kernel_available)
from .ulp_accumulate import Accumulator as _Acc  # moved: the old private name, for tests
from .ulp_reference import RefUlpReport, error_histogram, error_labels, ulp_vs_reference
from .ulp_report import UlpReport, ulp_tensors
from .ulp_stream import compare_sources

__all__ = ["TensorDiff", "compare_sources", "UlpReport", "ulp_compare", "ulp_tensors",
           "RefUlpReport", "ulp_vs_reference", "error_histogram", "DEFAULT_MAX_BIN"]
#: names kept importable from here after the split (tests, benchmarks, notebooks)
_MOVED = (CHUNK_BYTES, _kernel, bin_labels, bits_dtype, kernel_available, _Acc, error_labels)


class _UlpModule(types.ModuleType):
    """This module, with ``USE_KERNEL`` read from and written to the accumulator's."""

    @property
    def USE_KERNEL(self) -> bool:  # noqa: N802 - the module constant's name
        return _accumulate.USE_KERNEL

    @USE_KERNEL.setter
    def USE_KERNEL(self, value: bool) -> None:  # noqa: N802
        _accumulate.USE_KERNEL = value


sys.modules[__name__].__class__ = _UlpModule
