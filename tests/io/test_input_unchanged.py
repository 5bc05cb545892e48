"""The base checkpoint and the adapter are byte-for-byte unchanged by every fuse:
successful ones, in every rounding mode and dtype policy, for every adapter format,
quantized bases, and --force runs replacing an earlier output (API and CLI). The
failing fuses are covered case by case in test_bad_inputs.py.

Every file (and link) under the inputs is hashed before and after. The output must
also share no file with the inputs (no hard links, no links into them), so writing
to it later cannot change them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import pytest
from helpers import make_env, run_cli, temporaries, tree_hash

from lorakit.fusion.fuse import fuse

COMBOS = [  # (base, adapter, options)
    ("base", "ad", dict(rounding="nearest")),
    ("base", "ad", dict(rounding="round-once")),
    ("base", "ad", dict(rounding="mlx-lm")),
    ("base", "ad", dict(rounding="scale-after")),
    ("base", "ad", dict(dtype="promote")),
    ("base", "ad", dict(dtype="float16")),
    ("base", "ad", dict(dtype="float32")),
    ("base", "ad_dora", dict()),
    ("base", "ad_dora", dict(rounding="mlx-lm")),
    ("base", "ad_peft", dict(rounding="round-once")),
    ("base_q", "ad_q", dict()),
    ("base_q", "ad_q", dict(dequantize=True)),
    ("base_q", "ad_q", dict(dequantize=True, dtype="float32")),
]


def assert_output_independent(out: Path, inputs: Path) -> None:
    """No output file is a hard link to, or a link into, an input file."""
    input_inodes = {(s.st_dev, s.st_ino) for p in inputs.rglob("*") if p.is_file()
                    for s in [p.stat()]}
    for p in out.rglob("*"):
        assert not p.is_symlink(), f"{p} is a link"
        if p.is_file():
            s = p.stat()
            assert (s.st_dev, s.st_ino) not in input_inodes, f"{p} shares an inode with an input"
            assert s.st_nlink == 1, p


@pytest.mark.parametrize("base,adapter,opts", COMBOS,
                         ids=[f"{b}-{a}-" + "-".join(f"{v}" for v in o.values())
                              for b, a, o in COMBOS])
def test_successful_fuse_leaves_inputs_unchanged(base: str, adapter: str, opts: Dict,
                                                 tmp_path: Path, pristine) -> None:
    e = make_env(tmp_path, pristine)
    before = tree_hash(e.inputs)
    fuse(e.at(base), e.at(adapter), e.out, progress=False, **opts)
    assert tree_hash(e.inputs) == before
    assert_output_independent(e.out, e.inputs)
    # --force over the earlier output, through the API: inputs still untouched
    first = tree_hash(e.out)
    fuse(e.at(base), e.at(adapter), e.out, progress=False, force=True, **opts)
    assert tree_hash(e.inputs) == before
    assert tree_hash(e.out) == first, "the same fuse twice wrote different bytes"
    assert temporaries(e.out) == []


@pytest.mark.slow
def test_cli_force_leaves_inputs_unchanged(tmp_path: Path, pristine) -> None:
    e = make_env(tmp_path, pristine)
    before = tree_hash(e.inputs)
    args = ["fuse", "--model", e.base, "--adapter-path", e.adapter, "--save-path", e.out, "-q"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    first = tree_hash(e.out)
    r = run_cli(*args, "--force", "--rounding", "mlx-lm")
    assert r.returncode == 0, r.stderr
    assert tree_hash(e.inputs) == before
    assert tree_hash(e.out) != first  # it really was replaced (other rounding)
    assert temporaries(e.out) == []
    assert_output_independent(e.out, e.inputs)


def test_inputs_with_links_stay_unchanged(tmp_path: Path, pristine) -> None:
    """A base whose tokenizer file is a link inside the directory: the output gets a
    copy of the file, the link and its target stay as they were."""
    e = make_env(tmp_path, pristine)
    tok = e.base / "tokenizer.json"
    (e.base / "tokenizer.real.json").write_bytes(tok.read_bytes())
    tok.unlink()
    tok.symlink_to("tokenizer.real.json")
    before = tree_hash(e.inputs)
    fuse(e.base, e.adapter, e.out, progress=False)
    assert tree_hash(e.inputs) == before
    assert (e.out / "tokenizer.json").read_bytes() == (e.base / "tokenizer.real.json").read_bytes()
    assert_output_independent(e.out, e.inputs)
    assert os.readlink(tok) == "tokenizer.real.json"


def test_a_sidecar_linked_out_of_the_folder_is_named_not_copied(tmp_path: Path, pristine) -> None:
    """A base whose tokenizer.json is a link out of its folder: the fuse does not follow
    it (nothing outside is read into the output) and says so in its report, naming the
    file and where it points, instead of leaving the tokenizer out silently."""
    e = make_env(tmp_path, pristine)
    tok = e.base / "tokenizer.json"
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes(tok.read_bytes())
    tok.unlink()
    tok.symlink_to(outside)
    before = tree_hash(e.inputs)
    res = fuse(e.base, e.adapter, e.out, progress=False)
    assert tree_hash(e.inputs) == before and os.readlink(tok) == str(outside)
    assert not (e.out / "tokenizer.json").exists()
    assert res.not_copied == [f"tokenizer.json (a link to {outside.resolve()}, outside the model folder)"]
    assert res.to_dict()["not_copied"] == res.not_copied
    text = str(res)
    assert "not copied" in text and "tokenizer.json" in text and str(outside.resolve()) in text
    assert "never copies what a link out of the model folder points at" in text
    assert "not copied" in res._repr_html_()
    clean = fuse(e.base, e.adapter, tmp_path / "again", progress=False)
    assert clean.not_copied == res.not_copied  # the same base, the same account
    tok.unlink()
    tok.write_bytes(outside.read_bytes())
    assert fuse(e.base, e.adapter, tmp_path / "plain", progress=False).not_copied == []
