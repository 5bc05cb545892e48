"""Temporary siblings of an output: exact names, and which of them are stale.

A temporary of output ``NAME`` is ``.NAME.lorakit-tmp-PID-RANDOM`` (synth:
``.lorakit-synth-``; an old output moved aside: ``...-old-PID-RANDOM``). Names are
parsed, never matched as glob patterns, so an output path holding ``[``, ``*`` or
``?`` cannot reach another output's temporary. Those of dead processes are
deleted; those of running ones are kept and reported.
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import List, Optional, Set, Tuple

TMP_MARK = ".lorakit-tmp-"
SYNTH_MARK = ".lorakit-synth-"
_MARKS = (TMP_MARK, SYNTH_MARK)
_TAIL = re.compile(r"(old-)?([0-9]{1,10})-([0-9a-f]{8,32})")

#: temporaries this process is writing right now (its own pid is alive, but a
#: temporary of its own that is not listed here is left over from a failed run)
ACTIVE: Set[Path] = set()


class OutputWarning(UserWarning):
    """Temporaries of a running lorakit process were found and left in place."""


def _stem(name: str) -> str:
    """The output's name as its temporaries carry it: long names are cut and hashed, so
    the temporary's name stays within the 255 bytes a file name may have."""
    if len(os.fsencode(name)) <= 200:
        return name
    cut = os.fsencode(name)[:150].decode(errors="ignore")
    return f"{cut}~{hashlib.sha256(os.fsencode(name)).hexdigest()[:16]}"


def temp_owner(out: Path, entry: str) -> Optional[int]:
    """The pid in ``entry`` if it is exactly the name of a temporary of ``out``, else None.

    >>> temp_owner(Path("/x/a[1]"), ".a[1].lorakit-tmp-42-0123abcd")
    42
    >>> temp_owner(Path("/x/a[1]"), ".a1.lorakit-tmp-42-0123abcd") is None
    True
    """
    for mark in _MARKS:
        prefix = f".{_stem(out.name)}{mark}"
        if entry.startswith(prefix):
            m = _TAIL.fullmatch(entry[len(prefix):])
            if m:
                return int(m.group(2))
    return None


def _temporaries(out: Path) -> List[Tuple[Path, int]]:
    """(path, owner pid) of every directory named exactly as a temporary of ``out``."""
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return []
    found = []
    for e in entries:
        pid = temp_owner(out, e.name)
        if pid is not None and e.is_dir(follow_symlinks=False):
            found.append((Path(e.path), pid))
    return sorted(found)


def _alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours, or one we may not signal)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False


def _is_live(p: Path, pid: int) -> bool:
    if pid == os.getpid():
        return p in ACTIVE
    return _alive(pid)


def stale_temporaries(out: Path) -> List[Path]:
    """Temporaries of ``out`` whose process is gone (safe to delete), by exact name."""
    return [p for p, pid in _temporaries(out) if not _is_live(p, pid)]


def live_temporaries(out: Path) -> List[Path]:
    """Temporaries of ``out`` that a running lorakit process is writing."""
    return [p for p, pid in _temporaries(out) if _is_live(p, pid)]


def clean_stale_temporaries(out: Path) -> List[Path]:
    """Delete the temporaries dead processes left beside ``out``; return (and warn
    about) the ones a running process still writes, which are left in place."""
    for p in stale_temporaries(out):
        shutil.rmtree(p, ignore_errors=True)
    live = live_temporaries(out)
    if live:
        warnings.warn(f"{len(live)} temporary director{'y' if len(live) == 1 else 'ies'} of "
                      f"a running lorakit process beside {out} left in place: "
                      + ", ".join(p.name for p in live), OutputWarning, stacklevel=3)
    return live


def temp_path(out: Path, mark: str, old: bool = False) -> Path:
    """A fresh temporary name for ``out``: this process's pid and 48 random bits."""
    return out.parent / (f".{_stem(out.name)}{mark}{'old-' if old else ''}{os.getpid()}-"
                         f"{secrets.token_hex(6)}")
