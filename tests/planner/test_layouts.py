"""Real engines' layouts: strided items, tensors at offsets inside one page or slot, aliased
registrations, and a sharded state axis that is not the first per-slot axis."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdwire.runtime.descriptors import MemoryKind
from pdwire.runtime.planner import (
    GeometryMismatch,
    Indexing,
    KvPool,
    Layout,
    OverlappingDestination,
    ParallelRank,
    RankMemory,
    StateKind,
    StatePool,
    StateTensor,
    UnsupportedTransfer,
    prepare_peer,
    region_index,
    regions,
    route_decode_rank,
)
from pdwire.runtime.planner.reference_executor import AddressSpace, execute

# ---- issue: conv state stored [slots, kernel-1, dim/TP] (Kimi-Linear) ----------------------------

CHANNELS = (2, 2, 2)  # q | k | v
ROWS = 2  # kernel - 1


def _kimi_conv(tp: int, rank: int, base: int, slots: int = 2) -> RankMemory:
    axis = sum(CHANNELS) // tp
    item = ROWS * axis  # 1-byte elements
    conv = StateTensor("conv", (base,), (item * slots,), item, axis, CHANNELS, outer_rows=ROWS)
    return RankMemory(ParallelRank(tp, rank), None, (StatePool(StateKind.MAMBA, Indexing.SLOT, (conv,)),))


def _full_slot() -> np.ndarray:
    """byte value = 16 x row + global channel"""
    return np.array([[16 * row + ch for ch in range(sum(CHANNELS))] for row in range(ROWS)], np.uint8)


def _shard(tp: int, rank: int) -> list[int]:
    rows = []
    for row in _full_slot():
        parts = np.split(row, np.cumsum(CHANNELS)[:-1])
        rows.append(np.concatenate([np.split(p, tp)[rank] for p in parts]))
    return np.concatenate(rows).tolist()


def _move(prefill_tp: int, decode_tp: int) -> dict[int, list[int]]:
    """Every decode rank's slot 1 after all its prefill ranks wrote their slot 0 into it."""
    item_src = ROWS * sum(CHANNELS) // prefill_tp
    spaces, sources = {}, {}
    for p in range(prefill_tp):
        space = AddressSpace()
        buffer = space.allocate((p + 1) << 32, item_src * 2)
        buffer[:item_src] = _shard(prefill_tp, p)
        spaces[p], sources[p] = space, _kimi_conv(prefill_tp, p, (p + 1) << 32)
    held = {}
    for d in range(decode_tp):
        dst = _kimi_conv(decode_tp, d, (d + 100) << 32)
        space = AddressSpace()
        item_dst = ROWS * sum(CHANNELS) // decode_tp
        buffer = space.allocate((d + 100) << 32, item_dst * 2)
        buffer[:] = 255
        for p in route_decode_rank(prefill_tp, decode_tp, d, is_mla=False).prefill_ranks:
            plan = prepare_peer(sources[p], dst)
            execute(plan.plan_state([[0]], [[1]])[0].table, spaces[p], space)
        assert buffer[:item_dst].tolist() == [255] * item_dst  # slot 0 untouched
        held[d] = buffer[item_dst:].tolist()
    return held


def test_kimi_conv_smallest_case_moves_the_right_channels() -> None:
    # prefill TP 1 -> decode TP 2, q|k|v = 2|2|2, two rows: each decode rank holds q_i, k_i, v_i per row
    assert _move(1, 2) == {0: [0, 2, 4, 16, 18, 20], 1: [1, 3, 5, 17, 19, 21]}


@pytest.mark.parametrize(("prefill", "decode"), [(2, 1), (1, 2), (2, 2)])
def test_kimi_conv_every_tp_pair(prefill: int, decode: int) -> None:
    assert _move(prefill, decode) == {d: _shard(decode, d) for d in range(decode)}


def test_p4_to_d2_kimi_conv() -> None:
    global CHANNELS
    saved, CHANNELS = CHANNELS, (4, 4, 4)
    try:
        assert _move(4, 2) == {d: _shard(2, d) for d in range(2)}
    finally:
        CHANNELS = saved


