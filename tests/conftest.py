"""Shared test setup and fixtures.

Layout: one folder per package of lorakit (``numerics/``, ``io/``, ``fusion/``,
``algebra/``, ``inspect/``, ``timing/``, ``synth/``, ``widgets/``, ``cli/``; ``base/`` for
the modules every package shares), ``project/`` for whole-repository checks,
``browser/`` for the real-browser JupyterLab suite; the README and claims tests stay
here. Each file is ``test_<module or idea>.py`` after what it tests. The folders have no
``__init__.py`` (pytest's default ``prepend`` import mode), so every test file's name is
unique across the suite.

Tests import their helpers (``model_factory``, ``helpers``) from this folder, which is
put on ``sys.path`` below; matplotlib draws off-screen (through ``MPLBACKEND``, so
nothing heavy is imported while collecting). Fixtures shared by several modules live here, built once per
session; tests must treat what they return as read-only and write elsewhere
(their own ``tmp_path``).

Fast tier: ``pytest -m "not slow"``; the whole suite: ``bash tools/test.sh``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# never pop up windows; notebooks and the browser suite drop this for their kernels
os.environ["MPLBACKEND"] = "Agg"
# one OpenBLAS thread (set before numpy loads; a value already set wins): the suite's
# BLAS calls are small, lorakit runs its own 2 workers on 2 cores, and OpenBLAS's
# spin-waiting threads on shared cores made the fast tier 2-3x slower under load
# (270 s against 112 s, the same tests passing); subprocesses and kernels inherit it
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# -- the small qwen3 base, its LoRA adapter and their fuses ---------------------------------
@pytest.fixture(scope="session")
def qwen3(tmp_path_factory) -> Dict[str, Path]:
    """A random 2-layer bf16 qwen3 (one file) and mlx-lm LoRA on q/v/down_proj."""
    import model_factory as mf

    root = tmp_path_factory.mktemp("qwen3")
    base = mf.make_model(root / "base", "qwen3")
    return {"base": base, "ad": mf.make_adapter(base, root / "ad")}


@pytest.fixture(scope="session")
def qwen3_q4(tmp_path_factory) -> Path:
    """The same qwen3 family, 4-bit affine quantized (group size 32)."""
    import model_factory as mf

    return mf.make_model(tmp_path_factory.mktemp("qwen3_q4") / "q4", "qwen3",
                         quantize=dict(group_size=32, bits=4))


@pytest.fixture(scope="session")
def qwen3_fused(qwen3, tmp_path_factory) -> Dict[str, Path]:
    """``qwen3``'s adapter fused three ways: nearest (the default), mlx-lm's rounding,
    and dtype promote (f32 projections)."""
    import lorakit

    root = tmp_path_factory.mktemp("qwen3_fused")
    out = {}
    for name, kw in (("nearest", {}), ("mlx-lm", dict(rounding="mlx-lm")),
                     ("promote", dict(dtype="promote"))):
        out[name] = lorakit.fuse(qwen3["base"], qwen3["ad"], root / name, progress=False,
                                 **kw).output
    return out


# -- the bad-input / input-unchanged world -----------------------------------------------------
@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Dict[str, Path]:
    """Valid inputs, built once; every case works on copies."""
    from helpers import make_peft, shard_model
    from model_factory import make_adapter, make_model

    root = tmp_path_factory.mktemp("pristine")
    base = make_model(root / "base", "qwen3")
    shard_model(base)
    base_q = make_model(root / "base_q", "qwen3", quantize={"group_size": 32, "bits": 4})
    return {
        "base": base,
        "base_q": base_q,
        "ad": make_adapter(base, root / "ad"),
        "ad_dora": make_adapter(base, root / "ad_dora", dora=True),
        "ad_q": make_adapter(base_q, root / "ad_q"),
        "ad_peft": make_peft(root / "ad", root / "ad_peft"),
    }
