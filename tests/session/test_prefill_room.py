"""Prefill room and session driven by hypothesis over event orders, with no sockets."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdwire.runtime.session import (
    Action,
    AuxPart,
    CancelTransfers,
    Failure,
    FailureKind,
    KvPart,
    PeerRef,
    PostTransfer,
    PrefillSession,
    ProtocolViolation,
    ReleaseRoom,
    RoomStatus,
    SendAbortAck,
    SendStatus,
    StatePart,
    Target,
)

ROOM = 42


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Target], list[tuple[int, int, bool]]]:
    n = draw(st.integers(1, 4))
    targets = []
    for rank in range(n):
        dummy = draw(st.booleans())
        comps = tuple(sorted(draw(st.sets(st.integers(0, 3), max_size=3))))
        targets.append(
            Target(PeerRef("dec", rank), dummy, () if dummy else comps, not dummy and draw(st.booleans()))
        )
    sizes = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
    chunks, start = [], 0
    for i, size in enumerate(sizes):
        chunks.append((start, start + size, i == len(sizes) - 1))
        start += size
    return targets, chunks


@dataclass
class Log:
    posts: list[PostTransfer] = field(default_factory=list)
    statuses: list[SendStatus] = field(default_factory=list)
    releases: list[ReleaseRoom] = field(default_factory=list)
    acks: list[SendAbortAck] = field(default_factory=list)
    cancels: list[CancelTransfers] = field(default_factory=list)
    after_release: list[Action] = field(default_factory=list)

    def take(self, actions: list[Action]) -> None:
        for a in actions:
            if self.releases and not isinstance(a, SendAbortAck):
                self.after_release.append(a)
            if isinstance(a, PostTransfer):
                self.posts.append(a)
            elif isinstance(a, SendStatus):
                self.statuses.append(a)
            elif isinstance(a, ReleaseRoom):
                self.releases.append(a)
            elif isinstance(a, SendAbortAck):
                self.acks.append(a)
            elif isinstance(a, CancelTransfers):
                self.cancels.append(a)


class Driver:
    """Feeds one room's events to a session in an order hypothesis chooses."""

    def __init__(
        self, data: st.DataObject, targets: list[Target], chunks: list[tuple[int, int, bool]]
    ) -> None:
        self.data, self.targets, self.chunks = data, targets, chunks
        self.s = PrefillSession(room_timeout_s=10.0)
        self.log = Log()
        self.pending = list(targets)
        self.next_chunk = 0
        self.in_flight: list[int] = []

    @property
    def enabled(self) -> list[str]:
        flags = (("r", self.pending), ("c", self.next_chunk < len(self.chunks)), ("d", self.in_flight))
        return [k for k, ok in flags if ok]

    def pick(self, items: list) -> int:  # type: ignore[type-arg]
        return self.data.draw(st.integers(0, len(items) - 1))

    def step(self) -> None:
        kind = self.data.draw(st.sampled_from(self.enabled))
        before = len(self.log.posts)
        if kind == "r":
            t = self.pending.pop(self.pick(self.pending))
            self.log.take(self.s.on_request(ROOM, t, len(self.targets), 0.0))
        elif kind == "c":
            self.log.take(self.s.on_chunk(ROOM, *self.chunks[self.next_chunk], now=0.0))
            self.next_chunk += 1
        else:
            self.log.take(self.s.on_xfer_done(self.in_flight.pop(self.pick(self.in_flight))))
        self.in_flight += [p.xfer_id for p in self.log.posts[before:]]


Scenario = tuple[list[Target], list[tuple[int, int, bool]]]