def test_rows_around_the_axis_must_agree() -> None:
    src = _kimi_conv(1, 0, 1 << 32)
    flat = replace(src.state[0].tensors[0], outer_rows=1)
    dst = _kimi_conv(2, 0, 1 << 40)
    with pytest.raises(GeometryMismatch, match="rows around the sharded axis differ"):
        prepare_peer(replace(src, state=(replace(src.state[0], tensors=(flat,)),)), dst)
    same_tp = replace(dst, position=ParallelRank(1, 0), state=src.state)
    with pytest.raises(GeometryMismatch, match="another order"):  # same TP, transposed on one side
        prepare_peer(replace(src, state=(replace(src.state[0], tensors=(flat,)),)), same_tp)


# ---- vLLM: Mamba and attention groups on the same blocks --------------------------------------

BLOCKS, PAGE_STRIDE = 16, 32768
CONV, SSM = 1920, 8000  # int8 [blocks, 1, 1, 9920]: conv and SSM state in one page
TOKENS, HEAD_BYTES = 128, 64 * 2  # attention bf16 [blocks, 2, 128, 64]: K then V fill each block


def _vllm(base: int) -> RankMemory:
    """Layer 0 is Mamba, layer 1 attention; both groups use the same allocation (vLLM HMA)."""
    length = BLOCKS * PAGE_STRIDE
    kv_item = TOKENS * HEAD_BYTES
    kv = KvPool(
        (base,), (base,), (length,), kv_item, TOKENS, Layout.NHD, 1, 1, HEAD_BYTES,
        page_stride=PAGE_STRIDE, v_offset=kv_item,
    )  # fmt: skip
    conv = StateTensor("conv", (base,), (length,), CONV, slot_stride=PAGE_STRIDE)
    ssm = StateTensor("ssm", (base,), (length,), SSM, slot_stride=PAGE_STRIDE, offset=CONV)
    mamba = StatePool(StateKind.MAMBA, Indexing.SLOT, (conv, ssm))
    return RankMemory(ParallelRank(1, 0), kv, (mamba,))


def test_aliased_groups_are_one_registration() -> None:
    memory = _vllm(1 << 36)
    index = region_index(memory)
    assert index.kv_k == index.kv_v == (0,) and index.state == (((0,), (0,)),) and index.count == 1
    (region,) = regions(memory)
    assert (region.base, region.length) == (1 << 36, BLOCKS * PAGE_STRIDE)


def test_interleaved_kv_and_shared_mamba_page_move_in_one_descriptor_per_run() -> None:
    src, dst = _vllm(1 << 36), _vllm(1 << 44)
    assert 2 * TOKENS * HEAD_BYTES == PAGE_STRIDE and CONV + SSM < PAGE_STRIDE
    plan = prepare_peer(src, dst)
    kv = plan.plan_kv_chunk(0, [2, 3, 4, 9], [5, 6, 7, 1]).table
    # K and V of a block are adjacent, and so are consecutive blocks: one row per run, K+V together
    assert sorted(kv.length.tolist()) == [PAGE_STRIDE, 3 * PAGE_STRIDE]
    state = plan.plan_state([[0]], [[3]])[0].table
    assert state.length.tolist() == [CONV + SSM] and state.dst_addr.tolist() == [(1 << 44) + 3 * PAGE_STRIDE]


def test_a_request_naming_one_block_for_two_groups_is_refused() -> None:
    plan = prepare_peer(_vllm(1 << 36), _vllm(1 << 44))
    plan.check_request([1, 2], [[3]])
    with pytest.raises(OverlappingDestination, match="overlap"):
        plan.check_request([1, 2], [[2]])
    with pytest.raises(OverlappingDestination):
        plan.plan_request([5, 6], [1, 2], [[0]], [[2]])


def test_aliased_registration_of_two_memory_kinds_is_refused() -> None:
    memory = _vllm(1 << 36)
    host = replace(memory, state=(replace(memory.state[0], memory_kind=MemoryKind.DRAM),))
    with pytest.raises(GeometryMismatch, match="share memory but differ in memory kind"):
        regions(host)


