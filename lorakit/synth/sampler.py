"""Random values for synthetic tensors: fast N(0, std^2) draws in a float format's storage."""
from __future__ import annotations

import zlib
from typing import Iterator, Tuple

import numpy as np

from .. import numerics as nm

__all__ = []

_PIECE = 1 << 16  # elements per generated piece: the table lookups stay in cache
_WRITE_CHUNK = 1 << 22  # elements handed to the writer at a time (8 MB of bf16)


def _fill_kind(name: str, shape: Tuple[int, ...]) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1 and "norm" in name and leaf == "weight":
        return "ones"  # RMSNorm / LayerNorm gains: 1, so activations keep their scale
    if leaf == "bias" or leaf.endswith("_bias"):
        return "zeros"
    return "normal"


class _Sampler:
    """Fast N(0, std^2) values in a float format's storage, by table lookup."""

    def __init__(self, code: str, std: float, seed: int) -> None:
        self.code = code
        self.fmt = nm.float_format(code)
        rng = np.random.default_rng([seed, 0x5EED])
        draws = rng.standard_normal(1 << 16) * std
        if code == "F32":
            self.table = draws.astype(np.float32).view(np.uint32)
        else:
            self.table = nm.round_to_format(draws, self.fmt)
        self.one = nm.round_to_format(np.array([1.0]), self.fmt)[0]
        self.seed = seed

    def chunks(self, name: str, numel: int, kind: str) -> Iterator[np.ndarray]:
        """The tensor's storage in pieces of at most ``_WRITE_CHUNK`` elements. Each
        tensor has its own stream (seeded by its name), so values do not depend on
        which other tensors were written."""
        st = self.fmt.storage
        if kind != "normal":
            fill = self.one if kind == "ones" else 0
            for start in range(0, numel, _WRITE_CHUNK):
                yield np.full(min(_WRITE_CHUNK, numel - start), fill, dtype=st)
            return
        bitgen = np.random.PCG64(np.random.SeedSequence([self.seed, zlib.crc32(name.encode())]))
        f32 = self.code == "F32"
        # one buffer reused for every chunk: the writer has consumed a chunk before
        # the next is asked for, and fresh 8 MB arrays would cost a page fault per page
        buf = np.empty(min(_WRITE_CHUNK, numel), dtype=st)
        for start in range(0, numel, _WRITE_CHUNK):
            m = min(_WRITE_CHUNK, numel - start)
            out = buf[:m]
            words = -(-m // 2) if f32 else -(-m // 4)
            rnd = bitgen.random_raw(words).view(np.uint32 if f32 else np.uint16)
            for s in range(0, m, _PIECE):
                e = min(m, s + _PIECE)
                if f32:
                    # high half picks a normal draw; the low 13 mantissa bits are
                    # redrawn so f32 weights take more than 65,536 distinct values
                    r = rnd[s:e]
                    np.take(self.table, (r >> np.uint32(16)).astype(np.uint16), out=out[s:e])
                    out[s:e] ^= r & np.uint32(0x1FFF)
                else:
                    np.take(self.table, rnd[s:e], out=out[s:e])
            yield out
