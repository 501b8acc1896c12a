"""Decode completion accounting: Success exactly when every (sender, component, chunk) arrived;
a failed room's slots are released exactly when every real sender fenced (or, loudly, at the
fence timeout)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdwire.runtime.session import (
    DecodeSession,
    DuplicateRoomError,
    Failure,
    FailureKind,
    PartKind,
    PeerRef,
    ReleaseRoom,
    ReleaseSlots,
    RoomStatus,
    SendAbort,
    SenderPlan,
)

ROOM = 9
Completion = tuple[int, PartKind, int, bool, int]  # sender, kind, chunk, is_last, component


@st.composite
def plans(draw: st.DrawFn) -> tuple[list[SenderPlan], list[Completion]]:
    """Sender plans plus the exact set of completions they owe."""
    n = draw(st.integers(1, 4))
    dummies = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if all(dummies):
        dummies[0] = False
    real = [i for i in range(n) if not dummies[i]]
    aux_owner = draw(st.sampled_from(real))
    comps = tuple(sorted(draw(st.sets(st.integers(0, 3), max_size=3))))
    senders, owed = [], []
    for i in range(n):
        sender = 10 + i  # sender ranks need not be dense
        senders.append(
            SenderPlan(sender, PeerRef("pre", i), dummies[i], () if dummies[i] else comps, i == aux_owner)
        )
        if dummies[i]:
            continue
        chunks = draw(st.integers(1, 4))
        owed += [(sender, PartKind.KV, c, c == chunks - 1, 0) for c in range(chunks)]
        owed += [(sender, PartKind.STATE, 0, False, c) for c in comps]
        if i == aux_owner:
            owed.append((sender, PartKind.AUX, 0, False, 0))
    return senders, owed


@given(plans(), st.randoms(use_true_random=False))
def test_success_exactly_at_the_last_expected_completion(plan, rnd) -> None:
    senders, owed = plan
    s = DecodeSession()
    room = s.start_room(ROOM, senders, now=0.0)
    assert room.status is RoomStatus.BOOTSTRAPPING
    room.on_requests_sent()
    order = list(owed)
    rnd.shuffle(order)
    for i, c in enumerate(order):
        acts = s.on_notification(ROOM, *c)
        if i < len(order) - 1:
            assert acts == [], f"finished early after {i + 1}/{len(order)}"
            assert room.status is RoomStatus.TRANSFERRING
        else:  # every write completed: the slots are the engine's at once
            assert acts == [ReleaseRoom(ROOM, RoomStatus.SUCCESS, None), ReleaseSlots(ROOM)]
    assert ROOM not in s.rooms and not s.quarantined
    assert s.on_notification(ROOM, *order[0]) == [] and s.stray_completions == 1


@given(plans(), st.randoms(use_true_random=False), st.data())
def test_a_missing_completion_never_succeeds_and_times_out_naming_it(plan, rnd, data) -> None:
    senders, owed = plan
    s = DecodeSession(room_timeout_s=5.0)
    s.start_room(ROOM, senders, now=0.0)
    order = list(owed)
    rnd.shuffle(order)
    dropped = order.pop(data.draw(st.integers(0, len(order) - 1)))
    for c in order:
        assert s.on_notification(ROOM, *c) == []
    assert s.on_tick(4.99) == []
    acts = s.on_tick(5.0)
    rel = acts[-1]
    assert isinstance(rel, ReleaseRoom) and rel.status is RoomStatus.FAILED
    assert rel.failure is not None and rel.failure.kind is FailureKind.TIMEOUT
    assert f"sender {dropped[0]}" in rel.failure.detail
    # every prefill peer is asked to abort, so it releases its side too
    assert {a.peer for a in acts if isinstance(a, SendAbort)} == {p.peer for p in senders}


@given(plans(), st.data())
def test_unexpected_completions_fail_the_room(plan, data) -> None:
    senders, owed = plan
    bad_kind = data.draw(st.sampled_from(["repeat", "unknown_sender", "dummy", "component", "after_last"]))
    s = DecodeSession()
    s.start_room(ROOM, senders, now=0.0)
    first = owed[0]
    assert s.on_notification(ROOM, *first) == []
    real = next(p for p in senders if not p.is_dummy)
    if bad_kind == "repeat":
        bad: Completion = first
    elif bad_kind == "unknown_sender":
        bad = (999, PartKind.KV, 0, True, 0)
    elif bad_kind == "dummy" and any(p.is_dummy for p in senders):
        bad = (next(p for p in senders if p.is_dummy).sender, PartKind.KV, 0, True, 0)
    elif bad_kind == "component":
        bad = (real.sender, PartKind.STATE, 0, False, 7)
    else:
        last = max(c[2] for c in owed if c[0] == first[0] and c[1] is PartKind.KV)
        if first[2] != last:
            s.on_notification(ROOM, first[0], PartKind.KV, last, True, 0)
        bad = (first[0], PartKind.KV, last + 1, False, 0)
    acts = s.on_notification(ROOM, *bad)
    assert isinstance(acts[-1], ReleaseRoom) and acts[-1].status is RoomStatus.FAILED
    assert acts[-1].failure is not None and acts[-1].failure.kind is FailureKind.VALIDATION


def test_per_component_accounting_not_per_sender() -> None:
    """Two state components from one sender: the first must not complete the room (#39846)."""
    s = DecodeSession()
    s.start_room(ROOM, [SenderPlan(0, PeerRef("p", 0), False, (0, 1), True)], now=0.0)
    assert s.on_notification(ROOM, 0, PartKind.KV, 0, True) == []
    assert s.on_notification(ROOM, 0, PartKind.AUX) == []
    assert s.on_notification(ROOM, 0, PartKind.STATE, component=1) == []
    assert s.rooms[ROOM].missing() == ["sender 0: state [0]"]
    assert s.on_notification(ROOM, 0, PartKind.STATE, component=0)[0].status is RoomStatus.SUCCESS  # type: ignore[union-attr]


def test_failed_status_from_a_sender_fails_and_aborts_the_others() -> None:
    s = DecodeSession()
    p0, p1 = PeerRef("p", 0), PeerRef("p", 1)
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True), SenderPlan(1, p1)], now=0.0)
    other = s.start_room(ROOM + 1, [SenderPlan(0, p0, aux=True)], now=0.0)
    assert s.on_status(ROOM, 1, RoomStatus.SUCCESS, None) == []  # success is counted, not believed
    fail = Failure(FailureKind.ENGINE_ERROR, "ERR")
    acts = s.on_status(ROOM, 1, RoomStatus.FAILED, fail)
    assert acts == [SendAbort(p0, ROOM, fail), ReleaseRoom(ROOM, RoomStatus.FAILED, fail)]
    assert ROOM + 1 in s.rooms and other.status is RoomStatus.BOOTSTRAPPING  # others untouched


