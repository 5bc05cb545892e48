"""A fuse killed with SIGKILL at any moment leaves either nothing or a complete,
loadable output at the output path, and the next fuse cleans the temporary
directory the killed one left behind.

CI kills at a few points here; ``benchmarks/kill.py`` kills at many.
"""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx
import pytest
from helpers import REPO, build_kill_inputs, cli, temporaries, tree_hash
from helpers import cli_env as _env

from lorakit.fusion.fuse import fuse
from lorakit.io.formats.checkpoint import Checkpoint

pytestmark = pytest.mark.slow  # fuse processes killed at timed points

def timed_run(base: Path, adapter: Path, out: Path) -> Tuple[float, float]:
    """Run one uninterrupted CLI fuse; return (seconds until its temporary directory
    appeared, seconds until it exited)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cli(base, adapter, out), env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, cwd=REPO)
    t_tmp = None
    while p.poll() is None:
        if t_tmp is None and temporaries(out):
            t_tmp = time.perf_counter() - t0
        time.sleep(0.001)
    t_end = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr.read().decode() if p.stderr else ""
    return (t_tmp if t_tmp is not None else t_end), t_end


def check_output(out: Path, ref: Path) -> str:
    """``"nothing"`` if nothing is at ``out``; ``"complete"`` if ``out`` is a whole,
    loadable fused checkpoint identical to ``ref``; AssertionError otherwise."""
    if not out.exists() and not out.is_symlink():
        return "nothing"
    assert out.is_dir() and not out.is_symlink(), f"{out} is not a directory"
    got, want = tree_hash(out), tree_hash(ref)
    assert sorted(got) == sorted(want), f"files differ: {sorted(got)} vs {sorted(want)}"
    ck = Checkpoint(out)  # index, headers, config all parse
    for shard in ck.shards:
        loaded = mx.load(str(out / shard))
        ref_loaded = mx.load(str(ref / shard))
        assert sorted(loaded) == sorted(ref_loaded)
        for k, v in loaded.items():
            assert v.dtype == ref_loaded[k].dtype and mx.array_equal(v, ref_loaded[k]).item(), k
    assert got == want, "same files, different bytes"
    return "complete"


def kill_once(base: Path, adapter: Path, out: Path, ref: Path, delay: float, *,
              after_tmp: bool, force: bool = False) -> Dict[str, object]:
    """Start a CLI fuse into ``out``, SIGKILL it ``delay`` s after it starts (or after
    its temporary directory appears), check what is at ``out``, then run a plain
    fuse and check that it cleans up and writes the right output.
    """
    p = subprocess.Popen(cli(base, adapter, out, force=force), env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    t0 = time.perf_counter()
    if after_tmp:
        while p.poll() is None and not temporaries(out) and time.perf_counter() - t0 < 60:
            time.sleep(0.0005)
        t0 = time.perf_counter()
    while p.poll() is None and time.perf_counter() - t0 < delay:
        time.sleep(0.0005)
    finished = p.poll() is not None
    if not finished:
        p.send_signal(signal.SIGKILL)
    p.wait()
    outcome = check_output(out, ref)
    stale = temporaries(out)
    # the next run: cleans what the killed one left, and writes the right output
    fuse(base, adapter, out, force=out.exists(), progress=False)
    assert temporaries(out) == [], "stale temporary directory survived the next run"
    assert check_output(out, ref) == "complete"
    return {"delay": delay, "after_tmp": after_tmp, "force": force, "finished": finished,
            "outcome": outcome, "stale": len(stale)}


@pytest.fixture(scope="module")
def kill_setup(tmp_path_factory) -> Dict[str, object]:
    root = tmp_path_factory.mktemp("kill")
    base, adapter = build_kill_inputs(root)
    ref = root / "ref"
    fuse(base, adapter, ref, progress=False)
    # an uninterrupted CLI run writes the same bytes as the API, and tells how long
    # the write phase lasts on this machine now
    t_tmp, t_end = timed_run(base, adapter, root / "cli-ref")
    assert check_output(root / "cli-ref", ref) == "complete"
    return {"root": root, "base": base, "adapter": adapter, "ref": ref, "t_tmp": t_tmp,
            "t_end": t_end, "inputs": tree_hash(base) | tree_hash(adapter)}


def test_kill_points(kill_setup) -> None:
    s = kill_setup
    write = max(s["t_end"] - s["t_tmp"], 0.05)
    rng = random.Random(7)
    points = [(0.0, True), (0.3 * write, True), (0.7 * write, True),
              (rng.uniform(0, s["t_end"]), False)]
    results = []
    for i, (delay, after_tmp) in enumerate(points):
        out = s["root"] / f"out-{i}"
        results.append(kill_once(s["base"], s["adapter"], out, s["ref"], delay,
                                 after_tmp=after_tmp))
    # the first kill lands while the temporary directory is being filled: it must
    # have left one behind (which the next run removed), and nothing at the output
    assert results[0]["outcome"] == "nothing" and results[0]["stale"] == 1, results[0]
    assert all(r["outcome"] in ("nothing", "complete") for r in results)
    assert tree_hash(s["base"]) | tree_hash(s["adapter"]) == s["inputs"]


def test_kill_during_force_replace(kill_setup) -> None:
    """Killing a --force run that replaces an earlier output leaves the earlier
    output, the new one, or (between the two renames) nothing; never a mix."""
    s = kill_setup
    write = max(s["t_end"] - s["t_tmp"], 0.05)
    for i, frac in enumerate((0.5, 1.2)):
        out = s["root"] / f"force-{i}"
        fuse(s["base"], s["adapter"], out, progress=False)
        r = kill_once(s["base"], s["adapter"], out, s["ref"], frac * write, after_tmp=True,
                      force=True)
        assert r["outcome"] in ("nothing", "complete"), r
    assert tree_hash(s["base"]) | tree_hash(s["adapter"]) == s["inputs"]


def test_stale_temporary_of_live_fuse_is_kept(kill_setup, tmp_path: Path) -> None:
    """A temporary directory that belongs to a fuse still running (its pid is alive)
    is not removed by another fuse into the same path."""
    s = kill_setup
    out = tmp_path / "fused"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".fused.lorakit-tmp-{sleeper.pid}-abcdef12"
        dead = tmp_path / ".fused.lorakit-tmp-999999999-abcdef12"
        for d in (live, dead):
            d.mkdir()
            (d / "partial.safetensors").write_bytes(b"\0" * 100)
        fuse(s["base"], s["adapter"], out, progress=False)
        assert live.exists() and not dead.exists()
        assert check_output(out, s["ref"]) == "complete"
    finally:
        sleeper.kill()
        sleeper.wait()
