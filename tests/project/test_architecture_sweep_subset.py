"""The architecture sweep (benchmarks/architectures.py) on a fixed subset of mlx-lm's
model modules: a dense llama, qwen3, a MoE (mixtral), an SSM (mamba), a hybrid
attention + SSM (falcon_h1) and the gemma family (gemma2), each with its tiny config
from the committed sweep JSON. Every step runs as in the full sweep: LoRA bit-identical
to mlx_lm fuse, DoRA the same values (and its exact bytes with ``dtype="promote"``),
dtypes kept, check 0 wrong, the fused model's forward pass and KL fused vs unfused."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import missing_modules

# skipif, not importorskip: importing mlx-lm (transformers) while collecting cost every
# worker of the fast tier about a second for a test only the whole suite runs
pytestmark = pytest.mark.skipif(bool(missing_modules("mlx_lm")), reason="mlx-lm is not installed")

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "architectures.json"
SUBSET = ("llama", "qwen3", "mixtral", "mamba", "falcon_h1", "gemma2")
#: steps mlx-lm itself cannot do on these (its own error): mixtral's experts are
#: SwitchLinear, which mlx-lm's DoRA refuses
MLX_LM_OWN = {("mixtral", "dora"): "SwitchLinear doesn't support DoRA yet"}


def _sweep():
    spec = importlib.util.spec_from_file_location("architectures",
                                                  ROOT / "benchmarks" / "architectures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # six tiny models built, adapted, fused four ways, checked and run (~5 s each)
@pytest.mark.parametrize("module", SUBSET)
def test_architecture_sweep_row(module, tmp_path):
    import mlx.core as mx

    rows = {r["module"]: r for r in json.loads(RESULTS.read_text())["rows"]}
    sweep = _sweep()
    mx.set_default_device(mx.cpu)
    row = sweep.run_one(module, rows[module]["config"], tmp_path)
    st = row["steps"]
    for name, v in st.items():
        if not v["ok"]:
            want = MLX_LM_OWN.get((module, name))
            assert want and want in v["error"] and v["owner"] == "mlx-lm", (name, v)
    done = {n for n, v in st.items() if v["ok"]}
    assert {"build", "lora", "mlx_fuse", "bits_lora", "dtypes", "check", "forward",
            "kl"} <= done, st
    assert st["bits_lora"]["differ"] == 0 and st["bits_lora"]["dtype_differ"] == 0
    assert st["check"]["wrong"] == 0
    assert st["forward"]["finite"]
    if (module, "dora") not in MLX_LM_OWN:
        d = st["bits_dora"]
        assert d["values"]["differ"] == 0 and d["values"]["dtype_differ"] > 0
        assert d["promote_exact"]["differ"] == 0 and d["promote_exact"]["dtype_differ"] == 0
    assert st["kl"]["mean_kl"] < 1e-2
