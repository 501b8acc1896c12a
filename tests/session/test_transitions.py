"""The machines' transition tables (:mod:`pdwire.runtime.session.states`), checked both ways.

Every move a machine makes goes through its table, which raises ``TransitionError`` for a move
it does not list; so hypothesis driving each machine through its real entry points, in any
order, checks that the code makes only listed moves. The other direction needs a guarantee
that random runs cannot give: a breadth-first walk over the same entry points (:func:`explore`,
every sequence of moves that reaches a new state, up to the machine's ``DEPTH``) records the
moves it makes, and they must be every row of the table: a row no entry point reaches is dead,
and fails the test.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from pdwire import wire
from pdwire.runtime.indices import RequestIndices
from pdwire.runtime.session import states as S
from pdwire.runtime.session.actions import PeerRef, PostTransfer
from pdwire.runtime.session.decode_connection import DecodeConnection, Expected
from pdwire.runtime.session.decode_room import SenderPlan
from pdwire.runtime.session.decode_session import DecodeSession
from pdwire.runtime.session.events import AddPeer
from pdwire.runtime.session.failures import Failure, FailureKind, ProtocolViolation
from pdwire.runtime.session.group_connect import GroupConnect, GroupIdentity, LinkSpec, OpenLink
from pdwire.runtime.session.prefill_connection import PrefillConnection
from pdwire.runtime.session.prefill_room import PrefillRoom
from pdwire.runtime.session.prefill_session import PrefillSession
from pdwire.runtime.session.status import Status
from pdwire.wire import NotificationKind
from tests.session.test_connections import decode_local, prefill_local
from tests.session.test_prefill_room import target

SEEN: dict[str, set[tuple[Any, Any]]] = {}
RUN = settings(
    max_examples=60,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
FAIL = Failure(FailureKind.ABORTED, "test")
OTHER_MODEL = wire.ModelFingerprint(model_name="other", revision="v1", dtype="bf16", num_layers=4)


@pytest.fixture(autouse=True)
def record(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Record every move any machine makes (the start excluded)."""
    move = S.StateTable.move

    def recording(table: S.StateTable[Any], old: Any, new: Any) -> Any:
        got = move(table, old, new)
        if old is not None:
            SEEN.setdefault(table.machine, set()).add((old, new))
        return got

    SEEN.clear()
    monkeypatch.setattr(S.StateTable, "move", recording)
    yield


def check_covered(table: S.StateTable[Any]) -> None:
    seen = SEEN.get(table.machine, set())
    assert seen <= table.rows()  # the guard raised otherwise
    missing = sorted(f"{a.name} -> {b.name}" for a, b in table.rows() - seen)
    assert not missing, f"{table.machine}: rows no run reached: {missing}"


# --- the room machines, through their sessions -----------------------------------------------

TWO, BOOLS = [0, 1], [False, True]
ROOMS = st.sampled_from(TWO)  # the newest room or the one after it (``next_room`` moves on)
PEER_LIST = [PeerRef("dec", 0), PeerRef("dec", 1)]
PEERS = st.sampled_from(PEER_LIST)
Move = tuple[str, dict[str, Any]]


def moves(rule: str, **domains: list[Any]) -> list[Move]:
    """``rule`` with every combination of the given argument values."""
    names = list(domains)
    return [(rule, dict(zip(names, values, strict=True))) for values in itertools.product(*domains.values())]


def explore(machine: Any, depth: int) -> int:
    """Every sequence of ``machine.MOVES`` up to ``depth`` long, breadth first, that leads to a
    state not seen before (by ``fingerprint()``): deterministic, and exhaustive over the
    fingerprints within that depth. Returns the number of distinct states reached."""
    seen: set[Hashable] = set()
    frontier: list[tuple[dict[str, Any], tuple[Move, ...]]] = [
        (i, ()) for i in getattr(machine, "INITS", [{}])
    ]
    for _ in range(depth):
        grown = []
        for init, path in frontier:
            for move in machine.MOVES:
                m = machine()
                if init:
                    m.start(**init)
                for name, kwargs in (*path, move):
                    getattr(m, name)(**kwargs)
                fp = m.fingerprint()
                if fp not in seen:
                    seen.add(fp)
                    grown.append((init, (*path, move)))
        frontier = grown
    return len(seen)


