"""The intended delta lives in lorakit.fusion.delta; every caller gets its numbers.

Each test recomputes what a caller reports from ``delta.intended`` / ``delta.lowrank``
and requires the caller's value: the nearest fuse is the intended weight correctly
rounded, the merge check's target is the intended weight, delta norms are the norms of
the low-rank change, and the re-quantization survival projects on intended - base
(DoRA's rescaling included).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import lorakit
from lorakit import numerics as nm
from lorakit.fusion import delta as dl
from lorakit.fusion.core import fuse_bindings
from lorakit.fusion.delta import intended_pieces
from lorakit.fusion.quant import RequantStat, dequantize_raw, quantize_raw, requant_survival
from lorakit.inspect.deltas import delta_norms
from lorakit.io.adapters.base import LoraTarget
from lorakit.io.adapters.load import load_adapter
from lorakit.io.adapters.naming import bind, bindings_by_tensor
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.weights import weight_f64

DATA = Path(__file__).resolve().parents[2] / "data"
CASES = [("tiny-qwen3", "lora"), ("tiny-qwen3", "dora"), ("tiny-qwen3", "lora-embed"),
         ("tiny-qwen3", "peft-lora"), ("tiny-qwen3-moe", "moe-lora")]


def _binds(model: str, adapter: str):
    ck = Checkpoint(DATA / model)
    return ck, bindings_by_tensor(bind(load_adapter(DATA / "adapters" / adapter), ck))


def _w64(ck: Checkpoint, tensor: str, slot):
    w = weight_f64(ck, tensor)
    return w if slot is None else w[slot]


@pytest.mark.parametrize("model,adapter", CASES)
def test_nearest_fuse_is_intended_rounded_once(model, adapter):
    ck, by_tensor = _binds(model, adapter)
    for tensor, binds in by_tensor.items():
        raw, code = ck.read(tensor), ck.tensors[tensor].dtype
        fused, fcode = fuse_bindings(raw, code, binds, "nearest", "preserve", tensor)
        fmt = nm.float_format(fcode)
        for p in dl.tensor_pieces(binds):
            T = dl.intended(_w64(ck, tensor, p.slot), p)
            got = nm.to_float64(fused if p.slot is None else fused[p.slot], fmt)
            rounded = nm.to_float64(nm.round_to_format(T, fmt), fmt)
            # the fuse rounds the exact sum; T is its float64 evaluation, so the two may
            # differ only where T sits within f64 noise of a tie: rarely, and then the
            # fused value is as close to T as the rounded one is
            off = got != rounded
            assert off.mean() < 1e-4, (tensor, off.mean())
            assert np.allclose(np.abs(got - T)[off], np.abs(rounded - T)[off], rtol=1e-6)


@pytest.mark.parametrize("model,adapter", CASES)
def test_merge_check_target_is_intended(model, adapter):
    ck, by_tensor = _binds(model, adapter)
    src = lorakit.open(DATA / model)
    for tensor, binds in by_tensor.items():
        Ts = [T for _, _, T in intended_pieces(src, src, tensor, binds)]
        want = [dl.intended(_w64(ck, tensor, p.slot), p) for p in dl.tensor_pieces(binds)]
        assert np.array_equal(np.concatenate([t.reshape(-1) for t in Ts]),
                              np.concatenate([t.reshape(-1) for t in want]))


@pytest.mark.parametrize("adapter", ["lora", "dora", "lora-embed", "moe-lora"])
def test_delta_norms_are_norms_of_the_lowrank_change(adapter):
    ad = load_adapter(DATA / "adapters" / adapter)
    rep = delta_norms(ad)
    pieces = [p for t in ad.targets for p in dl.target_pieces(t)]
    assert len(rep.rows) == len(pieces)
    for row, p in zip(rep.rows, pieces):
        assert row["module"] == p.target.module and row["expert"] == p.expert
        fro = float(np.linalg.norm(dl.lowrank(p)))
        assert row["fro"] == pytest.approx(fro, rel=1e-9)


def test_requant_survival_projects_on_intended_minus_base():
    ck, by_tensor = _binds("tiny-qwen3-4bit", "lora-4bit")
    tensor, binds = next(iter(by_tensor.items()))
    module = tensor[: -len(".weight")]
    q = ck.quant_params(module)
    code = ck.tensors[f"{module}.scales"].dtype
    base = dequantize_raw(ck, module, None)
    fused, fcode = fuse_bindings(base, code, binds, "nearest", "preserve", tensor)
    parts = quantize_raw(fused, fcode, q)
    stat = requant_survival(base, code, parts, fcode, q, binds, tensor)
    assert isinstance(stat, RequantStat)
    # recompute from the intended weight and MLX's own dequantization of the new codes
    import mlx.core as mx

    from lorakit.io.formats.safetensors import raw_to_mx

    new = np.array(mx.dequantize(mx.array(parts["weight"]), raw_to_mx(parts["scales"], fcode),
                                 raw_to_mx(parts["biases"], fcode), group_size=q.group_size,
                                 bits=q.bits, mode=q.mode).astype(mx.float32)).astype(np.float64)
    W = nm.to_float32(base, nm.float_format(code)).astype(np.float64)
    (p,) = dl.tensor_pieces(binds)
    d = dl.intended(W, p) - W
    assert stat.survived == pytest.approx(float(((new - W) * d).sum() / (d * d).sum()), rel=1e-9)


def test_dora_survival_counts_the_magnitude():
    """A DoRA piece whose low-rank part is zero still changes the weight (the rows are
    rescaled to the magnitudes): the intended change is that rescaling, not zero."""
    W = np.array([[3.0, 4.0], [1.0, 0.0]])
    t = LoraTarget("m", "linear", np.zeros((1, 2), np.float32), np.zeros((2, 1), np.float32),
                   1.0, magnitude=np.array([10.0, 2.0], np.float32))
    (p,) = dl.target_pieces(t)
    assert dl.lowrank(p).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert dl.intended(W, p).tolist() == [[6.0, 8.0], [2.0, 0.0]]


def test_pieces_of_stacked_experts_land_on_their_slots():
    ck, by_tensor = _binds("tiny-qwen3-moe", "moe-lora")
    stacked = [(t, b) for t, b in by_tensor.items() if len(b[0].shape) == 3]
    assert stacked
    for tensor, binds in stacked:
        pieces = dl.tensor_pieces(binds)
        assert [p.slot for p in pieces] == list(range(binds[0].shape[0]))
        assert all(p.shape == tuple(binds[0].shape[1:]) for p in pieces)
