"""Bad inputs: every broken checkpoint, index, adapter, config or output path ends in
one lorakit error that names the file (and tensor), what was expected and what was
found; the CLI exits 2 with one line of error and no traceback; nothing appears at
the output path; and no input file changes by a single byte.

Each case starts from copies of small, valid inputs (a 2-shard qwen3 checkpoint, a
quantized one, mlx-lm LoRA and DoRA adapters, a PEFT adapter), breaks one thing, and
runs the fuse through the Python API and through ``python -m lorakit fuse``.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Type

import numpy as np
import pytest
from helpers import INDEX, S1, S2, Env, make_env, run_cli, temporaries, tree_hash
from safetensors.numpy import load_file, save_file

from lorakit.errors import (
    AdapterError,
    FormatError,
    FuseError,
    LorakitError,
    OutputExistsError,
    UnsafePathError,
)
from lorakit.fusion.fuse import fuse

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"  # adapted, in S2


# -- small tools for breaking files ----------------------------------------------------------
def split_st(path: Path) -> Tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def edit_header(path: Path, fn: Callable[[dict], Optional[str]]) -> Optional[str]:
    header, data = split_st(path)
    ret = fn(header)
    write_st(path, header, data)
    return ret


def by_offset(header: dict) -> List[str]:
    return sorted((k for k in header if k != "__metadata__"),
                  key=lambda k: header[k]["data_offsets"][0])


def edit_json(path: Path, fn: Callable[[dict], None]) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def edit_tensors(path: Path, fn: Callable[[Dict[str, np.ndarray]], None]) -> None:
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


def mlx_weights(e: Env, name: str = "ad") -> Path:
    return e.at(name) / "adapters.safetensors"


def peft(e: Env) -> Path:
    e.adapter = e.at("ad_peft")
    return e.adapter


# -- the cases -----------------------------------------------------------------------------------
@dataclass
class Case:
    """One broken input. ``mutate`` breaks the copies in ``env`` and returns facts
    (e.g. the tensor it broke) used to fill ``says`` / ``tensor`` templates."""

    id: str
    mutate: Callable[[Env], Optional[Dict[str, str]]]
    error: Type[LorakitError]
    file: str  # must appear in the error's file
    says: Tuple[str, ...]  # must all appear in the message (expected and found values)
    tensor: Optional[str] = None  # must appear in the message


CASES: List[Case] = []


def case(id: str, error: Type[LorakitError], file: str, *says: str,
         tensor: Optional[str] = None):
    def deco(fn):
        CASES.append(Case(id, fn, error, file, says, tensor))
        return fn
    return deco


# safetensors files -------------------------------------------------------------------------
@case("truncated-shard", FormatError, S2, "truncated", "expected: end <=", tensor="{tensor}")
def _(e):
    p = e.base / S2
    header, data = split_st(p)
    last = by_offset(header)[-1]
    p.write_bytes(p.read_bytes()[:-100])
    return {"tensor": last}


@case("shard-shorter-than-8-bytes", FormatError, S2, "8-byte", ">= 8 bytes", "found: 3 bytes")
def _(e):
    (e.base / S2).write_bytes(b"\x01\x02\x03")


@case("empty-shard", FormatError, S2, "8-byte", "found: 0 bytes")
def _(e):
    (e.base / S2).write_bytes(b"")


@case("header-length-past-eof", FormatError, S2, "header length is larger than the file",
      "found: {n} bytes")
def _(e):
    p = e.base / S2
    raw = p.read_bytes()
    n = len(raw)
    p.write_bytes(struct.pack("<Q", n) + raw[8:])
    return {"n": str(n)}


@case("header-length-2**60", FormatError, S2, "header length is larger than the file",
      f"found: {2 ** 60} bytes")
def _(e):
    p = e.base / S2
    p.write_bytes(struct.pack("<Q", 2 ** 60) + p.read_bytes()[8:])


@case("header-not-json", FormatError, S2, "header is not JSON", "JSONDecodeError")
def _(e):
    p = e.base / S2
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    p.write_bytes(raw[:8] + b"{this is not json" + b" " * (n - 17) + raw[8 + n:])


@case("header-not-utf8", FormatError, S2, "header is not JSON", "UnicodeDecodeError")
def _(e):
    p = e.base / S2
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    p.write_bytes(raw[:8] + b"\xff\xfe" * (n // 2) + b" " * (n % 2) + raw[8 + n:])


@case("header-json-not-object", FormatError, S2, "not a JSON object", "expected: a JSON object",
      "found: list")
def _(e):
    p = e.base / S2
    _, data = split_st(p)
    blob = b"[1, 2, 3]"
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@case("overlapping-offsets", FormatError, S2, "tensors overlap", "begin >=", tensor="{tensor}")
def _(e):
    def fn(h):
        names = by_offset(h)
        a, b = names[0], names[1]
        n = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        start = h[a]["data_offsets"][0] + 2
        h[b]["data_offsets"] = [start, start + n]
        return b
    return {"tensor": edit_header(e.base / S2, fn)}


@case("offsets-past-data", FormatError, S2, "runs past the end of the file", "found: end =",
      tensor="{tensor}")
def _(e):
    def fn(h):
        name = by_offset(h)[0]
        b0, b1 = h[name]["data_offsets"]
        end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
        h[name]["data_offsets"] = [end + 64, end + 64 + (b1 - b0)]
        return name
    return {"tensor": edit_header(e.base / S2, fn)}


@case("offsets-reversed", FormatError, S2, "data_offsets must be", "found: [100, 2]",
      tensor=Q_PROJ)
def _(e):
    edit_header(e.base / S2, lambda h: h[Q_PROJ].update(data_offsets=[100, 2]))


@case("unknown-dtype", FormatError, S2, "unknown dtype", "expected: one of", "found: 'F12'",
      tensor=Q_PROJ)
def _(e):
    edit_header(e.base / S2, lambda h: h[Q_PROJ].update(dtype="F12"))


@case("dtype-not-a-string", FormatError, S2, "unknown dtype", "found: ['BF16']", tensor=Q_PROJ)
def _(e):
    edit_header(e.base / S2, lambda h: h[Q_PROJ].update(dtype=["BF16"]))


@case("shape-disagrees-with-bytes", FormatError, S2, "byte length disagrees",
      "expected: 30 bytes for BF16[3, 5]", "found: 8192 bytes", tensor=Q_PROJ)
def _(e):
    edit_header(e.base / S2, lambda h: h[Q_PROJ].update(shape=[3, 5]))


@case("negative-shape", FormatError, S2, "shape must be", "found: [-1, 64]", tensor=Q_PROJ)
def _(e):
    edit_header(e.base / S2, lambda h: h[Q_PROJ].update(shape=[-1, 64]))


@case("entry-not-object", FormatError, S2, "tensor entry is not an object", "found: 5",
      tensor="model.extra")
def _(e):
    edit_header(e.base / S2, lambda h: h.update({"model.extra": 5}))


@case("metadata-not-strings", FormatError, S2, "__metadata__ must map strings to strings",
      "found: {'format': 1}")
def _(e):
    edit_header(e.base / S2, lambda h: h.update({"__metadata__": {"format": 1}}))


@case("duplicate-name-in-header", FormatError, S2, "appears twice", "found: duplicate",
      tensor=Q_PROJ)
def _(e):
    p = e.base / S2
    header, data = split_st(p)
    entry = json.dumps(header[Q_PROJ])
    blob = json.dumps(header)[:-1] + f', "{Q_PROJ}": {entry}}}'
    p.write_bytes(struct.pack("<Q", len(blob)) + blob.encode() + data)


@case("tensor-in-two-shards", FormatError, S2, "tensor appears in two shards",
      f"found: also in {S1}", tensor="model.embed_tokens.weight")
def _(e):
    edit_header(e.base / S2, lambda h: h.update({"model.embed_tokens.weight": h.pop(Q_PROJ)}))


@case("shard-is-a-fifo", FormatError, S2, "not a regular file", "found: a FIFO")
def _(e):
    (e.base / S2).unlink()
    os.mkfifo(e.base / S2)
    # no index: the shard list comes from the directory itself
    (e.base / INDEX).unlink()


# indexes --------------------------------------------------------------------------------------
def set_shard(e: Env, tensor: str, shard: object) -> None:
    edit_json(e.base / INDEX, lambda idx: idx["weight_map"].__setitem__(tensor, shard))


@case("index-names-missing-shard", FormatError, "model-00003-of-00003.safetensors",
      "shard named in the index is missing", "found: no such file", tensor=Q_PROJ)
def _(e):
    set_shard(e, Q_PROJ, "model-00003-of-00003.safetensors")


@case("index-dotdot", UnsafePathError, INDEX, "unsafe shard name",
      "found: '../outside.safetensors'", tensor=Q_PROJ)
def _(e):
    set_shard(e, Q_PROJ, "../outside.safetensors")


@case("index-absolute-path", UnsafePathError, INDEX, "unsafe shard name",
      "found: '/etc/passwd'", tensor=Q_PROJ)
def _(e):
    set_shard(e, Q_PROJ, "/etc/passwd")


@case("index-subdirectory", UnsafePathError, INDEX, "unsafe shard name",
      "found: 'sub/x.safetensors'", tensor=Q_PROJ)
def _(e):
    (e.base / "sub").mkdir()
    shutil.copy(e.base / S2, e.base / "sub" / "x.safetensors")
    set_shard(e, Q_PROJ, "sub/x.safetensors")


@case("index-symlink-out", UnsafePathError, "evil.safetensors", "link out of the directory",
      "found: link to {target}")
def _(e):
    outside = e.root / "elsewhere"
    outside.mkdir()
    shutil.copy(e.base / S2, outside / "evil.safetensors")
    (e.base / "evil.safetensors").symlink_to(outside / "evil.safetensors")
    edit_json(e.base / INDEX, lambda idx: idx["weight_map"].update(
        {k: "evil.safetensors" for k, v in idx["weight_map"].items() if v == S2}))
    (e.base / S2).unlink()
    return {"target": str((outside / "evil.safetensors").resolve())}


@case("index-shard-not-a-string", UnsafePathError, INDEX, "unsafe shard name", "found: [1, 2]",
      tensor=Q_PROJ)
def _(e):
    set_shard(e, Q_PROJ, [1, 2])


@case("index-wrong-shard", FormatError, INDEX, "index names a tensor its shard does not hold",
      f"expected: tensor in {S1}", f"found: in {S2}", tensor=Q_PROJ)
def _(e):
    set_shard(e, Q_PROJ, S1)


@case("index-names-absent-tensor", FormatError, INDEX, "does not hold", "found: absent",
      tensor="model.layers.9.mlp.up_proj.weight")
def _(e):
    set_shard(e, "model.layers.9.mlp.up_proj.weight", S2)


@case("index-not-json", FormatError, INDEX, "index is not valid JSON", "JSONDecodeError")
def _(e):
    (e.base / INDEX).write_text('{"weight_map": {')


@case("index-without-weight-map", FormatError, INDEX, "no weight_map", "found: list")
def _(e):
    (e.base / INDEX).write_text('{"weight_map": []}')


# configs --------------------------------------------------------------------------------------
@case("config-missing", FormatError, "config.json", "config.json is missing",
      "found: no such file")
def _(e):
    (e.base / "config.json").unlink()


@case("config-malformed", FormatError, "config.json", "not valid JSON", "JSONDecodeError")
def _(e):
    (e.base / "config.json").write_text('{"model_type": "qwen3",')


@case("config-not-object", FormatError, "config.json", "not a JSON object", "found: list")
def _(e):
    (e.base / "config.json").write_text("[]")


@case("config-huge-integer", FormatError, "config.json", "not valid JSON", "4300 digits")
def _(e):
    (e.base / "config.json").write_text('{"vocab_size": ' + "9" * 5000 + "}")


@case("config-symlink-out", UnsafePathError, "config.json", "link out of the directory",
      "found: link to")
def _(e):
    real = e.root / "elsewhere.json"
    shutil.copy(e.base / "config.json", real)
    (e.base / "config.json").unlink()
    (e.base / "config.json").symlink_to(real)


@case("no-weights", FormatError, "base", "no safetensors weights",
      "expected: model.safetensors or model.safetensors.index.json")
def _(e):
    for n in (S1, S2, INDEX):
        (e.base / n).unlink()


@case("model-path-missing", FormatError, "no-such-model", "model path does not exist",
      "found: no such file or directory")
def _(e):
    e.base = e.root / "no-such-model"


# quantized bases ---------------------------------------------------------------------------
@case("quant-unsupported-mode", FuseError, "config.json", "unsupported quantization mode",
      "found: 'nf4'", tensor="_proj.weight")
def _(e):
    e.base, e.adapter = e.at("base_q"), e.at("ad_q")
    edit_json(e.base / "config.json", lambda c: c["quantization"].update(mode="nf4"))


@case("quant-params-unreadable", FormatError, "model.safetensors",
      "cannot tell how a quantized weight was packed", "found:", tensor="_proj.weight")
def _(e):
    e.base, e.adapter = e.at("base_q"), e.at("ad_q")
    edit_json(e.base / "config.json", lambda c: c["quantization"].update(group_size=0))


# adapters: tensors ----------------------------------------------------------------------------
@case("adapter-for-another-model", AdapterError, "adapters.safetensors",
      "adapter does not fit the checkpoint", "6 of 6 targets",
      "weight of shape [64, 128] but the checkpoint's is [64, 64]",
      tensor="model.layers.0.self_attn.q_proj.lora_a")
def _(e):
    def fn(t):
        for k in list(t):
            if k.endswith("lora_a"):
                t[k] = np.concatenate([t[k], t[k]], axis=0)
    edit_tensors(mlx_weights(e), fn)


@case("adapter-keys-match-nothing", AdapterError, "adapters.safetensors",
      "adapter does not fit the checkpoint",
      "no tensor model.layers.0.self_attn.qq_proj.weight in the checkpoint",
      tensor="model.layers.0.self_attn.qq_proj.lora_a")
def _(e):
    def fn(t):
        for k in list(t):
            t[k.replace("q_proj", "qq_proj")] = t.pop(k)
    edit_tensors(mlx_weights(e), fn)


@case("rank-mismatch-a-b", AdapterError, "adapters.safetensors", "rank mismatch",
      "found lora_a [64, 4], lora_b [3, 64]", tensor="model.layers.0.self_attn.q_proj")
def _(e):
    edit_tensors(mlx_weights(e), lambda t: t.update({
        "model.layers.0.self_attn.q_proj.lora_b": t["model.layers.0.self_attn.q_proj.lora_b"][:3]}))


@case("adapter-same-module-twice", AdapterError, "adapters.safetensors",
      "the same module spelled twice", "both reach model.layers.0.self_attn.q_proj.weight")
def _(e):
    """``model.layers.0...`` and ``layers.0...`` in one adapter land on one weight."""
    def fn(t):
        for leaf in ("lora_a", "lora_b"):
            t[f"layers.0.self_attn.q_proj.{leaf}"] = t[f"model.layers.0.self_attn.q_proj.{leaf}"]
    edit_tensors(mlx_weights(e), fn)


@case("adapter-nan", AdapterError, "adapters.safetensors", "NaN or Inf",
      "expected: finite values", "found: 1 non-finite of 256",
      tensor="model.layers.0.self_attn.q_proj.lora_b")
def _(e):
    def fn(t):
        t["model.layers.0.self_attn.q_proj.lora_b"][0, 0] = np.nan
    edit_tensors(mlx_weights(e), fn)


@case("adapter-inf", AdapterError, "adapters.safetensors", "NaN or Inf",
      "found: 384 non-finite of 384", tensor="model.layers.1.mlp.down_proj.lora_a")
def _(e):
    def fn(t):
        t["model.layers.1.mlp.down_proj.lora_a"] = np.full((96, 4), -np.inf, np.float32)
    edit_tensors(mlx_weights(e), fn)


@case("adapter-int-dtype", AdapterError, "adapters.safetensors", "not floating point",
      "expected: F32, F16 or BF16", "found: I32", tensor="model.layers.0.self_attn.q_proj.lora_a")
def _(e):
    def fn(t):
        t["model.layers.0.self_attn.q_proj.lora_a"] = np.ones((64, 4), np.int32)
    edit_tensors(mlx_weights(e), fn)


@case("adapter-empty-file", FormatError, "adapters.safetensors", "8-byte", "found: 0 bytes")
def _(e):
    mlx_weights(e).write_bytes(b"")


@case("adapter-truncated", FormatError, "adapters.safetensors", "truncated", "found: end =")
def _(e):
    p = mlx_weights(e)
    p.write_bytes(p.read_bytes()[:-10])


@case("adapter-non-lora-tensor", AdapterError, "adapters.safetensors", "not a LoRA tensor",
      "expected <module>.lora_a/.lora_b/.m", tensor="model.layers.0.self_attn.q_proj.weight")
def _(e):
    edit_tensors(mlx_weights(e), lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32)}))


@case("adapter-missing-lora-b", AdapterError, "adapters.safetensors",
      "needs both lora_a and lora_b", "has ['lora_a']", tensor="model.layers.0.self_attn.v_proj")
def _(e):
    edit_tensors(mlx_weights(e), lambda t: t.pop("model.layers.0.self_attn.v_proj.lora_b"))


@case("adapter-weights-missing", AdapterError, "ad", "no adapter weights found",
      "expected: adapters.safetensors (mlx-lm) or adapter_model.safetensors (PEFT)",
      "found: adapter_config.json")
def _(e):
    mlx_weights(e).unlink()


@case("peft-pickled-weights", AdapterError, "ad_peft", "no adapter weights found",
      "found: adapter_config.json, adapter_model.bin", "is a pickle", "safe_serialization=True")
def _(e):
    w = peft(e) / "adapter_model.safetensors"
    w.rename(w.with_name("adapter_model.bin"))


@case("adapter-weights-symlink-out", UnsafePathError, "adapters.safetensors",
      "link out of the directory", "found: link to")
def _(e):
    real = e.root / "stolen.safetensors"
    shutil.move(mlx_weights(e), real)
    mlx_weights(e).symlink_to(real)


@case("adapter-path-missing", AdapterError, "no-such-adapter", "adapter path is not a directory",
      "expected: a directory with adapter_config.json")
def _(e):
    e.adapter = e.root / "no-such-adapter"


@case("dora-magnitude-missing", AdapterError, "adapters.safetensors",
      "fine_tune_type is dora but model.layers.0.self_attn.q_proj.m is missing",
      tensor="model.layers.0.self_attn.q_proj")
def _(e):
    e.adapter = e.at("ad_dora")
    edit_tensors(mlx_weights(e, "ad_dora"), lambda t: t.pop("model.layers.0.self_attn.q_proj.m"))


@case("dora-magnitude-wrong-shape", AdapterError, "adapters.safetensors",
      "DoRA magnitude has the wrong shape", "expected [64]", "found [10]",
      tensor="model.layers.0.self_attn.q_proj.m")
def _(e):
    e.adapter = e.at("ad_dora")
    edit_tensors(mlx_weights(e, "ad_dora"), lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.m": np.ones(10, np.float32)}))


@case("dora-zero-norm-row", FuseError, "model-0000", "DoRA row has zero norm",
      "found: zero norm in row 0", tensor="model.layers.0.self_attn.q_proj.weight")
def _(e):
    """Row 0 of W + delta is all zeros (base row zeroed, the adapter adds nothing there):
    DoRA's direction is undefined; one error, no RuntimeWarning, nothing written."""
    e.adapter = e.at("ad_dora")
    edit_tensors(mlx_weights(e, "ad_dora"), lambda t: t["model.layers.0.self_attn.q_proj.lora_b"]
                 .__setitem__((slice(None), 0), 0.0))
    name = "model.layers.0.self_attn.q_proj.weight"
    for shard in sorted(e.base.glob("model-*.safetensors")):
        header, data = split_st(shard)
        if name in header:
            h = header[name]
            at, row = h["data_offsets"][0], h["shape"][1] * 2
            write_st(shard, header, data[:at] + bytes(row) + data[at + row:])


