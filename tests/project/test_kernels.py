"""The one switch of lorakit's C kernels (lorakit/kernels.py): ``LORAKIT_KERNELS=0`` and
``use_kernels`` turn every kernel off; CI (``LORAKIT_REQUIRE_KERNEL=1``, set by .ci/run)
has each of them built."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorakit import kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", kernels.KERNELS)
def test_every_kernel_is_built_where_required(name) -> None:
    """A silent fallback in CI would hide a packaging break; elsewhere the numpy twins are
    a supported configuration."""
    if os.environ.get("LORAKIT_REQUIRE_KERNEL") == "1":
        assert kernels.load(name) is not None, f"{name} is not built"


def test_use_kernels_turns_every_kernel_off_and_back() -> None:
    before = [kernels.load(n) for n in kernels.KERNELS]
    with kernels.use_kernels(False):
        assert not kernels.enabled()
        assert [kernels.load(n) for n in kernels.KERNELS] == [None] * len(kernels.KERNELS)
    assert [kernels.load(n) for n in kernels.KERNELS] == before


def test_the_environment_variable_turns_them_off() -> None:
    code = ("from lorakit import kernels; "
            "print(kernels.enabled(), [kernels.load(n) for n in kernels.KERNELS])")
    env = dict(os.environ, PYTHONPATH=str(ROOT), LORAKIT_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[0] == "False" and "None" in out[1]
