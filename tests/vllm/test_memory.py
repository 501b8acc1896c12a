"""vLLM's cache layout as the connector describes it, checked byte for byte through pdwire's planner.

Each rank's memory is laid out the way vLLM 0.32's CPU build lays it out (observed with real
engines): per attention layer ``[blocks, heads, block_size, 2 * head_size]`` (each head's K, then
its V), and for the hybrid model one allocation per layer pair in which block ``b`` of the Mamba
layer (conv state ``[kernel - 1, x | B | C]`` then the SSM state, padded to the attention page) is
the same memory as block ``b`` of the attention layer. The connector's description goes through
``prepare_peer`` / ``plan_request`` and the reference executor, between ranks of equal TP in every
description mode (opaque whole blocks, strided, by head) and, described by head, between every
TP pair of 1, 2 (and 4 with replicated heads): every destination byte must be the decode rank's
share of one full logical cache (heads, x | B | C channels and SSM heads cut with numpy), and
every other byte untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from pdwire.integrations.vllm.memory import (
    AttentionGroup,
    Described,
    LayerTensor,
    LayoutError,
    MambaGroup,
    describe,
)
from pdwire.runtime.planner import has_tp_sharded_state, prepare_peer, regions, route_decode_rank
from pdwire.runtime.planner.reference_executor import AddressSpace, execute

F32 = 4
BLOCKS, N, C, H = 6, 4, 8, 2  # blocks, tokens per block, head size, total KV heads
M_HEADS, M_HD, M_G, M_S, K1 = 4, 2, 2, 2, 3  # Mamba2: heads, head dim, groups, d_state, kernel - 1
X, BC = M_HEADS * M_HD, M_G * M_S
SLOT = 5  # the prefill request's Mamba block


@dataclass
class Rank:
    space: AddressSpace
    described: Described
    attn: list[np.ndarray]  # per attention layer, the raw bytes [blocks, block bytes]
    mamba_bytes: int  # used bytes of a Mamba page (0: dense)


def attn_tensor(name: str, base: int, hl: int) -> LayerTensor:
    es = F32
    strides = (hl * N * 2 * C * es, N * 2 * C * es, 2 * C * es, es)
    return LayerTensor(name, base, strides, (BLOCKS, hl, N, 2 * C))


MODES = {"whole": (False, False), "strided": (True, False), "by_head": (True, True)}


def build_rank(
    hybrid: bool, tp: int, r: int, base: int, seed: int, strided: bool, head_strided: bool = False
) -> Rank:
    """One rank's memory laid out like vLLM's CPU build, filled with random bytes."""
    hl = max(1, H // tp)
    block = hl * N * 2 * C * F32
    space = AddressSpace()
    rng = np.random.default_rng(seed)
    names = (
        ["model.layers.1.self_attn.attn"]
        if hybrid
        else [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    )
    bufs = [space.allocate(base + i * (1 << 32), BLOCKS * block, rng) for i in range(len(names))]
    tensors = {n: attn_tensor(n, base + i * (1 << 32), hl) for i, n in enumerate(names)}
    layer_ids = {n: int(n.split(".")[2]) for n in names}
    groups: list[AttentionGroup | MambaGroup | None] = []
    used = 0
    if hybrid:
        conv_w = (X + 2 * BC) // tp
        conv_bytes, ssm_bytes = K1 * conv_w * F32, (M_HEADS // tp) * M_HD * M_S * F32
        used = conv_bytes + ssm_bytes
        assert used < block  # the Mamba page is padded to the attention page
        tensors["model.layers.0.mixer"] = LayerTensor(
            "model.layers.0.mixer", base, (block, 1), (BLOCKS, block)
        )
        layer_ids["model.layers.0.mixer"] = 0
        shapes = ((K1, conv_w), (M_HEADS // tp, M_HD, M_S))
        groups.append(
            MambaGroup(("model.layers.0.mixer",), shapes, (conv_bytes, ssm_bytes), (X, BC, BC), False)
        )
    groups.append(AttentionGroup(tuple(names), N, hl, C, F32, total_kv_heads=H))
    d = describe(
        groups,
        tensors,
        BLOCKS,
        tp_size=tp,
        tp_rank=r,
        layer_ids=layer_ids,
        strided=strided,
        head_strided=head_strided,
    )
    return Rank(space, d, [b.reshape(BLOCKS, block) for b in bufs], used)


def move(hybrid: bool, tp: int, mode: str) -> None:
    strided, by_head = MODES[mode]
    prefill = [build_rank(hybrid, tp, r, (1 << 40) + r * (1 << 36), r, strided, by_head) for r in range(tp)]
    decode = [
        build_rank(hybrid, tp, r, (1 << 44) + r * (1 << 36), 100 + r, strided, by_head) for r in range(tp)
    ]
    before = [[a.copy() for a in d.attn] for d in decode]
    # the prompt in prefill blocks [4, 1] (Mamba slot SLOT), written to decode blocks [2, 3] (slot 0)
    src_pages, dst_pages = np.array([4, 1]), np.array([2, 3])
    src_slot, dst_slot = np.array([SLOT]), np.array([0])
    for d, rank in enumerate(decode):
        route = route_decode_rank(tp, tp, d, is_mla=not by_head)
        assert list(route.prefill_ranks) == [d] and not route.dummy_prefill_ranks
        plan = prepare_peer(prefill[d].described.memory, rank.described.memory)
        state = ([src_slot], [dst_slot]) if hybrid else ((), ())
        table = plan.plan_request(src_pages, dst_pages, *state).table()
        src_mem, dst_mem = prefill[d].described.memory, rank.described.memory
        execute(table, prefill[d].space, rank.space, regions(src_mem), regions(dst_mem))
        for li, a in enumerate(rank.attn):
            src = prefill[d].attn[li]
            for s, t in zip(src_pages, dst_pages, strict=True):
                np.testing.assert_array_equal(a[t], src[s])
            untouched = [b for b in range(BLOCKS) if b not in dst_pages and not (hybrid and b == dst_slot[0])]
            np.testing.assert_array_equal(a[untouched], before[d][li][untouched])
        if hybrid:  # the Mamba page aliases the attention layer's block
            a, src = rank.attn[0], prefill[d].attn[0]
            if strided:  # only conv + SSM state; the page's padding stays as it was
                np.testing.assert_array_equal(a[0, : rank.mamba_bytes], src[SLOT, : rank.mamba_bytes])
                np.testing.assert_array_equal(a[0, rank.mamba_bytes :], before[d][0][0, rank.mamba_bytes :])
            else:
                np.testing.assert_array_equal(a[0], src[SLOT])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_dense_layout_moves_byte_for_byte(tp: int, mode: str) -> None:
    move(False, tp, mode)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_hybrid_layout_with_aliased_groups_moves_byte_for_byte(tp: int, mode: str) -> None:
    move(True, tp, mode)


# ---- different TP sizes: one full logical cache, each rank holding its share -------------------


def _heads(tp: int, r: int) -> list[int]:
    return [r * H // tp] if tp >= H else list(range(r * H // tp, (r + 1) * H // tp))


def _mamba_share(conv: np.ndarray, ssm: np.ndarray, tp: int, r: int) -> np.ndarray:
    """A rank's Mamba page bytes: per conv row its x, B and C channel shares, then its SSM heads."""
    rows = [np.concatenate([np.split(part, tp)[r] for part in np.split(row, [X, X + BC])]) for row in conv]
    return np.concatenate([np.concatenate(rows).reshape(-1), np.split(ssm, tp)[r].reshape(-1)])


