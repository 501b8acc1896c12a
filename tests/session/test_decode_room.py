"""Decode completion accounting: Success exactly when every (sender, component, chunk) arrived;
a failed room's slots are released exactly when every real sender fenced or was revoked, never
by a timeout (a sender still silent at the fence timeout, or lost, is revoked)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdwire.runtime.session.actions import PeerRef, ReleaseRoom, ReleaseSlots, RevokePeer, SendAbort
from pdwire.runtime.session.decode_room import SenderPlan
from pdwire.runtime.session.decode_session import DecodeSession
from pdwire.runtime.session.failures import DuplicateRoomError, Failure, FailureKind
from pdwire.runtime.session.status import Status
from pdwire.wire import NotificationKind

ROOM = 9
Completion = tuple[int, NotificationKind, int, bool, int]  # sender, kind, chunk, is_last, component


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
        owed += [(sender, NotificationKind.KV, c, c == chunks - 1, 0) for c in range(chunks)]
        owed += [(sender, NotificationKind.STATE, 0, False, c) for c in comps]
        if i == aux_owner:
            owed.append((sender, NotificationKind.AUX, 0, False, 0))
    return senders, owed


@given(plans(), st.randoms(use_true_random=False))
def test_success_exactly_at_the_last_expected_completion(plan, rnd) -> None:
    senders, owed = plan
    s = DecodeSession()
    room = s.start_room(ROOM, senders, now=0.0)
    assert room.status is Status.BOOTSTRAPPING
    room.on_requests_sent()
    order = list(owed)
    rnd.shuffle(order)
    for i, c in enumerate(order):
        acts = s.on_notification(ROOM, *c)
        if i < len(order) - 1:
            assert acts == [], f"finished early after {i + 1}/{len(order)}"
            assert room.status is Status.TRANSFERRING
        else:  # every write completed: the slots are the engine's at once
            assert acts == [ReleaseRoom(ROOM, Status.SUCCESS, None), ReleaseSlots(ROOM)]
    assert ROOM not in s.rooms and not s.quarantined
    assert s.on_notification(ROOM, *order[0]) == [] and s.stray_completions == 1


@given(plans(), st.randoms(use_true_random=False), st.data())
def test_where_notifications_can_be_lost_each_real_senders_success_stands_for_its_parts(
    plan, rnd, data
) -> None:
    # An engine that may drop notifications (Mooncake during a cut): some never arrive, yet a
    # room succeeds once every real sender either delivered all it owes or said Success.
    senders, owed = plan
    s = DecodeSession(status_completes=True)
    s.start_room(ROOM, senders, now=0.0)
    real = [p.sender for p in senders if not p.is_dummy]
    vouching = data.draw(st.lists(st.sampled_from(real), unique=True, min_size=1))
    lost = {next(c for c in owed if c[0] == v) for v in vouching}  # each vouching sender lost one
    arrived = [c for c in owed if c not in lost and (c[0] not in vouching or data.draw(st.booleans()))]
    rnd.shuffle(arrived)
    for c in arrived:
        assert s.on_notification(ROOM, *c) == []  # each vouching sender still owes a status
    for p in senders:
        if p.is_dummy:  # a dummy's Success proves nothing: it owes nothing
            assert s.on_status(ROOM, p.sender, Status.SUCCESS, None) == []
    for i, sender in enumerate(vouching):
        acts = s.on_status(ROOM, sender, Status.SUCCESS, None)
        if i < len(vouching) - 1:
            assert acts == []
        else:
            assert acts == [ReleaseRoom(ROOM, Status.SUCCESS, None), ReleaseSlots(ROOM)]


@given(plans())
def test_a_success_status_alone_completes_nothing_where_notifications_are_reliable(plan) -> None:
    senders, _ = plan
    s = DecodeSession(room_timeout_s=5.0)
    s.start_room(ROOM, senders, now=0.0)
    for p in senders:
        assert s.on_status(ROOM, p.sender, Status.SUCCESS, None) == []
    [rel] = [a for a in s.on_tick(5.0) if isinstance(a, ReleaseRoom)]
    assert rel.status is Status.FAILED and rel.failure is not None
    assert rel.failure.kind is FailureKind.TIMEOUT


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
    assert isinstance(rel, ReleaseRoom) and rel.status is Status.FAILED
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
        bad = (999, NotificationKind.KV, 0, True, 0)
    elif bad_kind == "dummy" and any(p.is_dummy for p in senders):
        bad = (next(p for p in senders if p.is_dummy).sender, NotificationKind.KV, 0, True, 0)
    elif bad_kind == "component":
        bad = (real.sender, NotificationKind.STATE, 0, False, 7)
    else:
        last = max(c[2] for c in owed if c[0] == first[0] and c[1] is NotificationKind.KV)
        if first[2] != last:
            s.on_notification(ROOM, first[0], NotificationKind.KV, last, True, 0)
        bad = (first[0], NotificationKind.KV, last + 1, False, 0)
    acts = s.on_notification(ROOM, *bad)
    assert isinstance(acts[-1], ReleaseRoom) and acts[-1].status is Status.FAILED
    assert acts[-1].failure is not None and acts[-1].failure.kind is FailureKind.VALIDATION


def test_per_component_accounting_not_per_sender() -> None:
    """Two state components from one sender: the first must not complete the room (#39846)."""
    s = DecodeSession()
    s.start_room(ROOM, [SenderPlan(0, PeerRef("p", 0), False, (0, 1), True)], now=0.0)
    assert s.on_notification(ROOM, 0, NotificationKind.KV, 0, True) == []
    assert s.on_notification(ROOM, 0, NotificationKind.AUX) == []
    assert s.on_notification(ROOM, 0, NotificationKind.STATE, component=1) == []
    assert s.rooms[ROOM].missing() == ["sender 0: state [0]"]
    assert s.on_notification(ROOM, 0, NotificationKind.STATE, component=0)[0].status is Status.SUCCESS  # type: ignore[union-attr]


def test_failed_status_from_a_sender_fails_and_aborts_the_others() -> None:
    s = DecodeSession()
    p0, p1 = PeerRef("p", 0), PeerRef("p", 1)
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True), SenderPlan(1, p1)], now=0.0)
    other = s.start_room(ROOM + 1, [SenderPlan(0, p0, aux=True)], now=0.0)
    assert s.on_status(ROOM, 1, Status.SUCCESS, None) == []  # success is counted, not believed
    fail = Failure(FailureKind.ENGINE_ERROR, "ERR")
    acts = s.on_status(ROOM, 1, Status.FAILED, fail)
    assert acts == [SendAbort(p0, ROOM, fail), ReleaseRoom(ROOM, Status.FAILED, fail)]
    assert ROOM + 1 in s.rooms and other.status is Status.BOOTSTRAPPING  # others untouched


