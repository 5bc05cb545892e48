"""The life of an output directory: checked, built hidden, published whole, or never there.

Every verb that writes a directory goes through here. :func:`check_output_path` refuses a
path in or around an input, and an existing one unless ``force``, which replaces only an
empty directory or a previous lorakit output (every entry listed in its ``lorakit.json``).
:class:`OutputDirectory` builds the output in a hidden sibling
``.NAME.lorakit-tmp-PID-RANDOM`` (SIGTERM and SIGHUP raise, as SIGINT does, so cleanup
runs) and renames it into place whole. Temporaries are parsed by exact name, never
globbed; those of dead processes are deleted, those of running ones kept and reported.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
import signal
import stat
import threading
import warnings
from pathlib import Path
from types import FrameType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ...errors import OutputExistsError, PathLike
from .provenance import IGNORABLE, PROVENANCE, foreign_entries, write_provenance

__all__ = ["check_output_path", "OutputDirectory", "OutputWarning", "SYNTH_MARK"]


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


def _is_live(p: Path, pid: int) -> bool:
    """Whether temporary ``p`` of process ``pid`` is being written (``pid`` exists, ours or
    one we may not signal; for this process, ``p`` is in :data:`ACTIVE`)."""
    if pid == os.getpid():
        return p in ACTIVE
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        pass
    return True


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
        pids = sorted({pid for p, pid in _temporaries(out) if p in live})
        warnings.warn(f"another running lorakit process (pid {', '.join(map(str, pids))}) is "
                      f"writing {out} right now; its temporary "
                      + ", ".join(p.name for p in live) + " is left alone. This one goes on: "
                      "whichever finishes second refuses to replace the other's output "
                      "(nothing is lost; pass --force to replace it)", OutputWarning,
                      stacklevel=3)
    return live


def temp_path(out: Path, mark: str, old: bool = False) -> Path:
    """A fresh temporary name for ``out``: this process's pid and 48 random bits."""
    return out.parent / (f".{_stem(out.name)}{mark}{'old-' if old else ''}{os.getpid()}-"
                         f"{secrets.token_hex(6)}")



class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while an output was written (handled like SIGINT)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


def _lstat(p: Path) -> Optional[os.stat_result]:
    """``os.lstat``, or None when nothing is there; other errors name the path."""
    try:
        return os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise _refused("cannot use the output path", p, "a path this user can create", e) from None


def _refused(what: str, path: Path, expected: str, e: OSError) -> OutputExistsError:
    return OutputExistsError(what, file=path, expected=expected,
                             found=f"{type(e).__name__}: {e.strerror or e}")


def check_output_path(save_path: PathLike, *, protected: Sequence[Path], force: bool,
                      allow_empty: bool = False,
                      overlap_message: str = "output path would overlap an input directory",
                      ) -> Path:
    """The resolved output path, or an OutputExistsError saying why it cannot be written:
    it lies in or around a ``protected`` input, or exists (``allow_empty``: an empty
    directory is fine) and ``force`` does not cover it."""
    try:
        out = Path(save_path).expanduser().resolve()
    except (RuntimeError, OSError) as e:  # ~nosuchuser, a loop of links
        raise OutputExistsError("cannot resolve the output path", file=str(save_path),
                                expected="an existing user's home, no link loops",
                                found=f"{type(e).__name__}: {e}") from None
    for p in protected:
        p = Path(p).resolve()
        if out.is_relative_to(p) or p.is_relative_to(out):
            raise OutputExistsError(overlap_message, file=out,
                                    expected=f"a path outside {p}",
                                    found="inside it" if out.is_relative_to(p) else "a parent of it",
                                    hint="choose a --save-path outside the model and adapter")
    st = _lstat(out)
    if st is not None:
        _check_replaceable(out, st, force=force, allow_empty=allow_empty)
    return out


