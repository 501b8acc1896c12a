"""Prefill room and session driven by hypothesis over event orders, with no sockets."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdwire.runtime.session.actions import (
    Action,
    AuxPart,
    CancelTransfers,
    KvPart,
    PeerRef,
    PostTransfer,
    ReleaseRoom,
    SendAbortAck,
    SendStatus,
    StatePart,
)
from pdwire.runtime.session.failures import Failure, FailureKind, ProtocolViolation
from pdwire.runtime.session.prefill_room import Destination, Target
from pdwire.runtime.session.prefill_session import PrefillSession
from pdwire.runtime.session.status import Status

ROOM = 42
COMPONENTS = 4
Chunk = tuple[int, int, bool]  # [start, stop) page positions, is_last


def target(
    peer: PeerRef, dummy: bool, comps: tuple[int, ...] = (), aux: bool = False, pages: int = 0
) -> Target:
    """A decode rank asking for ``pages`` KV pages (at 100 + i), components ``comps`` (index 10 + c)
    and aux item 5."""
    state = tuple(
        np.array([10 + c], np.int32) if c in comps else np.zeros(0, np.int32) for c in range(COMPONENTS)
    )
    dst = Destination(np.arange(100, 100 + pages, dtype=np.int32), state, 5 if aux else -1)
    return Target(peer, dummy, comps, aux, dst)


def chunk(s: PrefillSession, c: Chunk, room: int = ROOM) -> list[Action]:
    """The engine produced pages ``[start, stop)`` (source page i is i); the last chunk brings
    source state index 20 + c per component and aux item 3."""
    start, stop, last = c
    pages = np.arange(start, stop, dtype=np.int32)
    if not last:
        return s.on_chunk(room, pages, False, 0.0)
    state = [np.array([20 + i], np.int32) for i in range(COMPONENTS)]
    return s.on_chunk(room, pages, True, 0.0, state, 3)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Target], list[Chunk]]:
    sizes = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
    chunks, start = [], 0
    for i, size in enumerate(sizes):
        chunks.append((start, start + size, i == len(sizes) - 1))
        start += size
    n = draw(st.integers(1, 4))
    targets = []
    for rank in range(n):
        dummy = draw(st.booleans())
        comps = tuple(sorted(draw(st.sets(st.integers(0, COMPONENTS - 1), max_size=3))))
        aux = not dummy and draw(st.booleans())
        targets.append(
            target(PeerRef("dec", rank), dummy, () if dummy else comps, aux, 0 if dummy else start)
        )
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

    def __init__(self, data: st.DataObject, targets: list[Target], chunks: list[Chunk]) -> None:
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
            self.log.take(chunk(self.s, self.chunks[self.next_chunk]))
            self.next_chunk += 1
        else:
            self.log.take(self.s.on_xfer_done(self.in_flight.pop(self.pick(self.in_flight))))
        self.in_flight += [p.xfer_id for p in self.log.posts[before:]]


Scenario = tuple[list[Target], list[Chunk]]


@given(scenarios(), st.data())
def test_every_order_succeeds_with_exact_posts(scn: Scenario, data: st.DataObject) -> None:
    targets, chunks = scn
    d = Driver(data, targets, chunks)
    while d.enabled:
        d.step()
    log, s = d.log, d.s
    assert [r.status for r in log.releases] == [Status.SUCCESS]
    assert not log.after_release
    assert ROOM not in s.rooms and s.tombstones[ROOM].status is Status.SUCCESS
    assert sorted(x.peer.rank for x in log.statuses) == list(range(len(targets)))
    assert all(x.status is Status.SUCCESS for x in log.statuses)
    assert len({p.xfer_id for p in log.posts}) == len(log.posts)
    for t in targets:
        mine = [p.part for p in log.posts if p.peer == t.peer]
        if t.is_dummy:
            assert mine == []
            continue
        kv = [p for p in mine if isinstance(p, KvPart)]
        assert [(k.start, k.stop, k.is_last) for k in kv] == chunks  # every chunk, in order
        assert [k.chunk_id for k in kv] == list(range(len(chunks)))
        for k in kv:  # each post carries the pages it writes: source i to the target's page 100 + i
            assert k.src.tolist() == list(range(k.start, k.stop))
            assert k.dst.tolist() == [100 + i for i in range(k.start, k.stop)]
        last = mine.index(kv[-1])
        after_last = mine[last + 1 :]
        states = [p for p in after_last if isinstance(p, StatePart)]
        assert sorted(p.component for p in states) == list(t.components)
        assert all(
            (p.src.tolist(), p.dst.tolist()) == ([20 + p.component], [10 + p.component]) for p in states
        )
        auxes = [p for p in after_last if isinstance(p, AuxPart)]
        assert [(a.src, a.dst) for a in auxes] == ([(3, 5)] if t.sends_aux else [])
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
    elif fault == "abort" and not requesters:  # nobody asked yet: the decode rank declines the room
        log.take(s.on_abort(ROOM, culprit))
        kind = FailureKind.ABORTED
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
        assert not [x for x in log.statuses if x.status is Status.FAILED]
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
            assert chunk(s, chunks[next_chunk]) == []  # posts nothing
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
    assert rel == ReleaseRoom(ROOM, Status.FAILED, failure)
    assert not log.after_release
    failed = [x.peer for x in log.statuses if x.status is Status.FAILED]
    assert sorted(failed, key=str) == sorted(requesters - skip - lost, key=str)  # each once
    assert all(x.failure == failure for x in log.statuses if x.status is Status.FAILED)
    assert log.acks == [SendAbortAck(p, ROOM) for p in acks]
    # completions and engine events after the release change nothing
    assert s.on_xfer_done(max((p.xfer_id for p in log.posts), default=0)) == []
    assert chunk(s, (0, 1, True)) == []
    assert s.on_abort(ROOM, culprit) == [SendAbortAck(culprit, ROOM)]
    assert ROOM not in s.rooms and s.tombstones[ROOM].status is Status.FAILED


def test_a_draining_room_acknowledges_an_abort_only_after_its_last_transfer_stopped() -> None:
    s = PrefillSession()
    d0, d1 = PeerRef("d", 0), PeerRef("d", 1)
    s.on_request(ROOM, target(d0, False, pages=4), 2, 0.0)
    s.on_request(ROOM, target(d1, False, pages=4), 2, 0.0)
    posts = [a for a in chunk(s, (0, 4, True)) if isinstance(a, PostTransfer)]
    assert [p.peer for p in posts] == [d0, d1]
    fail = s.on_xfer_failed(posts[0].xfer_id, "ERR")
    assert fail == [CancelTransfers(ROOM, (posts[1].xfer_id,))]  # d1's write may still land
    assert s.on_abort(ROOM, d1) == []
    assert (
        s.on_request(ROOM, target(d1, False, pages=4), 2, 0.0)[0].failure.kind is FailureKind.DUPLICATE_ROOM
    )  # type: ignore[union-attr]
    assert ROOM in s.rooms  # not released: its source slots are still being read
    end = s.on_xfer_failed(posts[1].xfer_id, "cancelled")
    failure = Failure(FailureKind.ENGINE_ERROR, f"KvPart to {d0}: ERR")
    assert end == [
        SendStatus(d0, ROOM, Status.FAILED, failure),
        SendStatus(d1, ROOM, Status.FAILED, failure),
        SendAbortAck(d1, ROOM),
        ReleaseRoom(ROOM, Status.FAILED, failure),
    ]


def test_a_late_request_from_the_same_engine_for_a_draining_room_learns_the_failure_at_once() -> None:
    s = PrefillSession()
    owner, late = PeerRef("d", 0), PeerRef("d", 1)
    s.on_request(ROOM, target(owner, False, pages=2), 1, 0.0)
    (post,) = [a for a in chunk(s, (0, 2, True)) if isinstance(a, PostTransfer)]
    s.on_tick(1e9)
    assert s.rooms[ROOM].draining
    failure = s.rooms[ROOM].failure
    # nothing was ever posted to the late peer: its answer does not wait for the drain
    assert s.on_request(ROOM, target(late, False, pages=2), 1, 0.0) == [
        SendStatus(late, ROOM, Status.FAILED, failure)
    ]
    assert s.on_xfer_done(post.xfer_id)[-1] == ReleaseRoom(ROOM, Status.FAILED, failure)


def test_chunks_before_requests_are_posted_when_the_last_request_arrives() -> None:
    s = PrefillSession()
    assert chunk(s, (0, 3, False)) == []
    assert chunk(s, (3, 5, True)) == []
    t = target(PeerRef("d", 0), False, (0, 1), True, pages=5)
    acts = s.on_request(ROOM, t, 1, 0.0)
    parts = [a.part for a in acts if isinstance(a, PostTransfer)]
    assert parts == [KvPart(0, 0, 3, False), KvPart(1, 3, 5, True), StatePart(0), StatePart(1), AuxPart()]
    assert s.rooms[ROOM].status is Status.TRANSFERRING


def test_status_progression_and_chunk_order_is_enforced() -> None:
    s = PrefillSession()
    t0, t1 = target(PeerRef("d", 0), False, pages=2), target(PeerRef("d", 1), False, (), True, pages=2)
    s.on_request(ROOM, t0, 2, 0.0)
    assert s.rooms[ROOM].status is Status.BOOTSTRAPPING
    s.on_request(ROOM, t1, 2, 0.0)
    assert s.rooms[ROOM].status is Status.WAITING_FOR_INPUT
    chunk(s, (0, 2, True))
    with pytest.raises(ProtocolViolation, match="after the last chunk"):
        chunk(s, (2, 3, True))


def test_required_count_disagreement_fails_the_room() -> None:
    s = PrefillSession()
    s.on_request(ROOM, Target(PeerRef("d", 0), False), 2, 0.0)
    acts = s.on_request(ROOM, Target(PeerRef("d", 1), False), 3, 0.0)
    rel = [a for a in acts if isinstance(a, ReleaseRoom)]
    assert rel and rel[0].failure is not None and rel[0].failure.kind is FailureKind.VALIDATION
    assert "required_dst_info_num=3" in rel[0].failure.detail


def test_abort_of_unknown_room_is_acknowledged_and_remembered_as_declined() -> None:
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


def test_pages_decode_already_holds_are_skipped_per_target() -> None:
    s = PrefillSession()
    near = Target(PeerRef("d", 0), False, dst=Destination(np.arange(100, 106, dtype=np.int32)))
    cached = Target(
        PeerRef("d", 1), False, dst=Destination(np.arange(200, 203, dtype=np.int32), skip_pages=3)
    )
    s.on_request(ROOM, near, 2, 0.0)
    s.on_request(ROOM, cached, 2, 0.0)
    posts = [a for a in chunk(s, (0, 4, False)) + chunk(s, (4, 6, True)) if isinstance(a, PostTransfer)]
    got = {(p.peer.rank, p.part.chunk_id): (p.part.src.tolist(), p.part.dst.tolist()) for p in posts}  # type: ignore[union-attr]
    assert got == {
        (0, 0): ([0, 1, 2, 3], [100, 101, 102, 103]),
        (0, 1): ([4, 5], [104, 105]),
        (1, 0): ([3], [200]),  # pages 0..2 are on that decode rank already
        (1, 1): ([4, 5], [201, 202]),
    }


@pytest.mark.parametrize(
    ("asked", "chunks", "needle"),
    [
        (9, [(0, 6, True)], "prefill produced 6 KV pages (0 of them already on decode), d/0 asked for 9"),
        (3, [(0, 4, False), (4, 6, True)], "prefill produced at least 4 KV pages"),
    ],
)
def test_a_page_list_that_does_not_fit_what_was_produced_fails_the_room_before_posting(
    asked: int, chunks: list[Chunk], needle: str
) -> None:
    s = PrefillSession()
    s.on_request(ROOM, target(PeerRef("d", 0), False, pages=asked), 1, 0.0)
    actions = [a for c in chunks for a in chunk(s, c)]
    assert not [a for a in actions if isinstance(a, PostTransfer)] or len(chunks) > 1
    release = next(a for a in actions if isinstance(a, ReleaseRoom))
    assert release.failure is not None and release.failure.kind is FailureKind.VALIDATION
    assert needle in release.failure.detail


def test_a_state_component_the_engine_gave_no_source_for_fails_the_room() -> None:
    s = PrefillSession()
    s.on_request(ROOM, target(PeerRef("d", 0), False, (1,), pages=2), 1, 0.0)
    actions = s.on_chunk(ROOM, np.arange(2, dtype=np.int32), True, 0.0, [None] * COMPONENTS, 3)
    assert not [a for a in actions if isinstance(a, PostTransfer)]
    release = next(a for a in actions if isinstance(a, ReleaseRoom))
    assert release.failure is not None and "no source index for it" in release.failure.detail


def test_a_post_is_refused_once_the_room_failed_or_its_deadline_passed() -> None:
    # Asked at the moment of each post: a rank that stalled between two posts of one batch
    # (stopped, starved) and resumed past the deadline posts nothing more.
    s = PrefillSession(room_timeout_s=5.0)
    s.on_request(ROOM, target(PeerRef("d", 0), False, pages=2), 1, now=100.0)
    assert s.refuses_post(ROOM, 104.9) is None
    late = s.refuses_post(ROOM, 105.0)
    assert late is not None and late.kind is FailureKind.TIMEOUT and "deadline" in late.detail
    gone = s.refuses_post(ROOM + 1, 100.0)
    assert gone is not None and gone.kind is FailureKind.ABORTED
    s.fail_room(ROOM, Failure(FailureKind.ABORTED, "engine gave up"))
    failed = s.refuses_post(ROOM, 101.0)
    assert failed is not None and failed.kind is FailureKind.ABORTED


def test_a_decode_rank_declines_a_produced_room_no_one_asked_for() -> None:
    # the engine produced the room, decode dropped the request while it waited: the pages come
    # back now (not at the deadline) and a later request for the room is refused
    s = PrefillSession()
    chunk(s, (0, 4, True))
    d0 = PeerRef("d", 0)
    acts = s.on_abort(ROOM, d0)
    rel = next(a for a in acts if isinstance(a, ReleaseRoom))
    assert rel.status is Status.FAILED and rel.failure is not None
    assert rel.failure.kind is FailureKind.ABORTED and "declined" in rel.failure.detail
    assert SendAbortAck(d0, ROOM) in acts and ROOM not in s.rooms
    late = s.on_request(ROOM, target(d0, False, pages=4), 1, 0.0)
    assert isinstance(late[0], SendStatus) and late[0].status is Status.FAILED


def test_a_room_declined_before_the_engine_produced_it_releases_each_chunk_at_once() -> None:
    s = PrefillSession()
    d0 = PeerRef("d", 0)
    assert s.on_abort(ROOM, d0) == [SendAbortAck(d0, ROOM)]
    first = chunk(s, (0, 2, False))
    assert len(first) == 1 and isinstance(first[0], ReleaseRoom) and first[0].status is Status.FAILED
    assert first[0].failure is not None and first[0].failure.kind is FailureKind.ABORTED
    assert not any(isinstance(a, PostTransfer) for a in chunk(s, (2, 4, True)))
    assert ROOM not in s.rooms
    late = s.on_request(ROOM, target(d0, False, pages=4), 1, 0.0)
    assert isinstance(late[0], SendStatus) and late[0].failure is not None
    assert late[0].failure.kind is FailureKind.ABORTED