def test_duplicate_room_is_a_typed_error_and_leaves_the_room_alone() -> None:
    s = DecodeSession()
    senders = [SenderPlan(0, PeerRef("p", 0), aux=True)]
    room = s.start_room(ROOM, senders, now=0.0)
    with pytest.raises(DuplicateRoomError, match=f"room {ROOM} is already in use"):
        s.start_room(ROOM, senders, now=0.0)
    assert s.rooms[ROOM] is room
    s.on_notification(ROOM, 0, NotificationKind.KV, 0, True)
    assert s.on_notification(ROOM, 0, NotificationKind.AUX)[0].status is Status.SUCCESS  # type: ignore[union-attr]
    with pytest.raises(DuplicateRoomError, match="finished SUCCESS"):
        s.start_room(ROOM, senders, now=1.0)


def test_peer_lost_fails_only_rooms_fed_by_that_peer() -> None:
    s = DecodeSession()
    a, b = PeerRef("p", 0), PeerRef("p", 1)
    s.start_room(1, [SenderPlan(0, a, aux=True)], now=0.0)
    s.start_room(2, [SenderPlan(1, b, aux=True)], now=0.0)
    acts = s.on_peer_lost(a)
    # the room fails (its peer is told too: a revoked rank is alive), but a lost peer fences
    # nothing (a stopped process resumes, buffered bytes still land): it is revoked
    assert [type(x) for x in acts] == [SendAbort, ReleaseRoom, RevokePeer]
    assert acts[1].failure.kind is FailureKind.PEER_GONE and acts[2] == RevokePeer(a)  # type: ignore[union-attr]
    assert list(s.rooms) == [2] and list(s.quarantined) == [1]
    assert s.on_peer_lost(a) == []  # asked once until answered
    assert s.on_revoked(a) == [ReleaseSlots(1, (a,))]  # cut off: nothing it writes lands now
    assert s.revoking == set()


