"""Oracle tests: plans executed byte for byte must leave every decode rank holding exactly its shard
of one known full tensor, for KV and every state component, and nothing else changed.
(``run_world`` also asserts per group: no two rows mergeable, every row inside its regions, no two
writers on one destination byte.)"""

from __future__ import annotations

from hypothesis import given

from tests.planner.strategies import (
    ORACLE,
    head_interleaved_kv_worlds,
    hybrid_worlds,
    kv_worlds,
    laid_out_kv_worlds,
    laid_out_state_worlds,
    pp_worlds,
    state_worlds,
    unit_interleaved_kv_worlds,
)
from tests.planner.world import World, run_world


@ORACLE
@given(kv_worlds(hetero=False))
def test_kv_same_tp_whole_pages(world: World) -> None:
    run_world(world)


@ORACLE
@given(kv_worlds(hetero=False, is_mla=True))
def test_kv_mla_any_tp_whole_pages(world: World) -> None:
    run_world(world)


@ORACLE
@given(kv_worlds(hetero=True))
def test_kv_heterogeneous_tp_head_slices(world: World) -> None:
    run_world(world)


@ORACLE
@given(state_worlds(mamba=True, paged=False))
def test_mamba_state_slices_with_sub_blocks(world: World) -> None:
    run_world(world)


@ORACLE
@given(state_worlds(mamba=False, paged=True))
def test_swa_and_dsa_pages(world: World) -> None:
    run_world(world)


@ORACLE
@given(pp_worlds())
def test_pipeline_stages_land_on_their_layers(world: World) -> None:
    run_world(world)


@ORACLE
@given(laid_out_kv_worlds())
def test_kv_in_strided_and_interleaved_pages(world: World) -> None:
    run_world(world)


@ORACLE
@given(head_interleaved_kv_worlds())
def test_kv_heads_apart_in_a_page_head_stride(world: World) -> None:
    run_world(world)


@ORACLE
@given(unit_interleaved_kv_worlds())
def test_kv_side_by_side_per_token_and_head_in_either_block_layout(world: World) -> None:
    run_world(world)


@ORACLE
@given(laid_out_state_worlds())
def test_state_in_strided_slots_and_shared_items(world: World) -> None:
    run_world(world)


@ORACLE
@given(hybrid_worlds())
def test_hybrid_any_axis_aliased_groups_and_every_carried_kind(world: World) -> None:
    run_world(world)