def test_duplicate_room_is_a_typed_error_and_leaves_the_room_alone() -> None:
    s = DecodeSession()
    senders = [SenderPlan(0, PeerRef("p", 0), aux=True)]
    room = s.start_room(ROOM, senders, now=0.0)
    with pytest.raises(DuplicateRoomError, match=f"room {ROOM} is already in use"):
        s.start_room(ROOM, senders, now=0.0)
    assert s.rooms[ROOM] is room
    s.on_notification(ROOM, 0, PartKind.KV, 0, True)
    assert s.on_notification(ROOM, 0, PartKind.AUX)[0].status is RoomStatus.SUCCESS  # type: ignore[union-attr]
    with pytest.raises(DuplicateRoomError, match="finished SUCCESS"):
        s.start_room(ROOM, senders, now=1.0)


def test_peer_lost_fails_only_rooms_fed_by_that_peer() -> None:
    s = DecodeSession()
    a, b = PeerRef("p", 0), PeerRef("p", 1)
    s.start_room(1, [SenderPlan(0, a, aux=True)], now=0.0)
    s.start_room(2, [SenderPlan(1, b, aux=True)], now=0.0)
    acts = s.on_peer_lost(a)
    assert [x.room for x in acts] == [1, 1] and acts[0].failure.kind is FailureKind.PEER_GONE  # type: ignore[union-attr]
    assert acts[1] == ReleaseSlots(1)  # its only writer is gone: nothing can land any more
    assert list(s.rooms) == [2]


def test_bad_plans_are_refused() -> None:
    s = DecodeSession()
    with pytest.raises(ValueError, match="no real"):
        s.start_room(1, [SenderPlan(0, PeerRef("p", 0), is_dummy=True)], now=0.0)
    with pytest.raises(ValueError, match="aux"):
        s.start_room(1, [SenderPlan(0, PeerRef("p", 0))], now=0.0)


TRIGGERS = ["timeout", "status", "abort", "unexpected", "peer_lost"]
FENCES = ["failed_status", "success_status", "abort_ack", "peer_lost"]
NOISE = ["late_completion", "dummy_ack", "unknown_ack", "non_final_status", "repeat_fence", "tick"]