class PrefillRooms(RuleBasedStateMachine):
    DEPTH = 5

    def __init__(self) -> None:
        super().__init__()
        self.s = PrefillSession(room_timeout_s=30.0)
        self.now = 0.0
        self.posted: list[int] = []
        self.chunks: dict[int, int] = {}
        self.base = 1

    @rule()
    def next_room(self) -> None:
        self.base += 1

    def _run(self, actions: list[Any]) -> None:
        self.posted += [a.xfer_id for a in actions if isinstance(a, PostTransfer)]

    @rule(room=ROOMS, peer=PEERS, dummy=st.booleans(), required=st.integers(1, 2))
    def request(self, room: int, peer: PeerRef, dummy: bool, required: int) -> None:
        room += self.base
        t = target(peer, dummy, pages=0 if dummy else 4)
        self._run(self.s.on_request(room, t, required, self.now))

    @rule(room=ROOMS, last=st.booleans())
    def chunk(self, room: int, last: bool) -> None:
        room += self.base
        start = self.chunks.get(room, 0)
        self.chunks[room] = start + 2
        with contextlib.suppress(ProtocolViolation):  # a chunk after the last one: refused
            self._run(self.s.on_chunk(room, np.arange(start, start + 2, dtype=np.int32), last, self.now))

    @rule(nth=st.integers(0, 2), how=st.sampled_from(["done", "failed", "not posted"]))
    def transfer_ends(self, nth: int, how: str) -> None:
        if not self.posted:
            return
        xfer = self.posted.pop(nth % len(self.posted))
        if how == "done":
            self._run(self.s.on_xfer_done(xfer))
        elif how == "failed":
            self._run(self.s.on_xfer_failed(xfer, "engine error"))
        else:
            self._run(self.s.on_not_posted(xfer, FAIL))

    @rule(room=ROOMS, peer=PEERS)
    def decode_aborts(self, room: int, peer: PeerRef) -> None:
        room += self.base
        self._run(self.s.on_abort(room, peer))

    @rule(room=ROOMS)
    def engine_aborts(self, room: int) -> None:
        room += self.base
        self._run(self.s.abort(room, FAIL, self.now))

    @rule(peer=PEERS)
    def peer_lost(self, peer: PeerRef) -> None:
        self._run(self.s.on_peer_lost(peer))

    @rule()
    def time_passes(self) -> None:
        self.now += 40.0  # past every live room's deadline
        self._run(self.s.on_tick(self.now))

    MOVES = (
        *moves("request", room=TWO, peer=PEER_LIST, dummy=BOOLS, required=[1, 2]),
        *moves("chunk", room=TWO, last=BOOLS),
        *moves("transfer_ends", nth=[0, 1], how=["done", "failed", "not posted"]),
        *moves("decode_aborts", room=TWO, peer=PEER_LIST),
        *moves("engine_aborts", room=TWO),
        *moves("peer_lost", peer=PEER_LIST),
        ("time_passes", {}),
        ("next_room", {}),
    )

    def fingerprint(self) -> Hashable:
        def room(i: int) -> Hashable:
            r = self.s.rooms.get(self.base + i)
            if r is None:
                return self.s.status(self.base + i)
            return r.status, r.required, len(r.targets), len(r.chunks), r.last_chunk_seen, len(r.outstanding)

        return room(0), room(1), tuple(self.s.room_of(x) for x in self.posted)


SENDER = SenderPlan(10, PeerRef("pre", 0), aux=True)
DUMMY = SenderPlan(11, PeerRef("pre", 1), is_dummy=True)


