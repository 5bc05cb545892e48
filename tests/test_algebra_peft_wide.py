"""``combine(..., like="peft")`` against the real PEFT 0.21.2 on the wide fixtures
(tests/fixtures/algebra_wide, made once by tests/fixtures/make_algebra_fixtures_wide.py;
no torch here): fp16/fp32/bf16 bases, three adapters, different ranks, rsLoRA,
rank/alpha patterns, different target modules, zero and negative weights, density 0.3,
majority_sign_method "frequency", svd_rank, svd_clamp, DoRA, and PEFT's refusals.

linear, cat, ties, magnitude_prune: bit for bit. svd: lorakit's SVD is not torch's
float32 LAPACK call; the tolerance below is measured (max ulps, share of elements).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import pytest

import lorakit
from lorakit.errors import LorakitError

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "algebra_wide"
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from make_algebra_fixtures_wide import cast_base, sha256  # noqa: E402
from make_peft_fixtures import read_safetensors  # noqa: E402  (numpy-only reader)

MANIFEST = json.loads((FIX / "manifest.json").read_text())
CASES = MANIFEST["cases"]
CODE = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
SVD_MAX_ULPS = 1          # measured: see BENCHMARKS.md, "Adapter algebra"
SVD_MAX_SHARE = 0.01


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> Dict[str, Path]:
    out = {"bf16": cast_base("bf16", Path())}
    for dt in ("fp16", "fp32"):
        out[dt] = cast_base(dt, tmp_path_factory.mktemp(dt))
    for dt, p in out.items():  # the very bases PEFT merged into
        assert sha256(p / "model.safetensors") == MANIFEST["bases"][dt]["sha256"], dt
    return out


def _combine(case: dict):
    kw = dict(case["kwargs"])
    return lorakit.combine([FIX / "adapters" / a for a in case["adapters"]], case["weights"],
                           method=case["combination_type"], like="peft",
                           base_dtype=CODE[case["base"]], density=kw.pop("density", None),
                           rank=kw.pop("svd_rank", None), **kw)


def compare(got_dir: Path, want_file: Path) -> Tuple[int, int, int]:
    """(elements differing, max distance in ulps, elements compared)."""
    got = read_safetensors(got_dir / "model.safetensors")
    want = read_safetensors(want_file)
    n = bad = ulps = 0
    for k, (tag, w) in want.items():
        g = got[k][1]
        assert got[k][0] == tag and g.shape == w.shape, k
        iv = {"BF16": np.int16, "F16": np.int16, "F32": np.int32}[tag]
        gi, wi = g.view(iv).astype(np.int64), w.view(iv).astype(np.int64)
        # sign-magnitude bit patterns to a monotone integer line
        gi = np.where(gi < 0, np.iinfo(iv).min - gi, gi)
        wi = np.where(wi < 0, np.iinfo(iv).min - wi, wi)
        n += w.size
        bad += int((gi != wi).sum())
        ulps = max(ulps, int(np.abs(gi - wi).max()))
    return bad, ulps, n


def run_case(name: str, bases: Dict[str, Path], out: Path) -> Tuple[int, int, int]:
    case = CASES[name]
    c = _combine(case)
    lorakit.fuse(bases[case["base"]], c.adapter, out, rounding="round-once", progress=False)
    return compare(out, FIX / case["merged"])


MERGED = [k for k, v in CASES.items() if "merged" in v and not k.startswith("dora")]
EXACT = [k for k in MERGED if CASES[k]["combination_type"] != "svd"]
SVD = [k for k in MERGED if CASES[k]["combination_type"] == "svd"]
REFUSED = [k for k, v in CASES.items() if "error" in v]


@pytest.mark.parametrize("name", EXACT)
def test_like_peft_bit_for_bit(tmp_path, bases, name):
    bad, ulps, n = run_case(name, bases, tmp_path / "f")
    assert n > 0 and bad == 0, (name, bad, ulps, n)


@pytest.mark.parametrize("name", SVD)
def test_like_peft_svd_within_tolerance(tmp_path, bases, name):
    bad, ulps, n = run_case(name, bases, tmp_path / "f")
    assert ulps <= SVD_MAX_ULPS and bad <= SVD_MAX_SHARE * n, (name, bad, ulps, n)


@pytest.mark.parametrize("name", REFUSED)
def test_pefts_refusals_are_lorakits(name):
    with pytest.raises(LorakitError):
        _combine(CASES[name])