@case("overflow-bf16-huge-scale", FuseError, "model-0000", "fused weight is not finite",
      "expected: finite BF16 values", "non-finite elements", tensor="_proj.weight")
def _(e):
    edit_json(e.adapter / "adapter_config.json",
              lambda c: c["lora_parameters"].update(scale=1e300))


@case("overflow-fp16", FuseError, "model-0000", "fused weight is not finite",
      "expected: finite F16 values", tensor="_proj.weight")
def _(e):
    e.kwargs["dtype"] = "float16"
    edit_json(e.adapter / "adapter_config.json",
              lambda c: c["lora_parameters"].update(scale=1e8))


@case("fp16-unadapted-out-of-range", FuseError, S2, "does not fit F16", "would write Inf",
      "expected: finite F16 values", "99840.0", tensor="{tensor}")
def _(e):
    """A value bf16 holds and f16 cannot, in a tensor the adapter never touches: the
    conversion is refused by name instead of writing Inf."""
    e.kwargs["dtype"] = "float16"
    path = e.base / S2
    header, data = split_st(path)
    name = next(k for k in by_offset(header) if k.endswith("input_layernorm.weight"))
    assert header[name]["dtype"] == "BF16"
    at = header[name]["data_offsets"][0]
    data = data[:at] + struct.pack("<H", 0x47C3) + data[at + 2:]  # bf16 99840.0
    write_st(path, header, data)
    return {"tensor": name}