class DecodeRooms(RuleBasedStateMachine):
    DEPTH = 3

    @initialize(vouching=st.booleans())
    def start(self, vouching: bool) -> None:
        self.s = DecodeSession(room_timeout_s=30.0, fence_timeout_s=10.0, status_completes=vouching)
        self.now = 0.0
        self.base = 1

    @rule()
    def next_room(self) -> None:
        self.base += 1

    @rule(room=ROOMS, dummy=st.booleans())
    def start_room(self, room: int, dummy: bool) -> None:
        room += self.base
        if room not in self.s.rooms and room not in self.s.tombstones:
            self.s.start_room(room, [SENDER, DUMMY] if dummy else [SENDER], self.now)

    @rule(room=ROOMS)
    def requests_sent(self, room: int) -> None:
        room += self.base
        if room in self.s.rooms:
            self.s.rooms[room].on_requests_sent()

    @rule(room=ROOMS, part=st.sampled_from(["kv0", "kv1 last", "aux", "stray"]))
    def completion(self, room: int, part: str) -> None:
        room += self.base
        if part == "aux":
            self.s.on_notification(room, 10, NotificationKind.AUX)
        elif part == "stray":
            self.s.on_notification(room, 11, NotificationKind.KV)  # a dummy writes nothing
        else:
            self.s.on_notification(room, 10, NotificationKind.KV, int(part[2]), part.endswith("last"))

    @rule(room=ROOMS, status=st.sampled_from([Status.SUCCESS, Status.FAILED, Status.TRANSFERRING]))
    def status(self, room: int, status: Status) -> None:
        room += self.base
        self.s.on_status(room, 10, status, FAIL if status is Status.FAILED else None)

    @rule(room=ROOMS)
    def abort_ack(self, room: int) -> None:
        room += self.base
        self.s.on_abort_ack(room, 10)

    @rule(room=ROOMS)
    def engine_aborts(self, room: int) -> None:
        room += self.base
        self.s.abort(room, FAIL)

    @rule()
    def peer_lost(self) -> None:
        self.s.on_peer_lost(SENDER.peer)

    @rule()
    def revoked(self) -> None:
        self.s.on_revoked(SENDER.peer)

    @rule()
    def time_passes(self) -> None:
        self.now += 20.0  # past the deadline of the rooms live since the last time
        self.s.on_tick(self.now)

    INITS = ({"vouching": False}, {"vouching": True})
    MOVES = (
        *moves("start_room", room=TWO, dummy=BOOLS),
        *moves("requests_sent", room=TWO),
        *moves("completion", room=TWO, part=["kv0", "kv1 last", "aux", "stray"]),
        *moves("status", room=TWO, status=[Status.SUCCESS, Status.FAILED, Status.TRANSFERRING]),
        *moves("abort_ack", room=TWO),
        *moves("engine_aborts", room=TWO),
        ("peer_lost", {}),
        ("revoked", {}),
        ("time_passes", {}),
        ("next_room", {}),
    )

    def fingerprint(self) -> Hashable:
        def room(i: int) -> Hashable:
            r = self.s.rooms.get(self.base + i)
            if r is None:
                return self.s.status(self.base + i)
            return r.status, tuple(r.missing()), r.unfenced(), r.slots_released, self.now - r.deadline

        return self.s.status_completes, room(0), room(1)


# --- the connection machines ------------------------------------------------------------------


class PrefillConnections(RuleBasedStateMachine):
    DEPTH = 3

    def __init__(self) -> None:
        super().__init__()
        self.c = PrefillConnection(prefill_local())
        self.good = decode_local()
        self.bad = decode_local(model=OTHER_MODEL)

    @rule(good=st.booleans())
    def hello(self, good: bool) -> None:
        self.c.receive((self.good if good else self.bad).hello)

    @rule(added=st.booleans())
    def register(self, added: bool) -> None:
        version = self.c.version or (1, 0)
        for e in self.c.receive(self.good.register_info(version)):
            if isinstance(e, AddPeer):  # the edge answers at once
                self.c.peer_added() if added else self.c.peer_refused("the engine refused it")

    @rule()
    def undecodable(self) -> None:
        self.c.undecodable("garbage")

    MOVES = (*moves("hello", good=BOOLS), *moves("register", added=BOOLS), ("undecodable", {}))

    def fingerprint(self) -> Hashable:
        return self.c.state, self.c.version, self.c.peer, self.c.plan is not None


def register_ack(accepted: bool) -> wire.RegisterAck:
    kind = FailureKind.UNSPECIFIED if accepted else FailureKind.HANDSHAKE
    return wire.RegisterAck(
        accepted=accepted, sender_rank=0, failure_kind=kind, reason="" if accepted else "no"
    )