def test_bad_plans_are_refused() -> None:
    s = DecodeSession()
    with pytest.raises(ValueError, match="no real"):
        s.start_room(1, [SenderPlan(0, PeerRef("p", 0), is_dummy=True)], now=0.0)
    with pytest.raises(ValueError, match="aux"):
        two_owners = [SenderPlan(0, PeerRef("p", 0), aux=True), SenderPlan(1, PeerRef("p", 1), aux=True)]
        s.start_room(1, two_owners, now=0.0)


def test_a_room_without_aux_succeeds_on_kv_alone() -> None:
    s = DecodeSession()
    s.start_room(1, [SenderPlan(0, PeerRef("p", 0))], now=0.0)
    actions = s.on_notification(1, 0, NotificationKind.KV, 0, True, 0)
    assert actions == [ReleaseRoom(1, Status.SUCCESS, None), ReleaseSlots(1)]


TRIGGERS = ["timeout", "status", "abort", "unexpected", "peer_lost"]
FENCES = ["failed_status", "success_status", "abort_ack", "revoked"]
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
            acts = s.on_status(ROOM, culprit.sender, Status.FAILED, Failure(FailureKind.ENGINE_ERROR, "x"))
            fenced.add(culprit.sender)  # its Failed is sent after its drain
        else:
            acts = s.on_peer_lost(culprit.peer)
            assert acts[-1] == RevokePeer(culprit.peer)  # lost fences nothing: it is revoked
            acts = acts[:-1]
    elif trigger == "abort":
        acts = s.abort(ROOM, Failure(FailureKind.ABORTED, "the engine gave up"))
    else:
        acts = s.on_notification(ROOM, 999, NotificationKind.KV, 0, True, 0)
    rel = [a for a in acts if isinstance(a, ReleaseRoom)]
    assert len(rel) == 1 and rel[0].status is Status.FAILED  # the engine learns at once
    assert ROOM not in s.rooms and s.tombstones[ROOM] is Status.FAILED
    with pytest.raises(DuplicateRoomError):
        s.start_room(ROOM, senders, now=1.0)  # the id stays taken
    if {p.sender for p in real} <= fenced:
        assert acts[-1] == ReleaseSlots(ROOM)  # nobody left who could write
        return
    assert not any(isinstance(a, ReleaseSlots) for a in acts) and ROOM in s.quarantined
    waiting = [p for p in real if p.sender not in fenced]
    rnd.shuffle(waiting)
    stray = 0
    revoked: set[PeerRef] = set()
    for i, p in enumerate(waiting):
        for _ in range(data.draw(st.integers(0, 2))):  # anything else that may arrive meanwhile
            noise = data.draw(st.sampled_from(NOISE))
            if noise == "late_completion":
                acts = s.on_notification(ROOM, *data.draw(st.sampled_from(owed)))
                stray += 1
            elif noise == "dummy_ack" and dummies:
                acts = s.on_abort_ack(ROOM, dummies[0].sender)
            elif noise == "non_final_status":
                acts = s.on_status(ROOM, p.sender, Status.TRANSFERRING, None)
            elif noise == "repeat_fence" and fenced:
                acts = s.on_abort_ack(ROOM, next(iter(fenced)))
            elif noise == "tick":
                acts = s.on_tick(14.99)  # before the fence timeout
            else:
                acts = s.on_abort_ack(ROOM, 999)
            assert acts == [], noise
        how = data.draw(st.sampled_from(FENCES))
        if how == "failed_status":
            acts = s.on_status(ROOM, p.sender, Status.FAILED, Failure(FailureKind.ABORTED, "aborted"))
        elif how == "success_status":
            acts = s.on_status(ROOM, p.sender, Status.SUCCESS, None)
        elif how == "abort_ack":
            acts = s.on_abort_ack(ROOM, p.sender)
        else:
            acts = s.on_revoked(p.peer)
            revoked.add(p.peer)
        fenced.add(p.sender)
        if i < len(waiting) - 1:
            assert acts == [], f"slots released with {len(waiting) - 1 - i} sender(s) unfenced"
        else:
            assert acts == [ReleaseSlots(ROOM, tuple(sorted(revoked, key=str)))]
    assert not s.quarantined
    assert s.stray_completions == stray  # late completions of a quarantined room are stray, no failure
    assert s.on_abort_ack(ROOM, waiting[0].sender) == [] and s.on_tick(1e9) == []  # released once


