"""`check` on a checkpoint fused with an exact combination of adapters (one scale per
rank column): passes the correct fuse, flags a fuse with other weights."""
from __future__ import annotations

from pathlib import Path

import lorakit

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "data" / "tiny-qwen3"
ADAPTERS = [ROOT / "data" / "adapters" / "lora", ROOT / "data" / "adapters" / "lora-embed"]


def test_check_of_an_exact_combination(tmp_path: Path) -> None:
    combo = lorakit.combine(ADAPTERS, [0.7, -0.3]).adapter
    assert any(getattr(t.scale, "ndim", 0) for t in combo.targets)  # per-column scales
    lorakit.fuse(BASE, combo, tmp_path / "ok", progress=False)
    assert lorakit.check(tmp_path / "ok", BASE, combo, progress=False).status == "ok"

    other = lorakit.combine(ADAPTERS, [0.7, -0.35]).adapter
    lorakit.fuse(BASE, other, tmp_path / "other", progress=False)
    r = lorakit.check(tmp_path / "other", BASE, combo, progress=False)
    assert r.status == "wrong" and r.exit_code() == 1
    assert len(r.causes()) == len(combo.targets)  # every adapted tensor is named
