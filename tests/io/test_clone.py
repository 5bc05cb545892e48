"""Clone and patch (issue 43): on a copy-on-write file system a fused shard is a clone of
the base shard with only the adapted tensors written; elsewhere today's writer runs and
the report says why. Either way the output is the same model (``lorakit diff`` = 0).

The copy-on-write tests run on a small XFS image (reflink=1) loop-mounted by the test:
as root on Linux with ``mkfs.xfs`` (xfsprogs; ``tools/setup.sh`` installs it as root).
Elsewhere they skip, saying why; ``LORAKIT_REQUIRE_COW=1`` (set by ``.ci/run``) makes
that a failure.
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, Tuple

import pytest
from helpers import DATA, build_kill_inputs, temporaries, tree_hash

import lorakit
from lorakit.errors import FuseError
from lorakit.io.formats.safetensors import read_header
from lorakit.io.outputs.clone import CLONED, WRITTEN

BASE, LORA = DATA / "tiny-qwen3", DATA / "adapters" / "lora"


def _cow_missing() -> str:
    if not sys.platform.startswith("linux"):
        return "the copy-on-write image is Linux's (loop-mounted XFS)"
    if os.geteuid() != 0:
        return "not root: mounting a loop XFS image needs root"
    if shutil.which("mkfs.xfs") is None:
        return "no mkfs.xfs (apt-get install -y xfsprogs; tools/setup.sh does it as root)"
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices (/dev/loop-control)"
    return ""


def _skip_or_fail(why: str) -> None:
    if os.environ.get("LORAKIT_REQUIRE_COW") == "1":
        pytest.fail(f"copy-on-write tests required but {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def cow(tmp_path_factory) -> Iterator[Path]:
    """A fresh 1 GB XFS with reflink (a sparse image), mounted for this module."""
    why = _cow_missing()
    if why:
        _skip_or_fail(why)
    root = tmp_path_factory.mktemp("cow")
    img, mnt = root / "xfs.img", root / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(1 << 30)
    for cmd in (["mkfs.xfs", "-q", "-m", "reflink=1", str(img)],
                ["mount", "-o", "loop", str(img), str(mnt)]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            _skip_or_fail(f"{' '.join(cmd[:2])} failed: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _inputs(where: Path, name: str) -> Tuple[Path, Path]:
    base, ad = where / name / "base", where / name / "lora"
    shutil.copytree(BASE, base)
    shutil.copytree(LORA, ad)
    return base, ad


def _state(d: Path) -> Dict[str, object]:
    """Every file's bytes and mtime."""
    return {"hash": tree_hash(d), "mtime": {p.name: p.stat().st_mtime_ns for p in d.iterdir()}}


def _same_model(a: Path, b: Path) -> None:
    """``lorakit diff`` = 0, the same metadata, and every other file the same bytes (but
    the index's total_size and the provenance's file list, which hold the shards' sizes)."""
    assert lorakit.diff(a, b, progress=False).identical
    for shard in (p.name for p in a.glob("*.safetensors")):
        assert read_header(a / shard).metadata == read_header(b / shard).metadata
    ha, hb = tree_hash(a), tree_hash(b)
    assert sorted(ha) == sorted(hb)
    sizes = (".safetensors", ".index.json", "lorakit.json")
    assert {k: v for k, v in ha.items() if not k.endswith(sizes)} \
        == {k: v for k, v in hb.items() if not k.endswith(sizes)}


def _free(p: Path) -> int:
    os.sync()
    st = os.statvfs(p)
    return st.f_bfree * st.f_frsize


def _pad_header(shard: Path, extra: int) -> None:
    """Rewrite ``shard`` with ``extra`` more bytes of spaces in its header."""
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    shard.write_bytes(struct.pack("<Q", n + extra) + raw[8:8 + n] + b" " * extra + raw[8 + n:])


def test_fuse_says_which_path_and_matches_todays_writer(tmp_path: Path, monkeypatch) -> None:
    """On any file system: a clone or the whole shard, said in the report, same model."""
    r = lorakit.fuse(BASE, LORA, tmp_path / "a", progress=False)
    assert list(r.shards) == ["model.safetensors"]
    how = r.shards["model.safetensors"]
    assert how == CLONED or how.startswith(f"{WRITTEN}: "), how
    assert "disk writes" in r.summary and how in r.summary["disk writes"]
    monkeypatch.setenv("LORAKIT_CLONE", "0")
    r0 = lorakit.fuse(BASE, LORA, tmp_path / "b", progress=False)
    assert r0.shards == {"model.safetensors": f"{WRITTEN}: cloning turned off (LORAKIT_CLONE=0)"}
    assert r0.bytes_shared == 0 and r0.to_dict()["shards"] == r0.shards
    _same_model(tmp_path / "a", tmp_path / "b")


def test_a_changed_layout_is_written_whole(tmp_path: Path) -> None:
    r = lorakit.fuse(BASE, LORA, tmp_path / "f32", dtype="promote", progress=False)
    assert r.shards == {"model.safetensors": f"{WRITTEN}: tensors change dtype, shape or order"}


