"""SGLang's KVArgs -> pdwire's RankMemory, without SGLang: every kind, every refusal by name."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import pdwire.runtime.engine as pd
from pdwire.integrations.sglang.memory import (
    DECODE_KV_HEADS,
    POOL_LAYERS,
    Geometry,
    KVArgsError,
    PoolLayers,
    fill_decode_heads,
    fill_layer_ids,
    missing_pp_layer_ids,
    rank_memory,
)

PAGE, HEADS, HEAD_BYTES = 4, 2, 16
ITEM = PAGE * HEADS * HEAD_BYTES


def kvargs(**over: Any) -> SimpleNamespace:
    """KVArgs as SGLang's _init_kv_manager fills them: 2 full-attention layers, SWA (1 layer),
    Mamba (2 layers x conv + temporal, with layer ids), aux."""
    base = 1 << 20
    a = SimpleNamespace(
        kv_data_ptrs=[base, base + 0x1000, base + 0x2000, base + 0x3000],
        kv_data_lens=[0x1000] * 4, kv_item_lens=[ITEM] * 4, page_size=PAGE, kv_head_num=HEADS,
        total_kv_head_num=HEADS * 2, num_draft_entries=0, prefill_start_layer=0,
        state_types=["swa", "mamba"],
        state_data_ptrs=[[base + 0x10000, base + 0x11000], [base + 0x20000 + 0x1000 * i for i in range(4)]],
        state_data_lens=[[0x1000, 0x1000], [0x1000] * 4],
        state_item_lens=[[ITEM, ITEM], [96, 96, 512, 512]],
        state_dim_per_tensor=[[], [24, 24, 2, 2]],
        state_slice_outer_counts=[[], [1, 1, 1, 1]],
        state_conv_shard_groups=[[], [[16, 16, 16], [16, 16, 16], None, None]],
        state_layer_ids=[[], [0, 2, 0, 2]],
        swa_kv_cache_layout="nhd",
        aux_data_ptrs=[base + 0x30000], aux_data_lens=[0x100], aux_item_lens=[0x20],
    )  # fmt: skip
    for k, v in over.items():
        setattr(a, k, v)
    return a


GEO = Geometry(pd.ParallelRank(tp_size=2, tp_rank=1), memory_kind=pd.MemoryKind.DRAM)


def test_hybrid_kvargs_map_field_for_field() -> None:
    m = rank_memory(kvargs(), GEO)
    assert (m.position, m.first_layer) == (pd.ParallelRank(2, 1, 1, 0), 0)
    assert m.kv is not None and m.kv.k_base_addrs == (1 << 20, (1 << 20) + 0x1000)
    assert m.kv.v_base_addrs == ((1 << 20) + 0x2000, (1 << 20) + 0x3000)
    assert (m.kv.kv_heads_per_rank, m.kv.total_kv_heads, m.kv.bytes_per_head) == (HEADS, 4, HEAD_BYTES)
    swa, mamba = m.state
    assert swa.kind is pd.StateKind.SWA and swa.indexing is pd.Indexing.PAGE
    assert swa.heads == pd.HeadGeometry(PAGE, pd.Layout.NHD, HEADS, 4, HEAD_BYTES)
    assert [t.name for t in swa.tensors] == ["k", "v"]
    assert mamba.kind is pd.StateKind.MAMBA and mamba.indexing is pd.Indexing.SLOT
    assert mamba.layer_ids == (0, 2)
    conv, ssm = mamba.tensors
    assert (conv.bytes_per_slot, conv.sharded_axis_size, conv.sub_block_sizes) == (96, 24, (16, 16, 16))
    assert (ssm.bytes_per_slot, ssm.sharded_axis_size, ssm.sub_block_sizes) == (512, 2, None)
    assert m.aux == (pd.AuxBuffer("aux0", (1 << 20) + 0x30000, 0x100, 0x20),)
    pd.regions(m)  # the planner accepts the description


def test_mamba_without_layer_ids_splits_by_runs_and_dim_zero_is_replicated() -> None:
    m = rank_memory(kvargs(state_layer_ids=[[], []], state_dim_per_tensor=[[], [24, 24, 0, 0]]), GEO)
    conv, ssm = m.state[1].tensors
    assert m.state[1].layer_ids is None and len(conv.base_addrs) == 2
    assert ssm.replicated and ssm.sharded_axis_size is None
    with pytest.raises(KVArgsError, match="equal layer counts"):
        rank_memory(kvargs(state_layer_ids=[[], []], state_item_lens=[[ITEM, ITEM], [96, 96, 96, 512]]), GEO)


def test_draft_kv_entries_join_their_halves() -> None:
    b = 1 << 20
    a = kvargs(kv_data_ptrs=[b, b + 1, b + 2, b + 3, b + 4, b + 5], kv_data_lens=[64] * 6,
               kv_item_lens=[ITEM] * 6, num_draft_entries=2)  # fmt: skip
    m = rank_memory(a, GEO)
    assert (
        m.kv is not None
        and m.kv.k_base_addrs == (b, b + 1, b + 4)
        and m.kv.v_base_addrs == (b + 2, b + 3, b + 5)
    )


@pytest.mark.parametrize(
    ("kind", "indexing", "replicated"),
    [
        ("dsa", pd.Indexing.PAGE, True), ("nsa", pd.Indexing.PAGE, True),
        ("qsa_compressed", pd.Indexing.PAGE, False), ("minimax_index_k", pd.Indexing.PAGE, False),
        ("minimax_dense_kv", pd.Indexing.PAGE, False), ("block_scale", pd.Indexing.PAGE, False),
        ("block_scale_swa", pd.Indexing.PAGE, False), ("qsa_pending", pd.Indexing.ROW, False),
        ("swa_ring", pd.Indexing.ROW, False), ("c128_state", pd.Indexing.ROW, False),
        ("request_row", pd.Indexing.ROW, False),
    ],
)  # fmt: skip
def test_every_other_sglang_kind_is_carried(kind: str, indexing: pd.Indexing, replicated: bool) -> None:
    a = kvargs(state_types=[kind], state_data_ptrs=[[(1 << 21), (1 << 21) + 0x1000]],
               state_data_lens=[[0x1000] * 2], state_item_lens=[[64, 64]], state_dim_per_tensor=[[]],
               state_slice_outer_counts=[[]], state_conv_shard_groups=[[]], state_layer_ids=[[]])  # fmt: skip
    (comp,) = rank_memory(a, GEO).state
    assert comp.kind.value == kind and comp.indexing is indexing and comp.replicated is replicated


def test_mla_kv_and_swa_are_flat_and_replicated() -> None:
    m = rank_memory(kvargs(kv_head_num=0), Geometry(pd.ParallelRank(2, 0), is_mla=True))
    assert m.kv is not None and m.kv.is_mla and m.kv.v_base_addrs == () and m.kv.num_layers == 4
    assert m.state[0].replicated and m.state[0].heads is None


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"kv_item_lens": [ITEM, ITEM, ITEM, 64]}, "kv_item_lens differ"),
        ({"page_size": 0}, "page_size"),
        ({"kv_head_num": 0}, "kv_head_num"),
        ({"kv_data_lens": [1, 2, 3]}, "kv_data_lens"),
        ({"state_types": ["swa", "no_such_kind"]}, "no_such_kind"),
        ({"swa_kv_cache_layout": "vectorized_5d"}, "vectorized_5d"),
        ({"state_layer_ids": [[], [0, 2, 0]]}, "state_layer_ids"),
        ({"aux_item_lens": []}, "aux"),
    ],
)
def test_what_does_not_fit_is_refused_by_name(over: dict[str, Any], match: str) -> None:
    with pytest.raises(KVArgsError, match=match):
        rank_memory(kvargs(**over), GEO)


def test_decode_heads_come_from_the_hook_only_where_sglang_left_them_unset() -> None:
    a = SimpleNamespace(kv_head_num=0)
    fill_decode_heads(a)
    assert a.kv_head_num == 0  # no hook value: nothing invented
    token = DECODE_KV_HEADS.set((1, 4))
    try:
        fill_decode_heads(a)
        b = SimpleNamespace(kv_head_num=2, total_kv_head_num=8)
        fill_decode_heads(b)
    finally:
        DECODE_KV_HEADS.reset(token)
    assert (a.kv_head_num, a.total_kv_head_num) == (1, 4)
    assert (b.kv_head_num, b.total_kv_head_num) == (2, 8)


def test_pool_layers_fill_only_what_sglang_left_out() -> None:
    """A PP stage of an SWAKVPool model: SGLang's KVArgs name no SWA layers and start at 0; the
    plugin's hook read the stage's layers from the pools (PoolLayers)."""
    a = kvargs(state_layer_ids=[[], []])  # Mamba in the request pool: no ids either
    assert missing_pp_layer_ids(a) == ["state[0]:swa", "state[1]:mamba"]
    fill_layer_ids(a)
    assert a.state_layer_ids == [[], []]  # no hook value: nothing invented
    token = POOL_LAYERS.set(PoolLayers(kv_start=3, state=(("swa", (7,)), ("mamba", (5, 9)))))
    try:
        fill_layer_ids(a)
        assert missing_pp_layer_ids(a) == []
        b = kvargs()  # SGLang's own Mamba layer ids stay
        fill_layer_ids(b)
    finally:
        POOL_LAYERS.reset(token)
    # per layer, repeated per tensor (SWA: K then V; Mamba: conv then temporal)
    assert (a.prefill_start_layer, a.state_layer_ids) == (3, [[7, 7], [5, 9, 5, 9]])
    assert b.state_layer_ids == [[7, 7], [0, 2, 0, 2]]
    m = rank_memory(a, Geometry(pd.ParallelRank(2, 1, pp_size=2, pp_rank=1), memory_kind=pd.MemoryKind.DRAM))
    assert m.first_layer == 3
    assert [c.layer_ids for c in m.state] == [(7,), (5, 9)]


def test_pool_layers_that_do_not_fit_are_left_out() -> None:
    a = kvargs(state_layer_ids=[[], []], state_types=["swa", "swa"])  # a kind twice: ambiguous
    token = POOL_LAYERS.set(PoolLayers(state=(("swa", (7,)), ("mamba", (1, 2, 3)))))
    try:
        fill_layer_ids(a)
        b = kvargs(state_layer_ids=[[], []])
        fill_layer_ids(b)  # 3 Mamba layers for 4 buffers: not this pool's
    finally:
        POOL_LAYERS.reset(token)
    assert a.state_layer_ids == [[], []]
    assert b.state_layer_ids == [[7, 7], []]
    token = POOL_LAYERS.set(PoolLayers(kv_start_missing=True))
    try:
        assert missing_pp_layer_ids(kvargs())[0].startswith("the KV start layer")
    finally:
        POOL_LAYERS.reset(token)
