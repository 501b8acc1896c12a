"""Whether the PP stages of a prefill group hold each of a decode rank's layers exactly once
(protocol 1.4): the pure check, and the group connect that refuses a group failing it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdwire.runtime.session.decode_connection import Expected
from pdwire.runtime.session.group_connect import (
    GroupConnect,
    GroupConnected,
    GroupFailed,
    GroupIdentity,
    GroupState,
    LinkSpec,
    OpenLink,
)
from pdwire.runtime.session.stage_layers import HeldLayers, coverage_problem

OWN = HeldLayers(kv=(0, 1, 2, 3), state=((0, 2),))


def held(kv: range | tuple[int, ...], state: tuple[int, ...]) -> HeldLayers:
    return HeldLayers(tuple(kv), (state,))


def test_stages_that_split_the_layers_pass_and_tp_ranks_of_a_stage_may_share_them() -> None:
    stages = {0: [held(range(2), (0,)), held(range(2), (0,))], 1: [held(range(2, 4), (2,))]}
    assert coverage_problem(OWN, stages) is None


@pytest.mark.parametrize(
    ("stages", "problem"),
    [
        ({0: [held(range(2), (0,))], 1: [held(range(2), (2,))]}, "KV layer 0 is held by PP stages 0 and 1"),
        (
            {0: [held(range(2), (0,))], 1: [held((2,), (2,))]},
            r"KV layers \[3\] of this decode rank are held by no",
        ),
        ({0: [held(range(2), (0,))], 1: [held(range(2, 5), (2,))]}, r"KV layers \[4\] of the group are not"),
        (
            {0: [held(range(2), (0,))], 1: [held(range(2, 4), (0,))]},
            "state component 0 layer 0 is held by PP",
        ),
        ({0: [held(range(2), (0,))], 1: [held(range(2, 4), ())]}, r"state component 0 layers \[2\] of this"),
        (
            {0: [HeldLayers((0, 1), ())]},
            "PP stage 0 names layers for 0 state components, this decode rank has 1",
        ),
        ({}, "no ranks"),
    ],
)
def test_overlaps_gaps_and_foreign_layers_are_named(
    stages: dict[int, list[HeldLayers]], problem: str
) -> None:
    found = coverage_problem(OWN, stages)
    assert found is not None
    assert __import__("re").search(problem, found), found


@given(st.lists(st.integers(0, 3), min_size=8, max_size=8))
def test_the_check_passes_exactly_when_every_layer_has_one_stage(owner: list[int]) -> None:
    """Layers 0..7 handed to stages 0..3 by ``owner`` (a stage may get none: it holds nothing)."""
    own = HeldLayers(tuple(range(8)), ())
    stages = {s: [HeldLayers(tuple(x for x in range(8) if owner[x] == s), ())] for s in range(4)}
    assert coverage_problem(own, stages) is None
    if owner[0] != owner[1]:  # the first stage also claims its neighbour's layer
        moved = {**stages, owner[0]: [HeldLayers((*stages[owner[0]][0].kv, 1), ())]}
        assert "held by PP stages" in (coverage_problem(own, moved) or "")
    dropped = {s: [HeldLayers(tuple(x for x in h[0].kv if x != 5), ())] for s, h in stages.items()}
    assert "[5] of this decode rank are held by no PP stage" in (coverage_problem(own, dropped) or "")


IDENT = GroupIdentity("pre", 0, 1, 2)


def two_stages() -> list[LinkSpec]:
    return [LinkSpec((0, s), f"tcp://127.0.0.1:{9100 + s}", Expected(1, 0, 2, s)) for s in range(2)]


def test_a_group_whose_stages_leave_a_layer_unwritten_fails_by_name() -> None:
    g = GroupConnect(two_stages(), deadline=10.0, own_layers=OWN)
    g.start()
    assert g.on_link_ready((0, 0), IDENT, held(range(2), (0,))) == [OpenLink(two_stages()[1])]
    (failed,) = g.on_link_ready((0, 1), IDENT, held(range(2), (2,)))
    assert isinstance(failed, GroupFailed) and "KV layer 0 is held by PP stages 0 and 1" in failed.reason
    assert g.state is GroupState.FAILED and not g.layers_checked


def test_a_group_with_a_rank_before_1_7_is_taken_unchecked_and_a_good_one_checked() -> None:
    g = GroupConnect(two_stages(), deadline=10.0, own_layers=OWN)
    g.start()
    g.on_link_ready((0, 0), IDENT, held(range(2), (0,)))
    assert g.on_link_ready((0, 1), IDENT, None) == [GroupConnected(IDENT)]  # an older rank: no layers
    assert not g.layers_checked
    g = GroupConnect(two_stages(), deadline=10.0, own_layers=OWN)
    g.start()
    g.on_link_ready((0, 0), IDENT, held(range(2), (0,)))
    assert g.on_link_ready((0, 1), IDENT, held(range(2, 4), (2,))) == [GroupConnected(IDENT)]
    assert g.layers_checked
