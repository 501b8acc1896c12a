"""The per-peer connection machines, with no sockets and no processes.

Both handshakes run between a PrefillConnection and a DecodeConnection in memory, every message
through the real codec at the version it is sent at: every pair of offered versions, refusals
named on both sides, the registration answer by version. Hypothesis then feeds each machine
messages in any order (valid ones, other models, bad registrations and requests, garbage) and
checks what it may and may not do.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdwire import wire
from pdwire.runtime.config import ParallelRank
from pdwire.runtime.indices import RequestIndices
from pdwire.runtime.session.actions import KvPart, PeerRef, SendRequest
from pdwire.runtime.session.decode_connection import DecodeConnection, DecodeConnState, DecodeLocal, Expected
from pdwire.runtime.session.events import (
    AbortAcked,
    AbortRequested,
    AddPeer,
    Completed,
    Problem,
    Ready,
    Refused,
    Registered,
    Requested,
    Send,
    StatusReceived,
)
from pdwire.runtime.session.failures import Failure, FailureKind, failure_from_wire
from pdwire.runtime.session.hello import LAYOUTS_SINCE, Identity
from pdwire.runtime.session.prefill_connection import PrefillConnection, PrefillConnState, PrefillLocal
from pdwire.runtime.session.stage_layers import HeldLayers
from pdwire.runtime.session.status import Status
from tests.session.memories import MODEL, hybrid

VERSIONS = [tuple(v) for v in wire.VERSIONS]


def trip(msg: wire.Message, version: tuple[int, int] | None) -> wire.Message:
    """What the peer decodes: the message through the real codec at ``version``."""
    return wire.decode([bytes(f) for f in wire.encode(msg, version)])


def prefill_local(
    tp: int = 1,
    rank: int = 0,
    versions: tuple[tuple[int, int], ...] = (),
    model: wire.ModelFingerprint = MODEL,
    **memory: Any,
) -> PrefillLocal:
    hello = Identity(wire.Role.PREFILL, "pre", ParallelRank(tp, rank), model, versions).hello()
    return PrefillLocal(hello, hybrid(tp, rank, **memory), ParallelRank(tp, rank).sender_rank, "local", False)


def decode_local(
    tp: int = 1,
    rank: int = 0,
    versions: tuple[tuple[int, int], ...] = (),
    model: wire.ModelFingerprint = MODEL,
    **memory: Any,
) -> DecodeLocal:
    hello = Identity(wire.Role.DECODE, "dec", ParallelRank(tp, rank), model, versions).hello()
    mem = hybrid(tp, rank, base=1 << 44, **memory)
    return DecodeLocal(hello, mem, "decode:dec/0", "local", "dec-agent", b"opaque engine metadata")


@dataclass
class Handshake:
    """Both machines, and every message that crossed, in order, with the version it went at."""

    p: PrefillConnection
    d: DecodeConnection
    crossed: list[tuple[str, wire.Message, tuple[int, int] | None]] = field(default_factory=list)
    prefill_events: list[object] = field(default_factory=list)
    decode_events: list[object] = field(default_factory=list)

    def run(self, add_peer_error: str | None = None) -> None:
        to_p: deque[Send] = deque(e for e in self.d.start() if isinstance(e, Send))
        to_d: deque[Send] = deque()
        while to_p or to_d:
            while to_p:
                s = to_p.popleft()
                self.crossed.append(("d->p", s.message, s.version))
                events = self.p.receive(trip(s.message, s.version))
                while events:
                    e = events.pop(0)
                    self.prefill_events.append(e)
                    if isinstance(e, Send):
                        to_d.append(e)
                    elif isinstance(e, AddPeer):
                        events += (
                            self.p.peer_refused(add_peer_error) if add_peer_error else self.p.peer_added()
                        )
            while to_d:
                s = to_d.popleft()
                self.crossed.append(("p->d", s.message, s.version))
                for e in self.d.receive(trip(s.message, s.version)):
                    self.decode_events.append(e)
                    if isinstance(e, Send):
                        to_p.append(e)


def handshake(p_local: PrefillLocal, d_local: DecodeLocal, expected: Expected | None = None) -> Handshake:
    return Handshake(PrefillConnection(p_local), DecodeConnection(d_local, "tcp://p:1", math.inf, expected))


@pytest.mark.parametrize("p_version", VERSIONS, ids=lambda v: f"P{v[0]}.{v[1]}")
@pytest.mark.parametrize("d_version", VERSIONS, ids=lambda v: f"D{v[0]}.{v[1]}")
def test_the_handshake_agrees_on_the_lower_version_and_answers_in_its_form(
    p_version: tuple[int, int], d_version: tuple[int, int]
) -> None:
    agreed = min(p_version, d_version)
    # 1.0 carries one state component of one block: that model there, the hybrid above
    model = {"components": 1, "sub_blocks": False} if agreed == (1, 0) else {}
    h = handshake(prefill_local(versions=(p_version,), **model), decode_local(versions=(d_version,), **model))
    h.run()
    assert h.d.state is DecodeConnState.READY and h.p.state is PrefillConnState.READY
    assert h.d.version == h.p.version == agreed
    kinds = [(way, type(m).__name__) for way, m, _ in h.crossed]
    answer = "RegisterAck" if agreed >= (1, 2) else "TransferStatus"
    assert kinds == [("d->p", "Hello"), ("p->d", "Hello"), ("d->p", "RegisterInfo"), ("p->d", answer)]
    assert [v for _, _, v in h.crossed[2:]] == [
        agreed,
        agreed,
    ]  # everything after the Hellos at the agreed version
    ready = [e for e in h.decode_events if isinstance(e, Ready)]
    # from 1.4 the prefill rank names the layers it holds
    layers = HeldLayers.of(h.p.local.memory) if agreed >= LAYOUTS_SINCE else None
    assert ready == [Ready(PeerRef("pre", 0), ParallelRank(), agreed, layers)]
    assert [e for e in h.prefill_events if isinstance(e, Registered)] == [Registered(PeerRef("dec", 0))]
    assert h.p.plan is not None and not h.p.plan.is_dummy


def test_a_model_that_cannot_travel_at_the_agreed_version_is_refused_by_name() -> None:
    h = handshake(prefill_local(versions=((1, 0),)), decode_local())  # two components at 1.0
    h.run()
    assert h.d.state is DecodeConnState.REFUSED
    assert h.d.refusal is not None and "RegisterInfo cannot be sent to 'pre' at version 1.0" in h.d.refusal
    assert [type(m).__name__ for _, m, _ in h.crossed] == ["Hello", "Hello"]  # nothing registered


@pytest.mark.parametrize(
    ("p_local", "d_local", "needle"),
    [
        (
            lambda: prefill_local(model=msgspec.structs.replace(MODEL, revision="r2")),
            decode_local,
            "model differs",
        ),
        (lambda: prefill_local(versions=((2, 0),)), decode_local, "2.0"),
        (lambda: prefill_local(tp=3), lambda: decode_local(tp=2), "do not divide"),
    ],
    ids=["other-model", "other-major", "tp-does-not-divide"],
)
def test_hello_refusals_are_named_on_both_sides(p_local, d_local, needle: str) -> None:  # type: ignore[no-untyped-def]
    h = handshake(p_local(), d_local())
    h.run()
    assert h.d.state is DecodeConnState.REFUSED and needle in (h.d.refusal or "")
    assert h.p.state is PrefillConnState.REFUSED and needle in (h.p.refusal or "")
    # the prefill side answered the Hello anyway, so the decode side could name the cause
    assert [(way, type(m).__name__) for way, m, _ in h.crossed] == [("d->p", "Hello"), ("p->d", "Hello")]


def test_an_engine_that_cannot_add_the_peer_refuses_the_registration_with_its_reason() -> None:
    h = handshake(prefill_local(), decode_local())
    h.run(add_peer_error="PeerError: its previous incarnation's transfers are still stopping")
    assert h.d.state is DecodeConnState.REFUSED and h.p.state is PrefillConnState.AWAIT_REGISTRATION
    assert h.d.refusal is not None and "refused the registration: handshake: PeerError" in h.d.refusal
    assert not [e for e in h.prefill_events if isinstance(e, Registered)]


def test_a_refused_first_registration_is_sent_again_on_request_and_can_then_be_accepted() -> None:
    # the edge closed its own older link to that rank; the prefill rank refused while it still
    # saw that connection: the same RegisterInfo goes again, on the same connection
    h = handshake(prefill_local(), decode_local())
    h.run(add_peer_error="dec/0 is registered on a live connection (retry later)")
    assert h.d.state is DecodeConnState.REFUSED
    first = [m for way, m, _ in h.crossed if isinstance(m, wire.RegisterInfo)]
    (again,) = h.d.register_again()
    assert isinstance(again, Send) and again.message == first[0] and again.version == h.d.version
    assert h.d.state is DecodeConnState.REGISTERING and h.d.refusal is None
    for e in h.p.receive(trip(again.message, again.version)):
        if isinstance(e, AddPeer):
            (ack,) = [x for x in h.p.peer_added() if isinstance(x, Send)]
            assert h.d.receive(trip(ack.message, ack.version)) == [
                Ready(PeerRef("pre", 0), ParallelRank(), h.d.version, HeldLayers.of(h.p.local.memory))
            ]
    assert h.d.state is DecodeConnState.READY and h.p.state is PrefillConnState.READY
    assert h.d.register_again() == []  # only a refused registration goes again


def test_a_refused_hello_is_not_registered_again() -> None:
    h = handshake(prefill_local(versions=((2, 0),)), decode_local())
    h.run()
    assert h.d.state is DecodeConnState.REFUSED and h.d.register_again() == []


def test_a_rank_that_is_not_the_one_expected_at_its_endpoint_is_refused() -> None:
    h = handshake(prefill_local(tp=2, rank=1), decode_local(tp=2, rank=0), Expected(2, 0))
    h.run()
    assert h.d.state is DecodeConnState.REFUSED
    assert "says it is prefill rank (tp 1/2), expected tp 0/2" in (h.d.refusal or "")


def test_a_silent_prefill_rank_is_refused_at_the_handshake_deadline() -> None:
    d = DecodeConnection(decode_local(), "tcp://p:1", deadline=10.0)
    d.start()
    assert d.on_tick(9.9) == []
    assert d.on_tick(10.0) == [Refused("no Hello from tcp://p:1 within the handshake timeout")]
    assert d.on_tick(11.0) == [] and d.receive(trip(prefill_local().hello, None)) == []  # over


def test_a_prefill_rank_of_a_tp_group_that_writes_nothing_is_prepared_as_a_dummy() -> None:
    # MLA is where dummies exist; here the routing facts come out of the prepared plan
    h = handshake(prefill_local(tp=2, rank=1), decode_local(tp=1, rank=0))
    h.run()
    assert h.d.state is DecodeConnState.READY and h.p.plan is not None
    assert not h.p.plan.is_dummy and not h.p.plan.writes_aux  # GQA: rank 1 writes its heads, rank 0 aux


# --------------------------------------------------------------------------- requests and builders


def registered() -> Handshake:
    h = handshake(prefill_local(), decode_local())
    h.run()
    assert h.p.registered and h.d.ready
    return h


def request(h: Handshake, room: int = 7, **kw: object) -> wire.TransferRequest:
    indices = RequestIndices(np.arange(3), state=[[1], np.arange(2)], aux_index=2)
    msg = h.d.transfer_request(SendRequest(PeerRef("pre", 0), room, False, 1, indices))
    return msgspec.structs.replace(msg, **kw) if kw else msg


def test_a_request_becomes_a_target_carrying_its_destination() -> None:
    h = registered()
    assert h.d.version is not None
    (event,) = h.p.receive(trip(request(h, decode_prefix_len=8), h.d.version))
    assert isinstance(event, Requested) and (event.room, event.required) == (7, 1)
    t = event.target
    assert (t.peer, t.is_dummy, t.components, t.sends_aux) == (PeerRef("dec", 0), False, (0, 1), True)
    assert t.dst.kv_pages.tolist() == [0, 1, 2] and t.dst.skip_pages == 2  # 8 tokens = 2 pages of 4
    assert [s.tolist() for s in t.dst.state] == [[1], [0, 1]] and t.dst.aux_index == 2


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"is_dummy": True}, "is_dummy=True, the rank routing says False"),
        ({"decode_prefix_len": 6}, "not a multiple of the page size 4"),
        ({"dst_kv_indices": np.array([3, 1, 3], np.int32)}, "destination index 3 appears twice"),
        ({"state_indices": [np.array([1], np.int32)]}, "1 state index lists for 2 state components"),
        ({"room": 0}, "room 0 is reserved"),
    ],
)
def test_a_request_that_cannot_be_planned_is_answered_failed_at_once(
    changes: dict[str, object], needle: str
) -> None:
    h = registered()
    assert h.d.version is not None
    (event,) = h.p.receive(trip(request(h, **changes), h.d.version))
    assert isinstance(event, Send) and isinstance(event.message, wire.TransferStatus)
    st = trip(event.message, event.version)
    assert isinstance(st, wire.TransferStatus) and st.status == wire.Status.FAILED
    failure = failure_from_wire(st.failure_kind, st.reason)
    assert failure.kind is FailureKind.VALIDATION and needle in failure.detail
    if st.room:  # decode takes it as the room's failure (room 0 is a registration answer)
        assert h.d.receive(st) == [StatusReceived(int(st.room), 0, Status.FAILED, failure)]


@pytest.mark.parametrize("version", VERSIONS[1:], ids=lambda v: f"{v[0]}.{v[1]}")
def test_statuses_notifications_and_acks_reach_decode_as_typed_events(version: tuple[int, int]) -> None:
    h = handshake(prefill_local(versions=(version,)), decode_local())
    h.run()
    failure = Failure(FailureKind.TIMEOUT, "room 5 not done by its deadline")
    msgs = [h.p.status(5, Status.FAILED, failure), h.p.abort_ack(5), h.p.status(0, Status.SUCCESS)]
    got = [e for m in msgs for e in h.d.receive(trip(m, h.p.version))]
    # room 0 is a late registration answer: nothing
    assert got == [StatusReceived(5, 0, Status.FAILED, failure), AbortAcked(5, 0)]
    note = h.p.notification(5, KvPart(2, 0, 4, True))
    assert h.d.receive(trip(note, h.p.version)) == [Completed(5, 0, wire.NotificationKind.KV, 2, True, 0)]


# --------------------------------------------------------------------------- any order, prefill side


def _prefill_inputs(h: Handshake) -> dict[str, wire.Message]:
    """Messages a decode peer may send, good and bad, captured from a real handshake."""
    info = next(m for way, m, _ in h.crossed if isinstance(m, wire.RegisterInfo))
    assert isinstance(info, wire.RegisterInfo)
    hello = next(m for way, m, _ in h.crossed if way == "d->p" and isinstance(m, wire.Hello))
    assert isinstance(hello, wire.Hello)
    return {
        "hello": hello,
        "hello_other_model": msgspec.structs.replace(
            hello, model=msgspec.structs.replace(MODEL, revision="x")
        ),
        "register": info,
        "register_bad": msgspec.structs.replace(info, state_components=info.state_components[:1]),
        "request": request(h),
        "request_dummy": request(h, is_dummy=True),
        "abort": wire.Abort(room=7, sender="decode:dec/0"),
        "stray": wire.Notification(room=7, kind=wire.NotificationKind.KV),
    }


_REFERENCE = registered()
PREFILL_INPUTS = _prefill_inputs(_REFERENCE)


@settings(deadline=None)
@given(st.lists(st.sampled_from([*PREFILL_INPUTS, "garbage", "engine_refuses"]), max_size=12), st.data())
def test_the_prefill_connection_in_any_message_order(order: list[str], data: st.DataObject) -> None:
    c = PrefillConnection(prefill_local())
    registered_seen = False
    for name in order:
        if name == "garbage":
            events = c.undecodable("bad magic")
        elif name == "engine_refuses":
            continue
        else:
            events = c.receive(PREFILL_INPUTS[name])
            if name.startswith("hello"):
                # every Hello is answered with ours, accepted or not
                assert [e for e in events if isinstance(e, Send)] == [Send(c.local.hello, c.version)]
        more = []
        for e in events:
            if isinstance(e, AddPeer):
                assert c.state is PrefillConnState.ADDING_PEER and c.version is not None
                refuse = data.draw(st.booleans())
                more += c.peer_refused("PeerError: stopping") if refuse else c.peer_added()
        events += more
        for e in events:
            if isinstance(e, Send):
                wire.encode(e.message, e.version)  # every answer encodes at the version it names
                if isinstance(e.message, wire.RegisterAck):
                    assert c.version is not None and c.version >= (1, 2)
            if isinstance(e, Registered):
                registered_seen = True
            if isinstance(e, Requested):
                assert c.registered and registered_seen  # requests only from a registered peer
            if isinstance(e, AbortRequested):
                assert c.peer is not None
        if name.startswith("request") and not c.registered:
            (answer,) = events
            assert isinstance(answer, Send) and isinstance(answer.message, wire.TransferStatus)
            assert answer.message.status == wire.Status.FAILED
        if name == "hello":
            registered_seen = False  # a new Hello starts the registration over
    if c.state is PrefillConnState.REFUSED:
        assert c.plan is None and c.refusal is not None


# --------------------------------------------------------------------------- any order, decode side


def _decode_inputs() -> dict[str, wire.Message]:
    h = _REFERENCE
    p_hello = next(m for way, m, _ in h.crossed if way == "p->d" and isinstance(m, wire.Hello))
    assert isinstance(p_hello, wire.Hello)
    return {
        "hello": p_hello,
        "hello_other_model": msgspec.structs.replace(
            p_hello, model=msgspec.structs.replace(MODEL, revision="x")
        ),
        "ack": wire.RegisterAck(accepted=True, sender_rank=0),
        "nack": wire.RegisterAck(
            accepted=False, sender_rank=0, failure_kind=wire.FailureKind.HANDSHAKE, reason="no"
        ),
        "status_room0": wire.TransferStatus(room=0, status=wire.Status.SUCCESS, sender_rank=0),
        "status": wire.TransferStatus(room=5, status=wire.Status.SUCCESS, sender_rank=0),
        "note": wire.Notification(room=5, kind=wire.NotificationKind.AUX),
        "ack_abort": wire.AbortAck(room=5, sender_rank=0),
        "request": request(h),
    }


DECODE_INPUTS = _decode_inputs()


@settings(deadline=None)
@given(st.lists(st.sampled_from([*DECODE_INPUTS, "garbage", "tick"]), max_size=12))
def test_the_decode_connection_in_any_message_order(order: list[str]) -> None:
    c = DecodeConnection(decode_local(), "tcp://p:1", deadline=100.0)
    (first,) = c.start()
    assert first == Send(c.local.hello, None)
    path = []
    for name in order:
        before = c.state
        if name == "garbage":
            events = c.undecodable("bad magic")
        elif name == "tick":
            events = c.on_tick(1000.0)
        else:
            events = c.receive(DECODE_INPUTS[name])
        for e in events:
            if isinstance(e, Send):
                wire.encode(e.message, e.version)
                assert before is DecodeConnState.HELLO_SENT and isinstance(e.message, wire.RegisterInfo)
            if isinstance(e, StatusReceived | Completed | AbortAcked | Problem):
                assert before is DecodeConnState.READY  # room traffic only on a ready link
            if isinstance(e, Ready):
                assert before is DecodeConnState.REGISTERING and name in ("ack", "status_room0")
        if before is DecodeConnState.REFUSED:
            assert events == []  # a refused link says nothing more
        path.append(c.state)
    # READY only through a Hello and then an accepted answer, in that order
    if DecodeConnState.READY in path:
        i = path.index(DecodeConnState.READY)
        assert DecodeConnState.REGISTERING in path[:i]
