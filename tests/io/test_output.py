"""The output-directory lifecycle (lorakit.io.outputs.directory): --force replaces only what
lorakit wrote, SIGTERM/SIGHUP leave nothing behind, stale temporaries are found by
exact name, and parents created for a failed write are removed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import pytest
from helpers import REPO, build_kill_inputs, cli, cli_env, temporaries, tree_hash
from model_factory import make_adapter, make_model

from lorakit.errors import OutputExistsError
from lorakit.fusion.fuse import fuse
from lorakit.io.outputs.directory import (
    PROVENANCE,
    Interrupted,
    OutputDirectory,
    OutputWarning,
    check_output_path,
    clean_stale_temporaries,
    live_temporaries,
    stale_temporaries,
    temp_owner,
)

DEAD_PID = 999_999_999  # above any pid_max: no such process


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("lifecycle")
    base = make_model(root / "base", "qwen3")
    return {"base": base, "adapter": make_adapter(base, root / "adapter")}


def _fuse(inputs: Dict[str, Path], out: Path, **kw):
    return fuse(inputs["base"], inputs["adapter"], out, progress=False, **kw)


def _all_temps(parent: Path) -> list:
    return sorted(p.name for p in parent.iterdir() if ".lorakit-" in p.name)


# -- --force replaces only what lorakit wrote ------------------------------------------------
def test_force_refuses_dir_with_only_config_json(inputs, tmp_path: Path) -> None:
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "config.json").write_text('{"chapter": 3}')
    before = tree_hash(out)
    with pytest.raises(OutputExistsError, match="refusing to replace") as e:
        _fuse(inputs, out, force=True)
    assert "config.json" in str(e.value) and "not written by lorakit" in str(e.value)
    assert tree_hash(out) == before
    assert _all_temps(tmp_path) == []


def test_force_refuses_dir_with_other_checkpoints(inputs, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    _fuse(inputs, out / "ckpt-1")  # lorakit outputs inside: the directory itself is not one
    (out / "ckpt-2").mkdir()
    (out / "ckpt-2" / "model.safetensors").write_bytes(b"\0" * 64)
    (out / "model.safetensors").write_bytes(b"\1" * 64)
    before = tree_hash(out)
    with pytest.raises(OutputExistsError, match="refusing to replace") as e:
        _fuse(inputs, out, force=True)
    msg = str(e.value)
    assert "3 other entries" in msg and "ckpt-1" in msg and "model.safetensors" in msg
    assert tree_hash(out) == before


def test_force_on_empty_dir_replaces_it(inputs, tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    with pytest.raises(OutputExistsError, match="already exists"):
        _fuse(inputs, out)  # without --force, even an empty directory is kept
    res = _fuse(inputs, out, force=True)
    assert res.output == out.resolve() and (out / "config.json").is_file()
    assert _all_temps(tmp_path) == []


def test_force_on_previous_output_replaces_it(inputs, tmp_path: Path) -> None:
    out = tmp_path / "fused"
    _fuse(inputs, out)
    first = tree_hash(out)
    _fuse(inputs, out, force=True, rounding="mlx-lm")
    second = tree_hash(out)
    assert second != first and sorted(second) == sorted(first)
    doc = json.loads((out / PROVENANCE).read_text())
    assert doc["kind"] == "fuse" and doc["settings"]["rounding"] == "mlx-lm"
    assert _all_temps(tmp_path) == []


def test_provenance_lists_every_file(inputs, tmp_path: Path) -> None:
    out = tmp_path / "fused"
    _fuse(inputs, out)
    doc = json.loads((out / PROVENANCE).read_text())
    assert doc["format"] == "lorakit-output/1"
    assert sorted(doc["files"]) == sorted(p.name for p in out.iterdir() if p.name != PROVENANCE)
    assert all(rec["size"] == (out / n).stat().st_size for n, rec in doc["files"].items())


@pytest.mark.parametrize("change", ["added", "edited", "replaced-by-link", "no-provenance"])
def test_force_refuses_previous_output_the_user_changed(inputs, tmp_path: Path,
                                                        change: str) -> None:
    out = tmp_path / "fused"
    _fuse(inputs, out)
    if change == "added":
        (out / "notes.md").write_text("my results")
        name = "notes.md"
    elif change == "edited":  # same size, other bytes: caught by the sha256
        cfg = (out / "config.json").read_bytes()
        (out / "config.json").write_bytes(cfg.replace(b"4", b"5", 1))
        name = "config.json"
    elif change == "replaced-by-link":
        (tmp_path / "mine.json").write_text("{}")
        (out / "tokenizer.json").unlink()
        (out / "tokenizer.json").symlink_to(tmp_path / "mine.json")
        name = "tokenizer.json"
    else:
        (out / PROVENANCE).unlink()
        name = "config.json"
    before = tree_hash(out)
    with pytest.raises(OutputExistsError, match="refusing to replace") as e:
        _fuse(inputs, out, force=True)
    assert name in str(e.value)
    assert tree_hash(out) == before


def test_force_refuses_a_file(inputs, tmp_path: Path) -> None:
    out = tmp_path / "fused"
    out.write_text("precious")
    with pytest.raises(OutputExistsError, match="is a file"):
        _fuse(inputs, out, force=True)
    assert out.read_text() == "precious"


def test_output_checked_again_before_publishing(tmp_path: Path) -> None:
    """A user's file that appears in the output directory while lorakit writes is kept."""
    out = check_output_path(tmp_path / "o", protected=[], force=True)
    with pytest.raises(OutputExistsError, match="refusing to replace"):
        with OutputDirectory(out, force=True) as od:
            (od.tmp / "a.json").write_text("{}")
            out.mkdir()
            (out / "draft.tex").write_text("precious")
            od.commit("test", {})
    assert (out / "draft.tex").read_text() == "precious"
    assert _all_temps(tmp_path) == []


