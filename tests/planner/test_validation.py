"""Bad registrations and requests: one typed PlanError naming component, tensor, layer and index."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdwire.runtime.descriptors import DescriptorTable, Region
from pdwire.runtime.planner import (
    DuplicateDestination,
    GeometryMismatch,
    IndexListMismatch,
    IndexOutOfRange,
    MissingShardingInfo,
    PlanError,
    StateKind,
    TopologyError,
    prepare_peer,
)
from tests.planner.builders import kv_pool, mamba, paged, rank, with_kv


def test_index_outside_the_region_names_component_tensor_layer_and_index() -> None:
    plan = prepare_peer(rank(1, 0, state=(mamba(1),)), rank(1, 0, state=(mamba(1, slots=2),)))
    with pytest.raises(IndexOutOfRange) as caught:
        plan.plan_state([[3]], [[2]])
    error = caught.value
    assert (error.component, error.tensor, error.layer, error.index) == ("state[0]:mamba", "conv", 0, 2)
    assert "destination" in str(error) and "tensor=conv" in str(error)


def test_kv_page_outside_the_region_and_negative_pages() -> None:
    plan = prepare_peer(rank(1, 0, kv_pool(1, pages=16)), rank(1, 0, kv_pool(1, pages=4, base=1 << 44)))
    with pytest.raises(IndexOutOfRange, match="destination index 4") as caught:
        plan.plan_kv_chunk(0, [0, 1], [3, 4])
    assert (caught.value.component, caught.value.tensor, caught.value.layer) == ("kv", "k", 0)
    with pytest.raises(IndexOutOfRange, match="negative"):
        plan.plan_kv_chunk(0, [-1], [0])
    with pytest.raises(PlanError, match="integers"):
        plan.plan_kv_chunk(0, np.array([0.0]), [0])


def test_a_rank_that_writes_nothing_still_refuses_an_out_of_range_index() -> None:
    # replicated SWA from prefill TP 2 into decode TP 1: one prefill rank writes, the other
    # has nothing to send; both must refuse the same bad index, not just the writer
    swa = paged(StateKind.SWA, replicated=True, pages=8)
    tables = []
    for src_rank in (0, 1):
        plan = prepare_peer(rank(2, src_rank, state=(swa,)), rank(1, 0, state=(swa,)))
        tables.append(len(plan.plan_state([[0, 1]], [[6, 7]])[0].table))
        with pytest.raises(IndexOutOfRange, match="destination index 8") as caught:
            plan.plan_state([[0, 1]], [[7, 8]])
        assert caught.value.component == "state[0]:swa"
    assert sorted(tables)[0] == 0 < sorted(tables)[1]  # exactly one of the two ranks writes


def test_unequal_index_lists_are_an_error_never_a_truncation() -> None:
    kv_plan = prepare_peer(rank(1, 0, kv_pool(1)), rank(1, 0, kv_pool(1, base=1 << 44)))
    with pytest.raises(IndexListMismatch, match="3 source indices but 2"):
        kv_plan.plan_kv_chunk(0, [0, 1, 2], [0, 1])
    swa = paged(StateKind.SWA, replicated=True)
    plan = prepare_peer(rank(2, 0, state=(swa,)), rank(4, 1, state=(swa,)))
    with pytest.raises(IndexListMismatch) as caught:
        plan.plan_state([[0, 1, 2]], [[0, 1]])
    assert caught.value.component == "state[0]:swa"
    with pytest.raises(IndexListMismatch, match="1 state components"):
        plan.plan_state([], [])
    mamba_plan = prepare_peer(rank(1, 0, state=(mamba(1),)), rank(1, 0, state=(mamba(1),)))
    with pytest.raises(IndexListMismatch, match="exactly one index"):
        mamba_plan.plan_state([[1, 2]], [[1, 2]])
    assert len(mamba_plan.plan_state([[]], [[]])[0].table) == 0  # both empty: component not sent


def test_two_writes_to_one_destination_page_are_refused() -> None:
    plan = prepare_peer(rank(1, 0, kv_pool(1)), rank(1, 0, kv_pool(1, base=1 << 44)))
    with pytest.raises(DuplicateDestination) as caught:
        plan.plan_kv_chunk(0, [0, 1, 2], [5, 3, 5])
    assert caught.value.index == 5


def test_slot_size_mismatch_at_same_tp_is_refused_not_copied() -> None:
    # Same TP, different dtype: SGLang used the source stride and corrupted state (#36371).
    src = rank(2, 0, state=(mamba(2, unit=4),))
    with pytest.raises(GeometryMismatch, match="bytes per slot differ") as caught:
        prepare_peer(src, rank(2, 0, state=(mamba(2, unit=2),)))
    assert (caught.value.component, caught.value.tensor) == ("state[0]:mamba", "conv")
    with pytest.raises(GeometryMismatch, match="bytes per sharded-axis element"):
        prepare_peer(src, rank(4, 1, state=(mamba(4, unit=2),)))


def test_tp_mismatch_without_the_sharded_axis_is_refused() -> None:
    with pytest.raises(MissingShardingInfo, match="decode") as caught:
        prepare_peer(rank(2, 0, state=(mamba(2),)), rank(4, 1, state=(mamba(4, declare_axis=False),)))
    assert caught.value.tensor == "conv"
    # A paged component with neither head geometry nor replication (non-MLA SWA without heads).
    swa = paged(StateKind.SWA)
    with pytest.raises(MissingShardingInfo):
        prepare_peer(rank(2, 0, state=(swa,)), rank(1, 0, state=(swa,)))
    prepare_peer(rank(2, 0, state=(swa,)), rank(2, 0, state=(swa,)))  # same TP needs no sharding info


def test_sub_blocks_must_shard_evenly_and_agree() -> None:
    with pytest.raises(TopologyError, match="sub-block of size 2"):
        prepare_peer(
            rank(1, 0, state=(mamba(1, blocks=(2, 6)),)), rank(4, 0, state=(mamba(4, blocks=(2, 6)),))
        )
    with pytest.raises(GeometryMismatch, match="sub-block sizes differ"):
        prepare_peer(
            rank(1, 0, state=(mamba(1, blocks=(8, 8)),)), rank(2, 0, state=(mamba(2, blocks=(4, 12)),))
        )


@pytest.mark.parametrize("undeclared", ["prefill", "decode"])
def test_a_sub_block_split_declared_on_one_side_only_is_taken_from_that_side(undeclared: str) -> None:
    # both sides hold the same model (the handshake checks the fingerprint); SGLang's decode
    # never declares the conv split, so the declaring side's split is the model's
    def conv(tp: int, declared: bool, blocks: tuple[int, ...] = (8, 8, 16)):  # type: ignore[no-untyped-def]
        comp = mamba(tp, blocks=blocks)
        tensor = comp.tensors[0] if declared else replace(comp.tensors[0], sub_block_sizes=None)
        return replace(comp, tensors=(tensor,))

    src = rank(1, 0, state=(conv(1, undeclared != "prefill"),))
    dst = rank(2, 1, state=(conv(2, undeclared != "decode"),))
    both = prepare_peer(rank(1, 0, state=(conv(1, True),)), rank(2, 1, state=(conv(2, True),)))
    one = prepare_peer(src, dst)
    tables = [p.plan_state([[1]], [[2]])[0].table for p in (both, one)]
    assert len(tables[0]) == 3 * 2  # q, k and v shares of decode rank 1, two layers
    for name in ("src_addr", "dst_addr", "length"):
        assert getattr(tables[0], name).tolist() == getattr(tables[1], name).tolist()
    with pytest.raises(GeometryMismatch, match=r"sub-block sizes differ: prefill \(.*\), decode \(.*\)"):
        prepare_peer(rank(1, 0, state=(conv(1, True),)), rank(2, 0, state=(conv(2, True, (8, 16, 8)),)))


@pytest.mark.parametrize(
    ("change", "error", "text"),
    [
        ({"page_size": 2, "bytes_per_page": 2 * 2 * 2}, GeometryMismatch, "page size differs"),
        ({"bytes_per_head": 4, "bytes_per_page": 4 * 2 * 4}, GeometryMismatch, "bytes_per_head differs"),
        ({"kv_heads_per_rank": 4, "bytes_per_page": 4 * 4 * 2}, GeometryMismatch, "kv_heads_per_rank 4"),
        ({"bytes_per_page": 99}, GeometryMismatch, "bytes per page 99"),
        ({"total_kv_heads": 6}, TopologyError, "6 KV heads cannot be split"),
        ({"region_lens": (1 << 64,) * 3}, GeometryMismatch, "64-bit address space"),
    ],
)
def test_kv_geometry_disagreements(change: dict, error: type[PlanError], text: str) -> None:
    src = rank(4, 1, kv_pool(4))
    dst = with_kv(rank(4, 1, kv_pool(4, base=1 << 44)), **change)
    with pytest.raises(error, match=text):
        prepare_peer(src, dst)


def test_topology_errors() -> None:
    with pytest.raises(TopologyError, match="divide"):
        prepare_peer(rank(3, 0, kv_pool(3, heads=3)), rank(2, 0, kv_pool(2, heads=2)))
    with pytest.raises(TopologyError, match="does not feed"):
        prepare_peer(rank(4, 3, kv_pool(4)), rank(2, 0, kv_pool(2, base=1 << 44)))
    with pytest.raises(GeometryMismatch, match="decode does not hold this layer") as caught:
        prepare_peer(
            rank(1, 0, kv_pool(1, layers=2), first_layer=2, pp_size=2, pp_rank=1),
            rank(1, 0, kv_pool(1, layers=3)),
        )
    assert caught.value.layer == 3


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_pp_stage_must_name_its_state_layers(side: str) -> None:
    # layer_ids None means 0..n-1: from PP stage 1 that would land on stage 0's layers, and two
    # stages writing one decode rank would both claim layer 0
    staged = rank(1, 0, state=(mamba(1),), pp_size=2, pp_rank=1)
    whole = rank(1, 0, state=(mamba(1, layers=4),))
    src, dst = (staged, whole) if side == "prefill" else (whole, staged)
    with pytest.raises(GeometryMismatch, match=f"{side}: PP stage 1 of 2 must give the layer ids"):
        prepare_peer(src, dst)
    named = replace(staged, state=(replace(staged.state[0], layer_ids=(2, 3)),))
    repeated = replace(staged, state=(replace(staged.state[0], layer_ids=(2, 2)),))
    with pytest.raises(GeometryMismatch, match="layer ids must be distinct"):
        prepare_peer(repeated, whole)
    if side == "prefill":  # stage 1's layers 2 and 3 land on the whole decode rank's entries 2 and 3
        table = prepare_peer(named, whole).plan_state([[0]], [[1]])[0].table
        conv = whole.state[0].tensors[0]
        hit = [
            layer
            for layer, (base, length) in enumerate(zip(conv.base_addrs, conv.region_lens, strict=True))
            if any(base <= int(a) < base + length for a in table.dst_addr)
        ]
        assert hit == [2, 3]


def test_component_lists_must_match_by_kind_and_count() -> None:
    with pytest.raises(GeometryMismatch, match="component kind differs"):
        prepare_peer(rank(1, 0, state=(paged(StateKind.SWA),)), rank(1, 0, state=(paged(StateKind.DSA),)))
    with pytest.raises(GeometryMismatch, match="1 state components, decode 2"):
        prepare_peer(rank(1, 0, state=(mamba(1),)), rank(1, 0, state=(mamba(1), paged(StateKind.DSA))))


def test_mla_with_sharded_state_and_larger_prefill_tp_writes_state_from_every_rank() -> None:
    # the latent is replicated (first rank of the group writes it), the Mamba state is not: rank 1
    # is no dummy, writes its conv shard and no KV
    src = rank(4, 1, kv_pool(4, is_mla=True), (mamba(4),))
    plan = prepare_peer(src, rank(2, 0, kv_pool(2, is_mla=True, base=1 << 44), (mamba(2),)))
    assert not plan.is_dummy and plan.route.dummy_prefill_ranks == () and plan.route.expected_responses == 2
    assert len(plan.plan_kv_chunk(0, [0, 1], [2, 3]).table) == 0
    assert len(plan.plan_state([[0]], [[1]])[0].table) == 3 * 2  # q, k, v shares of 2 layers
    assert not plan.writes_aux


def test_dummy_and_non_writer_plans_are_empty_but_complete() -> None:
    dsa = paged(StateKind.DSA, replicated=True)
    plan = prepare_peer(
        rank(4, 1, kv_pool(4, is_mla=True), (dsa,)), rank(2, 0, kv_pool(2, is_mla=True), (dsa,))
    )
    assert plan.is_dummy and not plan.writes_aux
    result = plan.plan_request([0, 1], [2, 3], [[0]], [[1]], aux=(0, 0))
    assert [g.kind.value for g in result.groups] == ["kv", "state", "aux"] and result.descriptor_count == 0
    with pytest.raises(IndexListMismatch):  # a dummy still validates what it is given
        plan.plan_kv_chunk(0, [0, 1], [2])


def test_descriptor_table_checks_detect_mergeable_and_outside_rows() -> None:
    u64, u32 = np.uint64, np.uint32
    table = DescriptorTable(
        np.array([0, 10, 100], dtype=u64),
        np.array([500, 510, 900], dtype=u64),
        np.array([10, 5, 8], dtype=u64),
        np.zeros(3, dtype=u32),
        np.array([0, 0, 1], dtype=u32),
    )
    assert table.mergeable_pairs().tolist() == [[0, 1]]
    split = replace(table, dst_region=np.array([0, 1, 1], dtype=u32))
    assert split.mergeable_pairs().tolist() == []  # adjacent bytes in different regions never merge
    src_regions = [Region(0, 200)]
    top = (1 << 64) - 1000
    assert table.rows_outside(src_regions, [Region(500, 15), Region(900, 8)]).tolist() == []
    assert table.rows_outside(src_regions, [Region(500, 14), Region(901, 8)]).tolist() == [1, 2]
    assert table.rows_outside(src_regions, [Region(500, 15)]).tolist() == [2]  # region 1 missing
    high = DescriptorTable(
        np.array([top], dtype=u64),
        np.array([top], dtype=u64),
        np.array([1000], dtype=u64),
        np.zeros(1, dtype=u32),
        np.zeros(1, dtype=u32),
    )
    assert high.rows_outside([Region(top, 1000)], [Region(top, 999)]).tolist() == [0]


def test_a_request_past_the_registered_pools_is_refused_whole_before_planning() -> None:
    # refused by check_request (at request time, before a chunk exists), naming the component
    plan = prepare_peer(
        rank(1, 0, kv_pool(1, pages=16), state=(mamba(1, slots=4),)),
        rank(1, 0, kv_pool(1, pages=4, base=1 << 44), state=(mamba(1, slots=2),)),
    )
    plan.check_request([0, 3], [[1]])
    with pytest.raises(IndexOutOfRange, match="destination index 4 is past the registered pool") as caught:
        plan.check_request([0, 4], [[1]])
    assert caught.value.component == "kv"
    with pytest.raises(IndexOutOfRange, match="destination index 2") as caught:
        plan.check_request([0, 1], [[2]])
    assert caught.value.component == "state[0]:mamba"
    with pytest.raises(IndexOutOfRange, match="destination index 4294967296"):
        plan.check_request(np.array([2**32], dtype=np.int64), [[1]])