# adapters: configs -----------------------------------------------------------------------------
@case("adapter-config-missing", FormatError, "adapter_config.json", "adapter config is missing",
      "found: no such file")
def _(e):
    (e.adapter / "adapter_config.json").unlink()


@case("adapter-config-malformed", FormatError, "adapter_config.json", "not valid JSON",
      "JSONDecodeError")
def _(e):
    (e.adapter / "adapter_config.json").write_text("{'single': 'quotes'}")


@case("adapter-config-not-object", AdapterError, "adapter_config.json", "not a JSON object",
      "found: str")
def _(e):
    (e.adapter / "adapter_config.json").write_text('"lora"')


@case("adapter-scale-missing", AdapterError, "adapter_config.json",
      "lora_parameters.scale missing", "expected: a finite number", "found: None",
      tensor="lora_parameters.scale")
def _(e):
    edit_json(e.adapter / "adapter_config.json", lambda c: c["lora_parameters"].pop("scale"))


@case("adapter-scale-string", AdapterError, "adapter_config.json",
      "lora_parameters.scale missing or not a number", "found: '2.0'",
      tensor="lora_parameters.scale")
def _(e):
    edit_json(e.adapter / "adapter_config.json",
              lambda c: c["lora_parameters"].update(scale="2.0"))


@case("adapter-scale-huge-int", AdapterError, "adapter_config.json",
      "lora_parameters.scale missing or not a number", "found: 1000000",
      tensor="lora_parameters.scale")