# -- failures leave nothing, parents included --------------------------------------------
def test_failed_write_removes_created_parents(inputs, tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper" / "fused"

    def boom(done: int, total: int) -> None:
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        fuse(inputs["base"], inputs["adapter"], out, progress=boom)
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_existing_parents(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    out = tmp_path / "a" / "b" / "c"
    with pytest.raises(ValueError):
        with OutputDirectory(out, force=False) as od:
            assert od.tmp.parent == tmp_path / "a" / "b"
            raise ValueError
    assert list(tmp_path.iterdir()) == [tmp_path / "a"]
    assert list((tmp_path / "a").iterdir()) == []


# -- signals ---------------------------------------------------------------------------------
def test_sigterm_in_process_cleans_up_then_calls_previous_handler(tmp_path: Path) -> None:
    seen = []
    old = signal.signal(signal.SIGTERM, lambda s, f: seen.append(
        (s, sorted(p.name for p in tmp_path.iterdir()))))
    try:
        out = tmp_path / "x" / "out"
        with pytest.raises(Interrupted):
            with OutputDirectory(out, force=False) as od:
                (od.tmp / "part.safetensors").write_bytes(b"\0" * 100)
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs at the next bytecode
                    time.sleep(0.001)
                pytest.fail("SIGTERM did not interrupt the write")
        # the earlier handler ran once, after the cleanup, and is back in place
        assert seen == [(signal.SIGTERM, [])]
        assert list(tmp_path.iterdir()) == []
        assert signal.getsignal(signal.SIGTERM) is not None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert len(seen) == 2
    finally:
        signal.signal(signal.SIGTERM, old)


def test_ignored_sighup_stays_ignored(tmp_path: Path) -> None:
    """Under ``nohup`` (SIGHUP ignored) a hangup must not stop the write."""
    if not hasattr(signal, "SIGHUP"):
        pytest.skip("no SIGHUP here")
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        out = tmp_path / "out"
        with OutputDirectory(out, force=False) as od:
            (od.tmp / "a.json").write_text("{}")
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.01)
            od.commit("test", {})
        assert (out / "a.json").exists() and (out / PROVENANCE).exists()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_signal_mid_fuse_leaves_nothing(tmp_path_factory, sig: str) -> None:
    """SIGTERM (timeout, systemd, schedulers, Jupyter restarts) or SIGHUP while a CLI
    fuse writes: no temporary, nothing at the output, no parent it created; the
    process still ends by that signal."""
    root = tmp_path_factory.mktemp(f"sig-{sig}")
    base, adapter = build_kill_inputs(root / "in")
    before = tree_hash(root / "in")
    out = root / "made" / "by" / "fuse" / "out"
    # the default disposition in the child, also where this run itself ignores SIGHUP
    # (under nohup a fuse keeps ignoring it: test_ignored_sighup_stays_ignored)
    p = subprocess.Popen(cli(base, adapter, out), env=cli_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, cwd=REPO,
                         preexec_fn=lambda: signal.signal(getattr(signal, sig), signal.SIG_DFL))
    t0 = time.perf_counter()
    while p.poll() is None and not (out.parent.is_dir() and temporaries(out)):
        assert time.perf_counter() - t0 < 120, "the fuse never started writing"
        time.sleep(0.0005)
    assert p.poll() is None, "the fuse ended before the signal: " + p.stderr.read().decode()
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=120)
    assert p.returncode == -getattr(signal, sig), (p.returncode, err.decode())
    assert "Traceback" not in err.decode()
    assert sorted(p.name for p in root.iterdir()) == ["in"], "left: " + str(list(root.iterdir()))
    assert tree_hash(root / "in") == before


