"""Lazy exports: a package maps each public name to the module that defines it, imported
on first use, so ``import lorakit`` (or ``lorakit.inspect``) loads no numpy or MLX."""
from __future__ import annotations

import sys
from importlib import import_module
from typing import Any, Callable, Dict, Iterable, Tuple

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Dict[str, Tuple[str, str]],
                 subpackages: Iterable[str] = ()) -> Tuple[Callable[[str], Any],
                                                           Callable[[], list]]:
    """``__getattr__`` and ``__dir__`` for ``package``: name -> (module, attribute)."""
    subs = tuple(subpackages)

    def __getattr__(name: str) -> Any:
        if name in names:
            mod, attr = names[name]
            value = getattr(import_module(mod), attr)
        elif name in subs:
            value = import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list:
        return sorted(names)

    return __getattr__, __dir__
