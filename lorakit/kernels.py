"""lorakit's optional C kernels and their one switch: each has a numpy twin giving the
same bits, and ``LORAKIT_KERNELS=0`` (or :func:`use_kernels` ``(False)``) sends every
verb through the twins."""
from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

__all__ = ["use_kernels", "load"]

#: every kernel pyproject.toml builds (CI, ``LORAKIT_REQUIRE_KERNEL=1``, checks each loads)
KERNELS = ("lorakit.inspect._ulpkernel", "lorakit.inspect._checkkernel")

_state = {"on": os.environ.get("LORAKIT_KERNELS", "1") != "0"}
_modules: Dict[str, Optional[Any]] = {}


def enabled() -> bool:
    """Whether the kernels are in use (built ones; ``LORAKIT_KERNELS=0`` turns them off)."""
    return _state["on"]


@contextmanager
def use_kernels(flag: bool) -> Iterator[None]:
    """Kernels on (True) or off (False) inside the ``with`` block, for tests and benchmarks."""
    old, _state["on"] = _state["on"], bool(flag)
    try:
        yield
    finally:
        _state["on"] = old


def load(name: str) -> Optional[Any]:
    """The kernel module ``name`` where built and enabled, else None (take the numpy twin)."""
    if not _state["on"]:
        return None
    if name not in _modules:
        try:
            _modules[name] = importlib.import_module(name)
        except ImportError:  # not built here: the numpy twin
            _modules[name] = None
    return _modules[name]
