"""Which command's output directory is already complete: stdout closing after that (the
summary has nowhere to go, ``lorakit fuse ... | true``) no longer fails the command."""
from __future__ import annotations

import argparse
from typing import Any, Optional

__all__ = []

FORCE_HELP = ("replace an existing output, but only an empty directory or a previous lorakit "
              "output (listed in its lorakit.json); anything else is refused and kept")


def wrote(args: argparse.Namespace, path: Any) -> None:
    """Record that this command's output is complete at ``path``."""
    args.lorakit_wrote = path


def written(args: Optional[argparse.Namespace]) -> Optional[Any]:
    """Where this command's complete output is, or None (nothing written yet)."""
    return getattr(args, "lorakit_wrote", None)