def _(e):
    (e.adapter / "adapter_config.json").write_text(
        '{"fine_tune_type": "lora", "lora_parameters": {"rank": 4, "scale": 1'
        + "0" * 400 + "}}")


@case("adapter-no-lora-parameters", AdapterError, "adapter_config.json",
      "no lora_parameters", 'expected: "lora_parameters"')
def _(e):
    edit_json(e.adapter / "adapter_config.json", lambda c: c.pop("lora_parameters"))


@case("adapter-full-fine-tune", AdapterError, "adapter_config.json",
      "unsupported fine_tune_type", "expected: lora or dora", "found: 'full'",
      tensor="fine_tune_type")
def _(e):
    edit_json(e.adapter / "adapter_config.json", lambda c: c.update(fine_tune_type="full"))


# PEFT ---------------------------------------------------------------------------------------------
@case("peft-type-not-lora", AdapterError, "adapter_config.json", "unsupported PEFT method",
      "expected: LORA", "found: 'PREFIX_TUNING'", tensor="peft_type")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(peft_type="PREFIX_TUNING"))


@case("peft-bias-all", AdapterError, "adapter_config.json", "trained biases",
      'expected: "none"', "found: 'all'", tensor="bias")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(bias="all"))


@case("peft-layer-replication", AdapterError, "adapter_config.json",
      "unsupported PEFT feature: layer_replication", "expected: false / absent",
      "found: [[0, 2], [1, 2]]", tensor="layer_replication")