@given(scenarios(), st.data())
def test_every_order_succeeds_with_exact_posts(scn: Scenario, data: st.DataObject) -> None:
    targets, chunks = scn
    d = Driver(data, targets, chunks)
    while d.enabled:
        d.step()
    log, s = d.log, d.s
    assert [r.status for r in log.releases] == [RoomStatus.SUCCESS]
    assert not log.after_release
    assert ROOM not in s.rooms and s.tombstones[ROOM].status is RoomStatus.SUCCESS
    assert sorted(x.peer.rank for x in log.statuses) == list(range(len(targets)))
    assert all(x.status is RoomStatus.SUCCESS for x in log.statuses)
    assert len({p.xfer_id for p in log.posts}) == len(log.posts)
    for t in targets:
        mine = [p.part for p in log.posts if p.peer == t.peer]
        if t.is_dummy:
            assert mine == []
            continue
        kv = [p for p in mine if isinstance(p, KvPart)]
        assert [(k.start, k.stop, k.is_last) for k in kv] == chunks  # every chunk, in order
        assert [k.chunk_id for k in kv] == list(range(len(chunks)))
        last = mine.index(kv[-1])
        after_last = mine[last + 1 :]
        assert sorted(p.component for p in after_last if isinstance(p, StatePart)) == list(t.components)
        assert [p for p in after_last if isinstance(p, AuxPart)] == ([AuxPart()] if t.sends_aux else [])
        assert all(not isinstance(p, StatePart | AuxPart) for p in mine[:last])


FAULTS = ["xfer_failed", "abort", "peer_lost", "timeout", "planning"]
STRANGER = PeerRef("other-engine", 9)
DRAIN_EVENTS = ["done", "failed", "abort", "stranger_abort", "chunk", "peer_lost", "tick"]


def assert_fenced(actions: list[Action], requesters: set[PeerRef]) -> None:
    """While a transfer of a failed room may still write, nothing may tell a requester that
    the room is over, release its source slots, or post anything new."""
    for a in actions:
        assert not isinstance(a, PostTransfer | ReleaseRoom | CancelTransfers), a
        assert not (isinstance(a, SendStatus | SendAbortAck) and a.peer in requesters), a


@given(scenarios(), st.sampled_from(FAULTS), st.integers(0, 15), st.data())
def test_a_failed_room_answers_and_releases_only_once_every_transfer_stopped(
    scn: Scenario, fault: str, fault_step: int, data: st.DataObject
) -> None:
    targets, chunks = scn
    d = Driver(data, targets, chunks)
    for _ in range(fault_step):
        if not d.enabled:
            return  # finished before the fault point: the success test covers it
        d.step()
    s, log = d.s, d.log
    if ROOM not in s.rooms:
        return
    culprit = targets[d.pick(targets)].peer
    requesters = {t.peer for t in targets} - {t.peer for t in d.pending}
    skip: set[PeerRef] = set()  # gets no Failed status
    acks: list[PeerRef] = []  # AbortAcks owed, in order
    if fault == "xfer_failed" and d.in_flight:
        log.take(s.on_xfer_failed(d.in_flight.pop(0), "ERR"))
        kind = FailureKind.ENGINE_ERROR
    elif fault == "abort" and culprit in requesters:
        log.take(s.on_abort(ROOM, culprit))
        kind = FailureKind.ABORTED
        skip.add(culprit)
        acks.append(culprit)
    elif fault == "abort":  # not a requester of this room (yet): acknowledged, the room untouched
        log.take(s.on_abort(ROOM, culprit))
        assert log.acks == [SendAbortAck(culprit, ROOM)] and not log.releases
        log.acks.clear()
        log.take(s.on_tick(1e9))
        kind = FailureKind.TIMEOUT
    elif fault == "peer_lost" and culprit in requesters:
        log.take(s.on_peer_lost(culprit))
        kind = FailureKind.PEER_GONE
        skip.add(culprit)
    elif fault == "planning" and d.in_flight:  # the edge could not post a part it was given
        log.take(s.on_not_posted(d.in_flight.pop(0), Failure(FailureKind.VALIDATION, "planner refused")))
        kind = FailureKind.VALIDATION
    elif fault == "planning":
        log.take(s.fail_room(ROOM, Failure(FailureKind.VALIDATION, "planner refused")))
        kind = FailureKind.VALIDATION
    else:
        log.take(s.on_tick(1e9))
        kind = FailureKind.TIMEOUT
    failure = s.rooms[ROOM].failure if ROOM in s.rooms else log.releases[0].failure
    assert failure is not None and failure.kind is kind

    if d.in_flight:
        # Transfers may still write into the targets' slots: cancel them and tell nobody yet.
        assert log.cancels == [CancelTransfers(ROOM, tuple(d.in_flight))]
        assert not log.releases and not log.acks
        assert not [x for x in log.statuses if x.status is RoomStatus.FAILED]
        assert s.rooms[ROOM].draining
    # Drain in any order, with anything else a peer or the engine may do meanwhile.
    lost: set[PeerRef] = set()
    next_chunk = d.next_chunk
    while d.in_flight:
        event = data.draw(st.sampled_from(DRAIN_EVENTS))
        live = sorted(requesters - lost, key=str)
        if event in ("done", "failed"):
            x = d.in_flight.pop(d.pick(d.in_flight))
            acts = s.on_xfer_done(x) if event == "done" else s.on_xfer_failed(x, "cancelled")
            if d.in_flight:
                assert_fenced(acts, requesters)
            log.take(acts)
        elif event == "abort" and live:
            peer = live[d.pick(live)]
            acts = s.on_abort(ROOM, peer)
            assert acts == []  # acknowledged after the drain, when it is true
            acks.append(peer)
        elif event == "stranger_abort":
            assert s.on_abort(ROOM, STRANGER) == [SendAbortAck(STRANGER, ROOM)]  # never asked: at once
        elif event == "chunk" and next_chunk < len(chunks):
            assert s.on_chunk(ROOM, *chunks[next_chunk], now=0.0) == []  # posts nothing
            next_chunk += 1
        elif event == "peer_lost" and live:
            peer = live[d.pick(live)]
            assert s.on_peer_lost(peer) == []
            lost.add(peer)
            acks = [p for p in acks if p != peer]
        else:
            assert s.on_tick(1e9) == []
    # Every transfer stopped: now, and only now, everyone is told and the room is released.
    assert len(log.releases) == 1
    rel = log.releases[0]
    assert rel == ReleaseRoom(ROOM, RoomStatus.FAILED, failure)
    assert not log.after_release
    failed = [x.peer for x in log.statuses if x.status is RoomStatus.FAILED]
    assert sorted(failed, key=str) == sorted(requesters - skip - lost, key=str)  # each once
    assert all(x.failure == failure for x in log.statuses if x.status is RoomStatus.FAILED)
    assert log.acks == [SendAbortAck(p, ROOM) for p in acks]
    # completions and engine events after the release change nothing
    assert s.on_xfer_done(max((p.xfer_id for p in log.posts), default=0)) == []
    assert s.on_chunk(ROOM, 0, 1, True, 0.0) == []
    assert s.on_abort(ROOM, culprit) == [SendAbortAck(culprit, ROOM)]
    assert ROOM not in s.rooms and s.tombstones[ROOM].status is RoomStatus.FAILED