def test_a_silent_sender_is_revoked_at_the_fence_timeout_and_the_slots_wait_for_that() -> None:
    s = DecodeSession(room_timeout_s=5.0, fence_timeout_s=10.0)
    p0, p1, p2 = PeerRef("p", 0), PeerRef("p", 1), PeerRef("p", 2)
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True), SenderPlan(1, p1), SenderPlan(2, p2, True)], now=100.0)
    fail = Failure(FailureKind.ENGINE_ERROR, "ERR")
    acts = s.on_status(ROOM, 0, Status.FAILED, fail)
    assert acts == [
        SendAbort(p1, ROOM, fail),
        SendAbort(p2, ROOM, fail),
        ReleaseRoom(ROOM, Status.FAILED, fail),
    ]
    assert s.on_tick(114.99) == []  # fence_timeout_s past the room's own deadline (105)
    assert s.on_tick(115.0) == [RevokePeer(p1)]  # p1 never answered; dummy p2 needs no fence
    assert s.on_tick(116.0) == [] and ROOM in s.quarantined  # asked once; a timeout releases nothing
    assert s.on_revoked(p1) == [ReleaseSlots(ROOM, (p1,))]
    assert not s.quarantined
    assert s.on_abort_ack(ROOM, 1) == []  # too late to matter: released once


def test_a_sender_that_cannot_be_revoked_leaves_the_slots_quarantined_until_a_real_fence() -> None:
    s = DecodeSession(room_timeout_s=5.0, fence_timeout_s=10.0)
    p0 = PeerRef("p", 0)
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True, fences=False)], now=100.0)
    fail = Failure(FailureKind.ENGINE_ERROR, "ERR")
    assert s.on_status(ROOM, 0, Status.FAILED, fail) == [ReleaseRoom(ROOM, Status.FAILED, fail)]
    assert s.on_tick(115.0) == [RevokePeer(p0)]
    assert s.on_unrevocable(p0, "memory the engine did not allocate") == []
    assert s.on_tick(1e9) == [] and ROOM in s.quarantined  # never released by time, never asked again
    assert s.unrevocable == {p0: "memory the engine did not allocate"}
    assert s.on_status(ROOM, 0, Status.SUCCESS, None) == [ReleaseSlots(ROOM)]  # a real fence still counts


def test_a_reclaimed_room_leaves_quarantine_and_its_late_fences_are_stray() -> None:
    s = DecodeSession(room_timeout_s=5.0)
    p0 = PeerRef("p", 0)
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True, fences=False)], now=100.0)  # its Failed fences nothing
    assert s.on_reclaimed(ROOM) is None  # live, not quarantined: nothing to reclaim
    fail = Failure(FailureKind.ENGINE_ERROR, "ERR")
    s.on_status(ROOM, 0, Status.FAILED, fail)
    s.on_tick(115.0)
    s.on_unrevocable(p0, "memory the engine did not allocate")
    r = s.on_reclaimed(ROOM)
    assert r is not None and r.unfenced() == (p0,) and ROOM not in s.quarantined
    assert s.on_reclaimed(ROOM) is None  # once
    assert s.on_status(ROOM, 0, Status.SUCCESS, None) == []  # no second release of its slots
    assert s.on_tick(1e9) == []
    with pytest.raises(DuplicateRoomError):
        s.check_free(ROOM)  # the tombstone keeps the id while late messages may come


def test_a_revoked_peer_fails_its_live_rooms_and_fences_its_quarantined_ones() -> None:
    s = DecodeSession(room_timeout_s=5.0)
    p0, p1 = PeerRef("p", 0), PeerRef("p", 1)
    s.start_room(1, [SenderPlan(0, p0, aux=True)], now=0.0)
    s.start_room(2, [SenderPlan(0, p0, aux=True), SenderPlan(1, p1)], now=0.0)
    s.start_room(3, [SenderPlan(1, p1, aux=True)], now=0.0)
    acts = s.on_revoked(p0)  # e.g. another room of p0 waited for it past its fence timeout
    released = [a.room for a in acts if isinstance(a, ReleaseSlots)]
    failed = [a.room for a in acts if isinstance(a, ReleaseRoom)]
    assert failed == [1, 2] and released == [1]  # room 2 still waits for p1
    assert list(s.rooms) == [3]


def test_the_fence_timeout_defaults_to_twice_the_room_timeout() -> None:
    assert DecodeSession(room_timeout_s=7.0).fence_timeout_s == 14.0