@given(plans(), st.sampled_from(TRIGGERS), st.randoms(use_true_random=False), st.data())
def test_a_failed_rooms_slots_are_released_exactly_when_its_last_real_sender_fenced(
    plan, trigger, rnd, data
) -> None:
    senders, owed = plan
    s = DecodeSession(room_timeout_s=5.0, fence_timeout_s=10.0)
    s.start_room(ROOM, senders, now=0.0)
    arrived = data.draw(st.integers(0, len(owed) - 1))
    for c in owed[:arrived]:
        assert s.on_notification(ROOM, *c) == []
    real = [p for p in senders if not p.is_dummy]
    dummies = [p for p in senders if p.is_dummy]
    fenced: set[int] = set()
    if trigger == "timeout":
        acts = s.on_tick(5.0)
    elif trigger in ("status", "peer_lost"):
        culprit = data.draw(st.sampled_from(real))
        if trigger == "status":
            acts = s.on_status(
                ROOM, culprit.sender, RoomStatus.FAILED, Failure(FailureKind.ENGINE_ERROR, "x")
            )
        else:
            acts = s.on_peer_lost(culprit.peer)
        fenced.add(culprit.sender)  # its Failed is sent after its drain; a lost process writes nothing
    elif trigger == "abort":
        acts = s.abort(ROOM, Failure(FailureKind.ABORTED, "the engine gave up"))
    else:
        acts = s.on_notification(ROOM, 999, PartKind.KV, 0, True, 0)
    rel = [a for a in acts if isinstance(a, ReleaseRoom)]
    assert len(rel) == 1 and rel[0].status is RoomStatus.FAILED  # the engine learns at once
    assert ROOM not in s.rooms and s.tombstones[ROOM] is RoomStatus.FAILED
    with pytest.raises(DuplicateRoomError):
        s.start_room(ROOM, senders, now=1.0)  # the id stays taken
    if {p.sender for p in real} <= fenced:
        assert acts[-1] == ReleaseSlots(ROOM)  # nobody left who could write
        return
    assert not any(isinstance(a, ReleaseSlots) for a in acts) and ROOM in s.quarantined
    waiting = [p for p in real if p.sender not in fenced]
    rnd.shuffle(waiting)
    stray = 0
    for i, p in enumerate(waiting):
        for _ in range(data.draw(st.integers(0, 2))):  # anything else that may arrive meanwhile
            noise = data.draw(st.sampled_from(NOISE))
            if noise == "late_completion":
                acts = s.on_notification(ROOM, *data.draw(st.sampled_from(owed)))
                stray += 1
            elif noise == "dummy_ack" and dummies:
                acts = s.on_abort_ack(ROOM, dummies[0].sender)
            elif noise == "non_final_status":
                acts = s.on_status(ROOM, p.sender, RoomStatus.TRANSFERRING, None)
            elif noise == "repeat_fence" and fenced:
                acts = s.on_abort_ack(ROOM, next(iter(fenced)))
            elif noise == "tick":
                acts = s.on_tick(14.99)  # before the fence timeout
            else:
                acts = s.on_abort_ack(ROOM, 999)
            assert acts == [], noise
        how = data.draw(st.sampled_from(FENCES))
        if how == "failed_status":
            acts = s.on_status(ROOM, p.sender, RoomStatus.FAILED, Failure(FailureKind.ABORTED, "aborted"))
        elif how == "success_status":
            acts = s.on_status(ROOM, p.sender, RoomStatus.SUCCESS, None)
        elif how == "abort_ack":
            acts = s.on_abort_ack(ROOM, p.sender)
        else:
            acts = s.on_peer_lost(p.peer)
        fenced.add(p.sender)
        if i < len(waiting) - 1:
            assert acts == [], f"slots released with {len(waiting) - 1 - i} sender(s) unfenced"
        else:
            assert acts == [ReleaseSlots(ROOM)]
    assert not s.quarantined
    assert s.stray_completions == stray  # late completions of a quarantined room are stray, no failure
    assert s.on_abort_ack(ROOM, waiting[0].sender) == [] and s.on_tick(1e9) == []  # released once


