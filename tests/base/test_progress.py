"""The one progress bar (lorakit.progress): ``progress=`` as a callback, as nothing, or
as a tqdm bar."""
from __future__ import annotations

from lorakit.progress import progress_bar


def test_progress_bar_forms() -> None:
    calls = []
    bar = progress_bar(lambda d, t: calls.append((d, t)), 5, "x")
    for n in (2, 0, 3):
        bar.update(n)
    bar.close()
    assert calls == [(2, 5), (2, 5), (5, 5)]  # (done so far, total) after every step
    for off in (False, None):
        quiet = progress_bar(off, 5, "x")
        quiet.update(5)
        quiet.set_postfix_str("step")
        quiet.close()
        assert quiet.done == 5 and quiet._bar is None
    shown = progress_bar(True, 5, "x")
    assert shown._bar is not None  # a tqdm bar (disabled when stderr is not a terminal)
    shown.update(5)
    shown.close()
