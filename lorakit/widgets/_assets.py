"""Where the embedded model and adapters are, and which checkpoints and adapters a
folder holds (the choices the widgets offer)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional

from ..errors import PathLike

__all__ = ["find_data"]
ENV = "LORAKIT_DATA"
_MARKER = "tiny-qwen3"


def find_data(start: Optional[PathLike] = None) -> Optional[Path]:
    """The repository's ``data/`` folder: ``$LORAKIT_DATA`` if set, else the first
    ``data/`` holding the embedded model in ``start`` (default: the working
    directory) or one of its parents, else the one beside this source tree."""
    env = os.environ.get(ENV)
    if env:
        return Path(env).expanduser().resolve()
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "data" / _MARKER).is_dir():
            return d / "data"
    beside = Path(__file__).resolve().parents[2] / "data"
    return beside if (beside / _MARKER).is_dir() else None


def _holds(p: Path, config: str) -> bool:
    return p.is_dir() and (p / config).is_file() and any(p.glob("*.safetensors"))


def checkpoints(data: Optional[PathLike]) -> Dict[str, Path]:
    """Checkpoint directories directly under ``data`` (label -> path), sorted."""
    if data is None or not Path(data).is_dir():
        return {}
    return {p.name: p for p in sorted(Path(data).iterdir()) if _holds(p, "config.json")}


def adapters(data: Optional[PathLike]) -> Dict[str, Path]:
    """Adapter directories under ``data/adapters`` (or ``data`` itself), sorted."""
    if data is None:
        return {}
    found: Dict[str, Path] = {}
    for root in (Path(data) / "adapters", Path(data)):
        if root.is_dir():
            for p in sorted(root.iterdir()):
                if _holds(p, "adapter_config.json"):
                    found.setdefault(p.name, p)
    return found
