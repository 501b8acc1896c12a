"""Sliding-window (and chunked-local) KV cache groups as the vLLM connector describes them,
checked byte for byte through pdwire's planner and the reference executor.

A window group's blocks are laid out like full attention's (vLLM CPU: per layer ``[blocks,
heads, block_size, 2 * head_size]``, each head's K page then its V page); it is a paged SWA
state component whose request indices are the live pages only. Every destination byte of a
listed page must be the decode rank's head share of one full logical cache, every other byte
(blocks outside the window included) untouched, for equal and different TP sizes, with the
window group aliasing the full-attention group's memory (the hybrid allocator), and for a model
of window groups only (the first one is then the KV page list).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import pdwire.runtime.engine as pd
from pdwire.integrations.vllm.memory import (
    AttentionGroup,
    Described,
    LayerTensor,
    WindowGroup,
    describe,
    kv_window,
)
from pdwire.runtime.planner import has_tp_sharded_state, prepare_peer, regions, route_decode_rank
from pdwire.runtime.planner.errors import PlanError
from pdwire.runtime.planner.reference_executor import AddressSpace, execute

F32 = 4
BLOCKS, N, C, H = 8, 4, 8, 2  # blocks, tokens per block, head size, total KV heads
WINDOW = 6  # tokens: with n = 13 computed tokens blocks 2 and 3 are live (skipped 13 - 6 + 1 = 8)
SW, FULL = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"


@dataclass
class Rank:
    space: AddressSpace
    described: Described
    layers: dict[str, np.ndarray]  # per layer, the raw bytes [blocks, block bytes]


# vLLM's [blocks, heads, block_size, 2 * head_size] in the CPU backend's meaning (per head its K
# page, then its V page) and in the GPU backends' (K|V per token and head), LBHNC or LBNHC
LAYOUTS = ("cpu", "lbhnc", "lbnhc")


def attn_tensor(name: str, base: int, hl: int, layout: str = "cpu") -> LayerTensor:
    unit = 2 * C * F32  # K|V of one token and head (or, CPU, two tokens' K or V)
    head, token = (N * unit, unit) if layout != "lbnhc" else (unit, hl * unit)
    return LayerTensor(name, base, (hl * N * unit, head, token, F32), (BLOCKS, hl, N, 2 * C))


def arrange(logical: np.ndarray, layout: str) -> np.ndarray:
    """A rank's blocks ``[blocks, block bytes]`` from its heads of ``[blocks, heads, tokens, K|V,
    head bytes]``, in the layout's byte order."""
    order = {"cpu": (0, 1, 3, 2, 4), "lbhnc": (0, 1, 2, 3, 4), "lbnhc": (0, 2, 1, 3, 4)}[layout]
    return logical.transpose(order).reshape(logical.shape[0], -1)


def attention(layers: tuple[str, ...], hl: int, layout: str = "cpu") -> AttentionGroup:
    return AttentionGroup(layers, N, hl, C, F32, total_kv_heads=H, kv_per_token=layout != "cpu")


def window(layers: tuple[str, ...], hl: int, layout: str = "cpu") -> WindowGroup:
    return WindowGroup(attention(layers, hl, layout), sliding_window=WINDOW)


def build_rank(
    tp: int,
    r: int,
    base: int,
    seed: int,
    *,
    full: bool = True,
    aliased: bool = False,
    strided: bool = True,
    layout: str = "cpu",
) -> Rank:
    """One rank: a sliding-window layer and (``full``) a full-attention layer, each its own
    allocation or (``aliased``) one allocation both groups' block tables index."""
    hl = max(1, H // tp)
    block = hl * N * 2 * C * F32
    space = AddressSpace()
    rng = np.random.default_rng(seed)
    names = [SW, FULL] if full else [SW]
    bases = {SW: base, FULL: base if aliased else base + (1 << 32)}
    allocations = [SW] if aliased else names  # aliased: one allocation, named by the window layer
    layers = {n: space.allocate(bases[n], BLOCKS * block, rng).reshape(BLOCKS, block) for n in allocations}
    tensors = {n: attn_tensor(n, bases[n], hl, layout) for n in names}
    groups: list[AttentionGroup | WindowGroup] = [window((SW,), hl, layout)]
    if full:
        groups.append(attention((FULL,), hl, layout))
    d = describe(groups, tensors, BLOCKS, tp_size=tp, tp_rank=r, layer_ids={SW: 0, FULL: 1}, strided=strided)
    return Rank(space, d, layers)


def _heads(tp: int, r: int) -> list[int]:
    return list(range(r * H // tp, (r + 1) * H // tp)) if tp <= H else [r * H // tp]


def move(
    prefill_tp: int, decode_tp: int, *, aliased: bool = False, full: bool = True, layout: str = "cpu"
) -> None:
    """The prompt's KV pages and the window's live pages, prefill -> decode, for every decode rank."""
    rng = np.random.default_rng(7)
    logical = {n: rng.integers(0, 256, (BLOCKS, H, N, 2, C * F32), dtype=np.uint8) for n in (SW, FULL)}
    n = 13
    live = window((SW,), 1).live_pages(n)
    assert list(live) == [2, 3]
    src_kv, dst_kv = [0, 1, 6, 4], [7, 5, 1, 0]  # the full layer's pages of the prompt
    src_sw, dst_sw = [3, 2], [3, 6]  # the window's pages at positions 2 and 3
    if aliased:  # one block pool: the groups' blocks are distinct ids of it
        src_sw, dst_sw = [3, 2], [4, 6]
        src_kv, dst_kv = [0, 1, 6, 5], [7, 5, 1, 0]
    if not full:
        src_kv, dst_kv, src_sw, dst_sw = src_sw, dst_sw, [], []
    prefill = []
    for r in range(prefill_tp):
        rank = build_rank(
            prefill_tp, r, (1 << 40) + r * (1 << 36), r, full=full, aliased=aliased, layout=layout
        )
        for name, a in rank.layers.items():
            a[:] = arrange(logical[name][:, _heads(prefill_tp, r)], layout)
        prefill.append(rank)
    sharded = has_tp_sharded_state(prefill[0].described.memory)
    assert sharded == full  # the window component is sliced by head
    for d in range(decode_tp):
        rank = build_rank(
            decode_tp, d, (1 << 44) + d * (1 << 36), 100 + d, full=full, aliased=aliased, layout=layout
        )
        before = {name: a.copy() for name, a in rank.layers.items()}
        route = route_decode_rank(prefill_tp, decode_tp, d, is_mla=False, sharded_state=sharded)
        for p in route.prefill_ranks:
            src_mem, dst_mem = prefill[p].described.memory, rank.described.memory
            plan = prepare_peer(src_mem, dst_mem)
            state = ([src_sw], [dst_sw]) if full else ((), ())
            table = plan.plan_request(src_kv, dst_kv, *state).table()
            execute(table, prefill[p].space, rank.space, regions(src_mem), regions(dst_mem))
        expected = {name: a.copy() for name, a in before.items()}
        share = {name: arrange(full_[:, _heads(decode_tp, d)], layout) for name, full_ in logical.items()}
        # aliased: the full layer's pages are blocks of the window layer's allocation
        kv_layer = FULL if full and not aliased else SW
        for s, t in zip(src_kv, dst_kv, strict=True):
            expected[kv_layer][t] = share[kv_layer][s]
        for s, t in zip(src_sw, dst_sw, strict=True):
            expected[SW][t] = share[SW][s]
        for name, a in rank.layers.items():
            np.testing.assert_array_equal(a, expected[name], err_msg=f"decode rank {d} layer {name}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_window_pages_move_by_head_across_tp_sizes(prefill_tp: int, decode_tp: int, layout: str) -> None:
    move(prefill_tp, decode_tp, layout=layout)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2)])
def test_window_group_aliasing_the_full_attention_memory(prefill_tp: int, decode_tp: int) -> None:
    move(prefill_tp, decode_tp, aliased=True)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1)])