def _(e):
    edit_json(peft(e) / "adapter_config.json",
              lambda c: c.update(layer_replication=[[0, 2], [1, 2]]))


@case("peft-activated-lora", AdapterError, "adapter_config.json", "activated LoRA",
      "found: [5, 7]", tensor="alora_invocation_tokens")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(alora_invocation_tokens=[5, 7]))


@case("peft-modules-to-save-wrong-shape", AdapterError, "adapter_model.safetensors",
      "modules_to_save copies do not fit", "base_model.model.model.norm.weight -> model.norm.weight",
      "expected shape [64], found [65]")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(modules_to_save=["model.norm"]))
    edit_tensors(e.adapter / "adapter_model.safetensors", lambda t: t.update(
        {"base_model.model.model.norm.weight": np.ones(65, np.float32)}))


@case("peft-modules-to-save-tied-head", AdapterError, "adapter_model.safetensors",
      "modules_to_save copies do not fit", "no tensor lm_head.weight in the checkpoint",
      "the head is tied to the embedding")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(modules_to_save=["lm_head"]))
    edit_tensors(e.adapter / "adapter_model.safetensors", lambda t: t.update(
        {"base_model.model.lm_head.weight": np.zeros((96, 64), np.float32)}))


@case("peft-modules-to-save-not-listed", AdapterError, "adapter_model.safetensors",
      "modules_to_save copy of a module that adapter_config.json's modules_to_save does not list",
      tensor="base_model.model.lm_head.modules_to_save.default.weight")
def _(e):
    edit_tensors(peft(e) / "adapter_model.safetensors", lambda t: t.update(
        {"base_model.model.lm_head.modules_to_save.default.weight": np.zeros((96, 64), np.float32)}))


@case("peft-modules-to-save-nan", AdapterError, "adapter_model.safetensors",
      "modules_to_save tensor holds NaN or Inf", tensor="base_model.model.lm_head.weight")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(modules_to_save=["lm_head"]))
    bad = np.zeros((96, 64), np.float32)
    bad[3, 5] = np.nan
    edit_tensors(e.adapter / "adapter_model.safetensors",
                 lambda t: t.update({"base_model.model.lm_head.weight": bad}))


@case("peft-unknown-target", AdapterError, "adapter_model.safetensors",
      "adapter does not fit the checkpoint", "no tensor model.layers.0.self_attn.qkv_proj.weight",
      tensor="base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight")
def _(e):
    edit_json(peft(e) / "adapter_config.json",
              lambda c: c.update(target_modules=["q_proj", "v_proj", "down_proj", "qkv_proj"]))

    def fn(t):
        for leaf in ("lora_A", "lora_B"):
            src = f"base_model.model.model.layers.0.self_attn.q_proj.{leaf}.weight"
            t[src.replace("q_proj", "qkv_proj")] = t[src].copy()
    edit_tensors(e.adapter / "adapter_model.safetensors", fn)


@case("peft-rank-disagrees-with-config", AdapterError, "adapter_model.safetensors",
      "rank 4 in the tensors but 8 in adapter_config.json", tensor="model.layers.0.self_attn.q_proj")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(r=8))


@case("peft-r-missing", AdapterError, "adapter_config.json", "needs a positive r",
      "expected: a positive number", "found: None", tensor="r")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.pop("r"))


@case("peft-layers-to-transform-string", AdapterError, "adapter_config.json",
      "layers_to_transform must be", "found: 'all'", tensor="layers_to_transform")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(layers_to_transform="all"))


@case("peft-rank-pattern-not-number", AdapterError, "adapter_config.json",
      "rank_pattern must map module names to positive numbers", "found: {'q_proj': 'eight'}",
      tensor="rank_pattern")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(rank_pattern={"q_proj": "eight"}))


@case("peft-dora-without-magnitude", AdapterError, "adapter_model.safetensors",
      "use_dora is set but lora_magnitude_vector is missing", tensor="model.layers.0.self_attn.q_proj")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(use_dora=True))


@case("peft-nan", AdapterError, "adapter_model.safetensors", "NaN or Inf",
      "found: 1 non-finite", tensor="base_model.model.model.layers.1.mlp.down_proj.lora_A.weight")
def _(e):
    def fn(t):
        t["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"][1, 2] = np.nan
    edit_tensors(peft(e) / "adapter_model.safetensors", fn)


# output paths ------------------------------------------------------------------------------------
@case("output-inside-base", OutputExistsError, "fused", "overlap an input directory",
      "expected: a path outside", "found: inside it")
def _(e):
    e.out = e.base / "fused"


@case("output-is-adapter-dir", OutputExistsError, "ad", "overlap an input directory",
      "found: inside it")
def _(e):
    e.out = e.adapter
    e.kwargs["force"] = True


@case("output-holds-base", OutputExistsError, "in", "overlap an input directory",
      "found: a parent of it")
def _(e):
    e.out = e.inputs
    e.kwargs["force"] = True


@case("output-exists", OutputExistsError, "fused", "output path already exists",
      "expected: a new path", "found: an existing directory")
def _(e):
    e.out.mkdir()
    (e.out / "config.json").write_text("{}")


@case("output-is-a-file-force", OutputExistsError, "fused", "is a file", "found: a file")
def _(e):
    e.out.write_text("precious")
    e.kwargs["force"] = True


@case("output-force-on-non-model-dir", OutputExistsError, "fused",
      "refusing to replace a directory that is not a model", "found: 1 other entries")
def _(e):
    e.out.mkdir()
    (e.out / "thesis.tex").write_text("precious")
    e.kwargs["force"] = True


@case("output-parent-is-a-file", OutputExistsError, "fused", "cannot create the output directory",
      "expected: a writable directory path", "NotADirectoryError")
def _(e):
    (e.root / "afile").write_text("x")
    e.out = e.root / "afile" / "sub" / "fused"


assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


# -- running a case ---------------------------------------------------------------------------------
def format_value(s: Optional[str], facts: Dict[str, str]) -> Optional[str]:
    return s.format(**facts) if s is not None and facts else s