def _check_replaceable(out: Path, st: os.stat_result, *, force: bool, allow_empty: bool,
                       appeared: bool = False) -> None:
    """Raise unless the existing ``out`` may be replaced under these flags."""
    is_dir = stat.S_ISDIR(st.st_mode)
    try:
        empty = is_dir and not [n for n in os.listdir(out) if n not in IGNORABLE]
        foreign = foreign_entries(out) if is_dir and force else []
    except OSError as e:  # unreadable: what it holds cannot be known, so it is kept
        raise _refused("cannot read the existing output directory", out,
                       "a directory this user can list", e) from None
    if not force and not (allow_empty and empty):
        raise OutputExistsError("output path appeared while writing" if appeared
                                else "output path already exists", file=out,
                                expected="a new path" + (" (or an empty directory)"
                                                         if allow_empty else ""),
                                found="an existing " + ("directory" if is_dir else "file"),
                                hint="another process wrote it while this one ran (a "
                                "lorakit run moves its output there only once it is "
                                "complete); it was left as it is, and nothing of this run "
                                "remains. Pass --force (force=True) to replace it"
                                if appeared else "pass --force (force=True) to replace it")
    if not is_dir:
        raise OutputExistsError("output path is a file, not a directory", file=out,
                                expected="a directory", found="a file",
                                hint="--force replaces only directories lorakit wrote")
    if foreign:
        shown = ", ".join(foreign[:5]) + (f", and {len(foreign) - 5} more"
                                          if len(foreign) > 5 else "")
        raise OutputExistsError(
            "refusing to replace a directory that is not a model or adapter lorakit wrote",
            file=out, expected=f"an empty directory or a previous lorakit output "
            f"(every entry listed in its {PROVENANCE})",
            found=f"{len(foreign)} other entries: {shown}",
            hint="choose a new --save-path, or move these away yourself: --force never "
            "deletes what lorakit did not write")


class _SignalGuard:
    """SIGTERM/SIGHUP -> :class:`Interrupted` while installed (main thread only; an ignored
    signal stays ignored). While ``defer`` is set a signal is only recorded; ``restore``
    brings the previous handlers back and delivers a recorded SIGTERM/SIGHUP to them."""

    def __init__(self) -> None:
        self.previous: Dict[int, Any] = {}
        self.caught: Optional[int] = None
        self.raised = False  # whether the caught signal already became an exception
        self.defer = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            prev = signal.getsignal(sig)
            if prev == signal.SIG_IGN or prev is None:  # ignored, or set outside Python
                continue
            if sig == signal.SIGINT and prev is not signal.default_int_handler:
                continue  # someone else's Ctrl-C handling: leave it alone
            self.previous[sig] = prev
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.caught is not None or self.defer:
            self.caught = self.caught or signum
            return
        self.caught, self.raised = signum, True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Interrupted(signum)

    def restore(self) -> None:
        for sig, prev in self.previous.items():
            signal.signal(sig, prev)
        handlers, self.previous = self.previous, {}
        sig, raised, self.caught, self.raised = self.caught, self.raised, None, False
        if sig is None or sig not in handlers:
            return
        if sig == signal.SIGINT:
            if not raised:  # pressed while publishing or cleaning up: interrupt now
                raise KeyboardInterrupt
            return
        prev = handlers[sig]
        if prev == signal.SIG_DFL:
            signal.raise_signal(sig)  # the process ends as the signal meant it to
        elif callable(prev):
            prev(sig, None)


