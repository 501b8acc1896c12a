"""The non-blocking connect of one prefill group, with no sockets: GroupConnect orders the ranks'
handshakes, checks they are one group, and holds rooms inside their deadlines.

Hypothesis feeds it link outcomes, held rooms, releases and ticks in any order and checks the
promises: ranks are opened one at a time and each once; the group is ready only when every rank
registered as the same group; every held room ends exactly once (started with its own deadline
after the group is ready, or failed typed, never both); nothing is held once the group is over.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pdwire.runtime.indices import RequestIndices
from pdwire.runtime.session.decode_connection import Expected
from pdwire.runtime.session.failures import FailureKind
from pdwire.runtime.session.group_connect import (
    FailHeld,
    GroupAction,
    GroupConnect,
    GroupConnected,
    GroupFailed,
    GroupIdentity,
    GroupState,
    LinkSpec,
    OpenLink,
    StartHeld,
)

IDENT = GroupIdentity("pre", 0, 2, 1)
OTHER = GroupIdentity("pre", 1, 2, 1)  # another DP group
INDICES = RequestIndices(np.arange(2, dtype=np.int32))


def specs(n: int) -> list[LinkSpec]:
    return [LinkSpec((p, 0), f"tcp://127.0.0.1:{9000 + p}", Expected(n, p)) for p in range(n)]


def test_ranks_open_one_after_another_and_held_rooms_start_once_all_are_ready() -> None:
    g = GroupConnect(specs(2), deadline=10.0)
    assert g.start() == [OpenLink(specs(2)[0])]
    assert g.hold(5, INDICES, deadline=4.0) == [] and g.state is GroupState.CONNECTING
    assert g.on_link_ready((0, 0), IDENT) == [OpenLink(specs(2)[1])]
    assert g.on_link_ready((0, 0), IDENT) == []  # a repeat changes nothing
    out = g.on_link_ready((1, 0), IDENT)
    assert out == [GroupConnected(IDENT), StartHeld(5, INDICES, 4.0)]
    assert g.state is GroupState.READY and not g.held
    assert g.hold(6, INDICES, 9.0) == [StartHeld(6, INDICES, 9.0)]


def test_a_refusal_fails_the_group_and_its_held_rooms_typed() -> None:
    g = GroupConnect(specs(1), deadline=10.0)
    g.start()
    g.hold(5, INDICES, 4.0)
    out = g.on_link_refused((0, 0), "prefill 'pre' refused the registration: model differs")
    assert out[0] == GroupFailed("prefill 'pre' refused the registration: model differs")
    (fail,) = out[1:]
    assert isinstance(fail, FailHeld) and fail.room == 5 and fail.failure.kind is FailureKind.HANDSHAKE
    assert "model differs" in fail.failure.detail
    later = g.hold(6, INDICES, 9.0)
    assert isinstance(later[0], FailHeld) and later[0].failure.kind is FailureKind.HANDSHAKE


def test_a_held_room_fails_at_its_deadline_and_the_group_at_the_handshake_deadline() -> None:
    g = GroupConnect(specs(1), deadline=10.0)
    g.start()
    g.hold(5, INDICES, 4.0)
    assert g.on_tick(3.9) == []
    (fail,) = g.on_tick(4.0)
    assert isinstance(fail, FailHeld) and fail.room == 5 and fail.failure.kind is FailureKind.TIMEOUT
    (failed,) = g.on_tick(10.0)
    assert isinstance(failed, GroupFailed) and "handshake timeout" in failed.reason


def test_ranks_of_different_groups_are_refused_by_name() -> None:
    g = GroupConnect(specs(2), deadline=10.0)
    g.start()
    g.on_link_ready((0, 0), IDENT)
    (failed,) = g.on_link_ready((1, 0), OTHER)
    assert isinstance(failed, GroupFailed)
    assert "tcp://127.0.0.1:9001 belongs to pre (DP group 1), the other endpoints to pre" in failed.reason


def test_a_released_room_is_forgotten() -> None:
    g = GroupConnect(specs(1), deadline=10.0)
    g.start()
    g.hold(5, INDICES, 4.0)
    assert g.release(5) and not g.release(5)
    assert g.on_link_ready((0, 0), IDENT) == [GroupConnected(IDENT)]


event = st.one_of(
    st.tuples(st.just("ready"), st.integers(0, 2), st.sampled_from([IDENT, IDENT, OTHER])),
    st.tuples(st.just("refused"), st.integers(0, 2), st.just("no")),
    st.tuples(st.just("hold"), st.integers(1, 6), st.floats(0.0, 12.0)),
    st.tuples(st.just("release"), st.integers(1, 6), st.just(0.0)),
    st.tuples(st.just("tick"), st.just(0), st.floats(0.0, 12.0)),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.lists(event, max_size=30))
def test_any_order_keeps_the_promises(n: int, events: list[tuple[str, int, object]]) -> None:
    g = GroupConnect(specs(n), deadline=10.0)
    opened: list[tuple[int, int]] = []
    ended: dict[int, str] = {}  # room -> how it ended
    held_deadline: dict[int, float] = {}
    idents: set[GroupIdentity] = set()
    now = 0.0

    def take(actions: list[GroupAction]) -> None:
        for a in actions:
            if isinstance(a, OpenLink):
                assert a.spec.key not in opened
                opened.append(a.spec.key)
            elif isinstance(a, StartHeld | FailHeld):
                assert a.room not in ended, f"room {a.room} ended twice"
                ended[a.room] = type(a).__name__
                if isinstance(a, StartHeld):
                    assert g.state is GroupState.READY
                    assert a.deadline == held_deadline[a.room]
                else:
                    assert a.failure.kind in (FailureKind.HANDSHAKE, FailureKind.TIMEOUT)
            elif isinstance(a, GroupConnected):
                assert g.state is GroupState.READY
                assert len(opened) == n and idents == {a.identity}

    take(g.start())
    for kind, arg, value in events:
        state_before = g.state
        if kind == "ready":
            key = (arg, 0)
            if key == (opened[-1] if opened else None) and g.state is GroupState.CONNECTING:
                assert isinstance(value, GroupIdentity)
                idents.add(value)
            take(g.on_link_ready(key, value))  # type: ignore[arg-type]
        elif kind == "refused":
            take(g.on_link_refused((arg, 0), "no"))
        elif kind == "hold":
            if arg in ended or arg in g.held:
                continue  # the edge refuses a room id in use (DuplicateRoomError) before this
            assert isinstance(value, float)
            held_deadline[arg] = value
            take(g.hold(arg, INDICES, value))
        elif kind == "release":
            if g.release(arg):
                ended[arg] = "released"
        else:
            assert isinstance(value, float)
            now = max(now, value)
            take(g.on_tick(now))
            assert all(deadline > now for _, deadline in g.held.values())  # due rooms failed
        if state_before is not GroupState.CONNECTING:
            assert g.state is state_before  # over is over
        # only one rank's handshake runs at a time, in order
        assert opened == [s.key for s in specs(n)][: len(opened)]
        if g.state is not GroupState.CONNECTING:
            assert not g.held
        assert not set(g.held) & set(ended)