def _inputs_and_output(e: Env) -> Dict[str, Dict[str, str]]:
    """Hashes of every input tree and of whatever already sits at the output path."""
    return {"inputs": tree_hash(e.inputs), "out": tree_hash(e.out),
            "outdir": tree_hash(e.out.parent) if e.out.parent != e.inputs else {}}


def _check_nothing_written(e: Env, before: Dict[str, Dict[str, str]]) -> None:
    after = _inputs_and_output(e)
    assert after["inputs"] == before["inputs"], "an input file changed"
    assert after["out"] == before["out"], "something was written at the output path"
    assert after["outdir"] == before["outdir"], "something was left beside the output path"
    assert temporaries(e.out) == []


def _api_case(c: Case, tmp_path: Path, pristine: Dict[str, Path]):
    """Break the inputs as ``c`` says and fuse through the Python API; return what the
    CLI half needs (env, error, message, hashes before)."""
    e = make_env(tmp_path, pristine)
    facts = c.mutate(e) or {}
    before = _inputs_and_output(e)

    # 1. the Python API: one lorakit error naming file, tensor, expected and found
    with pytest.raises(LorakitError) as info:
        fuse(e.base, e.adapter, e.out, progress=False, **e.kwargs)
    err = info.value
    assert type(err) is c.error, f"{type(err).__name__}: {err}"
    msg = str(err)
    assert err.file is not None and format_value(c.file, facts) in err.file, msg
    for s in c.says:
        assert format_value(s, facts) in msg, f"{format_value(s, facts)!r} not in:\n{msg}"
    if c.tensor is not None:
        assert format_value(c.tensor, facts) in msg, msg
    assert ("expected" in msg or err.expected) and ("found" in msg or err.found), msg
    _check_nothing_written(e, before)
    return e, err, msg, before


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, tmp_path: Path, pristine: Dict[str, Path]) -> None:
    """The Python API half (in process, fast tier)."""
    _api_case(c, tmp_path, pristine)


@pytest.mark.slow
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input_cli(c: Case, tmp_path: Path, pristine: Dict[str, Path]) -> None:
    """The API half again, then ``python -m lorakit fuse`` in a fresh process."""
    e, err, msg, before = _api_case(c, tmp_path, pristine)

    # 2. the CLI: exit 2, one clear message, no traceback, nothing written
    r = run_cli("fuse", *e.cli_args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("error:") == 1 and r.stderr.startswith("lorakit fuse: error: "), r.stderr
    assert msg.splitlines()[0] in r.stderr, r.stderr
    assert Path(err.file).name in r.stderr
    assert r.stdout == ""
    _check_nothing_written(e, before)


def test_case_count() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize("kind", ["mlx", "dora", "peft", "quant"])
def test_pristine_inputs_fuse(kind: str, tmp_path: Path, pristine: Dict[str, Path]) -> None:
    """The unbroken inputs fuse: every failure above comes from what the case broke."""
    e = make_env(tmp_path, pristine)
    base, ad = {"mlx": ("base", "ad"), "dora": ("base", "ad_dora"), "peft": ("base", "ad_peft"),
                "quant": ("base_q", "ad_q")}[kind]
    before = tree_hash(e.inputs)
    res = fuse(e.at(base), e.at(ad), e.out, progress=False)
    assert res.tensors_fused == 6
    assert tree_hash(e.inputs) == before
    assert temporaries(e.out) == []
    assert sorted(p.name for p in e.out.iterdir())[:2] == ["README.md", "config.json"]


# -- every dtype of the safetensors spec (issue 14) ------------------------------------------------
#: bits per element of the dtypes lorakit copies but does not compute on
SPEC_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
             "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "C64": 64, "BOOL": 8, "U8": 8, "I8": 8,
             "I16": 16, "U16": 16, "I32": 32, "U32": 32, "I64": 64, "U64": 64, "F64": 64}