def test_a_draining_room_acknowledges_an_abort_only_after_its_last_transfer_stopped() -> None:
    s = PrefillSession()
    d0, d1 = PeerRef("d", 0), PeerRef("d", 1)
    s.on_request(ROOM, Target(d0, False), 2, 0.0)
    s.on_request(ROOM, Target(d1, False), 2, 0.0)
    posts = [a for a in s.on_chunk(ROOM, 0, 4, True, 0.0) if isinstance(a, PostTransfer)]
    assert [p.peer for p in posts] == [d0, d1]
    fail = s.on_xfer_failed(posts[0].xfer_id, "ERR")
    assert fail == [CancelTransfers(ROOM, (posts[1].xfer_id,))]  # d1's write may still land
    assert s.on_abort(ROOM, d1) == []
    assert s.on_request(ROOM, Target(d1, False), 2, 0.0)[0].failure.kind is FailureKind.DUPLICATE_ROOM  # type: ignore[union-attr]
    assert ROOM in s.rooms  # not released: its source slots are still being read
    end = s.on_xfer_failed(posts[1].xfer_id, "cancelled")
    failure = Failure(FailureKind.ENGINE_ERROR, f"KvPart to {d0}: ERR")
    assert end == [
        SendStatus(d0, ROOM, RoomStatus.FAILED, failure),
        SendStatus(d1, ROOM, RoomStatus.FAILED, failure),
        SendAbortAck(d1, ROOM),
        ReleaseRoom(ROOM, RoomStatus.FAILED, failure),
    ]


