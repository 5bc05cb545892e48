"""Adapters are read as their own runtime runs them (issues 12 and 14).

* mlx-lm: LoRA only on the last ``num_layers`` blocks and the ``keys``, ranks as the
  config says; whatever mlx-lm's ``load_adapters`` refuses, lorakit refuses, listing
  every tensor (checked against mlx-lm itself on the same files).
* PEFT: ``target_modules`` (list / regex), ``layers_to_transform`` /
  ``layers_pattern``, ``exclude_modules``, ``rank_pattern`` / ``alpha_pattern``.
* non-numeric or disagreeing ranks, an ``--adapter-path`` naming another file,
  refused tensors never read into memory, and quantization configs checked against
  the packed tensors.
"""
from __future__ import annotations

import json
import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest
from model_factory import make_adapter, make_model
from safetensors.numpy import load_file, save_file

from lorakit.errors import AdapterError, FormatError
from lorakit.io.adapters.load import check_runtime_scope, load_adapter
from lorakit.io.adapters.peft import PeftSettings
from lorakit.io.formats.checkpoint import Checkpoint

REPO = Path(__file__).resolve().parents[2]
Q = "model.layers.{}.self_attn.q_proj"


@pytest.fixture(scope="module")
def base4(tmp_path_factory) -> Path:
    """A 4-block qwen3 (so 'the last 2 layers' leaves two blocks out)."""
    return make_model(tmp_path_factory.mktemp("base4") / "m", "qwen3", num_hidden_layers=4)