def test_a_sender_that_succeeded_before_another_failed_the_room_is_already_fenced() -> None:
    s = DecodeSession()
    p0, p1 = PeerRef("p", 0), PeerRef("p", 1)
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True), SenderPlan(1, p1)], now=0.0)
    assert s.on_status(ROOM, 1, Status.SUCCESS, None) == []  # all of p1's writes completed
    fail = Failure(FailureKind.ENGINE_ERROR, "ERR")
    acts = s.on_status(ROOM, 0, Status.FAILED, fail)
    assert acts[-2:] == [ReleaseRoom(ROOM, Status.FAILED, fail), ReleaseSlots(ROOM)]


def test_a_peer_older_than_1_3_fences_only_by_success_or_by_revocation() -> None:
    # before 1.3 a prefill rank sent Failed and AbortAck with writes possibly still in flight
    s = DecodeSession(room_timeout_s=5.0, fence_timeout_s=10.0)
    p0, p1 = PeerRef("p", 0), PeerRef("p", 1)
    old0, old1 = SenderPlan(0, p0, aux=True, fences=False), SenderPlan(1, p1, fences=False)
    s.start_room(ROOM, [old0, old1], now=100.0)
    fail = Failure(FailureKind.ENGINE_ERROR, "ERR")
    acts = s.on_status(ROOM, 0, Status.FAILED, fail)
    assert acts == [SendAbort(p1, ROOM, fail), ReleaseRoom(ROOM, Status.FAILED, fail)]  # no slots
    assert s.on_abort_ack(ROOM, 1) == []  # not a promise from this peer
    assert s.on_tick(114.0) == []
    assert s.on_tick(115.0) == [RevokePeer(p0), RevokePeer(p1)]
    assert s.on_revoked(p0) == []
    assert s.on_revoked(p1) == [ReleaseSlots(ROOM, (p0, p1))]
    # a Success (every write completed) fences at any version
    s.start_room(ROOM + 1, [old0, old1], now=200.0)
    assert s.on_status(ROOM + 1, 1, Status.SUCCESS, None) == []
    acts = s.on_peer_lost(p0)
    assert acts[-1] == RevokePeer(p0) and ROOM + 1 in s.quarantined
    assert s.on_revoked(p0) == [ReleaseSlots(ROOM + 1, (p0,))]


def test_a_quarantined_room_id_cannot_start_again_even_after_its_tombstone_is_gone() -> None:
    # the tombstone list is bounded; the quarantine is not: a new room of the same id would
    # take the old room's late fence for its own
    s = DecodeSession(room_timeout_s=5.0, tombstones=1)
    p0 = PeerRef("p", 0)
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True)], now=0.0)
    fail = Failure(FailureKind.ABORTED, "gave up")
    assert s.abort(ROOM, fail)[-1] == ReleaseRoom(ROOM, Status.FAILED, fail)  # slots still held
    for other in (ROOM + 1, ROOM + 2):  # push its tombstone out
        s.start_room(other, [SenderPlan(0, p0, aux=True)], now=0.0)
        s.abort(other, fail)
    assert ROOM not in s.tombstones and ROOM in s.quarantined
    with pytest.raises(DuplicateRoomError, match="still waiting for its senders to stop writing"):
        s.start_room(ROOM, [SenderPlan(0, p0, aux=True)], now=1.0)
    assert s.on_abort_ack(ROOM, 0) == [ReleaseSlots(ROOM)]  # the old room's fence reaches the old room
    s.start_room(ROOM, [SenderPlan(0, p0, aux=True)], now=2.0)  # and the id is free again


# -- multi-part notifications (protocol 1.4) ----------------------------------------------------

Merged = tuple[int, NotificationKind, int, bool, int, int, tuple[int, ...], bool]


def _merge(group: list[Completion]) -> Merged:
    """One notification for ``group`` (one sender's parts: at most one run of consecutive KV
    chunks, then state components, then aux), as a prefill rank builds it."""
    sender = group[0][0]
    kv = sorted(c for _, k, c, _, _ in group if k is NotificationKind.KV)
    comps = [comp for _, k, _, _, comp in group if k is NotificationKind.STATE]
    aux = any(k is NotificationKind.AUX for _, k, _, _, _ in group)
    if kv:
        last = any(last for _, k, c, last, _ in group if k is NotificationKind.KV and c == kv[-1])
        return (sender, NotificationKind.KV, kv[0], last, 0, len(kv), tuple(comps), aux)
    if comps:
        return (sender, NotificationKind.STATE, 0, False, comps[0], 1, tuple(comps[1:]), aux)
    return (sender, NotificationKind.AUX, 0, False, 0, 1, (), False)


