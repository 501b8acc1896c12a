"""Small hand-built rank memories for unit tests of counts and errors."""

from __future__ import annotations

from dataclasses import replace

from pdwire.runtime.planner import (
    Indexing,
    KvPool,
    Layout,
    ParallelRank,
    RankMemory,
    StateKind,
    StatePool,
    StateTensor,
)

LAYER_STRIDE = 1 << 24


def kv_pool(
    tp: int,
    *,
    heads: int = 8,
    layers: int = 3,
    page_size: int = 4,
    bytes_per_head: int = 2,
    pages: int = 16,
    layout: Layout = Layout.NHD,
    is_mla: bool = False,
    base: int = 1 << 36,
) -> KvPool:
    per_rank = 1 if is_mla else max(1, heads // tp)
    item = page_size * per_rank * bytes_per_head
    k = tuple(base + i * LAYER_STRIDE for i in range(layers))
    v = () if is_mla else tuple(base + (layers + i) * LAYER_STRIDE for i in range(layers))
    return KvPool(
        k,
        v,
        (item * pages,) * layers,
        item,
        page_size,
        layout,
        per_rank,
        1 if is_mla else heads,
        bytes_per_head,
        is_mla,
    )


def mamba(
    tp: int,
    *,
    layers: int = 2,
    blocks: tuple[int, ...] = (8, 8, 16),
    unit: int = 3,
    base: int = 1 << 40,
    slots: int = 4,
    declare_axis: bool = True,
) -> StatePool:
    axis = sum(blocks) // tp
    conv = StateTensor(
        "conv",
        tuple(base + i * LAYER_STRIDE for i in range(layers)),
        (axis * unit * slots,) * layers,
        axis * unit,
        axis if declare_axis else None,
        blocks if declare_axis else None,
    )
    return StatePool(StateKind.MAMBA, Indexing.SLOT, (conv,))


def paged(
    kind: StateKind,
    *,
    item: int = 16,
    layers: int = 2,
    pages: int = 8,
    base: int = 1 << 41,
    replicated: bool = False,
) -> StatePool:
    tensor = StateTensor(
        "t", tuple(base + i * LAYER_STRIDE for i in range(layers)), (item * pages,) * layers, item
    )
    return StatePool(kind, Indexing.PAGE, (tensor,), replicated=replicated)


def rank(
    tp: int,
    tp_rank: int,
    kv: KvPool | None = None,
    state: tuple[StatePool, ...] = (),
    first_layer: int = 0,
    **position: int,
) -> RankMemory:
    return RankMemory(ParallelRank(tp, tp_rank, **position), kv, state, first_layer=first_layer)


def with_kv(memory: RankMemory, **changes: object) -> RankMemory:
    assert memory.kv is not None
    return replace(memory, kv=replace(memory.kv, **changes))