def test_tensors_claiming_the_same_bytes_of_an_item_are_refused() -> None:
    memory = _vllm(1 << 36)
    kv = memory.kv
    assert kv is not None
    with pytest.raises(GeometryMismatch, match="k and v overlap inside one item"):
        regions(replace(memory, kv=replace(kv, v_offset=100)))
    conv, ssm = memory.state[0].tensors
    with pytest.raises(GeometryMismatch, match="conv and ssm overlap"):
        regions(replace(memory, state=(replace(memory.state[0], tensors=(conv, replace(ssm, offset=10))),)))
    with pytest.raises(GeometryMismatch, match="does not fit a stride"):
        regions(replace(memory, kv=replace(kv, v_offset=PAGE_STRIDE - 10)))


def test_layers_aliasing_at_different_bases_are_coalesced_across_entries() -> None:
    # two KV layers in one allocation, layer 1 half a stride after layer 0: no fused pattern fits
    # one stride, so the group's table is coalesced as a whole and stays minimal
    item, stride = 64, 128
    base = 1 << 36

    def pool(b: int) -> KvPool:
        return KvPool(
            (b, b + item), (b + (1 << 30), b + (1 << 30) + item), (stride * 8 + item, stride * 8),
            item, 4, Layout.NHD, 1, 1, item // 4, page_stride=stride,
        )  # fmt: skip

    src = RankMemory(ParallelRank(1, 0), pool(base))
    dst = RankMemory(ParallelRank(1, 0), pool(base + (1 << 33)))
    assert region_index(src).count == 2  # K layers share one registration, V layers another
    plan = prepare_peer(src, dst)
    table = plan.plan_kv_chunk(0, [0, 1], [2, 3]).table
    assert len(table.mergeable_pairs()) == 0
    # each side's K (and V) region is covered end to end by layer0/layer1 items of pages 2,3
    assert table.total_bytes == 2 * 2 * 2 * item and len(table) == 2


def test_state_kind_outside_the_model_is_refused_by_name() -> None:
    tail = StateTensor("k", (1 << 36,), (4096,), 512)
    memory = RankMemory(ParallelRank(1, 0), None, (StatePool(StateKind.DSA_TAIL, Indexing.ROW, (tail,)),))
    with pytest.raises(UnsupportedTransfer, match="state kind dsa_tail cannot be planned") as caught:
        regions(memory)
    assert caught.value.component == "state[0]:dsa_tail"


# ---- vLLM CPU attention: [blocks, heads, 2 * block_size, head_size], each head's K then its V ---

CPU_HEADS, CPU_TOKENS, CPU_HEAD = 4, 4, 2  # 4 KV heads, 4 tokens per block, 2 bytes per token and head
CPU_SPAN = CPU_TOKENS * CPU_HEAD  # one head's K (or V) page
CPU_BLOCKS = 4


def _vllm_cpu(tp: int, rank: int, base: int) -> RankMemory:
    heads = CPU_HEADS // tp
    head_stride = 2 * CPU_SPAN
    kv = KvPool(
        (base,), (base,), (CPU_BLOCKS * heads * head_stride,), heads * CPU_SPAN, CPU_TOKENS, Layout.HND,
        heads, CPU_HEADS, CPU_HEAD, page_stride=heads * head_stride, v_offset=CPU_SPAN,
        head_stride=head_stride,
    )  # fmt: skip
    return RankMemory(ParallelRank(tp, rank), kv)


def _cpu_block(block: int, heads: range) -> list[int]:
    """A block's bytes as vLLM CPU stores them: per head, K tokens then V tokens; byte value =
    64 x block + 16 x head + 8 x (0 K, 1 V) + byte of the head's page (0..7)."""
    return [64 * block + 16 * h + 8 * kv + b for h in heads for kv in (0, 1) for b in range(CPU_SPAN)]


