"""Descriptor counts: runs merge where both sides are consecutive, slices merge only where bytes
really are adjacent, and no plan ever holds two mergeable rows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdwire.runtime.planner import Layout, prepare_peer
from tests.planner.builders import kv_pool, rank
from tests.planner.strategies import index_lists

SRC = [5, 6, 0, 1, 2]
DST = [0, 1, 3, 4, 5]  # two runs on both sides: 5,6 -> 0,1 and 0,1,2 -> 3,4,5
LAYERS = 3


def _count(
    p_tp: int,
    p: int,
    d_tp: int,
    d: int,
    src_layout: Layout = Layout.NHD,
    dst_layout: Layout = Layout.NHD,
    heads: int = 8,
    page_size: int = 4,
    is_mla: bool = False,
    src: list[int] = SRC,
    dst: list[int] = DST,
) -> int:
    local = rank(p_tp, p, kv_pool(p_tp, heads=heads, page_size=page_size, layout=src_layout, is_mla=is_mla))
    remote = rank(
        d_tp,
        d,
        kv_pool(d_tp, heads=heads, page_size=page_size, layout=dst_layout, is_mla=is_mla, base=1 << 44),
    )
    table = prepare_peer(local, remote).plan_kv_chunk(7, src, dst).table
    assert len(table.mergeable_pairs()) == 0
    return len(table)


@pytest.mark.parametrize(
    ("case", "args", "expected"),
    [
        ("same TP: one descriptor per run per layer per K/V", (2, 1, 2, 1), 2 * LAYERS * 2),
        (
            "MLA gather: the first rank writes whole-page runs",
            (4, 0, 2, 0, Layout.NHD, Layout.NHD, 8, 4, True),
            2 * LAYERS,
        ),
        ("MLA gather: the others are dummies", (4, 1, 2, 0, Layout.NHD, Layout.NHD, 8, 4, True), 0),
        ("NHD scatter: one range per token", (2, 1, 4, 3), 5 * 4 * LAYERS * 2),
        ("NHD gather: source tokens adjacent, destination not", (4, 1, 2, 0), 5 * 4 * LAYERS * 2),
        ("HND scatter: one range per page", (2, 1, 4, 3, Layout.HND, Layout.HND), 5 * LAYERS * 2),
        ("HND gather: one range per page", (4, 3, 2, 1, Layout.HND, Layout.HND), 5 * LAYERS * 2),
        (
            "one head per rank: NHD and HND are the same bytes",
            (4, 2, 4, 2, Layout.NHD, Layout.HND, 4),
            2 * LAYERS * 2,
        ),
        (
            # One range per (token, head) unit, except that inside a run the last unit of a page and
            # the first of the next are adjacent on both sides: 3 joins per layer per K/V.
            "same TP, NHD -> HND transposes (token, head) units",
            (2, 0, 2, 0, Layout.NHD, Layout.HND, 4),
            (5 * 4 * 2 - 3) * LAYERS * 2,
        ),
        (
            "H=1 replicated on 4 prefill ranks: only the first writes",
            (4, 0, 1, 0, Layout.NHD, Layout.NHD, 1),
            2 * LAYERS * 2,
        ),
        ("H=1 replicated: the second writes nothing", (4, 1, 1, 0, Layout.NHD, Layout.NHD, 1), 0),
        (
            "page size 1 scatter: one range per page",
            (2, 0, 4, 1, Layout.NHD, Layout.NHD, 8, 1),
            5 * LAYERS * 2,
        ),
    ],
)
def test_descriptor_counts(case: str, args: tuple, expected: int) -> None:
    assert _count(*args) == expected, case


def _runs(src: list[int], dst: list[int]) -> int:
    """Reference count of runs consecutive on both sides, by a plain loop over pairs sorted by destination."""
    pairs = sorted(zip(dst, src, strict=True))
    runs = 0
    for i, (d, s) in enumerate(pairs):
        if i == 0 or not (d == pairs[i - 1][0] + 1 and s == pairs[i - 1][1] + 1):
            runs += 1
    return runs


@given(st.integers(0, 12).flatmap(lambda n: st.tuples(index_lists(16, n), index_lists(16, n))))
def test_same_tp_run_count_matches_a_plain_loop(lists: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    src, dst = lists
    assert _count(2, 0, 2, 0, src=list(src), dst=list(dst)) == _runs(list(src), list(dst)) * LAYERS * 2


def test_a_run_breaks_where_either_side_breaks() -> None:
    assert _count(1, 0, 1, 0, src=[0, 1, 2, 3], dst=[0, 1, 2, 3]) == 1 * LAYERS * 2
    assert _count(1, 0, 1, 0, src=[0, 1, 2, 3], dst=[0, 1, 5, 6]) == 2 * LAYERS * 2
    assert _count(1, 0, 1, 0, src=[0, 1, 7, 8], dst=[0, 1, 2, 3]) == 2 * LAYERS * 2
    # Consecutive on both sides only after sorting by destination still merges: the list order is free.
    assert _count(1, 0, 1, 0, src=[2, 0, 1], dst=[7, 5, 6]) == 1 * LAYERS * 2
