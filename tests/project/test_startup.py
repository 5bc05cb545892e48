"""CLI start-up stays light: ``lorakit inspect`` of a checkpoint reads headers only and
loads no array library (the timing itself is in benchmarks/startup.py, not here).

Each case runs the real command in a fresh interpreter and lists the heavy modules
left in ``sys.modules``; the adapter case, which computes delta norms, must load
numpy, so the check is shown to catch an import when there is one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("numpy", "mlx", "matplotlib", "ipywidgets", "tqdm")

_PROBE = ("import json, sys; from lorakit.cli.main import main\n"
          "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
          "print(json.dumps([rc, [m for m in %r if m in sys.modules]]), file=sys.stderr)"
          % (HEAVY,))


def _heavy_after(*argv: str):
    p = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    rc, loaded = json.loads(p.stderr.strip().splitlines()[-1])
    return rc, loaded, p.stdout


@pytest.mark.slow
def test_inspect_of_headers_loads_no_array_library():
    ck = ROOT / "data" / "tiny-qwen3"
    shard = next(ck.glob("*.safetensors"))
    for argv in (["inspect", str(ck)], ["inspect", "--json", str(ck)],
                 ["inspect", str(shard)], ["inspect", str(ROOT / "data" / "tiny-qwen3-4bit")]):
        rc, loaded, out = _heavy_after(*argv)
        assert rc == 0, argv
        assert "model.layers.0.self_attn.q_proj.weight" in out  # it did read the headers
        assert loaded == [], (argv, loaded)


@pytest.mark.slow
def test_argument_errors_and_help_load_no_array_library():
    for argv in (["--help"], ["fuse", "--no-such-flag"], ["inspect"], ["fuse", "--help"]):
        rc, loaded, _ = _heavy_after(*argv)
        assert rc in (0, 2), argv
        assert loaded == [], (argv, loaded)


@pytest.mark.slow
def test_the_probe_sees_numpy_when_a_command_needs_it():
    """Delta norms of an adapter are arithmetic: numpy must show up in the probe."""
    rc, loaded, out = _heavy_after("inspect", str(ROOT / "data" / "adapters" / "lora"))
    assert rc == 0 and "numpy" in loaded
