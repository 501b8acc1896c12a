"""Staged plans write exactly the bytes direct plans write.

The planner oracle (``tests/planner/world.py``) builds every rank's memory as shards of one full
tensor, executes every plan and compares every decode byte with its expected shard or its
untouched random value. Here the same worlds run with each table executed *staged*: gathered
into a staging buffer, written by the staged write table, scattered out of a staging buffer on
the decode side, each step by the reference executor and checked against its regions. Any byte
the staged steps put elsewhere than the direct table would fails the oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings

from pdwire.runtime.descriptors import DescriptorTable, Region
from pdwire.runtime.planner import PeerPlan, PlanGroup, RankMemory
from pdwire.runtime.planner.reference_executor import AddressSpace, execute
from pdwire.runtime.staging import Mode, both, gather, scatter, scatter_write
from pdwire.runtime.staging.receive import ScatterPlanner, stand_in_source
from tests.planner import world as oracle
from tests.planner.strategies import hybrid_worlds, kv_worlds, laid_out_kv_worlds, state_worlds

LOCAL_STAGING, REMOTE_STAGING = 0x7E00_0000_0000, 0x7F00_0000_0000


def _staging(base: int, nbytes: int) -> tuple[AddressSpace, Region]:
    space = AddressSpace()
    space.allocate(base, max(nbytes, 1), np.random.default_rng(nbytes))  # random: stale bytes would show
    return space, Region(base, max(nbytes, 1), name="staging")


def staged_executor(mode: Mode) -> Callable[..., None]:
    def run(
        table: DescriptorTable,
        src: AddressSpace,
        dst: AddressSpace,
        src_regions: Sequence[Region],
        dst_regions: Sequence[Region],
    ) -> None:
        total = table.total_bytes
        local_space, local_region = _staging(LOCAL_STAGING, total)
        remote_space, remote_region = _staging(REMOTE_STAGING, total)
        ls, rs = len(src_regions), len(dst_regions)  # staging regions come after the planner's
        src_all, dst_all = [*src_regions, local_region], [*dst_regions, remote_region]
        if mode is Mode.GATHER:
            plan = gather(table, LOCAL_STAGING, ls)
        elif mode is Mode.SCATTER:
            plan = scatter(table, REMOTE_STAGING, rs)
        else:
            plan = both(table, LOCAL_STAGING, ls, REMOTE_STAGING, rs)
        assert plan.write.total_bytes == total
        assert len(plan.write) <= len(table)
        if len(plan.gather):
            assert plan.gather.total_bytes == total and plan.local_bytes == total
            execute(plan.gather, src, local_space, src_all, src_all)
        write_src = local_space if len(plan.gather) else src
        write_dst = remote_space if len(plan.scatter) else dst
        execute(plan.write, write_src, write_dst, src_all, dst_all)
        if len(plan.scatter):
            assert plan.scatter.total_bytes == total and plan.remote_bytes == total
            execute(plan.scatter, remote_space, dst, dst_all, dst_all)

    return run


@contextmanager
def executed_as(mode: Mode) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(oracle, "execute", staged_executor(mode))
        yield


MODES = pytest.mark.parametrize("mode", [Mode.GATHER, Mode.SCATTER, Mode.BOTH])
# the planner oracle runs 300 worlds per case; staging adds three executions of each table
ORACLE = settings(max_examples=60)


@MODES
@ORACLE
@given(world=kv_worlds(hetero=True))
def test_kv_head_slices_staged(mode: Mode, world: oracle.World) -> None:
    with executed_as(mode):
        oracle.run_world(world)


@MODES
@ORACLE
@given(world=kv_worlds(hetero=False))
def test_kv_whole_pages_staged(mode: Mode, world: oracle.World) -> None:
    with executed_as(mode):
        oracle.run_world(world)


@MODES
@ORACLE
@given(world=state_worlds(mamba=True, paged=False))
def test_mamba_slices_staged(mode: Mode, world: oracle.World) -> None:
    with executed_as(mode):
        oracle.run_world(world)


@MODES
@ORACLE
@given(world=hybrid_worlds())
def test_hybrid_models_staged(mode: Mode, world: oracle.World) -> None:
    with executed_as(mode):
        oracle.run_world(world)


@MODES
@ORACLE
@given(world=laid_out_kv_worlds())
def test_strided_and_interleaved_layouts_staged(mode: Mode, world: oracle.World) -> None:
    with executed_as(mode):
        oracle.run_world(world)


def test_gather_turns_head_slices_into_destination_runs() -> None:
    """NHD P2 -> D4 shape: per token a 512 B slice of a 1 KiB source row, the destination page
    being exactly the slices: gathering leaves one engine row per destination page run."""
    pages, tokens, src_tok, slice_ = 4, 64, 1024, 512
    dst_pages = np.asarray([3, 4, 0, 9])  # runs: [3, 4], [0], [9] (sorted: 0 | 3 4 | 9)
    src_pages = np.asarray([7, 1, 2, 5])
    s = (src_pages[:, None] * tokens * src_tok + np.arange(tokens)[None, :] * src_tok + 512).ravel()
    d = (dst_pages[:, None] * tokens * slice_ + np.arange(tokens)[None, :] * slice_).ravel()
    n = len(s)
    table = DescriptorTable(
        (s + (1 << 40)).astype(np.uint64), (d + (1 << 41)).astype(np.uint64), np.full(n, slice_, np.uint64),
        np.zeros(n, np.uint32), np.zeros(n, np.uint32),
    )  # fmt: skip
    plan = gather(table, 1 << 42, 1)
    assert len(table) == pages * tokens
    assert len(plan.write) == 3
    assert sorted(plan.write.length.tolist()) == [tokens * slice_, tokens * slice_, 2 * tokens * slice_]
    assert len(scatter(table, 1 << 42, 1).write) == len(table)  # sources are strided: nothing to merge
    assert len(both(table, 1 << 42, 1, 1 << 43, 1).write) == 1


def _scattered_by_decode(world: oracle.World) -> None:
    """Run ``world`` with every KV table written the way a scattering prefill rank writes it
    (:func:`scatter_write` into a staging range of the decode rank) and copied into place the
    way the decode rank does it: from its own memory and a stand-in of the prefill rank built
    from the geometry it sends (:class:`ScatterPlanner`), never from the prefill's table."""
    real_prepare, real_execute = oracle.prepare_peer, oracle.execute
    kv_of: dict[int, tuple[RankMemory, RankMemory, np.ndarray]] = {}
    scattered: list[int] = []

    def prepare(source: RankMemory, decode: RankMemory) -> PeerPlan:
        plan = real_prepare(source, decode)
        plan_kv = plan.plan_kv_chunk

        def planned(chunk_id: int, src_pages: np.ndarray, dst_pages: np.ndarray) -> PlanGroup:
            group = plan_kv(chunk_id, src_pages, dst_pages)
            kv_of[id(group.table)] = (source, decode, np.asarray(dst_pages, np.int32))
            return group

        plan.plan_kv_chunk = planned  # type: ignore[method-assign]
        return plan

    def run(table: DescriptorTable, src: AddressSpace, dst: AddressSpace, src_regions, dst_regions) -> None:  # type: ignore[no-untyped-def]
        found = kv_of.pop(id(table), None)
        if found is None or not len(table) or found[0].kv is None or found[0].kv.is_mla:
            real_execute(table, src, dst, src_regions, dst_regions)
            return
        source, decode, dst_pages = found
        assert source.kv is not None and decode.kv is not None
        kv = source.kv
        stand_in = stand_in_source(source.position, kv.heads, kv.num_layers, len(dst_pages), decode.kv)
        receiver = ScatterPlanner(decode, stand_in)
        space, region = _staging(REMOTE_STAGING, table.total_bytes)
        rs = len(dst_regions)
        dst_all = [*dst_regions, region]
        write = scatter_write(table, REMOTE_STAGING, rs)
        copy = receiver.copy_table(dst_pages, REMOTE_STAGING, rs)
        assert write.total_bytes == copy.total_bytes == table.total_bytes
        assert receiver.page_bytes * len(dst_pages) == table.total_bytes
        real_execute(write, src, space, [*src_regions], dst_all)
        real_execute(copy, space, dst, dst_all, dst_all)
        scattered.append(len(table))  # MLA writes its replicated latent whole: never scattered

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(oracle, "prepare_peer", prepare)
        mp.setattr(oracle, "execute", run)
        oracle.run_world(world)
    if world.kv is not None and not world.kv.is_mla and len(world.dst_pages):
        assert scattered, "no KV table went through the scatter path"


@ORACLE
@given(world=kv_worlds(hetero=True))
def test_kv_scattered_by_the_decode_rank(world: oracle.World) -> None:
    _scattered_by_decode(world)


@ORACLE
@given(world=laid_out_kv_worlds())
def test_strided_layouts_scattered_by_the_decode_rank(world: oracle.World) -> None:
    _scattered_by_decode(world)


@ORACLE
@given(world=hybrid_worlds())
def test_hybrid_kv_scattered_by_the_decode_rank(world: oracle.World) -> None:
    _scattered_by_decode(world)
