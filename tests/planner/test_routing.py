"""Rank routing: which prefill ranks feed a decode rank, dummies, and response counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdwire.runtime.planner import TopologyError, decode_ranks_of_prefill, heads_held, route_decode_rank
from tests.planner.strategies import HEADS, TP
from tests.planner.world import oracle_heads


@pytest.mark.parametrize(
    ("prefill", "decode", "is_mla", "expected"),
    [
        # (decode rank -> prefill ranks, dummies, required_dst_info_num, expected responses)
        (2, 2, False, {0: ((0,), (), 1, 1), 1: ((1,), (), 1, 1)}),
        (2, 4, False, {0: ((0,), (), 2, 1), 1: ((0,), (), 2, 1), 2: ((1,), (), 2, 1), 3: ((1,), (), 2, 1)}),
        (4, 2, False, {0: ((0, 1), (), 1, 2), 1: ((2, 3), (), 1, 2)}),
        (4, 2, True, {0: ((0, 1), (1,), 1, 1), 1: ((2, 3), (3,), 1, 1)}),
        (8, 1, True, {0: (tuple(range(8)), tuple(range(1, 8)), 1, 1)}),
        # MLA with TP-sharded state (a Mamba component): no dummies, every rank answers
        (4, 2, "mla+state", {0: ((0, 1), (), 1, 2), 1: ((2, 3), (), 1, 2)}),
        (2, 4, "mla+state", {0: ((0,), (), 2, 1), 3: ((1,), (), 2, 1)}),
    ],
)
def test_route_table_of_the_protocol(prefill: int, decode: int, is_mla: bool | str, expected: dict) -> None:
    for rank, (ranks, dummies, dst_info, responses) in expected.items():
        sharded = is_mla == "mla+state"
        route = route_decode_rank(prefill, decode, rank, is_mla=bool(is_mla), sharded_state=sharded)
        assert (route.prefill_ranks, route.dummy_prefill_ranks) == (ranks, dummies)
        assert (route.required_dst_info_num, route.expected_responses) == (dst_info, responses)


@pytest.mark.parametrize(
    ("heads", "tp", "expected"),
    [
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
        (1, 2, [(0, 1), (0, 1)]),
    ],
)
def test_replicated_heads_use_division_not_modulo(heads: int, tp: int, expected: list) -> None:
    # H=2, TP=4: ranks 0,1 share head 0 and ranks 2,3 head 1 (the modulo form gave 0,1,0,1: #23746).
    assert [heads_held(tp, rank, heads) for rank in range(tp)] == expected


@given(prefill=TP, decode=TP, heads=HEADS, is_mla=st.booleans(), pp=st.integers(1, 3), sharded=st.booleans())
def test_every_decode_head_has_a_contacted_writer(
    prefill: int, decode: int, heads: int, is_mla: bool, pp: int, sharded: bool
) -> None:
    for d in range(decode):
        route = route_decode_rank(prefill, decode, d, is_mla=is_mla, prefill_pp=pp, sharded_state=sharded)
        needed = set(oracle_heads(decode, d, heads).tolist())
        held = set().union(*(oracle_heads(prefill, p, heads).tolist() for p in route.prefill_ranks))
        assert needed <= held
        real = [p for p in route.prefill_ranks if p not in route.dummy_prefill_ranks]
        # MLA: one writer of the latent, unless TP-sharded state needs every rank's shard
        assert len(real) == (1 if (is_mla and not sharded) or prefill <= decode else prefill // decode)
        assert route.expected_responses == len(real) * pp
        assert route.prefill_pp_stages == tuple(range(pp))
        for p in route.prefill_ranks:
            assert d in decode_ranks_of_prefill(prefill, decode, p)
            # A prefill rank waits for exactly the decode ranks that contact it.
            assert route.required_dst_info_num == len(decode_ranks_of_prefill(prefill, decode, p))


@pytest.mark.parametrize(("prefill", "decode"), [(3, 2), (2, 3), (0, 1), (6, 4)])
def test_non_divisible_tp_sizes_are_refused(prefill: int, decode: int) -> None:
    with pytest.raises(TopologyError):
        route_decode_rank(prefill, decode, 0, is_mla=False)


def test_decode_pp_must_be_one_or_equal() -> None:
    with pytest.raises(TopologyError, match="decode PP"):
        route_decode_rank(2, 2, 0, is_mla=False, prefill_pp=2, decode_pp=3)
    route = route_decode_rank(2, 2, 1, is_mla=False, prefill_pp=2, decode_pp=2, decode_pp_rank=1)
    assert route.prefill_pp_stages == (1,) and route.expected_responses == 1
