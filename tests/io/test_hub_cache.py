"""One door: every verb that reads a checkpoint takes a hub repo id, resolved the same
way (mlx-lm's resolver) from a Hugging Face cache laid out as the hub lays it out,
offline (``HF_HUB_OFFLINE=1``): no network is asked."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
ADAPTER = DATA / "adapters" / "lora"
REPO_ID = "org/name"


def _cache(root: Path, repo_id: str, src: Path) -> Path:
    """``root/models--org--name``: refs/main holding a commit hash, snapshots/<hash>/
    with each file a link to ../../blobs/<sha256 of its bytes>."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap, blobs = repo / "snapshots" / commit, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in sorted(src.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / sha)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", sha))
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict:
    """The cache and the environment that points at it, offline."""
    tmp = tmp_path_factory.mktemp("hub")
    snap = _cache(tmp / "hf" / "hub", REPO_ID, DATA / "tiny-qwen3")
    env = {k: v for k, v in os.environ.items() if k != "LORAKIT_OFFLINE"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp / "hf"), HF_HUB_CACHE=str(tmp / "hf" / "hub"),
               PYTHONPATH=str(REPO))
    return {"tmp": tmp, "snap": snap, "env": env}


@pytest.fixture(scope="module")
def fused(hub: dict) -> Path:
    """A checkpoint fused from the hub id (so ``lorakit.fuse`` takes the id too)."""
    fused = hub["tmp"] / "fused"
    code = ("import sys, lorakit\nr = lorakit.fuse(sys.argv[1], sys.argv[2], sys.argv[3])\n"
            "print(r.output)\n")
    r = subprocess.run([sys.executable, "-c", code, REPO_ID, str(ADAPTER), str(fused)],
                       env=hub["env"], cwd=hub["tmp"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (fused / "config.json").exists()
    return fused


def lorakit(hub: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lorakit", *args], env=hub["env"],
                          cwd=hub["tmp"], capture_output=True, text=True, timeout=timeout)


def test_open_resolves_the_id_from_the_cache(hub: dict) -> None:
    code = ("import sys, lorakit\ns = lorakit.open(sys.argv[1])\n"
            "print(s.kind, s.path, len(s.tensors))\n")
    r = subprocess.run([sys.executable, "-c", code, REPO_ID], env=hub["env"], cwd=hub["tmp"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    kind, path, n = r.stdout.split()
    assert kind == "checkpoint" and Path(path) == hub["snap"] and int(n) == 46


def test_inspect(hub: dict) -> None:
    r = lorakit(hub, "inspect", REPO_ID, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)


@pytest.mark.slow
def test_diff(hub: dict) -> None:
    r = lorakit(hub, "diff", REPO_ID, str(DATA / "tiny-qwen3"))
    assert r.returncode == 0, r.stdout + r.stderr  # the same bytes: identical


@pytest.mark.slow
def test_check(hub: dict, fused: Path) -> None:
    r = lorakit(hub, "check", "--model", REPO_ID, "--save-path", str(fused),
                "--adapter-path", str(ADAPTER), "--json")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_extract(hub: dict, fused: Path) -> None:
    out = hub["tmp"] / "extracted"
    r = lorakit(hub, "extract", "--base", REPO_ID, "--tuned", str(fused), "--rank", "2",
                "--save-path", str(out), "--json", "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "adapter_config.json").exists()


@pytest.mark.slow
def test_compare_outputs(hub: dict, fused: Path) -> None:
    r = lorakit(hub, "compare-outputs", REPO_ID, str(fused), "--tokens", "64",
                "--context", "32", "--json", "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kl" in r.stdout.lower()


@pytest.mark.slow
def test_time_decode(hub: dict) -> None:
    r = lorakit(hub, "time-decode", "--model", REPO_ID, "--tokens", "2", "--repeats", "1",
                "--prompt-tokens", "4", "--warmup", "0", "--rounds", "1", "--json", "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)


def test_an_id_missing_from_the_cache_is_one_clear_error(hub: dict) -> None:
    r = lorakit(hub, "inspect", "org/absent")
    assert r.returncode == 2 and "cannot fetch the model from the hub" in r.stderr, r.stderr