def _cpu_move(prefill_tp: int, decode_tp: int, src_blocks: list[int], dst_blocks: list[int]) -> dict:
    """Every decode rank's buffer after its prefill ranks wrote ``src_blocks`` into ``dst_blocks``,
    and the rows each pair needed."""
    spaces, sources = {}, {}
    for p in range(prefill_tp):
        heads = CPU_HEADS // prefill_tp
        memory = _vllm_cpu(prefill_tp, p, (p + 1) << 32)
        space = AddressSpace()
        buffer = space.allocate((p + 1) << 32, CPU_BLOCKS * heads * 2 * CPU_SPAN)
        for block in range(CPU_BLOCKS):
            start = block * heads * 2 * CPU_SPAN
            buffer[start : start + heads * 2 * CPU_SPAN] = _cpu_block(
                block, range(p * heads, (p + 1) * heads)
            )
        spaces[p], sources[p] = space, memory
    held, rows = {}, {}
    for d in range(decode_tp):
        dst = _vllm_cpu(decode_tp, d, (d + 100) << 32)
        space = AddressSpace()
        buffer = space.allocate((d + 100) << 32, CPU_BLOCKS * (CPU_HEADS // decode_tp) * 2 * CPU_SPAN)
        buffer[:] = 255
        for p in route_decode_rank(prefill_tp, decode_tp, d, is_mla=False).prefill_ranks:
            table = prepare_peer(sources[p], dst).plan_kv_chunk(0, src_blocks, dst_blocks).table
            execute(table, spaces[p], space)
            rows[(p, d)] = len(table)
        held[d] = buffer.tolist()
    return {"held": held, "rows": rows}


def _expected(tp: int, rank: int, moves: dict[int, int]) -> list[int]:
    """Decode rank's buffer: its heads of source block ``moves[b]`` in block b, 255 elsewhere."""
    heads = CPU_HEADS // tp
    out: list[int] = []
    for block in range(CPU_BLOCKS):
        if block in moves:
            out += _cpu_block(moves[block], range(rank * heads, (rank + 1) * heads))
        else:
            out += [255] * heads * 2 * CPU_SPAN
    return out


def test_vllm_cpu_prefill_tp2_into_decode_tp1_one_row_per_head_pair_and_block() -> None:
    moved = _cpu_move(2, 1, [0, 1], [3, 1])
    assert moved["held"] == {0: _expected(1, 0, {3: 0, 1: 1})}
    # each prefill rank's two heads are adjacent (K, V, K, V) on both sides: one row per block
    assert moved["rows"] == {(0, 0): 2, (1, 0): 2}


def test_vllm_cpu_prefill_tp1_into_decode_tp2() -> None:
    moved = _cpu_move(1, 2, [0, 1, 2], [1, 2, 3])
    assert moved["held"] == {d: _expected(2, d, {1: 0, 2: 1, 3: 2}) for d in range(2)}
    # decode's consecutive blocks take one run of the prefill block's heads each: one row per block
    assert moved["rows"] == {(0, 0): 3, (0, 1): 3}


@pytest.mark.parametrize(("prefill", "decode"), [(4, 1), (1, 4), (4, 2), (2, 4), (2, 2)])
def test_vllm_cpu_every_tp_pair(prefill: int, decode: int) -> None:
    moved = _cpu_move(prefill, decode, [2, 0], [0, 3])
    assert moved["held"] == {d: _expected(decode, d, {0: 2, 3: 0}) for d in range(decode)}


def test_vllm_cpu_same_tp_moves_consecutive_blocks_in_one_row() -> None:
    assert _cpu_move(2, 2, [0, 1, 2], [1, 2, 3])["rows"] == {(0, 0): 1, (1, 1): 1}


def test_a_head_stride_outside_the_model_is_refused_by_name() -> None:
    memory = _vllm_cpu(1, 0, 1 << 36)
    kv = memory.kv
    assert kv is not None
    with pytest.raises(GeometryMismatch, match="head stride 1 is smaller than one unit"):
        regions(replace(memory, kv=replace(kv, layout=Layout.NHD, head_stride=1)))
    with pytest.raises(GeometryMismatch, match="token stride 7 is smaller than one token's heads"):
        regions(replace(memory, kv=replace(kv, layout=Layout.NHD, head_stride=CPU_HEAD, token_stride=7)))
    with pytest.raises(GeometryMismatch, match="smaller than one head's page"):
        regions(replace(memory, kv=replace(kv, head_stride=CPU_SPAN - 1)))
    with pytest.raises(GeometryMismatch, match="token stride 1 is smaller than one unit"):
        regions(replace(memory, kv=replace(kv, token_stride=1)))
    with pytest.raises(GeometryMismatch, match="v run 0 and k run 1 overlap"):  # V spills into K
        regions(replace(memory, kv=replace(kv, v_offset=CPU_SPAN + 1, page_stride=kv.stride + 8)))
    with pytest.raises(GeometryMismatch, match="does not fit a stride"):
        regions(replace(memory, kv=replace(kv, page_stride=kv.stride - 1)))
