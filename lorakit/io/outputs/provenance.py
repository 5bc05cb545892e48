"""Provenance: the ``lorakit.json`` lorakit writes into every output, and what it proves.

An existing directory may be replaced (``--force``) only if it is empty or every
entry in it is listed, unchanged, in its ``lorakit.json``: :func:`foreign_entries`
names everything else, which lorakit therefore never deletes.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from ... import __version__

__all__ = []

#: the provenance file lorakit writes into every output it makes
PROVENANCE = "lorakit.json"
_FORMAT = "lorakit-output/1"
_HASH_LIMIT = 16 << 20  # files up to this size are also recorded by sha256
#: entries that are never the user's work (written by macOS Finder)
IGNORABLE = frozenset({".DS_Store"})


def foreign_entries(path: Path) -> List[str]:
    """Entries of directory ``path`` that lorakit did not write (not listed unchanged in
    its ``lorakit.json``), each with the reason."""
    names = sorted(n for n in os.listdir(path) if n not in IGNORABLE)
    manifest = _read_manifest(path)
    out: List[str] = []
    for n in names:
        if n == PROVENANCE and manifest is not None:
            continue
        rec = manifest.get(n) if manifest is not None else None
        if rec is None:
            out.append(f"{n!r} (not written by lorakit)")
            continue
        st = os.lstat(path / n)
        if not stat.S_ISREG(st.st_mode):
            out.append(f"{n!r} (not the file lorakit wrote)")
        elif st.st_size != rec.get("size") or (
                "sha256" in rec and _sha256(path / n) != rec["sha256"]):
            out.append(f"{n!r} (changed since lorakit wrote it)")
    return out


def _read_manifest(path: Path) -> Optional[Dict[str, Dict[str, Any]]]:
    """The ``files`` table of ``path``'s provenance, or None if it has none (or a bad one)."""
    p = path / PROVENANCE
    try:
        if not stat.S_ISREG(os.lstat(p).st_mode) or os.lstat(p).st_size > 1 << 24:
            return None
        doc = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        return None
    files = doc.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return None
    return files


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_provenance(directory: Path, kind: str, info: Mapping[str, Any]) -> Path:
    """Write ``lorakit.json``: what made this output (``kind``, ``info`` under ``settings``)
    and every file it holds."""
    files: Dict[str, Dict[str, Any]] = {}
    for name in sorted(os.listdir(directory)):
        p = directory / name
        st = os.lstat(p)
        if name == PROVENANCE or not stat.S_ISREG(st.st_mode):
            continue
        rec: Dict[str, Any] = {"size": st.st_size}
        if st.st_size <= _HASH_LIMIT:
            rec["sha256"] = _sha256(p)
        files[name] = rec
    doc = {"format": _FORMAT, "kind": kind, "lorakit_version": __version__,
           "settings": dict(info), "files": files}
    target = directory / PROVENANCE
    if target.is_symlink():  # copied from an input: never write through a link
        target.unlink()
    target.write_text(json.dumps(doc, indent=2) + "\n")
    return target