def add_tensor(e: Env, shard: str, name: str, dtype: str, shape: Tuple[int, ...]) -> bytes:
    """Append tensor ``name`` to a shard of ``e.base`` (and its index); returns its bytes."""
    numel = int(np.prod(shape))
    data = bytes((7 * i + 3) % 256 for i in range(numel * SPEC_BITS[dtype] // 8))
    header, body = split_st(e.base / shard)
    header[name] = {"dtype": dtype, "shape": list(shape),
                    "data_offsets": [len(body), len(body) + len(data)]}
    write_st(e.base / shard, header, body + data)
    edit_json(e.base / INDEX, lambda idx: idx["weight_map"].__setitem__(name, shard))
    return data


def set_dtype(e: Env, shard: str, name: str, dtype: str) -> None:
    """Store tensor ``name`` as ``dtype`` (same shape, new bytes), offsets kept contiguous."""
    header, body = split_st(e.base / shard)
    blobs, off = [], 0
    for n in by_offset(header):
        b0, b1 = header[n]["data_offsets"]
        blob = body[b0:b1]
        if n == name:
            header[n]["dtype"] = dtype
            numel = int(np.prod(header[n]["shape"]))
            blob = bytes(i % 2 for i in range(numel * SPEC_BITS[dtype] // 8))
        header[n]["data_offsets"] = [off, off + len(blob)]
        off += len(blob)
        blobs.append(blob)
    write_st(e.base / shard, header, b"".join(blobs))


@pytest.mark.parametrize("dtype", sorted(SPEC_BITS))
def test_unadapted_tensor_of_any_spec_dtype_is_copied(dtype: str, tmp_path: Path,
                                                      pristine: Dict[str, Path]) -> None:
    """An F4 / F6 / fp8 / complex / integer tensor no adapter touches is copied byte for byte."""
    import safetensors

    e = make_env(tmp_path, pristine)
    data = add_tensor(e, S1, "model.extra_codes", dtype, (2, 8))
    fuse(e.base, e.adapter, e.out, progress=False)
    out = e.out / S1
    got = dict(safetensors.deserialize(out.read_bytes()))["model.extra_codes"]
    assert (got["dtype"], got["shape"], bytes(got["data"])) == (dtype, [2, 8], data)


@pytest.mark.parametrize("dtype", sorted(SPEC_BITS))
def test_mlx_lm_rounding_beside_a_tensor_mlx_cannot_load(dtype: str, tmp_path: Path,
                                                        pristine: Dict[str, Path]) -> None:
    """--rounding mlx-lm reads weights through MLX, which refuses a whole shard holding
    one tensor of a dtype it does not load (F64, ...): the shard's other weights are
    fused all the same (no RuntimeError), that tensor copied byte for byte."""
    import safetensors

    e = make_env(tmp_path, pristine)
    data = add_tensor(e, S2, "model.extra_codes", dtype, (2, 8))  # beside Q_PROJ
    fuse(e.base, e.adapter, e.out, rounding="mlx-lm", progress=False)
    got = dict(safetensors.deserialize((e.out / S2).read_bytes()))["model.extra_codes"]
    assert (got["dtype"], got["shape"], bytes(got["data"])) == (dtype, [2, 8], data)


@pytest.mark.parametrize("dtype", ["F4", "F6_E3M2", "F8_E4M3", "C64", "I32"])
def test_adapted_tensor_of_a_non_float_dtype_is_refused_by_name(
        dtype: str, tmp_path: Path, pristine: Dict[str, Path]) -> None:
    e = make_env(tmp_path, pristine)
    set_dtype(e, S2, Q_PROJ, dtype)
    before = _inputs_and_output(e)
    with pytest.raises(LorakitError) as info:
        fuse(e.base, e.adapter, e.out, progress=False)
    msg = str(info.value)
    assert dtype in msg and Q_PROJ in msg, msg
    _check_nothing_written(e, before)


@pytest.mark.slow
def test_cli_fuse_with_packed_tensors(tmp_path: Path, pristine: Dict[str, Path]) -> None:
    """Through the CLI: an unadapted F4 tensor fuses (exit 0); an adapted one is one error."""
    e = make_env(tmp_path, pristine)
    add_tensor(e, S1, "model.extra_codes", "F4", (4, 4))
    r = run_cli("fuse", *e.cli_args, "-q")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    set_dtype(e, S2, Q_PROJ, "F4")
    r = run_cli("fuse", *e.cli_args[:-1], str(e.root / "outdir" / "fused2"), "-q")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("lorakit fuse: error: ") and "F4" in r.stderr, r.stderr


def test_gap_and_trailing_bytes_in_a_shard_are_refused(tmp_path: Path,
                                                      pristine: Dict[str, Path]) -> None:
    """Bytes hidden between tensors, or after the last one, as the reference refuses them."""
    e = make_env(tmp_path, pristine)
    p = e.base / S2
    header, body = split_st(p)
    write_st(p, header, body + b"hidden")
    with pytest.raises(FormatError, match="after the last tensor") as info:
        fuse(e.base, e.adapter, e.out, progress=False)
    assert S2 in str(info.value) and "found: 6 more bytes" in str(info.value)
    first = by_offset(header)[0]

    def shift(h):
        for n in h:
            if n != "__metadata__":
                h[n]["data_offsets"] = [o + 8 for o in h[n]["data_offsets"]]
    header2 = json.loads(json.dumps(header))
    shift(header2)
    write_st(p, header2, b"\0" * 8 + body)
    with pytest.raises(FormatError, match="bytes between tensors") as info:
        fuse(e.base, e.adapter, e.out, progress=False)
    assert f"tensor: {first}" in str(info.value) and "8 unclaimed bytes" in str(info.value)


# -- adapters read as their runtime runs them (issue 14) ----------------------------------------
# Kept out of CASES (whose ids are fixed when test_bad_input is parametrized): each runs
# through the same checks, API and CLI.
RUNTIME_CASES: List[Case] = []


def runtime_case(id: str, error: Type[LorakitError], file: str, *says: str,
                 tensor: Optional[str] = None):
    def deco(fn):
        RUNTIME_CASES.append(Case(id, fn, error, file, says, tensor))
        return fn
    return deco


@runtime_case("adapter-layer-outside-num-layers", AdapterError, "adapters.safetensors",
              "not an adapter parameter in the model", "not among the last 1 layers",
              tensor="model.layers.0.self_attn.q_proj.lora_a")
def _(e):
    edit_json(e.adapter / "adapter_config.json", lambda c: c.update(num_layers=1))


@runtime_case("adapter-config-rank-disagrees", AdapterError, "adapters.safetensors",
              "rank 4 in the tensors but 8 in adapter_config.json", "expected rank 8, found 4",
              tensor="model.layers.0.self_attn.q_proj")
def _(e):
    edit_json(e.adapter / "adapter_config.json", lambda c: c["lora_parameters"].update(rank=8))


@runtime_case("adapter-config-rank-not-a-number", AdapterError, "adapter_config.json",
              "lora_parameters.rank missing or not a positive integer", "found: 'four'",
              tensor="lora_parameters.rank")
def _(e):
    edit_json(e.adapter / "adapter_config.json",
              lambda c: c["lora_parameters"].update(rank="four"))


@runtime_case("adapter-path-names-another-file", AdapterError, "0000100_adapters.safetensors",
              "adapter path names a file lorakit does not read", "expected: the adapter directory")
def _(e):
    shutil.copy(mlx_weights(e), e.adapter / "0000100_adapters.safetensors")
    e.adapter = e.adapter / "0000100_adapters.safetensors"


@runtime_case("peft-tensor-outside-target-modules", AdapterError, "adapter_model.safetensors",
              "PEFT puts no LoRA layer on model.layers.0.mlp.down_proj", "target_modules",
              tensor="base_model.model.model.layers.0.mlp.down_proj.lora_A.weight")
def _(e):
    edit_json(peft(e) / "adapter_config.json",
              lambda c: c.update(target_modules=["q_proj", "v_proj"]))


@runtime_case("peft-layer-outside-layers-to-transform", AdapterError, "adapter_model.safetensors",
              "layer 0 is not in layers_to_transform [1]",
              tensor="base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
def _(e):
    edit_json(peft(e) / "adapter_config.json", lambda c: c.update(layers_to_transform=[1]))


@runtime_case("quant-bits-disagree-with-codes", FormatError, "model.safetensors",
              "quantization config disagrees with the packed weight", "bits=3", "4-bit codes",
              tensor="_proj.weight")
def _(e):
    e.base, e.adapter = e.at("base_q"), e.at("ad_q")
    edit_json(e.base / "config.json", lambda c: c["quantization"].update(bits=3))


@pytest.mark.slow
@pytest.mark.parametrize("c", RUNTIME_CASES, ids=[c.id for c in RUNTIME_CASES])
def test_bad_input_runtime(c: Case, tmp_path: Path, pristine: Dict[str, Path]) -> None:
    test_bad_input(c, tmp_path, pristine)


# -- a config value that disagrees with the tensors, an F64 base: each message names the
# value and the file it came from (config.json / adapter_config.json). Fast: API half;
# the CLI half (exit 2, one message, nothing written) runs in the slow tier.
CONFLICT_CASES: List[Case] = []


def conflict_case(id: str, error: Type[LorakitError], file: str, *says: str,
                  tensor: Optional[str] = None):
    def deco(fn):
        CONFLICT_CASES.append(Case(id, fn, error, file, says, tensor))
        return fn
    return deco


@conflict_case("config-fewer-layers-than-the-tensors", AdapterError, "adapters.safetensors",
               "layer 1 is past the model's last layer 0", "num_hidden_layers=1 in ",
               "base/config.json, but the checkpoint's tensors hold blocks 0..1",
               tensor="model.layers.1.self_attn.q_proj.lora_a")
def _(e):
    edit_json(e.base / "config.json", lambda c: c.update(num_hidden_layers=1))


@conflict_case("config-more-layers-than-the-tensors", AdapterError, "adapters.safetensors",
               "layer 0 is not among the last 2 layers", "num_hidden_layers=4 in ",
               "base/config.json, but the checkpoint's tensors hold blocks 0..1",
               "num_layers=2 in ", tensor="model.layers.0.self_attn.q_proj.lora_a")
def _(e):
    edit_json(e.base / "config.json", lambda c: c.update(num_hidden_layers=4))


@conflict_case("adapter-config-num-layers-too-few", AdapterError, "adapters.safetensors",
               "layer 0 is not among the last 1 layers",
               "num_layers=1 in adapter_config.json",
               tensor="model.layers.0.self_attn.q_proj.lora_a")
def _(e):
    edit_json(e.adapter / "adapter_config.json", lambda c: c.update(num_layers=1))


@conflict_case("adapter-config-rank-too-high", AdapterError, "adapters.safetensors",
               "rank 4 in the tensors but 8 in adapter_config.json (lora_parameters.rank)",
               tensor="model.layers.0.self_attn.q_proj")
def _(e):
    edit_json(e.adapter / "adapter_config.json", lambda c: c["lora_parameters"].update(rank=8))


@conflict_case("peft-target-modules-regex-leaves-tensors-out", AdapterError,
               "adapter_model.safetensors", "PEFT puts no LoRA layer on model.layers.0.mlp.down_proj",
               r"not matched by target_modules '.*\\.(q|v)_proj' in adapter_config.json",
               "exclude_modules in ", tensor="base_model.model.model.layers.0.mlp.down_proj")
def _(e):
    edit_json(peft(e) / "adapter_config.json",
              lambda c: c.update(target_modules=r".*\.(q|v)_proj"))


@conflict_case("f64-base-mlx-lm-rounding", FuseError, S2, "cannot fuse into a float64 weight",
               "expected: a BF16, F16 or F32 weight", "found: F64 -> F64",
               "hint: store float64 weights as float32 first", tensor=Q_PROJ)
def _(e):
    set_dtype(e, S2, Q_PROJ, "F64")
    e.kwargs["rounding"] = "mlx-lm"


@pytest.mark.parametrize("c", CONFLICT_CASES, ids=[c.id for c in CONFLICT_CASES])
def test_config_conflict_names_value_and_file(c: Case, tmp_path: Path,
                                              pristine: Dict[str, Path]) -> None:
    _api_case(c, tmp_path, pristine)


@pytest.mark.slow
@pytest.mark.parametrize("c", CONFLICT_CASES, ids=[c.id for c in CONFLICT_CASES])
def test_config_conflict_cli(c: Case, tmp_path: Path, pristine: Dict[str, Path]) -> None:
    test_bad_input_cli(c, tmp_path, pristine)


# -- --force replaces only what lorakit wrote (issue 14) ------------------------------------------
def _force_refused(e: Env, *names: str) -> None:
    """API and CLI: --force over ``e.out`` is one OutputExistsError naming ``names``;
    inputs, the output directory and its surroundings stay byte for byte as they were."""
    e.kwargs["force"] = True
    before = _inputs_and_output(e)
    with pytest.raises(OutputExistsError, match="refusing to replace") as info:
        fuse(e.base, e.adapter, e.out, progress=False, force=True)
    assert all(n in str(info.value) for n in names), str(info.value)
    _check_nothing_written(e, before)
    r = run_cli("fuse", *e.cli_args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("lorakit fuse: error: refusing to replace"), r.stderr
    assert all(n in r.stderr for n in names), r.stderr
    _check_nothing_written(e, before)


@pytest.mark.slow
def test_force_output_with_only_config_json_is_refused(tmp_path: Path, pristine) -> None:
    e = make_env(tmp_path, pristine)
    e.out.mkdir()
    (e.out / "config.json").write_text('{"my": "thesis settings"}')
    _force_refused(e, "config.json")


@pytest.mark.slow
def test_force_output_holding_other_checkpoints_is_refused(tmp_path: Path, pristine) -> None:
    e = make_env(tmp_path, pristine)
    shutil.copytree(e.base, e.out / "run-1")
    shutil.copytree(e.base, e.out / "run-2")
    (e.out / "config.json").write_text("{}")
    _force_refused(e, "run-1", "run-2", "config.json")


@pytest.mark.slow
def test_force_output_previous_fuse_with_user_file_is_refused(tmp_path: Path, pristine) -> None:
    e = make_env(tmp_path, pristine)
    fuse(e.base, e.adapter, e.out, progress=False)
    (e.out / "eval-results.csv").write_text("step,loss\n1,0.5\n")
    _force_refused(e, "eval-results.csv")


def test_force_output_help_says_what_is_replaced() -> None:
    from lorakit.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["fuse"].format_help().split())
    assert "only an empty directory or a previous lorakit output" in text, text
