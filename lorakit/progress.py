"""The one progress bar of lorakit's long calls. Every ``progress=`` parameter takes
``True`` (a tqdm.auto bar; none when stderr is not a terminal), ``False`` / ``None``
(nothing) or a callable ``progress(done, total)`` called after every step."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

__all__ = ["Progress", "progress_bar"]

#: what a ``progress=`` parameter accepts
Progress = Union[bool, None, Callable[[int, int], None]]


class ProgressBar:
    """Counts steps towards ``total``: drives a tqdm bar, calls a callback, or neither
    (``update(n)`` per step, ``close()`` or a ``with`` block at the end)."""

    def __init__(self, total: int, bar: Any = None,
                 callback: Optional[Callable[[int, int], None]] = None) -> None:
        self.total = total
        self.done = 0
        self._bar = bar
        self._callback = callback

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        if self._callback is not None:
            self._callback(self.done, self.total)

    def set_postfix_str(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(progress: Progress, total: int, desc: str, unit: str = "B",
                 leave: bool = False) -> ProgressBar:
    """A :class:`ProgressBar` for a ``progress=`` argument over ``total`` steps (bytes,
    shown scaled, for ``unit="B"``); ``leave`` keeps the finished bar on screen."""
    if callable(progress):
        return ProgressBar(total, callback=progress)
    if not progress:
        return ProgressBar(total)
    from tqdm.auto import tqdm  # lazy: imports ipywidgets in a notebook

    # disable=None: no bar when stderr is not a terminal (logs, pipes, CI), so an
    # error there reads as one message; notebooks still show theirs
    bar = tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=desc, disable=None, leave=leave)
    return ProgressBar(total, bar=bar)