def test_window_groups_only_the_first_is_the_kv_page_list(prefill_tp: int, decode_tp: int) -> None:
    move(prefill_tp, decode_tp, full=False)


def test_describes_a_window_group_as_a_paged_swa_component_sharded_by_head() -> None:
    d = build_rank(1, 0, 1 << 40, 0).described
    (swa,) = d.memory.state
    span = N * C * F32
    assert (swa.kind, swa.indexing, swa.layer_ids) == (pd.StateKind.SWA, pd.Indexing.PAGE, (0,))
    assert swa.heads is None and not swa.replicated  # sharded on the tensor's first axis instead
    (t,) = swa.tensors
    assert (t.bytes_per_slot, t.sharded_axis_size, t.stride, t.offset) == (H * 2 * span, H, H * 2 * span, 0)
    assert d.kv_group == 1 and d.state_groups == (0,) and d.tp_sliceable
    assert kv_window([window((SW,), H), None]) == 0 and kv_window([window((SW,), H)] * 2) == 0
    opaque = build_rank(1, 0, 1 << 40, 0, strided=False).described  # a wire without item strides
    ((whole,),) = [c.tensors for c in opaque.memory.state]
    assert whole.sharded_axis_size is None and whole.bytes_per_slot == H * 2 * span


def test_opaque_window_blocks_are_refused_across_tp_sizes() -> None:
    src = build_rank(1, 0, 1 << 40, 0, strided=False).described.memory
    dst = build_rank(2, 0, 1 << 44, 1, strided=False).described.memory
    with pytest.raises(PlanError):
        prepare_peer(src, dst)


def test_a_request_whose_window_page_is_also_a_kv_page_is_refused() -> None:
    """Aliased groups: a decode block named by both lists would receive two writes."""
    src = build_rank(1, 0, 1 << 40, 0, aliased=True).described.memory
    dst = build_rank(1, 0, 1 << 44, 1, aliased=True).described.memory
    plan = prepare_peer(src, dst)
    with pytest.raises(PlanError, match=r"overlap|twice|share"):
        plan.check_request([1, 2], [[2]])


def test_live_pages_of_sliding_and_chunked_windows() -> None:
    sliding = window((SW,), H)
    assert list(sliding.live_pages(3)) == [0]  # shorter than the window: every block
    assert list(sliding.live_pages(13)) == [2, 3]
    assert list(sliding.live_pages(16)) == [2, 3]  # skipped 11: block 2 still holds token 11
    chunked = WindowGroup(sliding.attention, chunk=8)
    assert list(chunked.live_pages(13)) == [2, 3] and list(chunked.live_pages(16)) == []
    assert chunked.kind == "chunked-local" and sliding.kind == "sliding-window"


def test_a_window_with_no_live_page_sends_nothing_of_it() -> None:
    """Chunked-local attention right at a chunk boundary holds no live block: both lists empty."""
    src = build_rank(1, 0, 1 << 40, 0)
    dst = build_rank(1, 0, 1 << 44, 1)
    before = dst.layers[SW].copy()
    plan = prepare_peer(src.described.memory, dst.described.memory)
    table = plan.plan_request([0, 1], [2, 3], [[]], [[]]).table()
    execute(table, src.space, dst.space, regions(src.described.memory), regions(dst.described.memory))
    np.testing.assert_array_equal(dst.layers[SW], before)
    np.testing.assert_array_equal(dst.layers[FULL][[2, 3]], src.layers[FULL][[0, 1]])