# -- stale temporaries: exact names, dead cleaned, live reported ------------------------------
def _temp(parent: Path, out_name: str, pid: int, rand: str = "abcdef12") -> Path:
    d = parent / f".{out_name}.lorakit-tmp-{pid}-{rand}"
    d.mkdir()
    (d / "partial.safetensors").write_bytes(b"\0" * 10)
    return d


def test_dead_temporary_cleaned_live_one_reported(inputs, tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = _temp(tmp_path, "fused", DEAD_PID)
        synth_dead = tmp_path / f".fused.lorakit-synth-{DEAD_PID}-0123abcd"
        synth_dead.mkdir()
        live = _temp(tmp_path, "fused", sleeper.pid)
        out = tmp_path / "fused"
        assert stale_temporaries(out) == sorted([dead, synth_dead])
        assert live_temporaries(out) == [live]
        with pytest.warns(OutputWarning, match="running lorakit process"):
            _fuse(inputs, out)
        assert not dead.exists() and not synth_dead.exists()
        assert live.exists() and (live / "partial.safetensors").exists()
        with pytest.warns(OutputWarning):
            assert clean_stale_temporaries(out) == [live]
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("mine,other", [("a[1]", "a1"), ("x*", "xyz"), ("b?", "bc"),
                                        ("[ab]", "a"), ("*", "fused"), ("c", "c.lorakit-tmp-1")])
def test_glob_characters_do_not_reach_another_outputs_temporary(inputs, tmp_path: Path,
                                                                mine: str, other: str) -> None:
    theirs = _temp(tmp_path, other, DEAD_PID)
    assert temp_owner(tmp_path / mine, theirs.name) is None
    assert stale_temporaries(tmp_path / mine) == []
    _fuse(inputs, tmp_path / mine)
    assert theirs.exists(), f"a fuse into {mine!r} deleted the temporary of {other!r}"
    assert stale_temporaries(tmp_path / other) == [theirs]


def test_temporary_names_are_exact() -> None:
    out = Path("/x/out")
    assert temp_owner(out, ".out.lorakit-tmp-123-0123abcd") == 123
    assert temp_owner(out, ".out.lorakit-tmp-old-123-0123abcdef01") == 123
    assert temp_owner(out, ".out.lorakit-synth-7-0123abcd") == 7
    for name in (".out.lorakit-tmp-123-0123abc", ".out.lorakit-tmp-x-0123abcd",
                 ".out.lorakit-tmp-123-0123abcd.bak", ".outx.lorakit-tmp-1-0123abcd",
                 "out.lorakit-tmp-1-0123abcd", ".out.lorakit-tmp-1-0123ABCD"):
        assert temp_owner(out, name) is None, name


def test_own_pid_temporary_from_a_failed_run_is_stale(tmp_path: Path) -> None:
    """A temporary with this process's pid that no write of ours holds is left over."""
    left = _temp(tmp_path, "out", os.getpid())
    assert stale_temporaries(tmp_path / "out") == [left]
    with OutputDirectory(tmp_path / "out", force=False) as od:
        assert not left.exists()
        assert live_temporaries(tmp_path / "out") == [od.tmp]  # its own, in use
        od.commit("test", {})


def test_long_output_name_gets_a_temporary_that_fits(inputs, tmp_path: Path) -> None:
    """A 250-byte output name is legal; its temporary's name must be too."""
    out = tmp_path / ("n" * 250)
    _fuse(inputs, out)
    _fuse(inputs, out, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    left = out.parent / f".{'n' * 150}~{'0' * 16}.lorakit-tmp-{DEAD_PID}-abcdef12"
    left.mkdir()
    assert stale_temporaries(out) == []  # another name's stem: not ours
    with pytest.raises(OutputExistsError, match="cannot use the output path"):
        _fuse(inputs, tmp_path / ("n" * 300))


def test_a_racing_fuse_is_one_line_saying_what_is_safe(tmp_path: Path) -> None:
    """Another process writing the same output: the CLI says so in one line (who, what
    is left alone, what happens next), not Python's warning format; the other's
    temporary is untouched and this fuse still completes."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = _temp(tmp_path, "fused", sleeper.pid)
        out = tmp_path / "fused"
        proc = subprocess.run(cli(REPO / "data" / "tiny-qwen3", REPO / "data" / "adapters" / "lora",
                                  out), capture_output=True, text=True, env=cli_env(), cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lorakit fuse: warning: another running "
                                                       f"lorakit process (pid {sleeper.pid})")
        assert live.name in lines[0] and "left alone" in lines[0] and "--force" in lines[0]
        assert "OutputWarning" not in proc.stderr
        assert live.exists() and (live / "partial.safetensors").exists() and out.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("theirs", ["dir", "file"])
def test_an_output_published_between_check_and_rename_is_explained(
        tmp_path: Path, monkeypatch, theirs: str) -> None:
    """The other fuse renames its output into place after this one saw the path free
    but before its own rename (ENOTEMPTY / ENOTDIR): the same one error saying what
    happened and what is safe, not "I/O error: Directory not empty"."""
    import lorakit.io.outputs.directory as output

    out = check_output_path(tmp_path / "o", protected=[], force=False)
    real = output._lstat
    calls = {"n": 0}

    def racing_lstat(p):
        if Path(p) == out and calls["n"] == 0:  # _publish's check: free, then taken
            calls["n"] += 1
            if theirs == "dir":
                out.mkdir()
                (out / "theirs.txt").write_text("kept")
            else:
                out.write_text("kept")
            return None
        return real(p)

    with pytest.raises(OutputExistsError) as e:
        with OutputDirectory(out, force=False) as od:
            (od.tmp / "config.json").write_text("{}")
            monkeypatch.setattr(output, "_lstat", racing_lstat)
            od.commit("example", {})
    msg = str(e.value)
    assert calls["n"] == 1
    assert "appeared while writing" in msg and "another process wrote it" in msg, msg
    assert "left as it is" in msg and "nothing of this run remains" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # this run left nothing
    kept = out / "theirs.txt" if theirs == "dir" else out
    assert kept.read_text() == "kept"


def test_an_output_that_appears_while_writing_is_kept_and_explained(tmp_path: Path) -> None:
    from lorakit.errors import OutputExistsError

    out = check_output_path(tmp_path / "o", protected=[], force=False)
    with pytest.raises(OutputExistsError) as e:
        with OutputDirectory(out, force=False) as od:
            (od.tmp / "config.json").write_text("{}")
            out.mkdir()  # another process published its output meanwhile
            (out / "theirs.txt").write_text("kept")
            od.commit("example", {})
    msg = str(e.value)
    assert "appeared while writing" in msg and "another process wrote it" in msg
    assert "left as it is" in msg and "--force" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # this run left nothing
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
