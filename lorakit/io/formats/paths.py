"""Paths a user gives and files a directory names, resolved safely.

``user_path`` expands ``~`` (an unknown user is one clear error), ``stat_path`` names
why a path cannot be used, ``check_model_dir`` refuses what is not a model directory
(with the close names beside it), ``resolve_model_path`` tells a local typo from a hub
repo id, ``safe_member`` keeps a file named inside a directory inside it, and
``load_json`` reads a small JSON file or says why not.
"""
from __future__ import annotations

import difflib
import errno
import json
import os
import re
import stat
from functools import partial
from pathlib import Path
from typing import Any, Optional

from ...errors import FormatError, PathLike, UnsafePathError
from .safetensors import _file_kind

__all__ = ["resolve_model_path"]


#: a JSON config larger than this is refused before it is read (real ones are KBs).
MAX_JSON_BYTES = 64 * 1024 * 1024


def load_json(path: Path, what: str) -> Any:
    bad = partial(FormatError, file=path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            # a FIFO or device would block or never end
            raise bad(f"{what} is not a regular file", expected="a JSON file",
                      found=_file_kind(st.st_mode))
        if st.st_size > MAX_JSON_BYTES:
            raise bad(f"{what} is implausibly large", expected=f"<= {MAX_JSON_BYTES} bytes",
                      found=f"{st.st_size} bytes")
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise bad(f"{what} is missing", expected=f"a {path.name} file", found="no such file",
                  hint="point at a model directory with config.json"
                  if path.name == "config.json" else None) from None
    except (ValueError, RecursionError) as e:  # JSON, UTF-8 and int-size errors
        raise bad(f"{what} is not valid JSON", expected="valid UTF-8 JSON",
                  found=f"{type(e).__name__}: {str(e)[:100]}") from None
    except OSError as e:
        raise bad(f"cannot read {what}: {e.strerror or e}", expected="a readable file",
                  found=type(e).__name__) from None


def is_hub_blob(link: Path, target: Path) -> bool:
    """A hub snapshot file: <repo>/snapshots/<rev>/name -> <repo>/blobs/<hash>."""
    parts = link.parent.resolve().parts
    return len(parts) >= 3 and parts[-2] == "snapshots" and \
        target.parent == Path(*parts[:-2]) / "blobs"


def safe_member(directory: Path, name: Any, *, source: Path, what: str,
                tensor: Optional[str] = None) -> Path:
    """Resolve ``name`` as a file inside ``directory``, refusing anything that escapes it
    (a link out is refused, except a hub snapshot's link into the cache's blobs)."""
    p = Path(name) if isinstance(name, str) and "\x00" not in name and "\\" not in name else None
    if p is None or len(p.parts) != 1 or p.is_absolute() or name == "..":
        raise UnsafePathError(f"unsafe {what} name", file=source, tensor=tensor,
                              found=repr(name)[:80],
                              expected="a plain file name inside the directory")
    full = directory / name
    if full.is_symlink():
        try:
            target = full.resolve(strict=False)
        except (OSError, RuntimeError):  # a link loop
            raise UnsafePathError(f"{what} is a link that cannot be resolved", file=full,
                                  tensor=tensor, expected="a file inside the directory",
                                  found="a link loop") from None
        inside = target.parent == directory.resolve()
        if not inside and not is_hub_blob(full, target):
            raise UnsafePathError(f"{what} is a link out of the directory", file=full,
                                  tensor=tensor, found=f"link to {target}",
                                  expected="a file inside the directory")
    return full


def user_path(path: PathLike, what: str = "path") -> Path:
    """``path`` with ``~`` / ``~user`` expanded; an unknown user is a :class:`FormatError`."""
    p = Path(path)
    try:
        return p.expanduser()
    except RuntimeError:  # ~user for a user this system does not know
        user = str(path).split(os.sep, 1)[0]
        raise FormatError(f"{what} names an unknown user", file=str(path),
                          expected="~ or ~user for an existing user, or a plain path",
                          found=f"no user {user[1:]!r}") from None


def stat_path(path: Path, what: str = "path") -> Optional[os.stat_result]:
    """``os.stat`` of ``path``: None when nothing is there, a :class:`FormatError`
    naming the cause for a name too long, a permission denied, a link loop, ..."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        cause = {errno.ENAMETOOLONG: "a name in it is longer than the system allows",
                 errno.EACCES: "permission denied", errno.EPERM: "permission denied",
                 errno.ELOOP: "too many levels of links"}.get(e.errno, e.strerror or str(e))
        raise FormatError(f"cannot use the {what}: {cause}", file=short_path(path),
                          expected="an accessible path",
                          found=f"{type(e).__name__} ({errno.errorcode.get(e.errno, e.errno)})",
                          hint="check the directories' permissions" if e.errno in
                          (errno.EACCES, errno.EPERM) else None) from None
    except ValueError as e:  # an embedded NUL byte
        raise FormatError(f"cannot use the {what}: {e}", file=short_path(path),
                          expected="a path without NUL bytes", found=repr(str(path))[:80]) from None


def short_path(path: PathLike) -> str:
    """A path as shown in an error: a 4000-byte name would drown the message."""
    s = str(path)
    return s if len(s) <= 240 else f"{s[:120]}...{s[-60:]} ({len(s)} characters)"


def check_model_dir(path: Path) -> None:
    """Refuse a model path that is not an accessible directory, saying why."""
    st = stat_path(path, "model path")
    bad = partial(FormatError, file=short_path(path))
    if st is None and not path.is_symlink():
        raise bad("model path does not exist: no such directory",
                  expected="a local model directory or a hub repo id (owner/name)",
                  found="no such file or directory",
                  hint=_did_you_mean(path) or "check the path for typos")
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise bad("model path is not a directory", expected="a model directory with config.json",
                  found="a link to nothing" if st is None else "a file"
                  if stat.S_ISREG(st.st_mode) else _file_kind(st.st_mode),
                  hint="give a local model directory (or a hub repo id)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise bad("cannot use the model path: permission denied",
                  expected="a directory you can list and read",
                  found=f"mode {stat.filemode(st.st_mode)}",
                  hint="check the directory's permissions")


def _did_you_mean(path: Path) -> Optional[str]:
    """A hint naming the directories beside ``path`` whose names are close to its own."""
    parent = path.parent
    try:
        names = [p.name for p in parent.iterdir() if p.is_dir()]
    except OSError:
        return None
    close = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
    return "did you mean " + " or ".join(str(parent / n) for n in close) + "?" if close else None


#: what a hub repo id looks like (owner/name); anything else is taken as a local path.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")


def _looks_local(text: str, p: Path) -> bool:
    """Whether a missing model path was meant as a local path, not a hub repo id."""
    if not _REPO_ID.fullmatch(text) or text.startswith(("~", ".")) or "\\" in text or (
            os.sep != "/" and os.sep in text):
        return True
    try:
        return p.parent.is_dir()  # data/tiny-qwen where data/ exists: a typo, not a repo
    except OSError:
        return True


def resolve_model_path(path_or_repo: PathLike) -> Path:
    """A local directory as is; otherwise a hub repo id fetched through mlx-lm's downloader.
    A missing path that looks local (not ``owner/name``, or ``owner/`` exists) is refused
    at once, with the close names beside it."""
    text = os.fspath(path_or_repo)
    p = user_path(text, "model path")
    if stat_path(p, "model path") is not None or p.is_symlink() or \
            os.environ.get("LORAKIT_OFFLINE") or _looks_local(text, p):
        check_model_dir(p)
        return p
    from mlx_lm.utils import _download  # lazy: mlx-lm is heavy (the hub path its users rely on)

    try:
        return Path(_download(text))
    except Exception as e:  # the hub client's many error types, offline or not found
        raise FormatError("cannot fetch the model from the hub", file=text,
                          expected="a local directory, or a hub repo reachable now",
                          found=f"{type(e).__name__}: {str(e)[:160]}") from None
