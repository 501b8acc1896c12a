"""Hand-built rank memories for the pure protocol tests: descriptions only, nothing allocated.

A small hybrid model per TP rank: GQA KV (HND pages), a Mamba component (conv with q|k|v
sub-blocks, temporal state), a head-sharded SWA component and one aux buffer. Addresses are
made up: the connection machines and rooms never touch memory.
"""

from __future__ import annotations

from pdwire import wire
from pdwire.runtime.engine import (
    AuxBuffer,
    HeadGeometry,
    Indexing,
    KvPool,
    Layout,
    MemoryKind,
    ParallelRank,
    RankMemory,
    StateKind,
    StatePool,
    StateTensor,
)

LAYERS, HEADS, HEAD_BYTES, PAGE, PAGES = 2, 4, 16, 4, 32
CONV_BLOCKS, CONV_WIDTH, SSM_HEADS, SSM_BYTES = (8, 8, 16), 6, 4, 64
STRIDE = 1 << 24
MODEL = wire.ModelFingerprint(model_name="tiny-hybrid", revision="r1", dtype="bf16", num_layers=LAYERS)


def _bases(base: int, n: int) -> tuple[int, ...]:
    return tuple(base + i * STRIDE for i in range(n))


def hybrid(
    tp: int, rank: int, *, components: int = 2, base: int = 1 << 36, sub_blocks: bool = True
) -> RankMemory:
    """Rank ``rank`` of ``tp``; ``components`` = 2 (Mamba and SWA) or 1 (Mamba only, what 1.0
    can carry, with ``sub_blocks=False`` too: one conv block)."""
    heads = HEADS // tp
    page = PAGE * heads * HEAD_BYTES
    kv = KvPool(
        _bases(base, LAYERS), _bases(base + LAYERS * STRIDE, LAYERS), (page * PAGES,) * LAYERS, page,
        PAGE, Layout.HND, heads, HEADS, HEAD_BYTES, memory_kind=MemoryKind.DRAM,
    )  # fmt: skip
    conv_axis = sum(CONV_BLOCKS) // tp
    conv = StateTensor(
        "conv", _bases(base + 8 * STRIDE, LAYERS), (conv_axis * CONV_WIDTH * 4,) * LAYERS,
        conv_axis * CONV_WIDTH, conv_axis, CONV_BLOCKS if sub_blocks else None,
    )  # fmt: skip
    ssm = SSM_HEADS // tp
    temporal = StateTensor(
        "temporal", _bases(base + 12 * STRIDE, LAYERS), (ssm * SSM_BYTES * 4,) * LAYERS, ssm * SSM_BYTES, ssm
    )
    state = [StatePool(StateKind.MAMBA, Indexing.SLOT, (conv, temporal), memory_kind=MemoryKind.DRAM)]
    if components == 2:
        swa = tuple(
            StateTensor(name, _bases(base + (16 + 4 * i) * STRIDE, LAYERS), (page * 8,) * LAYERS, page)
            for i, name in enumerate(("k", "v"))
        )
        heads_geometry = HeadGeometry(PAGE, Layout.HND, heads, HEADS, HEAD_BYTES)
        state.append(
            StatePool(StateKind.SWA, Indexing.PAGE, swa, heads=heads_geometry, memory_kind=MemoryKind.DRAM)
        )
    aux = (AuxBuffer("out", base + 30 * STRIDE, 64 * 8, 64),)
    return RankMemory(ParallelRank(tp, rank), kv, tuple(state), aux)