def test_a_late_request_from_the_same_engine_for_a_draining_room_learns_the_failure_at_once() -> None:
    s = PrefillSession()
    owner, late = PeerRef("d", 0), PeerRef("d", 1)
    s.on_request(ROOM, Target(owner, False), 1, 0.0)
    (post,) = [a for a in s.on_chunk(ROOM, 0, 2, True, 0.0) if isinstance(a, PostTransfer)]
    s.on_tick(1e9)
    assert s.rooms[ROOM].draining
    failure = s.rooms[ROOM].failure
    # nothing was ever posted to the late peer: its answer does not wait for the drain
    assert s.on_request(ROOM, Target(late, False), 1, 0.0) == [
        SendStatus(late, ROOM, RoomStatus.FAILED, failure)
    ]
    assert s.on_xfer_done(post.xfer_id)[-1] == ReleaseRoom(ROOM, RoomStatus.FAILED, failure)


def test_chunks_before_requests_are_posted_when_the_last_request_arrives() -> None:
    s = PrefillSession()
    assert s.on_chunk(ROOM, 0, 3, False, 0.0) == []
    assert s.on_chunk(ROOM, 3, 5, True, 0.0) == []
    t = Target(PeerRef("d", 0), False, (0, 1), True)
    acts = s.on_request(ROOM, t, 1, 0.0)
    parts = [a.part for a in acts if isinstance(a, PostTransfer)]
    assert parts == [KvPart(0, 0, 3, False), KvPart(1, 3, 5, True), StatePart(0), StatePart(1), AuxPart()]
    assert s.rooms[ROOM].status is RoomStatus.TRANSFERRING


def test_status_progression_and_chunk_order_is_enforced() -> None:
    s = PrefillSession()
    t0, t1 = Target(PeerRef("d", 0), False), Target(PeerRef("d", 1), False, (), True)
    s.on_request(ROOM, t0, 2, 0.0)
    assert s.rooms[ROOM].status is RoomStatus.BOOTSTRAPPING
    s.on_request(ROOM, t1, 2, 0.0)
    assert s.rooms[ROOM].status is RoomStatus.WAITING_FOR_INPUT
    with pytest.raises(ProtocolViolation, match="must start at page 0"):
        s.on_chunk(ROOM, 2, 4, False, 0.0)
    s.on_chunk(ROOM, 0, 2, True, 0.0)
    with pytest.raises(ProtocolViolation, match="after the last chunk"):
        s.on_chunk(ROOM, 2, 3, True, 0.0)


def test_required_count_disagreement_fails_the_room() -> None:
    s = PrefillSession()
    s.on_request(ROOM, Target(PeerRef("d", 0), False), 2, 0.0)
    acts = s.on_request(ROOM, Target(PeerRef("d", 1), False), 3, 0.0)
    rel = [a for a in acts if isinstance(a, ReleaseRoom)]
    assert rel and rel[0].failure is not None and rel[0].failure.kind is FailureKind.VALIDATION
    assert "required_dst_info_num=3" in rel[0].failure.detail


def test_abort_of_unknown_room_is_acknowledged() -> None:
    assert PrefillSession().on_abort(7, PeerRef("d", 0)) == [SendAbortAck(PeerRef("d", 0), 7)]


def test_abort_from_a_peer_that_is_not_a_requester_leaves_the_room_alone() -> None:
    # another decode engine reused the room id, was refused as a duplicate, and aborts its attempt
    s = PrefillSession()
    s.on_request(ROOM, Target(PeerRef("owner", 0), False), 1, 0.0)
    stranger = PeerRef("other-engine", 0)
    assert s.on_abort(ROOM, stranger) == [SendAbortAck(stranger, ROOM)]
    assert ROOM in s.rooms and not s.rooms[ROOM].finished
    acts = s.on_abort(ROOM, PeerRef("owner", 0))
    rel = next(a for a in acts if isinstance(a, ReleaseRoom))
    assert rel.failure is not None and rel.failure.kind is FailureKind.ABORTED


def test_timeout_reason_says_what_was_missing() -> None:
    s = PrefillSession(room_timeout_s=5.0)
    s.on_request(ROOM, Target(PeerRef("d", 0), False), 2, now=100.0)
    assert s.on_tick(104.9) == []
    acts = s.on_tick(105.0)
    rel = next(a for a in acts if isinstance(a, ReleaseRoom))
    assert rel.failure is not None and rel.failure.kind is FailureKind.TIMEOUT
    assert "1/2 requests" in rel.failure.detail and "not seen" in rel.failure.detail