class OutputDirectory:
    """Build ``out`` in a hidden temporary sibling; publish it whole, or leave nothing.

    Write into :attr:`tmp`, then call :meth:`commit`; leaving the block without a commit
    removes the temporary and the parents created for it. ``force`` / ``allow_empty`` are
    checked again just before publishing. ``mark``: :data:`TMP_MARK` or :data:`SYNTH_MARK`.
    """

    def __init__(self, out: Path, *, force: bool, allow_empty: bool = False,
                 mark: str = TMP_MARK) -> None:
        self.out, self.force, self.allow_empty, self.mark = out, force, allow_empty, mark
        self.tmp = temp_path(out, mark)
        self.live: List[Path] = []
        self.committed = False
        self._created: List[Path] = []
        self._guard = _SignalGuard()

    def __enter__(self) -> "OutputDirectory":
        self._guard.install()
        try:
            self.live = clean_stale_temporaries(self.out)
            self._created = _make_parents(self.out)
            while True:
                try:
                    self.tmp.mkdir()
                    break
                except FileExistsError:  # 48 random bits taken: draw again
                    self.tmp = temp_path(self.out, self.mark)
            ACTIVE.add(self.tmp)
        except OSError as e:
            self._abort()
            raise _refused("cannot create the output directory", self.out,
                           "a writable directory path", e) from None
        except BaseException:
            self._abort()
            raise
        return self

    def commit(self, kind: str, info: Mapping[str, Any]) -> Path:
        """Write the provenance, fsync everything and move the output into place."""
        write_provenance(self.tmp, kind, info)
        for name in os.listdir(self.tmp):
            _fsync(self.tmp / name)
        _fsync(self.tmp)
        self._guard.defer = True  # from here on a signal waits until the output is whole
        try:
            _publish(self.tmp, self.out, force=self.force, allow_empty=self.allow_empty)
            self.committed = True
            for d in [self.out.parent] + [p.parent for p in self._created]:
                _fsync(d, strict=False)
        finally:
            self._guard.defer = False
        return self.out

    def __exit__(self, *exc: Any) -> bool:
        if not self.committed:
            self._abort()
        else:
            ACTIVE.discard(self.tmp)
            self._guard.restore()
        return False

    def _abort(self) -> None:
        """Remove the temporary and the parents made for it; restore signal handlers."""
        self._guard.defer = True
        try:
            shutil.rmtree(self.tmp, ignore_errors=True)
            _remove_dirs(self._created)
            self._created = []
        finally:
            ACTIVE.discard(self.tmp)
            self._guard.defer = False
            self._guard.restore()


def _make_parents(out: Path) -> List[Path]:
    """Create the missing parents of ``out``, outermost first; return those created."""
    missing = []
    p = out.parent
    while _lstat(p) is None and p != p.parent:
        missing.append(p)
        p = p.parent
    created: List[Path] = []
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                if not d.is_dir():
                    raise
                continue
            created.append(d)
    except BaseException:
        _remove_dirs(created)
        raise
    return created


def _remove_dirs(created: List[Path]) -> None:
    """Remove directories this process created, deepest first, while they are empty."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            break


#: what a rename onto a path that another process just took fails with
_TAKEN = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)


def _publish(tmp: Path, out: Path, *, force: bool, allow_empty: bool) -> None:
    """Move the complete ``tmp`` to ``out``; an existing ``out`` is checked again, then
    swapped out atomically where the OS can (old and new exchanged, old deleted)."""
    st = _lstat(out)
    if st is None:
        try:
            os.rename(tmp, out)
            return
        except OSError as e:  # another process published ``out`` since the check above
            st = _lstat(out)
            if st is None or e.errno not in _TAKEN:
                raise
    _check_replaceable(out, st, force=force, allow_empty=allow_empty, appeared=True)
    if _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old output
        return
    old = temp_path(out, TMP_MARK, old=True)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)  # put the old output back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2, macOS renamex_np); False where the
    OS or filesystem cannot, so the caller falls back to two renames."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    a_b, b_b = os.fsencode(str(a)), os.fsencode(str(b))
    if hasattr(libc, "renameat2"):
        rc = libc.renameat2(-100, a_b, -100, b_b, 2)  # AT_FDCWD, RENAME_EXCHANGE
    elif hasattr(libc, "renamex_np"):
        rc = libc.renamex_np(a_b, b_b, 2)  # RENAME_SWAP
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync(p: Path, strict: bool = True) -> None:
    """Flush a file or directory to the disk (``strict=False``: where the OS allows it)."""
    try:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if strict:
            raise
