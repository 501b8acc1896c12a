"""The decode rank's receive staging on its own: reservations, refusals and release.

A decode rank of TP 1 receiving from a prefill rank of TP 2 (NHD: its heads of one token are
half of the decode token's row, so its pages land cut per token and scatter is offered), and
from a prefill rank of TP 1 (whole pages: no reservation is made for it).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from pdwire.runtime import engine as pd
from pdwire.runtime.planner import HeadGeometry, Layout
from pdwire.runtime.session.actions import PeerRef
from pdwire.runtime.workers.scatter import ScatterReceiver, ScatterRefused
from tests.workers import nhd_ranks

SHAPE = nhd_ranks.Shape(layers=2, heads=4, head_bytes=32, page=8, pool=16)
PAGE_BYTES = 2 * SHAPE.layers * SHAPE.page * (SHAPE.heads // 2) * SHAPE.head_bytes  # from one of two ranks
A, B = PeerRef("p", 0), PeerRef("p", 1)


@pytest.fixture
def decode() -> Iterator[nhd_ranks.Rank]:
    r = nhd_ranks.rank(SHAPE, "local", "dec", 1, 0, fill=None)
    yield r
    r.backend.close()


def receiver(r: nhd_ranks.Rank, nbytes: int) -> ScatterReceiver:
    r.backend.register(pd.regions(r.memory))
    return ScatterReceiver(r.backend, r.memory, nbytes)


def heads(tp: int) -> HeadGeometry:
    return HeadGeometry(SHAPE.page, Layout.NHD, SHAPE.heads // tp, SHAPE.heads, SHAPE.head_bytes)


def test_a_range_per_room_and_sender_for_the_first_pages_that_fit(decode: nhd_ranks.Rank) -> None:
    rx = receiver(decode, 6 * PAGE_BYTES)
    plan = rx.planner("link-a", pd.ParallelRank(2, 0), heads(2), (0, 1))
    assert plan is not None and plan.page_bytes == PAGE_BYTES
    pages = np.arange(8, dtype=np.int32)
    r = rx.reserve(1, 0, A, plan, pages)
    assert r is not None and r.pages == 6 and r.offset == 0  # as many as fit
    assert rx.reserve(1, 0, A, plan, pages) is r  # asked again: the same range
    assert rx.reserve(2, 0, A, plan, pages) is None  # nothing left now
    rx.release(1)
    assert rx.arena.in_use == 0
    assert rx.reserve(2, 0, A, plan, pages) is not None  # reused


def test_whole_destination_pages_get_no_reservation(decode: nhd_ranks.Rank) -> None:
    rx = receiver(decode, 4 << 20)
    assert rx.planner("link-b", pd.ParallelRank(1, 0), heads(1), (0, 1)) is None
    assert rx.planner("link-c", pd.ParallelRank(2, 1), heads(2), (0, 2)) is None  # layers not one run


def test_staged_pages_outside_the_range_are_refused_and_nothing_is_copied(decode: nhd_ranks.Rank) -> None:
    rx = receiver(decode, 4 << 20)
    plan = rx.planner("link-a", pd.ParallelRank(2, 0), heads(2), (0, 1))
    assert plan is not None
    rx.reserve(3, 0, A, plan, np.arange(4, dtype=np.int32))
    before = [p.copy() for p in decode.pools]
    for room, sender, first, count in ((3, 0, 2, 3), (3, 0, -1, 1), (3, 0, 0, 0), (3, 1, 0, 1), (4, 0, 0, 1)):
        with pytest.raises(ScatterRefused):
            rx.scatter(room, sender, first, count)
    assert all(np.array_equal(a, b) for a, b in zip(before, decode.pools, strict=True))
    assert rx.scatter(3, 0, 1, 3) == 3 * PAGE_BYTES  # inside: copied


def test_a_reclaimed_room_keeps_the_ranges_of_writers_that_never_fenced(decode: nhd_ranks.Rank) -> None:
    rx = receiver(decode, 4 << 20)
    plan_a = rx.planner("link-a", pd.ParallelRank(2, 0), heads(2), (0, 1))
    plan_b = rx.planner("link-b", pd.ParallelRank(2, 1), heads(2), (0, 1))
    assert plan_a is not None and plan_b is not None
    pages = np.arange(4, dtype=np.int32)
    rx.reserve(5, 0, A, plan_a, pages)
    kept = rx.reserve(5, 1, B, plan_b, pages)
    assert kept is not None
    rx.release(5, keep=(B,))
    assert rx.arena.in_use == 4 * PAGE_BYTES  # B's range is never handed out again
    again = rx.reserve(6, 0, A, plan_a, np.arange(16, dtype=np.int32))
    assert again is not None and not (
        again.offset < kept.offset + 4 * PAGE_BYTES <= again.offset + again.pages * PAGE_BYTES
    )