def test_a_silent_sender_is_given_up_on_at_the_fence_timeout_and_named() -> None:
    s = DecodeSession(room_timeout_s=5.0, fence_timeout_s=10.0)
    p0, p1, p2 = PeerRef("p", 0), PeerRef("p", 1), PeerRef("p", 2)
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True), SenderPlan(1, p1), SenderPlan(2, p2, True)], now=100.0)
    fail = Failure(FailureKind.ENGINE_ERROR, "ERR")
    acts = s.on_status(ROOM, 0, RoomStatus.FAILED, fail)
    assert acts == [
        SendAbort(p1, ROOM, fail),
        SendAbort(p2, ROOM, fail),
        ReleaseRoom(ROOM, RoomStatus.FAILED, fail),
    ]
    assert s.on_tick(114.99) == []  # fence_timeout_s past the room's own deadline (105)
    assert s.on_tick(115.0) == [ReleaseSlots(ROOM, (p1,))]  # p1 never answered; dummy p2 needs no fence
    assert not s.quarantined
    assert s.on_abort_ack(ROOM, 1) == []  # too late to matter: released once


def test_the_fence_timeout_defaults_to_twice_the_room_timeout() -> None:
    assert DecodeSession(room_timeout_s=7.0).fence_timeout_s == 14.0


def test_a_sender_that_succeeded_before_another_failed_the_room_is_already_fenced() -> None:
    s = DecodeSession()
    p0, p1 = PeerRef("p", 0), PeerRef("p", 1)
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True), SenderPlan(1, p1)], now=0.0)
    assert s.on_status(ROOM, 1, RoomStatus.SUCCESS, None) == []  # all of p1's writes completed
    fail = Failure(FailureKind.ENGINE_ERROR, "ERR")
    acts = s.on_status(ROOM, 0, RoomStatus.FAILED, fail)
    assert acts[-2:] == [ReleaseRoom(ROOM, RoomStatus.FAILED, fail), ReleaseSlots(ROOM)]


def test_a_peer_older_than_1_3_fences_only_by_success_or_by_leaving() -> None:
    # before 1.3 a prefill rank sent Failed and AbortAck with writes possibly still in flight
    s = DecodeSession(room_timeout_s=5.0, fence_timeout_s=10.0)
    p0, p1 = PeerRef("p", 0), PeerRef("p", 1)
    old0, old1 = SenderPlan(0, p0, aux=True, fences=False), SenderPlan(1, p1, fences=False)
    s.start_room(ROOM, [old0, old1], now=100.0)
    fail = Failure(FailureKind.ENGINE_ERROR, "ERR")
    acts = s.on_status(ROOM, 0, RoomStatus.FAILED, fail)
    assert acts == [SendAbort(p1, ROOM, fail), ReleaseRoom(ROOM, RoomStatus.FAILED, fail)]  # no slots
    assert s.on_abort_ack(ROOM, 1) == []  # not a promise from this peer
    assert s.on_tick(114.0) == []
    assert s.on_tick(115.0) == [ReleaseSlots(ROOM, (p0, p1))]  # loud: both named
    # a Success (every write completed) and a lost peer fence at any version
    s.start_room(ROOM + 1, [old0, old1], now=200.0)
    assert s.on_status(ROOM + 1, 1, RoomStatus.SUCCESS, None) == []
    acts = s.on_peer_lost(p0)
    assert (
        acts[-1] == ReleaseSlots(ROOM + 1)
        and ReleaseRoom(ROOM + 1, RoomStatus.FAILED, acts[-2].failure) in acts
    )  # type: ignore[union-attr]


def test_a_quarantined_room_id_cannot_start_again_even_after_its_tombstone_is_gone() -> None:
    # the tombstone list is bounded; the quarantine is not: a new room of the same id would
    # take the old room's late fence for its own
    s = DecodeSession(room_timeout_s=5.0, tombstones=1)
    p0 = PeerRef("p", 0)
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True)], now=0.0)
    fail = Failure(FailureKind.ABORTED, "gave up")
    assert s.abort(ROOM, fail)[-1] == ReleaseRoom(ROOM, RoomStatus.FAILED, fail)  # slots still held
    for other in (ROOM + 1, ROOM + 2):  # push its tombstone out
        s.start_room(other, [SenderPlan(0, p0, aux=True)], now=0.0)
        s.abort(other, fail)
    assert ROOM not in s.tombstones and ROOM in s.quarantined
    with pytest.raises(DuplicateRoomError, match="still waiting for its senders to stop writing"):
        s.start_room(ROOM, [SenderPlan(0, p0, aux=True)], now=1.0)
    assert s.on_abort_ack(ROOM, 0) == [ReleaseSlots(ROOM)]  # the old room's fence reaches the old room
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True)], now=2.0)  # and the id is free again