def move_across_tp(hybrid: bool, prefill_tp: int, decode_tp: int) -> None:
    rng = np.random.default_rng(7)
    layers = 1 if hybrid else 2
    # full[layer][block, head, K|V, token*head bytes]: vLLM CPU's per-head K page then V page
    full = [rng.integers(0, 256, (BLOCKS, H, 2, N * C * F32), dtype=np.uint8) for _ in range(layers)]
    conv = rng.integers(0, 256, (K1, X + 2 * BC, F32), dtype=np.uint8)  # one slot, elements as bytes
    ssm = rng.integers(0, 256, (M_HEADS, M_HD * M_S * F32), dtype=np.uint8)
    src_pages, dst_pages, src_slot, dst_slot = [4, 1], [2, 3], SLOT, 0
    prefill = []
    for r in range(prefill_tp):
        rank = build_rank(hybrid, prefill_tp, r, (1 << 40) + r * (1 << 36), r, True, True)
        for li, a in enumerate(rank.attn):
            a[:] = full[li][:, _heads(prefill_tp, r)].reshape(BLOCKS, -1)
        if hybrid:
            share = _mamba_share(conv, ssm, prefill_tp, r)
            rank.attn[0][src_slot, : len(share)] = share
        prefill.append(rank)
    sharded = has_tp_sharded_state(prefill[0].described.memory)
    assert sharded == hybrid
    for d in range(decode_tp):
        rank = build_rank(hybrid, decode_tp, d, (1 << 44) + d * (1 << 36), 100 + d, True, True)
        before = [a.copy() for a in rank.attn]
        route = route_decode_rank(prefill_tp, decode_tp, d, is_mla=False, sharded_state=sharded)
        for p in route.prefill_ranks:
            src_mem, dst_mem = prefill[p].described.memory, rank.described.memory
            plan = prepare_peer(src_mem, dst_mem)
            state = ([[src_slot]], [[dst_slot]]) if hybrid else ((), ())
            table = plan.plan_request(src_pages, dst_pages, *state).table()
            execute(table, prefill[p].space, rank.space, regions(src_mem), regions(dst_mem))
        expected = [b.copy() for b in before]
        for li, e in enumerate(expected):
            for s, t in zip(src_pages, dst_pages, strict=True):
                e[t] = full[li][s, _heads(decode_tp, d)].reshape(-1)
        if hybrid:
            share = _mamba_share(conv, ssm, decode_tp, d)
            expected[0][dst_slot, : len(share)] = share  # the padding after it stays as it was
        for li, (a, e) in enumerate(zip(rank.attn, expected, strict=True)):
            np.testing.assert_array_equal(a, e, err_msg=f"decode rank {d} layer {li}")


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_dense_layout_by_head_across_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    move_across_tp(False, prefill_tp, decode_tp)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_hybrid_layout_by_head_and_channel_across_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    move_across_tp(True, prefill_tp, decode_tp)


