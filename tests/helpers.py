"""Helpers shared by several test modules (not tests themselves): file-tree hashes,
the ``python -m lorakit`` runner, sharded / PEFT copies of the small inputs, the
environment a bad-input case runs in, mlx-lm's own fuse, and lazy module imports.

Fixtures live in conftest.py; test modules import helpers from here, never from
each other.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import numpy as np
from model_factory import make_adapter, make_model
from safetensors.numpy import load_file, save_file

from lorakit.io.outputs.directory import TMP_MARK

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
S1 = "model-00001-of-00002.safetensors"
S2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


class LazyModule:
    """A module imported on first attribute access, so that collecting a test module
    does not pay for a heavy import (mlx_lm pulls in transformers, nbformat jsonschema)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pytest probes module globals for markers while collecting
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


def missing_modules(*names: str) -> List[str]:
    """The names among ``names`` that cannot be imported (found without importing)."""
    import importlib.util

    out = []
    for n in names:
        try:
            if importlib.util.find_spec(n) is None:
                out.append(n)
        except (ImportError, ValueError):
            out.append(n)
    return out


def run_mlx_lm_fuse(model: Path, adapter: Path, out: Path, *extra: str) -> None:
    """Run mlx-lm's own fuse command (its main(), in this process)."""
    from mlx_lm import fuse as mlx_fuse

    argv = sys.argv
    sys.argv = ["mlx_lm.fuse", "--model", str(model), "--adapter-path", str(adapter),
                "--save-path", str(out), *extra]
    try:
        mlx_fuse.main()
    finally:
        sys.argv = argv


# -- helpers shared with the kill, fuzz and input-unchanged tests --------------------------
def tree_hash(root: Path) -> Dict[str, str]:
    """Every entry under ``root`` (not following links): file -> sha256, link -> target."""
    out: Dict[str, str] = {}
    if not root.exists() and not root.is_symlink():
        return out
    if root.is_symlink() or root.is_file():
        return {".": _entry_hash(root)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        for n in sorted(dirnames + filenames):
            p = d / n
            out[str(p.relative_to(root))] = _entry_hash(p)
    return out


def _entry_hash(p: Path) -> str:
    if p.is_symlink():
        return "link:" + os.readlink(p)
    if p.is_dir():
        return "dir"
    if not p.is_file():  # a FIFO or device: reading it would block
        return "special"
    return "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()


def temporaries(out: Path) -> List[Path]:
    """Temporary directories a fuse into ``out`` leaves beside it (should be none)."""
    return sorted(out.parent.glob(f".{out.name}{TMP_MARK}*")) if out.parent.is_dir() else []


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m lorakit ...`` in a fresh process, offline, without debug tracebacks."""
    env = {k: v for k, v in os.environ.items() if k != "LORAKIT_DEBUG"}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "lorakit", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def shard_model(path: Path) -> None:
    """Split a single-file mlx-lm checkpoint into two shards plus an index."""
    weights = mx.load(str(path / "model.safetensors"))
    names = sorted(weights)
    first = {n: weights[n] for n in names if ".layers.1." not in n and n != "model.norm.weight"}
    second = {n: weights[n] for n in names if n not in first}
    mx.save_safetensors(str(path / S1), first, metadata={"format": "mlx"})
    mx.save_safetensors(str(path / S2), second, metadata={"format": "mlx"})
    (path / "model.safetensors").unlink()
    wm = {n: S1 for n in first} | {n: S2 for n in second}
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(wm.items()))}))


def make_peft(mlx_adapter: Path, path: Path, **cfg) -> Path:
    """The same LoRA as ``mlx_adapter`` saved the way PEFT saves it."""
    t = load_file(str(mlx_adapter / "adapters.safetensors"))
    out = {}
    for name, v in t.items():
        module, leaf = name.rsplit(".", 1)
        key = "base_model.model." + module
        if leaf == "lora_a":  # mlx (in, r) -> PEFT lora_A (r, in)
            out[key + ".lora_A.weight"] = np.ascontiguousarray(v.T)
        else:  # mlx (r, out) -> PEFT lora_B (out, r)
            out[key + ".lora_B.weight"] = np.ascontiguousarray(v.T)
    path.mkdir(parents=True)
    save_file(out, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none",
              "target_modules": ["q_proj", "v_proj", "down_proj"], "use_rslora": False,
              "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None}
    config.update(cfg)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


# -- the environment a case runs in --------------------------------------------------------
@dataclass
class Env:
    root: Path
    inputs: Path
    base: Path
    adapter: Path
    out: Path
    kwargs: Dict[str, object] = field(default_factory=dict)

    def at(self, name: str) -> Path:
        """Path of input ``name`` (base, base_q, ad, ad_dora, ad_q, ad_peft)."""
        return self.inputs / name

    @property
    def cli_args(self) -> List[str]:
        args = ["--model", self.base, "--adapter-path", self.adapter, "--save-path", self.out]
        if self.kwargs.get("force"):
            args.append("--force")
        if "dtype" in self.kwargs:
            args += ["--dtype", str(self.kwargs["dtype"])]
        if "rounding" in self.kwargs:
            args += ["--rounding", str(self.kwargs["rounding"])]
        return [str(a) for a in args]


def make_env(tmp_path: Path, pristine: Dict[str, Path]) -> Env:
    inputs = tmp_path / "in"
    for name, src in pristine.items():
        shutil.copytree(src, inputs / name, symlinks=True)
    (tmp_path / "outdir").mkdir()
    return Env(tmp_path, inputs, inputs / "base", inputs / "ad", tmp_path / "outdir" / "fused")


# -- the kill tests' inputs (also used by the signal tests) ----------------------------
#: a qwen3-shaped model of ~100 MB in 3 shards: 1-2 s for a whole `lorakit fuse` process.
KILL_MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=16,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64)
KILL_KEYS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj", "mlp.up_proj")


def reshard(path: Path, n: int) -> None:
    """Rewrite ``path``'s single model.safetensors as ``n`` shards of similar size + index."""
    weights = mx.load(str(path / "model.safetensors"))
    names = sorted(weights)
    total = sum(weights[k].nbytes for k in names)
    shards: List[Dict[str, mx.array]] = [{}]
    size = 0
    for k in names:
        if size >= total * len(shards) / n and len(shards) < n:
            shards.append({})
        shards[-1][k] = weights[k]
        size += weights[k].nbytes
    wm = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(path / fname), part, metadata={"format": "mlx"})
        wm.update({k: fname for k in part})
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2))


def build_kill_inputs(root: Path) -> Tuple[Path, Path]:
    base = make_model(root / "base", "qwen3", **KILL_MODEL)
    reshard(base, 3)
    adapter = make_adapter(base, root / "adapter", keys=KILL_KEYS, rank=8)
    return base, adapter


def cli(base: Path, adapter: Path, out: Path, force: bool = False) -> List[str]:
    args = [sys.executable, "-m", "lorakit", "fuse", "--model", str(base), "--adapter-path",
            str(adapter), "--save-path", str(out), "-q"]
    return args + (["--force"] if force else [])


def cli_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LORAKIT_DEBUG"}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    return env


def md_table(text: str, heading: str, header: str) -> Dict[str, List[str]]:
    """The first markdown table after ``heading`` whose header row starts with
    ``header``: its body rows keyed by their first cell (backticks stripped), each the
    list of stripped cells."""
    part = text[text.index(heading):]
    part = part[part.index(header):]
    rows: Dict[str, List[str]] = {}
    for line in part.splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    return rows
