"""Ranks of a small NHD KV cache in backend-allocated memory, for worker tests."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pdwire.runtime import engine as pd


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int  # in the whole model
    head_bytes: int
    page: int  # tokens per page
    pool: int  # pages per layer


@dataclass
class Rank:
    backend: pd.Backend
    pools: list[np.ndarray]  # K layers then V layers: [pool, page, heads of the rank, head_bytes]
    memory: pd.RankMemory


def rank(shape: Shape, backend_name: str, name: str, tp: int, r: int, fill: int | None) -> Rank:
    """TP rank ``r`` of ``tp``: its heads' pages, random bytes from seed ``fill`` (None: zeros)."""
    backend = pd.create_backend(backend_name, agent_name=f"{name}-{time.monotonic_ns()}")
    heads = shape.heads // tp
    item = shape.page * heads * shape.head_bytes
    buf = backend.allocate("kv", 2 * shape.layers * shape.pool * item).array
    if fill is not None:
        buf[:] = np.random.default_rng(fill).integers(0, 256, len(buf), dtype=np.uint8)
    size = shape.pool * item
    pools = [
        buf[i * size : (i + 1) * size].reshape(shape.pool, shape.page, heads, shape.head_bytes)
        for i in range(2 * shape.layers)
    ]
    bases = [int(p.ctypes.data) for p in pools]
    kv = pd.KvPool(
        tuple(bases[: shape.layers]), tuple(bases[shape.layers :]), (size,) * shape.layers, item, shape.page,
        pd.Layout.NHD, heads, shape.heads, shape.head_bytes, memory_kind=pd.MemoryKind.DRAM,
    )  # fmt: skip
    return Rank(backend, pools, pd.RankMemory(pd.ParallelRank(tp, r), kv))
