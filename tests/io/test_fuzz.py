"""Fuzzing the parsers that read untrusted files: safetensors headers, checkpoint
indexes, adapter configs and adapter tensors.

Whatever the bytes, only lorakit's own errors may escape (no KeyError, TypeError,
OverflowError, ...), nothing hangs (hypothesis deadlines), and no claimed size makes
lorakit allocate more than the file holds. When a parse succeeds, what it returns
must be true of the file (ranges inside it, no overlaps, sizes that add up).

Bounded for CI: ~200 examples per target. The same targets run under atheris
(coverage-guided) when it is installed: ``python tests/io/test_fuzz.py -runs=100000``.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import pytest

from lorakit.errors import LorakitError
from lorakit.io.adapters.load import load_adapter
from lorakit.io.adapters.naming import bind
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import ITEMSIZE, read_header, read_raw

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow  # hypothesis campaigns and an atheris subprocess

#: LORAKIT_FUZZ_EXAMPLES raises the count for a longer campaign than CI affords.
FUZZ = settings(max_examples=int(os.environ.get("LORAKIT_FUZZ_EXAMPLES", "200")), deadline=5000,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# -- a small valid world to mutate ---------------------------------------------------------------
TENSORS = {  # name -> (dtype, shape); a tiny llama-style checkpoint
    "model.embed_tokens.weight": ("BF16", (16, 8)),
    "model.layers.0.self_attn.q_proj.weight": ("BF16", (8, 8)),
    "model.layers.0.self_attn.v_proj.weight": ("BF16", (4, 8)),
    "model.layers.0.mlp.down_proj.weight": ("F16", (8, 12)),
    "model.norm.weight": ("F32", (8,)),
}
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def st_bytes(tensors: Dict[str, tuple], metadata: Optional[dict] = None) -> bytes:
    """A valid safetensors file with deterministic contents."""
    header: Dict[str, Any] = {"__metadata__": metadata or {"format": "mlx"}}
    off, blobs = 0, []
    rng = np.random.default_rng(0)
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape)) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        blobs.append((rng.standard_normal(n // 2 + 1).astype(np.float16).tobytes())[:n])
        off += n
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + b"".join(blobs)


def write_checkpoint(d: Path) -> None:
    names = list(TENSORS)
    parts = [dict((k, TENSORS[k]) for k in names[:3]), dict((k, TENSORS[k]) for k in names[3:])]
    for shard, part in zip(SHARDS, parts):
        (d / shard).write_bytes(st_bytes(part))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))


def valid_weight_map() -> Dict[str, str]:
    names = list(TENSORS)
    return {k: SHARDS[0] if i < 3 else SHARDS[1] for i, k in enumerate(names)}


def only_lorakit_errors(fn, *args):
    """Call ``fn``; a LorakitError is a fine answer, anything else fails the test."""
    try:
        return fn(*args)
    except LorakitError as e:
        assert str(e)  # and it has something to say
        return None


def scratch_dir(prefix: str) -> Path:
    """A scratch directory, in memory where possible: fuzzing rewrites small files
    thousands of times, and on ext4 each rewrite of a truncated file waits for the
    disk (auto_da_alloc), ~10^4 times slower than tmpfs on a busy machine."""
    shm = Path("/dev/shm")
    where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=where))


@pytest.fixture(scope="module")
def workdir():
    d = scratch_dir("lorakit-fuzz-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- 1. safetensors headers --------------------------------------------------------------------------
def check_header_claims(path: Path, h) -> None:
    """What a successful read_header returns is true of the file."""
    size = path.stat().st_size
    spans = sorted((t.begin, t.end, t.name) for t in h.tensors.values())
    for t in h.tensors.values():
        assert h.data_start <= t.begin <= t.end <= size, t
        if t.dtype != "F4":
            assert t.nbytes == t.numel * ITEMSIZE[t.dtype]
            raw = read_raw(t)  # reading what the header promised works
            assert raw.nbytes == t.nbytes
    end = h.data_start
    for b, e, n in spans:
        if e > b:  # bytes of two tensors never overlap (empty tensors hold none)
            assert b >= end, n
            end = e


@FUZZ
@given(data=st.binary(max_size=600))
def test_fuzz_header_random_bytes(workdir: Path, data: bytes) -> None:
    p = workdir / "random.safetensors"
    p.write_bytes(data)
    h = only_lorakit_errors(read_header, p)
    if h is not None:
        check_header_claims(p, h)


@FUZZ
@given(length=st.one_of(st.integers(0, 2 ** 64 - 1), st.integers(0, 400)),
       body=st.binary(max_size=400))
def test_fuzz_header_length_prefix(workdir: Path, length: int, body: bytes) -> None:
    """Any claimed header length, including ones far beyond the file."""
    p = workdir / "prefix.safetensors"
    p.write_bytes(struct.pack("<Q", length) + body)
    h = only_lorakit_errors(read_header, p)
    if h is not None:
        check_header_claims(p, h)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12)

field_values = {
    "dtype": st.sampled_from(sorted(ITEMSIZE)) | json_values,
    "shape": st.lists(st.integers(-3, 2 ** 40), max_size=4) | json_values,
    "data_offsets": st.lists(st.integers(-10, 2 ** 62), min_size=0, max_size=3) | json_values,
}


@FUZZ
@given(data=st.data())
def test_fuzz_header_mutated(workdir: Path, data) -> None:
    """A valid header with fields replaced, entries added or removed, data cut or padded."""
    header_json = json.loads(st_bytes(TENSORS)[8:8 + struct.unpack(
        "<Q", st_bytes(TENSORS)[:8])[0]])
    body = st_bytes(TENSORS)[8 + struct.unpack("<Q", st_bytes(TENSORS)[:8])[0]:]
    for _ in range(data.draw(st.integers(1, 4))):
        name = data.draw(st.sampled_from(sorted(header_json) + ["new.tensor"]))
        op = data.draw(st.sampled_from(["field", "replace", "delete", "offsets"]))
        if op == "delete":
            header_json.pop(name, None)
        elif op == "replace":
            header_json[name] = data.draw(json_values)
        elif op == "offsets" and isinstance(header_json.get(name), dict):
            b = data.draw(st.integers(0, len(body) + 64))
            header_json[name]["data_offsets"] = [b, b + data.draw(st.integers(0, 256))]
        else:
            entry = header_json.setdefault(name, {})
            if isinstance(entry, dict):
                key = data.draw(st.sampled_from(sorted(field_values)))
                entry[key] = data.draw(field_values[key])
    cut = data.draw(st.integers(-64, 64))
    body2 = body[:len(body) + cut] if cut < 0 else body + b"\0" * cut
    blob = json.dumps(header_json).encode()
    p = workdir / "mutated.safetensors"
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + body2)
    h = only_lorakit_errors(read_header, p)
    if h is not None:
        check_header_claims(p, h)


def test_claimed_sizes_allocate_nothing(workdir: Path) -> None:
    """A header claiming 2**60 bytes, or a tensor claiming a terabyte, is refused
    before anything of that size is allocated."""
    claims = [
        struct.pack("<Q", 2 ** 60) + b"{}",
        struct.pack("<Q", 2 ** 64 - 1) + b"{}",
        (lambda b: struct.pack("<Q", len(b)) + b)(json.dumps(
            {"w": {"dtype": "F32", "shape": [2 ** 38], "data_offsets": [0, 2 ** 40]}}).encode()),
        (lambda b: struct.pack("<Q", len(b)) + b)(json.dumps(
            {"w": {"dtype": "F32", "shape": [2 ** 20, 2 ** 20, 2 ** 20], "data_offsets": [0, 4]}}
        ).encode()),
    ]
    for i, raw in enumerate(claims):
        p = workdir / f"claim{i}.safetensors"
        p.write_bytes(raw)
        tracemalloc.start()
        try:
            with pytest.raises(LorakitError):
                read_header(p)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"claim {i}: {peak} bytes allocated"


# -- 2. checkpoint indexes ---------------------------------------------------------------------------
shard_names = st.one_of(
    st.sampled_from(list(SHARDS)),
    st.sampled_from(["../x.safetensors", "/etc/passwd", "", ".", "..", "sub/a.safetensors",
                     "model-00003-of-00002.safetensors", "config.json", "a\\b", "x\0y",
                     "link.safetensors", "loop.safetensors", "fifo.safetensors"]),
    json_values)
tensor_names = st.sampled_from(list(TENSORS)) | st.text(max_size=20)


@pytest.fixture(scope="module")
def ckdir(workdir: Path) -> Path:
    d = workdir / "ckpt"
    d.mkdir()
    write_checkpoint(d)
    outside = workdir / "outside.safetensors"
    outside.write_bytes((d / SHARDS[1]).read_bytes())
    (d / "link.safetensors").symlink_to(outside)
    (d / "loop.safetensors").symlink_to(d / "loop.safetensors")
    os.mkfifo(d / "fifo.safetensors")
    return d


@FUZZ
@given(edits=st.dictionaries(tensor_names, shard_names, max_size=6),
       drop=st.lists(st.sampled_from(list(TENSORS)), max_size=3),
       wrap=st.sampled_from(["ok", "no-map", "map-not-dict", "junk"]),
       junk=json_values)
def test_fuzz_index(ckdir: Path, edits, drop, wrap, junk) -> None:
    wm: Dict[str, Any] = valid_weight_map()
    for k in drop:
        wm.pop(k, None)
    wm.update(edits)
    index: Any = {"metadata": junk, "weight_map": wm}
    if wrap == "no-map":
        index = {"metadata": {}}
    elif wrap == "map-not-dict":
        index = {"weight_map": junk}
    elif wrap == "junk":
        index = junk
    (ckdir / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = only_lorakit_errors(Checkpoint, ckdir)
    if ck is not None:  # everything it opened lies inside the directory, as the index says
        for name, info in ck.tensors.items():
            assert info.file.resolve().parent == ckdir.resolve(), info
            if isinstance(index, dict) and isinstance(index.get("weight_map"), dict):
                assert index["weight_map"].get(name) in (None, info.file.name)


# -- 3. adapter configs -------------------------------------------------------------------------------
CFG_KEYS = ["fine_tune_type", "num_layers", "lora_parameters", "peft_type", "r", "lora_alpha",
            "use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
            "layers_to_transform", "bias", "modules_to_save", "use_qalora", "lora_bias",
            "target_modules"]
cfg_values = st.one_of(json_values, st.integers(-5, 10), st.sampled_from(
    ["lora", "dora", "full", "LORA", "none", "all", "IA3", "q_proj"]),
    st.fixed_dictionaries({}, optional={"rank": json_values, "scale": json_values | st.floats(),
                                        "alpha": json_values, "keys": json_values}),
    st.dictionaries(st.sampled_from(["q_proj", "v_proj", "(a+)", "[", "model.layers.0.q_proj"]),
                    json_values | st.integers(-2, 16), max_size=3))


def _adapter_dirs(workdir: Path) -> Dict[str, Path]:
    """An mlx-lm and a PEFT adapter for the TENSORS checkpoint (written once)."""
    from safetensors.numpy import save_file

    out = {}
    rng = np.random.default_rng(1)
    mods = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    outs = {mods[0]: 8, mods[1]: 4}
    mlx = workdir / "ad-mlx"
    if not mlx.exists():
        mlx.mkdir()
        save_file({f"{m}.{leaf}": rng.standard_normal(shape).astype(np.float32)
                   for m in mods for leaf, shape in (("lora_a", (8, 2)), ("lora_b", (2, outs[m])))},
                  str(mlx / "adapters.safetensors"))
    out["mlx"] = mlx
    pe = workdir / "ad-peft"
    if not pe.exists():
        pe.mkdir()
        save_file({f"base_model.model.{m}.{leaf}": rng.standard_normal(shape).astype(np.float32)
                   for m in mods for leaf, shape in (("lora_A.weight", (2, 8)),
                                                      ("lora_B.weight", (outs[m], 2)))},
                  str(pe / "adapter_model.safetensors"))
    out["peft"] = pe
    return out


@FUZZ
@given(kind=st.sampled_from(["mlx", "peft"]),
       cfg=st.dictionaries(st.sampled_from(CFG_KEYS), cfg_values, max_size=8),
       raw=st.none() | st.binary(max_size=64))
def test_fuzz_adapter_config(workdir: Path, kind: str, cfg, raw) -> None:
    d = _adapter_dirs(workdir)[kind]
    text = raw if raw is not None else json.dumps(cfg).encode()
    (d / "adapter_config.json").write_bytes(text)
    ad = only_lorakit_errors(load_adapter, d)
    if ad is not None:
        for t in ad.targets:
            assert np.isfinite(t.scale) and t.A.shape[-2] == t.B.shape[-1]
        bind_to_checkpoint(ad, workdir / "bind-ckpt")


def bind_to_checkpoint(ad, ckdir: Path) -> None:
    """Bind a loaded adapter to a small valid checkpoint (written once per folder):
    any failure must be a LorakitError."""
    if not ckdir.exists():
        ckdir.mkdir()
        write_checkpoint(ckdir)
        (ckdir / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": valid_weight_map()}))
    only_lorakit_errors(bind, ad, Checkpoint(ckdir))


# -- 4. adapter tensors (names and shapes) ------------------------------------------------------------
module_names = st.sampled_from([
    "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
    "model.layers.0.mlp.down_proj", "model.embed_tokens", "model.norm", "lm_head",
    "model.layers.0.mlp.switch_mlp.gate_proj", "model.layers.0.mlp.experts.0.up_proj", "",
    "x"])
leaves = st.sampled_from(["lora_a", "lora_b", "m", "weight", "lora_A.weight", "lora_B.weight",
                          "lora_magnitude_vector", "lora_embedding_A", ""])
shapes = st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple)
dtypes = st.sampled_from([np.float32, np.float16, np.float64, np.int32, np.uint8])


@FUZZ
@given(kind=st.sampled_from(["mlx", "peft"]),
       tensors=st.dictionaries(st.tuples(module_names, leaves), st.tuples(shapes, dtypes),
                               min_size=1, max_size=6),
       dora=st.booleans())
def test_fuzz_adapter_tensors(workdir: Path, kind: str, tensors, dora: bool) -> None:
    from safetensors.numpy import save_file

    d = workdir / f"ad-t-{kind}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    prefix = "base_model.model." if kind == "peft" else ""
    arrays = {}
    for (mod, leaf), (shape, dt) in tensors.items():
        name = f"{prefix}{mod}.{leaf}".strip(".")
        if name:
            arrays[name] = np.ones(shape, dtype=dt)
    if not arrays:
        return
    fname = "adapter_model.safetensors" if kind == "peft" else "adapters.safetensors"
    save_file(arrays, str(d / fname))
    cfg = ({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "use_dora": dora} if kind == "peft"
           else {"fine_tune_type": "dora" if dora else "lora",
                 "lora_parameters": {"rank": 2, "scale": 2.0}})
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    ad = only_lorakit_errors(load_adapter, d)
    if ad is not None:
        bind_to_checkpoint(ad, workdir / "bind-ckpt2")


# -- atheris (coverage-guided), optional -----------------------------------------------------------
def test_atheris_harness(tmp_path: Path) -> None:
    """The same targets under atheris for a few seconds, when atheris is installed."""
    pytest.importorskip("atheris")
    work = scratch_dir("lorakit-atheris-")
    try:
        r = subprocess.run([sys.executable, __file__, "-runs=5000", "-max_total_time=10",
                            f"-artifact_prefix={tmp_path}/"], capture_output=True, text=True,
                           timeout=180, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
                                "LORAKIT_FUZZ_DIR": str(work)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "Done" in r.stderr or "DONE" in r.stderr, r.stderr[-2000:]


def _atheris_main() -> None:  # pragma: no cover - runs in its own process
    import atheris

    import lorakit.io.adapters.load as adapter_mod
    import lorakit.io.adapters.naming as naming_mod
    import lorakit.io.formats.checkpoint as checkpoint_mod
    import lorakit.io.formats.safetensors as safetensors_mod
    from lorakit.errors import LorakitError as Err

    # lorakit is already imported (this file imports it at the top): instrument its
    # parser functions in place, for coverage feedback
    for mod in (adapter_mod, checkpoint_mod, naming_mod, safetensors_mod):
        for name, obj in list(vars(mod).items()):
            if callable(obj) and getattr(obj, "__module__", None) == mod.__name__:
                if isinstance(obj, type):
                    for attr, fn in list(vars(obj).items()):
                        if callable(fn) and hasattr(fn, "__code__"):
                            setattr(obj, attr, atheris.instrument_func(fn))
                elif hasattr(obj, "__code__"):
                    setattr(mod, name, atheris.instrument_func(obj))

    # libFuzzer exits without unwinding, so whoever runs this removes the directory
    root = Path(os.environ.get("LORAKIT_FUZZ_DIR") or scratch_dir("lorakit-atheris-"))
    ck = root / "ckpt"
    ck.mkdir()
    write_checkpoint(ck)
    ads = _adapter_dirs(root)

    def one_input(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        target = fdp.ConsumeIntInRange(0, 3)
        body = fdp.ConsumeBytes(fdp.remaining_bytes())
        try:
            if target == 0:  # raw safetensors bytes
                p = root / "a.safetensors"
                p.write_bytes(body)
                safetensors_mod.read_header(p)
            elif target == 1:  # header JSON after a correct length prefix
                p = root / "b.safetensors"
                p.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * 64)
                safetensors_mod.read_header(p)
            elif target == 2:  # index JSON
                (ck / "model.safetensors.index.json").write_bytes(body)
                checkpoint_mod.Checkpoint(ck)
            else:  # adapter config, mlx-lm and PEFT
                for d in ads.values():
                    (d / "adapter_config.json").write_bytes(body)
                    try:
                        adapter_mod.load_adapter(d)
                    except Err:
                        pass
        except Err:
            pass

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":  # pragma: no cover
    _atheris_main()
