"""Writing a synthetic LoRA/DoRA adapter, as ``mlx_lm lora`` or PEFT saves one."""
from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import List, Optional, Sequence, Union

import numpy as np

from ..errors import AdapterError, PathLike
from ..io.adapters.base import Adapter, LoraTarget
from ..io.adapters.write import save_adapter
from ..io.formats import source
from ..io.outputs.directory import SYNTH_MARK, check_output_path
from .presets import DEFAULT_KEYS
from .sites import _find_sites, _layer_prefix, _row_norms, _Site

__all__ = ["synth_adapter"]


def synth_adapter(path: PathLike, checkpoint_path: PathLike, *, rank: int = 8,
                  scale: Optional[float] = None, layers: Union[int, Sequence[int]] = 16,
                  keys: Sequence[str] = DEFAULT_KEYS, kind: str = "lora",
                  format: str = "mlx-lm", seed: int = 0, delta_std: float = 1e-3,
                  force: bool = False) -> Path:
    """Write a random LoRA/DoRA adapter for a checkpoint (any layout, quantized too), as
    ``mlx_lm lora`` or PEFT saves it; returns the output directory.

    ``lora_a`` is drawn as the trainers initialise it (uniform in +-1/sqrt(in));
    ``lora_b`` so that each element of ``scale * B @ A`` has standard deviation
    ``delta_std`` (1e-3: a few bf16 ulps of a 0.02-scale weight, every fused element
    moves). DoRA magnitudes are the base's row norms, perturbed by 1%. ``scale``:
    default 20.0 for mlx-lm, 2.0 (lora_alpha = 2 r) for PEFT. ``layers``: the last N, or
    a list of indices; ``keys``: q, k, v, o, gate, up, down or paths inside a block.
    ``force`` replaces only a previous lorakit output.
    """
    if kind not in ("lora", "dora"):
        raise AdapterError("unknown adapter kind", expected="lora or dora", found=repr(kind))
    if format not in ("mlx-lm", "peft"):
        raise AdapterError("unknown adapter format", expected="mlx-lm or peft",
                           found=repr(format))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError("rank must be a positive integer", found=repr(rank))
    ck = source.open(checkpoint_path, checkpoint=True)
    prefix, n_layers = _layer_prefix(list(ck.tensors))
    n_layers = int(ck.config.get("num_hidden_layers", n_layers))
    if isinstance(layers, int) and not isinstance(layers, bool):
        if not 0 < layers <= n_layers:
            raise AdapterError("layers out of range", expected=f"1..{n_layers} (last N layers)",
                               found=str(layers))
        layer_list = list(range(n_layers - layers, n_layers))
    else:
        layer_list = sorted({int(i) for i in layers})
        bad = [i for i in layer_list if not 0 <= i < n_layers]
        if bad or not layer_list:
            raise AdapterError("layer indices out of range", expected=f"0..{n_layers - 1}",
                               found=str(bad or "none"))
    if scale is None:
        scale = 20.0 if format == "mlx-lm" else 2.0
    out = check_output_path(path, protected=[ck.path], force=force, allow_empty=True,
                            overlap_message="adapter output would overlap the checkpoint "
                            "directory")
    sites = _find_sites(ck, layer_list, list(keys), prefix)
    if kind == "dora" and format == "mlx-lm" and any(s.switch for s in sites):
        raise AdapterError("mlx-lm has no DoRA for MoE experts (SwitchLinear)",
                           expected="kind='lora', or keys without gate/up/down, "
                           "or format='peft'", found="DoRA on stacked experts")
    targets = _targets(ck, sites, rank, float(scale), kind, format, seed, delta_std)
    adapter = Adapter(ck.path, format, targets, {}, ck.path / "none", kind)
    if format == "mlx-lm":
        cfg = {  # the rest of the adapter_config.json that ``mlx_lm lora`` writes
            "adapter_path": str(out),
            "batch_size": 4, "config": None, "data": "synthetic", "fine_tune_type": kind,
            "grad_accumulation_steps": 1, "grad_checkpoint": False, "iters": 1000,
            "learning_rate": 1e-05, "lora_parameters": {
                "rank": rank, "dropout": 0.0, "scale": float(scale),
                "keys": list(dict.fromkeys(s.rel for s in sites))},
            "lr_schedule": None, "mask_prompt": False, "max_seq_length": 2048,
            "model": str(ck.path), "num_layers": n_layers - min(layer_list), "optimizer": "adam",
            "resume_adapter_file": None, "save_every": 100, "seed": seed, "steps_per_eval": 200,
            "steps_per_report": 10, "test": False, "test_batches": 500, "train": True,
            "val_batches": 25,
        }
    else:
        all_layers = layer_list == list(range(n_layers))
        cfg = {"base_model_name_or_path": str(ck.path),
               "layers_pattern": None if all_layers else "layers",
               "layers_to_transform": None if all_layers else layer_list,
               "target_modules": sorted({t.module.rsplit(".", 1)[-1] for t in targets})}
    save_adapter(adapter, out, format=format, force=force, dtype="F32",
                 num_layers=n_layers - min(layer_list), protected=[ck.path],
                 verb="synth-adapter", config=cfg, mark=SYNTH_MARK,
                 provenance={"kind": kind, "format": format, "rank": rank, "scale": float(scale),
                             "layers": layer_list, "seed": seed, "delta_std": delta_std})
    return out


def _targets(ck, sites: List[_Site], rank: int, scale: float, kind: str, format: str,
             seed: int, delta_std: float) -> List[LoraTarget]:
    """One target per site (PEFT: one per expert of a stacked site), drawn per site."""
    out: List[LoraTarget] = []
    for site in sites:
        rng = np.random.default_rng([seed, zlib.crc32(site.module.encode())])
        lead, (n_out, n_in) = tuple(site.shape[:-2]), site.shape[-2:]
        # A (…, r, in), B (…, out, r) in f32 with std(scale * B @ A) = delta_std
        bound = 1.0 / math.sqrt(n_in)
        A = rng.uniform(-bound, bound, size=lead + (rank, n_in)).astype(np.float32)
        b_std = delta_std / (abs(scale) * math.sqrt(rank) * bound / math.sqrt(3.0))
        B = (rng.standard_normal(size=lead + (n_out, rank)) * b_std).astype(np.float32)
        norms = _row_norms(ck, site) if kind == "dora" else None
        split = site.switch and format != "mlx-lm"  # PEFT: one module per expert
        stacked = "switch" if site.switch and not split else "linear"
        for e, module in enumerate(site.expert_modules if split else (site.module,)):
            a, b = (A[e], B[e]) if split else (A, B)
            m = None
            if norms is not None:
                nrm = norms[e] if split else norms
                m = nrm * (1 + 0.01 * rng.standard_normal(n_out)).astype(np.float32)
            out.append(LoraTarget(module, stacked, a, b, scale, m))
    return out