class DecodeConnections(RuleBasedStateMachine):
    DEPTH = 5

    def __init__(self) -> None:
        super().__init__()
        self.c = DecodeConnection(decode_local(), "tcp://p:1", deadline=10.0, expected=Expected(1, 0))
        self.c.start()
        self.good = prefill_local().hello
        self.bad = prefill_local(model=OTHER_MODEL).hello

    @rule(good=st.booleans())
    def hello(self, good: bool) -> None:
        self.c.receive(self.good if good else self.bad)

    @rule(accepted=st.booleans())
    def answer(self, accepted: bool) -> None:
        self.c.receive(register_ack(accepted))

    @rule(how=st.sampled_from(["undecodable", "transport refused", "deadline"]))
    def trouble(self, how: str) -> None:
        if how == "undecodable":
            self.c.undecodable("garbage")
        elif how == "transport refused":
            self.c.transport_refused("CURVE keys differ")
        else:
            self.c.on_tick(11.0)

    @rule()
    def register_again(self) -> None:
        self.c.register_again()

    @rule()
    def reregister(self) -> None:
        self.c.reregister(decode_local())

    MOVES = (
        *moves("hello", good=BOOLS),
        *moves("answer", accepted=BOOLS),
        *moves("trouble", how=["undecodable", "transport refused", "deadline"]),
        ("register_again", {}),
        ("reregister", {}),
    )

    def fingerprint(self) -> Hashable:
        return self.c.state, self.c.version, self.c.peer


IDENT = GroupIdentity("pre", 0, 2, 1)


class GroupConnects(RuleBasedStateMachine):
    DEPTH = 2

    def __init__(self) -> None:
        super().__init__()
        specs = [LinkSpec((p, 0), f"tcp://127.0.0.1:{9000 + p}", Expected(2, p)) for p in range(2)]
        self.g = GroupConnect(specs, deadline=10.0)
        self.open = self._opened(self.g.start())

    @staticmethod
    def _opened(actions: list[Any], default: tuple[int, int] | None = None) -> tuple[int, int] | None:
        return next((a.spec.key for a in actions if isinstance(a, OpenLink)), default)

    @rule(same_group=st.booleans())
    def link_ready(self, same_group: bool) -> None:
        if self.open is not None:
            ident = IDENT if same_group else GroupIdentity("pre", 1, 2, 1)
            self.open = self._opened(self.g.on_link_ready(self.open, ident), self.open)

    @rule()
    def link_refused(self) -> None:
        if self.open is not None:
            self.g.on_link_refused(self.open, "refused")

    @rule(room=ROOMS)
    def hold(self, room: int) -> None:
        self.g.hold(room, RequestIndices(np.arange(2, dtype=np.int32)), 5.0)

    @rule()
    def deadline(self) -> None:
        self.g.on_tick(10.0)

    MOVES = (
        *moves("link_ready", same_group=BOOLS),
        ("link_refused", {}),
        *moves("hold", room=TWO),
        ("deadline", {}),
    )

    def fingerprint(self) -> Hashable:
        return self.g.state, self.open, tuple(sorted(self.g.held))


@pytest.mark.parametrize(
    ("machine", "table"),
    [
        (PrefillRooms, S.PREFILL_ROOM),
        (DecodeRooms, S.DECODE_ROOM),
        (PrefillConnections, S.PREFILL_CONNECTION),
        (DecodeConnections, S.DECODE_CONNECTION),
        (GroupConnects, S.GROUP_CONNECT),
    ],
    ids=lambda v: v.machine if isinstance(v, S.StateTable) else v.__name__,
)
def test_every_move_is_in_the_table_and_every_row_is_reached(
    machine: type[RuleBasedStateMachine], table: S.StateTable[Any]
) -> None:
    run_state_machine_as_test(machine, settings=RUN)  # any order: only listed moves (the guard)
    SEEN.clear()
    explore(machine, machine.DEPTH)  # every row within that many moves (the shortest path)
    check_covered(table)


def test_a_move_outside_the_table_raises() -> None:
    room = PrefillRoom(1, deadline=1.0, next_xfer_id=lambda: 1)
    room.on_tick(2.0)  # failed at its deadline
    assert room.status is Status.FAILED
    with pytest.raises(S.TransitionError, match=r"PrefillRoom: FAILED -> TRANSFERRING"):
        room.status = Status.TRANSFERRING


def test_docs_show_each_table_as_it_is() -> None:
    """docs/runtime.md lists every row of every table, one line each: machine, from, to, on."""
    text = (Path(__file__).parents[2] / "docs" / "runtime.md").read_text()
    documented = re.findall(r"^\| `(\w+)` \| `(\w+)` \| `(\w+)` \| (.*) \|$", text, re.M)
    code = [
        (t.machine, a.name, b.name, on) for t in S.TABLES for a, bs in t.moves.items() for b, on in bs.items()
    ]
    assert documented == code