def test_dense_layout_with_replicated_heads_from_tp4_to_tp1_and_back() -> None:
    move_across_tp(False, 4, 1)  # 2 heads over 4 ranks: each head on two ranks, written once
    move_across_tp(False, 1, 4)


def test_describes_vllm_cpu_blocks_by_head() -> None:
    d = build_rank(False, 1, 0, 1 << 40, 0, True, True).described
    kv = d.memory.kv
    assert kv is not None and not kv.is_mla and d.tp_sliceable
    span = N * C * F32
    assert (kv.layout.value, kv.kv_heads_per_rank, kv.total_kv_heads) == ("HND", H, H)
    assert (kv.head_stride, kv.k_offset, kv.v_offset, kv.bytes_per_page) == (2 * span, 0, span, H * span)
    assert kv.k_base_addrs == kv.v_base_addrs and kv.stride == H * 2 * span


def test_describes_aliased_groups_and_the_ssm_state_at_an_offset_inside_the_page() -> None:
    d = build_rank(True, 1, 0, 1 << 40, 0, strided=True).described  # a 1.4 wire: opaque blocks
    kv = d.memory.kv
    assert kv is not None and kv.is_mla and kv.bytes_per_page == H * N * 2 * C * F32
    (mamba,) = d.memory.state
    conv, ssm = mamba.tensors
    assert conv.base_addrs == ssm.base_addrs == kv.k_base_addrs  # the groups alias
    assert ssm.offset == conv.bytes_per_slot and conv.stride == ssm.stride == kv.stride
    assert conv.outer_rows == K1 and conv.sub_block_sizes == (X, BC, BC)
    assert d.kv_group == 1 and d.state_groups == (0,) and not d.tp_sliceable
    whole = build_rank(True, 1, 0, 1 << 40, 0, strided=False).described
    ((page,),) = [c.tensors for c in whole.memory.state]
    assert page.bytes_per_slot == kv.stride and page.offset == 0


def test_refuses_two_attention_groups_and_layouts_that_split_a_block() -> None:
    g = AttentionGroup(("a",), N, H, C, F32)
    t = {"a": attn_tensor("a", 1 << 40, H), "b": attn_tensor("b", 1 << 41, H)}
    with pytest.raises(LayoutError, match="both full attention"):
        two = [g, AttentionGroup(("b",), N, H, C, F32)]
        describe(two, t, BLOCKS, tp_size=1, tp_rank=0, layer_ids={"a": 0, "b": 1})
    head_outer = LayerTensor(
        "a", 1 << 40, (N * 2 * C * F32, BLOCKS * N * 2 * C * F32, 2 * C * F32, F32), (BLOCKS, H, N, 2 * C)
    )
    with pytest.raises(LayoutError, match=r"block layout pdwire plans \(LBHNC;"):
        describe([g], {"a": head_outer}, BLOCKS, tp_size=1, tp_rank=0, layer_ids={"a": 0})
    wrong = LayerTensor("a", 1 << 40, (2 * N * H * C * F32, N * H * C * F32, 1, 1), (BLOCKS, 2, H * N, C))
    with pytest.raises(LayoutError, match="expected"):
        describe([g], {"a": wrong}, BLOCKS, tp_size=1, tp_rank=0, layer_ids={"a": 0})
    with pytest.raises(LayoutError, match="of a kind"):
        describe([g, None], t, BLOCKS, tp_size=1, tp_rank=0, layer_ids={"a": 0})