@pytest.fixture(scope="module")
def ad_last2(base4: Path, tmp_path_factory) -> Path:
    """mlx-lm LoRA on q_proj and v_proj of the last 2 of 4 blocks, rank 4."""
    return make_adapter(base4, tmp_path_factory.mktemp("ad") / "a", num_layers=2,
                        keys=("self_attn.q_proj", "self_attn.v_proj"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_cfg(ad: Path, **changes) -> None:
    p = ad / "adapter_config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if k.startswith("lp_"):
            cfg["lora_parameters"][k[3:]] = v
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def _add(ad: Path, tensors: Dict[str, np.ndarray], name: str = "adapters.safetensors") -> None:
    t = load_file(str(ad / name))
    t.update(tensors)
    save_file(t, str(ad / name))


def _lorakit_verdict(base: Path, ad: Path) -> Optional[str]:
    try:
        a = load_adapter(ad)
        check_runtime_scope(a, Checkpoint(base))
    except AdapterError as e:
        return str(e)
    return None


def _mlx_verdict(base: Path, ad: Path) -> Optional[str]:
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    model, _ = load_model(base)
    try:
        load_adapters(model, str(ad))
    except (ValueError, KeyError) as e:
        return str(e)
    return None


# -- 1. one module per format ------------------------------------------------------------------
def test_each_adapter_format_has_its_module() -> None:
    import lorakit.io.adapters.base as base
    import lorakit.io.adapters.load as ad
    import lorakit.io.adapters.mlx as mlx_fmt
    import lorakit.io.adapters.peft as peft_fmt

    assert callable(ad.load_adapter)
    for name in ("Adapter", "LoraTarget", "Replacement", "MLX_WEIGHTS", "PEFT_WEIGHTS", "CONFIG"):
        assert hasattr(base, name), name
    assert callable(mlx_fmt.load_mlx) and callable(peft_fmt.load_peft)


# -- 2. mlx-lm semantics, checked against mlx-lm -------------------------------------------------
def _variants(base4: Path, ad_last2: Path, root: Path) -> Dict[str, Path]:
    r = 4
    out = {"pristine": _copy(ad_last2, root / "pristine")}
    # tensors for block 0, outside the last 2 of 4
    a = out["outside"] = _copy(ad_last2, root / "outside")
    _add(a, {f"{Q.format(0)}.lora_a": np.zeros((64, r), np.float32),
             f"{Q.format(0)}.lora_b": np.zeros((r, 64), np.float32)})
    # a module that exists in the model but is not in keys
    a = out["not-in-keys"] = _copy(ad_last2, root / "not-in-keys")
    k = "model.layers.3.self_attn.k_proj"
    _add(a, {f"{k}.lora_a": np.zeros((64, r), np.float32),
             f"{k}.lora_b": np.zeros((r, 32), np.float32)})
    # config rank 8 over rank-4 tensors
    a = out["rank"] = _copy(ad_last2, root / "rank")
    _edit_cfg(a, lp_rank=8)
    # num_layers -1: every block; the block-0 tensors are then fine
    a = out["all-layers"] = _copy(out["outside"], root / "all-layers")
    _edit_cfg(a, num_layers=-1)
    # keys absent: every linear layer of the last 2 blocks (k_proj included)
    a = out["no-keys"] = _copy(out["not-in-keys"], root / "no-keys")
    cfg = json.loads((a / "adapter_config.json").read_text())
    del cfg["lora_parameters"]["keys"]
    (a / "adapter_config.json").write_text(json.dumps(cfg))
    # a whole path in keys adapts that module in any block
    a = out["full-path-key"] = _copy(out["outside"], root / "full-path-key")
    _edit_cfg(a, lp_keys=["self_attn.q_proj", "self_attn.v_proj", Q.format(0)])
    return out


def test_mlx_refusals_equal_mlx_lm(base4: Path, ad_last2: Path, tmp_path: Path) -> None:
    want = {"pristine": True, "outside": False, "not-in-keys": False, "rank": False,
            "all-layers": True, "no-keys": True, "full-path-key": True}
    for name, ad in _variants(base4, ad_last2, tmp_path).items():
        mine, theirs = _lorakit_verdict(base4, ad), _mlx_verdict(base4, ad)
        assert (mine is None) == (theirs is None) == want[name], (name, mine, theirs)


def test_mlx_out_of_scope_tensors_each_listed(base4: Path, ad_last2: Path,
                                              tmp_path: Path) -> None:
    ad = _variants(base4, ad_last2, tmp_path)["outside"]
    with pytest.raises(AdapterError) as info:
        load_adapter(ad)  # refused from the adapter alone: block 0 < 4 - 2 for any model
    msg = str(info.value)
    for leaf in ("lora_a", "lora_b"):
        assert f"{Q.format(0)}.{leaf}: not an adapter parameter in the model" in msg
    assert "not among the last 2 layers" in msg and "incompatible tensors" in msg


def test_mlx_keys_checked_against_the_model(base4: Path, ad_last2: Path, tmp_path: Path) -> None:
    ad = _variants(base4, ad_last2, tmp_path)["not-in-keys"]
    a = load_adapter(ad)  # the module may be absent from the model: bind says which
    with pytest.raises(AdapterError) as info:
        check_runtime_scope(a, Checkpoint(base4))
    msg = str(info.value)
    assert "model.layers.3.self_attn.k_proj.lora_a" in msg
    assert "model.layers.3.self_attn.k_proj.lora_b" in msg
    assert "'self_attn.k_proj' is not in lora_parameters.keys" in msg


def test_mlx_layer_scope_needs_the_model_size(base4: Path, tmp_path: Path) -> None:
    """Tensors on blocks 0 and 1 with num_layers=2 fit a 2-block model, not a 4-block one."""
    ad = make_adapter(base4, tmp_path / "a", num_layers=4, keys=("self_attn.q_proj",))
    t = {k: v for k, v in load_file(str(ad / "adapters.safetensors")).items()
         if ".layers.0." in k or ".layers.1." in k}
    save_file(t, str(ad / "adapters.safetensors"))
    _edit_cfg(ad, num_layers=2)
    a = load_adapter(ad)
    with pytest.raises(AdapterError, match="layer 0 is not among the last 2 layers"):
        check_runtime_scope(a, Checkpoint(base4))
    assert _mlx_verdict(base4, ad) is not None


def test_data_adapters_still_load_and_fit() -> None:
    for ad in sorted((REPO / "data" / "adapters").iterdir()):
        a = load_adapter(ad)
        model = a.config.get("model") or "data/tiny-qwen3"
        check_runtime_scope(a, Checkpoint(REPO / model))
        assert len(a.targets) > 0


# -- 3. PEFT semantics -------------------------------------------------------------------------
@pytest.mark.parametrize("settings, key, adapted", [
    (dict(target_modules=["q_proj"]), "model.layers.0.self_attn.q_proj", True),
    (dict(target_modules=["q_proj"]), "model.layers.0.self_attn.qq_proj", False),
    (dict(target_modules=["self_attn.q_proj"]), "model.layers.0.self_attn.q_proj", True),
    (dict(target_modules=r".*\.(q|v)_proj"), "model.layers.0.self_attn.v_proj", True),
    (dict(target_modules=r"(q|v)_proj"), "model.layers.0.self_attn.v_proj", False),  # full match
    (dict(target_modules=["q_proj"], layers_to_transform=[1]),
     "model.layers.0.self_attn.q_proj", False),
    (dict(target_modules=["q_proj"], layers_to_transform=[1]),
     "model.layers.1.self_attn.q_proj", True),
    # a full name in target_modules skips the layer filter, as in PEFT
    (dict(target_modules=["model.layers.0.self_attn.q_proj"], layers_to_transform=[1]),
     "model.layers.0.self_attn.q_proj", True),
    (dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern=["blocks"]),
     "model.layers.0.self_attn.q_proj", False),
    (dict(target_modules=["q_proj"], layers_to_transform=[2], layers_pattern=["layers"]),
     "model.layers.2.experts.0.q_proj", True),
    (dict(target_modules=["q_proj"], exclude_modules=["layers.0.self_attn.q_proj"]),
     "model.layers.0.self_attn.q_proj", False),
    (dict(target_modules=["q_proj"], exclude_modules=r".*layers\.1\..*"),
     "model.layers.1.self_attn.q_proj", False),
    (dict(target_modules=["lm_head"], modules_to_save=["lm_head"]), "lm_head", False),
])
def test_peft_matching(settings, key: str, adapted: bool) -> None:
    assert (PeftSettings(4, 8, **settings).refusal(key) is None) is adapted


def test_peft_rank_and_alpha_patterns() -> None:
    s = PeftSettings(8, 16, rank_pattern={"down_proj": 4, "model.layers.2.self_attn.q_proj": 2},
                     alpha_pattern={"o_proj": 32})
    assert s.rank_alpha("model.layers.0.mlp.down_proj") == (4, 16)
    assert s.rank_alpha("model.layers.2.self_attn.q_proj") == (2, 16)
    assert s.rank_alpha("model.layers.12.self_attn.q_proj") == (8, 16)
    assert s.rank_alpha("model.layers.0.self_attn.o_proj") == (8, 32)


@pytest.fixture
def peft_ad(ad_last2: Path, tmp_path: Path) -> Path:
    """The mlx-lm adapter saved as PEFT saves it."""
    t = load_file(str(ad_last2 / "adapters.safetensors"))
    out = {}
    for name, v in t.items():
        module, leaf = name.rsplit(".", 1)
        out[f"base_model.model.{module}.{'lora_A' if leaf == 'lora_a' else 'lora_B'}.weight"] = \
            np.ascontiguousarray(v.T)
    p = tmp_path / "peft"
    p.mkdir()
    save_file(out, str(p / "adapter_model.safetensors"))
    (p / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    return p


def test_peft_tensors_for_modules_peft_would_not_adapt(peft_ad: Path) -> None:
    assert len(load_adapter(peft_ad).targets) == 4
    _edit_cfg(peft_ad, target_modules=["q_proj"])
    with pytest.raises(AdapterError) as info:
        load_adapter(peft_ad)
    msg = str(info.value)
    for layer in (2, 3):
        for f in ("A", "B"):
            assert (f"base_model.model.model.layers.{layer}.self_attn.v_proj.lora_{f}.weight: "
                    f"PEFT puts no LoRA layer") in msg
    _edit_cfg(peft_ad, target_modules=["q_proj", "v_proj"], layers_to_transform=[3])
    with pytest.raises(AdapterError, match="layer 2 is not in layers_to_transform"):
        load_adapter(peft_ad)
    _edit_cfg(peft_ad, layers_to_transform=None, exclude_modules=["v_proj"])
    with pytest.raises(AdapterError, match="excluded by exclude_modules"):
        load_adapter(peft_ad)


def test_peft_target_modules_matching_no_module_of_the_model(peft_ad: Path, base4: Path) -> None:
    cfg = json.loads((peft_ad / "adapter_config.json").read_text())
    cfg.update(modules_to_save=["norm"], target_modules=["qkv"])
    (peft_ad / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({"base_model.model.model.norm.weight": np.ones(64, np.float32)},
              str(peft_ad / "adapter_model.safetensors"))
    a = load_adapter(peft_ad)
    with pytest.raises(AdapterError, match="target_modules match no module of the model"):
        check_runtime_scope(a, Checkpoint(base4))
    _edit_cfg(peft_ad, target_modules=["q_proj"])
    check_runtime_scope(load_adapter(peft_ad), Checkpoint(base4))


# -- 4. config numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, says", [
    ("lp_rank", 8, "rank 4 in the tensors but 8 in adapter_config.json"),
    ("lp_rank", "4", "lora_parameters.rank missing or not a positive integer"),
    ("lp_rank", 4.0, "lora_parameters.rank missing or not a positive integer"),
    ("lp_scale", "2.0", "lora_parameters.scale missing or not a number"),
    ("num_layers", "2", "num_layers missing or not an integer"),
    ("lp_keys", "self_attn.q_proj", "lora_parameters.keys must be a list"),
    ("lp_dropout", 1.5, "lora_parameters.dropout is not a probability"),
])
def test_mlx_config_numbers(ad_last2: Path, tmp_path: Path, key: str, value, says: str) -> None:
    ad = _copy(ad_last2, tmp_path / "a")
    _edit_cfg(ad, **{key: value})
    with pytest.raises(AdapterError) as info:
        load_adapter(ad)
    assert says in str(info.value)
    assert info.value.expected and info.value.found


@pytest.mark.parametrize("key, value, says", [
    ("r", 8, "rank 4 in the tensors but 8 in adapter_config.json"),
    ("r", 4.5, "r must be a whole number"),
    ("r", "4", "needs a positive r"),
    ("lora_alpha", "eight", "needs a positive lora_alpha"),
    ("rank_pattern", {"q_proj": 2.5}, "rank_pattern values must be whole numbers"),
    ("target_modules", "(unclosed", "target_modules holds an invalid regular expression"),
])
def test_peft_config_numbers(peft_ad: Path, key: str, value, says: str) -> None:
    _edit_cfg(peft_ad, **{key: value})
    with pytest.raises(AdapterError) as info:
        load_adapter(peft_ad)
    assert says in str(info.value) and info.value.expected and info.value.found


# -- 5. --adapter-path naming a file -------------------------------------------------------------
def test_adapter_path_naming_another_file_is_refused(ad_last2: Path, tmp_path: Path) -> None:
    ad = _copy(ad_last2, tmp_path / "a")
    assert len(load_adapter(ad / "adapters.safetensors").targets) == 4  # the file it reads
    ckpt = ad / "0000100_adapters.safetensors"
    t = load_file(str(ad / "adapters.safetensors"))
    save_file({k: v * 3 for k, v in t.items()}, str(ckpt))
    with pytest.raises(AdapterError) as info:
        load_adapter(ckpt)
    assert "names a file lorakit does not read" in str(info.value)
    assert "0000100_adapters.safetensors" in str(info.value)


def test_adapter_path_naming_the_unread_format_file(peft_ad: Path) -> None:
    shutil.copy(peft_ad / "adapter_model.safetensors", peft_ad / "adapters.safetensors")
    cfg = json.loads((peft_ad / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    assert load_adapter(peft_ad / "adapter_model.safetensors").format == "peft"
    with pytest.raises(AdapterError, match="names a file lorakit does not read"):
        load_adapter(peft_ad / "adapters.safetensors")


# -- 6. refused tensors are never read -----------------------------------------------------------
def _append_sparse_tensor(file: Path, name: str, shape: List[int]) -> None:
    """Declare a huge F32 tensor at the end of ``file`` without writing its bytes
    (the file gets a hole: nothing is stored, but reading it would allocate it all)."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    nbytes = int(np.prod(shape)) * 4
    header[name] = {"dtype": "F32", "shape": shape,
                    "data_offsets": [len(data), len(data) + nbytes]}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)
        f.truncate(8 + len(blob) + len(data) + nbytes)


@pytest.mark.parametrize("name", ["model.layers.3.self_attn.q_proj.junk",
                                  f"{Q.format(0)}.lora_a"])
def test_a_refused_1gib_tensor_is_not_read(ad_last2: Path, tmp_path: Path, name: str) -> None:
    ad = _copy(ad_last2, tmp_path / "a")
    _append_sparse_tensor(ad / "adapters.safetensors", name, [1 << 18, 1 << 10])  # 1 GiB
    tracemalloc.start()
    try:
        with pytest.raises(AdapterError) as info:
            load_adapter(ad)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert name in str(info.value)
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB"


# -- 7. quantization config against the packed tensors -------------------------------------------
@pytest.fixture(scope="module")
def base_q(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("bq") / "m", "qwen3",
                      quantize={"group_size": 32, "bits": 4})


def _q_copy(base_q: Path, tmp_path: Path, edit) -> Checkpoint:
    p = _copy(base_q, tmp_path / "q")
    cfg = json.loads((p / "config.json").read_text())
    edit(cfg)
    (p / "config.json").write_text(json.dumps(cfg))
    return Checkpoint(p)


def test_quant_config_bits_disagree_with_codes(base_q: Path, tmp_path: Path) -> None:
    assert Checkpoint(base_q).quant_params(Q.format(0)).bits == 4
    ck = _q_copy(base_q, tmp_path, lambda c: c["quantization"].update(bits=3))
    with pytest.raises(FormatError) as info:
        ck.quant_params(Q.format(0))
    e = info.value
    assert "quantization config disagrees with the packed weight" in str(e)
    assert e.tensor == f"{Q.format(0)}.weight"
    assert "bits=3" in e.expected and "4-bit codes" in e.found


def test_quant_per_module_override(base_q: Path, tmp_path: Path) -> None:
    good = _q_copy(base_q, tmp_path / "g", lambda c: c["quantization"].update(
        {Q.format(0): {"group_size": 32, "bits": 4}}))
    assert good.quant_params(Q.format(0)).bits == 4
    bad = _q_copy(base_q, tmp_path / "b", lambda c: c["quantization"].update(
        {Q.format(0): {"group_size": 64, "bits": 4}}))
    with pytest.raises(FormatError, match="disagrees with the packed weight"):
        bad.quant_params(Q.format(0))
    assert bad.quant_params(Q.format(1)).group_size == 32  # others keep the top level
    off = _q_copy(base_q, tmp_path / "o", lambda c: c["quantization"].update({Q.format(0): False}))
    with pytest.raises(FormatError, match="not quantized"):
        off.quant_params(Q.format(0))


def test_quant_mode_disagrees_with_scales(base_q: Path, tmp_path: Path) -> None:
    ck = _q_copy(base_q, tmp_path, lambda c: c["quantization"].update(mode="mxfp4"))
    with pytest.raises(FormatError) as info:
        ck.quant_params(Q.format(0))
    assert "mxfp4 mode: uint8 scales and no biases" in info.value.expected


def test_peft_two_adapters_in_one_file_refused(peft_ad: Path) -> None:
    name = "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"
    t = load_file(str(peft_ad / "adapter_model.safetensors"))
    t[name.replace("lora_A.weight", "lora_A.other.weight")] = t[name] * 2
    save_file(t, str(peft_ad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="a second tensor for the same factor"):
        load_adapter(peft_ad)


# -- 5. the fuse obeys the same scope, and the fused model runs like the unfused one -----------
def _logits(model, tokens) -> np.ndarray:
    import mlx.core as mx

    out = model(mx.array([tokens]))
    mx.eval(out)
    return np.array(out.astype(mx.float32))[0]


@pytest.mark.slow  # loads mlx-lm models for each semantics case
def test_fused_runs_like_unfused_for_each_semantics_case(base4: Path, ad_last2: Path,
                                                         tmp_path: Path) -> None:
    """For every case of section 2: where mlx-lm refuses the adapter unfused, the fuse
    refuses it too (through bind, writing nothing); where mlx-lm runs it, the fused
    checkpoint gives mlx-lm's unfused logits on the same tokens. The tensors the cases
    add are made nonzero, so a fuse that dropped (or added) a module would show."""
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    import lorakit

    rng = np.random.default_rng(7)
    tokens = [1, 5, 9, 14, 3, 7, 2, 11]
    base_logits = _logits(load_model(base4)[0], tokens)
    checked = 0
    for name, ad in _variants(base4, ad_last2, tmp_path / "v").items():
        t = load_file(str(ad / "adapters.safetensors"))
        t = {k: (rng.normal(0, 0.05, v.shape).astype(np.float32) if not v.any() else v)
             * (40 if k.endswith("lora_b") else 1) for k, v in t.items()}
        save_file(t, str(ad / "adapters.safetensors"))
        out = tmp_path / "fused" / name / "out"
        if _mlx_verdict(base4, ad) is not None:
            with pytest.raises(AdapterError):
                lorakit.fuse(base4, ad, out, progress=False)
            assert not out.exists() and not out.parent.exists(), name
            continue
        lorakit.fuse(base4, ad, out, progress=False)
        unfused, _ = load_model(base4)
        load_adapters(unfused, str(ad))
        want, got = _logits(unfused, tokens), _logits(load_model(out)[0], tokens)
        moved = float(np.abs(want - base_logits).max())
        assert moved > 1e-3, (name, "the adapter changes nothing: the test could not fail")
        assert float(np.abs(got - want).max()) < 0.1 * moved, name
        assert (got.argmax(-1) == want.argmax(-1)).all(), name
        checked += 1
    assert checked == 4