@st.composite
def merged_deliveries(draw: st.DrawFn, owed: list[Completion]) -> list[Merged]:
    """``owed`` cut into mergeable groups (per sender: KV runs of consecutive chunks, the state
    and aux parts joined to any of them), delivered in a random order."""
    out: list[Merged] = []
    for sender in sorted({c[0] for c in owed}):
        mine = [c for c in owed if c[0] == sender]
        kv = [c for c in mine if c[1] is NotificationKind.KV]
        rest = [c for c in mine if c[1] is not NotificationKind.KV]
        groups: list[list[Completion]] = []
        i = 0
        while i < len(kv):
            n = draw(st.integers(1, len(kv) - i))
            groups.append(kv[i : i + n])
            i += n
        for c in rest:
            where = draw(st.integers(0, len(groups)))
            if where == len(groups):
                groups.append([c])
            else:
                groups[where].append(c)
        out += [_merge(g) for g in groups]
    return draw(st.permutations(out))


def _singles(m: Merged) -> list[Completion]:
    sender, kind, chunk, last, comp, count, also, aux = m
    if kind is NotificationKind.KV:
        out = [(sender, kind, c, last and c == chunk + count - 1, 0) for c in range(chunk, chunk + count)]
    else:
        out = [(sender, kind, chunk, last, comp)]
    out += [(sender, NotificationKind.STATE, 0, False, c) for c in also]
    return out + ([(sender, NotificationKind.AUX, 0, False, 0)] if aux else [])


@given(plans(), st.data())
def test_merged_notifications_succeed_exactly_at_the_last_part(plan, data) -> None:
    senders, owed = plan
    order = data.draw(merged_deliveries(owed))
    assert sorted(c for m in order for c in _singles(m)) == sorted(owed)  # the strategy's own check
    s = DecodeSession()
    room = s.start_room(ROOM, senders, now=0.0)
    room.on_requests_sent()
    for i, m in enumerate(order):
        acts = s.on_notification(ROOM, *m)
        if i < len(order) - 1:
            assert acts == [] and room.status is Status.TRANSFERRING
        else:
            assert acts == [ReleaseRoom(ROOM, Status.SUCCESS, None), ReleaseSlots(ROOM)]


@given(plans(), st.data())
def test_a_merged_notification_means_exactly_its_parts_one_by_one(plan, data) -> None:
    # Any notifications at all (owed parts, repeats, parts nobody owes, counts too large): a room
    # fed the multi-part forms ends exactly as one fed the single parts they stand for.
    senders, owed = plan
    sender_ids = [p.sender for p in senders] + [99]
    extra = st.tuples(
        st.sampled_from(sender_ids),
        st.sampled_from(list(NotificationKind)),
        st.integers(0, 5),
        st.booleans(),
        st.integers(0, 4),
        st.integers(1, 4),
        st.lists(st.integers(0, 4), max_size=3).map(tuple),
        st.booleans(),
    ).filter(lambda m: m[1] is NotificationKind.KV or m[5] == 1)
    good = data.draw(merged_deliveries(owed))
    noise = data.draw(st.lists(extra, max_size=4))
    order = data.draw(st.permutations(good + noise))
    merged, single = DecodeSession(), DecodeSession()
    a = merged.start_room(ROOM, senders, now=0.0)
    b = single.start_room(ROOM, senders, now=0.0)
    for m in order:
        merged.on_notification(ROOM, *m)
        for c in _singles(m):
            single.on_notification(ROOM, *c)
        assert a.status is b.status
        assert (a.failure and a.failure.reason) == (b.failure and b.failure.reason)


def test_a_hostile_chunk_count_fails_the_room_without_counting_it() -> None:
    s = DecodeSession()
    room = s.start_room(ROOM, [SenderPlan(1, PeerRef("pre", 0))], now=0.0)
    acts = s.on_notification(ROOM, 1, NotificationKind.KV, 0, False, 0, 4_000_000_000)
    assert room.status is Status.FAILED and any(isinstance(a, ReleaseRoom) for a in acts)
    assert room.failure is not None and "chunk_count 4000000000" in room.failure.reason
    s2 = DecodeSession()
    room2 = s2.start_room(ROOM, [SenderPlan(1, PeerRef("pre", 0), components=(0,))], now=0.0)
    s2.on_notification(ROOM, 1, NotificationKind.STATE, 0, False, 0, 2)
    assert room2.failure is not None and "chunk_count 2 on a state notification" in room2.failure.reason