def test_clone_shares_the_untouched_bytes(cow: Path, monkeypatch) -> None:
    base, ad = _inputs(cow, "share")
    before, free0 = _state(base), _free(cow)
    r = lorakit.fuse(base, ad, cow / "share" / "clone", progress=False)
    used = free0 - _free(cow)
    assert r.shards == {"model.safetensors": CLONED}
    adapted = sum(read_header(base / "model.safetensors").tensors[n].nbytes
                  for n in r.fused_names)
    assert r.bytes_written - r.bytes_shared < adapted + 16384  # the header's block(s)
    assert r.bytes_shared == r.bytes_written - adapted - read_header(
        cow / "share" / "clone" / "model.safetensors").data_start
    # new blocks: the patches, the header's block, the small sidecar files
    assert used < adapted + 512 * 1024, (used, adapted)
    assert _state(base) == before  # the base's bytes and mtimes are as they were
    monkeypatch.setenv("LORAKIT_CLONE", "0")
    lorakit.fuse(base, ad, cow / "share" / "whole", progress=False)
    _same_model(cow / "share" / "clone", cow / "share" / "whole")


@pytest.mark.parametrize("base, adapter, kw", [
    ("tiny-qwen3-4bit", "lora-4bit", {}),  # re-quantized with the same bits: same layout
    ("tiny-qwen3-4bit", "lora-4bit", {"dequantize": True}),  # new shapes: written whole
    ("tiny-qwen3", "dora", {}), ("tiny-qwen3", "peft-lora", {}),
    ("tiny-qwen3-moe", "moe-lora", {}), ("tiny-qwen3", "lora", {"rounding": "mlx-lm"})])
def test_every_kind_of_fuse_is_the_same_model(cow: Path, monkeypatch, base: str, adapter: str,
                                              kw: Dict[str, object]) -> None:
    where = cow / f"kind-{base}-{adapter}-{'-'.join(kw)}"
    shutil.copytree(DATA / base, where / "base")
    shutil.copytree(DATA / "adapters" / adapter, where / "ad")
    r = lorakit.fuse(where / "base", where / "ad", where / "clone", progress=False, **kw)
    want = f"{WRITTEN}: tensors change dtype, shape or order" if kw.get("dequantize") else CLONED
    assert set(r.shards.values()) == {want}, r.shards
    monkeypatch.setenv("LORAKIT_CLONE", "0")
    lorakit.fuse(where / "base", where / "ad", where / "whole", progress=False, **kw)
    _same_model(where / "clone", where / "whole")


def test_a_header_with_room_keeps_the_base_layout(cow: Path, monkeypatch) -> None:
    base, ad = _inputs(cow, "room")
    _pad_header(base / "model.safetensors", 4096)
    r = lorakit.fuse(base, ad, cow / "room" / "clone", progress=False)
    assert r.shards == {"model.safetensors": CLONED}
    out = cow / "room" / "clone" / "model.safetensors"
    assert read_header(out).data_start == read_header(base / "model.safetensors").data_start
    assert out.stat().st_size == (base / "model.safetensors").stat().st_size
    monkeypatch.setenv("LORAKIT_CLONE", "0")
    lorakit.fuse(base, ad, cow / "room" / "whole", progress=False)
    _same_model(cow / "room" / "clone", cow / "room" / "whole")


def test_editing_the_base_later_leaves_the_fuse_alone(cow: Path) -> None:
    base, ad = _inputs(cow, "edit")
    out = cow / "edit" / "fused"
    lorakit.fuse(base, ad, out, progress=False)
    fused = tree_hash(out)
    shard = base / "model.safetensors"
    h = read_header(shard)
    with open(shard, "r+b") as f:  # overwrite the base in place, every tensor
        for t in h.tensors.values():
            f.seek(t.begin)
            f.write(b"\x55" * t.nbytes)
    assert tree_hash(out) == fused


def test_a_full_disk_leaves_nothing(cow: Path) -> None:
    """The patches need new blocks; with too few free the fuse fails cleanly."""
    base, ad = _inputs(cow, "full")
    before = _state(base)
    filler = cow / "full" / "filler"
    free = _free(cow)
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, free - (2 << 20))  # 2 MB left, 4.6 MB needed
    out = cow / "full" / "fused"
    try:
        with pytest.raises(FuseError, match="No space left on device"):
            lorakit.fuse(base, ad, out, progress=False)
    finally:
        filler.unlink()
        # XFS frees an unlinked file's blocks in the background: the module's later tests
        # need them back
        os.sync()
        deadline = time.monotonic() + 30
        while _free(cow) < free - (8 << 20) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not out.exists() and temporaries(out) == []
    assert _state(base) == before
    r = lorakit.fuse(base, ad, out, progress=False)  # room again: the same fuse succeeds
    assert r.shards == {"model.safetensors": CLONED}


@pytest.mark.slow  # fuse processes killed at timed points, as tests/io/test_kill.py
def test_kill_on_the_cow_image(cow: Path) -> None:
    from test_kill import check_output, kill_once, timed_run

    root = cow / "kill"
    root.mkdir()
    base, ad = build_kill_inputs(root)
    inputs = _state(base) | {"ad": tree_hash(ad)}
    ref = root / "ref"
    r = lorakit.fuse(base, ad, ref, progress=False)
    assert set(r.shards.values()) == {CLONED}
    t_tmp, t_end = timed_run(base, ad, root / "cli-ref")
    assert check_output(root / "cli-ref", ref) == "complete"
    write = max(t_end - t_tmp, 0.05)
    results = [kill_once(base, ad, root / f"out-{i}", ref, d * write, after_tmp=True)
               for i, d in enumerate((0.0, 0.3, 0.7))]
    assert results[0]["outcome"] == "nothing" and results[0]["stale"] == 1, results[0]
    assert all(x["outcome"] in ("nothing", "complete") for x in results), results
    assert _state(base) | {"ad": tree_hash(ad)} == inputs
