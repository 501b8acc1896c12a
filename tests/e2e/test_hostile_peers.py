"""Hostile decode peers against a real prefill worker over real sockets.

An attacker socket on 127.0.0.1 speaks the protocol badly: a registration that disagrees with
its Hello, a message whose handling raises, a request nobody can serve, the id of a finished
room reused. Each ends in a typed refusal of that peer (or that request), and the prefill rank
goes on serving its real decode peer byte for byte.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from pdwire import wire
from pdwire.demo.content import fill, full_tensors
from pdwire.demo.rank import model_fingerprint
from pdwire.runtime.config import ParallelRank
from pdwire.runtime.engine import Status
from pdwire.runtime.session.failures import FailureKind
from pdwire.runtime.session.hello import Identity
from pdwire.runtime.session.prefill_connection import PrefillConnection
from pdwire.runtime.session.registration import register_info
from tests.e2e.conftest import SPEC, WorkerPair, room_slots, send, worker_pair


class Attacker:
    """A DEALER speaking to the prefill worker; every answer is stepped out of it."""

    def __init__(self, p: WorkerPair, engine_id: str = "evil") -> None:
        self.p = p
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(p.pre.endpoint)
        self.hello = Identity(
            wire.Role.DECODE, engine_id, ParallelRank(1, 0), model_fingerprint(SPEC), ()
        ).hello()

    def send(self, msg: wire.Message) -> wire.Message:
        self.sock.send_multipart(wire.encode(msg, wire.NEWEST))
        end = time.monotonic() + 10
        while not self.sock.poll(0):
            assert time.monotonic() < end, "the prefill rank did not answer"
            self.p.pre.step(5)
        return wire.decode(self.sock.recv_multipart())

    def registration(self, **kw: Any) -> wire.RegisterInfo:
        info = register_info(
            self.p.dc.memory,
            endpoint="tcp://127.0.0.1:1",
            engine_id=self.hello.engine_id,
            agent_name="evil-agent",
            agent_metadata=b"not an envelope",
            geometry=self.hello.geometry,
        )
        return msgspec.structs.replace(info, **kw) if kw else info

    def close(self) -> None:
        self.sock.close(0)


def run_room(p: WorkerPair, room: int, tokens: int = 24) -> tuple[int, Status, Any]:
    src = room_slots(tokens)
    fill(p.pc, src, full_tensors(SPEC, 1, room, tokens))
    p.ask(room, room_slots(tokens))
    p.step_until(lambda: p.pre.status(room) is Status.WAITING_FOR_INPUT, f"request of room {room}")
    send(p.pre, room, src)
    p.step_until(lambda: any(r == room for r, _, _ in p.finished), f"room {room} on decode")
    return next(f for f in p.finished if f[0] == room)


def refused(answer: wire.Message) -> str:
    assert isinstance(answer, wire.RegisterAck) and not answer.accepted, answer
    return str(answer.reason)


def test_bad_registrations_are_refused_and_the_rank_keeps_serving() -> None:
    with worker_pair() as p:
        a = Attacker(p)
        try:
            assert isinstance(a.send(a.hello), wire.Hello)
            zero_tp = msgspec.structs.replace(a.hello.geometry, tp_size=0)
            assert "geometry" in refused(a.send(a.registration(geometry=zero_tp)))
            assert "engine_id" in refused(a.send(a.registration(engine_id="dec")))
            assert "envelope" in refused(a.send(a.registration()))  # garbage backend metadata
        finally:
            a.close()
        assert run_room(p, 3)[1] is Status.SUCCESS


def test_a_message_whose_handling_raises_drops_that_peer_only(monkeypatch: pytest.MonkeyPatch) -> None:
    with worker_pair() as p:
        real = PrefillConnection.receive

        def explode(self: PrefillConnection, msg: wire.Message) -> Any:
            if isinstance(msg, wire.Abort) and msg.sender == "boom":
                raise RuntimeError("a defect only this peer's message reaches")
            return real(self, msg)

        monkeypatch.setattr(PrefillConnection, "receive", explode)
        a = Attacker(p)
        try:
            a.send(a.hello)
            a.sock.send_multipart(wire.encode(wire.Abort(room=9, sender="boom"), wire.NEWEST))
            p.step_until(lambda: p.pre.stats.peers_failed == 1, "the peer to be dropped")
        finally:
            a.close()
        assert any("RuntimeError" in f for f in p.pre.stats.failures)
        assert run_room(p, 4)[1] is Status.SUCCESS  # the rank and its real peer go on


def test_pages_of_a_reused_finished_room_id_are_released_at_once() -> None:
    with worker_pair() as p:
        assert run_room(p, 8)[1] is Status.SUCCESS
        released = len(p.released)
        send(p.pre, 8, room_slots(24))  # the engine reuses the finished id
        assert len(p.released) == released + 1
        room, status, failure = p.released[-1]
        assert room == 8 and status is Status.FAILED and failure is not None
        assert failure.kind is FailureKind.DUPLICATE_ROOM
        assert p.pre.status(8) is Status.SUCCESS  # the finished room keeps its outcome


def test_the_connection_table_is_bounded_and_registered_peers_survive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdwire.runtime.workers import prefill

    monkeypatch.setattr(prefill, "MAX_CONNECTIONS", 4)
    with worker_pair() as p:
        attackers = [Attacker(p, f"evil{i}") for i in range(10)]
        try:
            for a in attackers:
                assert isinstance(a.send(a.hello), wire.Hello)
            assert len(p.pre._conns) <= 4 and p.pre.stats.connections_evicted >= 7
            assert p.pre.registered_peers  # the real decode peer was never evicted
        finally:
            for a in attackers:
                a.close()
        assert run_room(p, 11)[1] is Status.SUCCESS


def test_a_frame_over_the_control_size_limit_is_never_delivered(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdwire.runtime.workers import prefill

    monkeypatch.setattr(prefill, "CONTROL_MAX_MESSAGE", 1 << 16)
    with worker_pair() as p:
        a = Attacker(p)
        try:
            before = p.pre.stats.messages_in
            a.sock.send_multipart([b"x" * (1 << 17)])
            for _ in range(50):
                p.pre.step(2)
            assert p.pre.stats.messages_in == before  # dropped by ZMQ, never buffered whole
        finally:
            a.close()
        assert run_room(p, 12)[1] is Status.SUCCESS


def test_a_prefill_peer_sending_an_oversized_frame_is_dropped_and_decode_serves_on() -> None:
    """The decode side's limit: a "prefill rank" that answers Hello with a frame over
    PREFILL_MAX_MESSAGE loses its connection before the frame is buffered; that connect fails
    at its handshake timeout, naming the endpoint, and the decode rank goes on serving its real
    prefill peer."""
    from pdwire.runtime.workers.decode import PREFILL_MAX_MESSAGE

    with worker_pair() as p:
        rogue = zmq.Context.instance().socket(zmq.ROUTER)
        rogue.setsockopt(zmq.LINGER, 0)
        endpoint = f"tcp://127.0.0.1:{rogue.bind_to_random_port('tcp://127.0.0.1')}"
        try:
            group = p.dec.connect([endpoint], timeout_s=5.0)
            end = time.monotonic() + 10
            answered = False
            while group.state.name == "CONNECTING":
                assert time.monotonic() < end, "the decode rank never gave up on the rogue peer"
                if not answered and rogue.poll(0):
                    ident, *_ = rogue.recv_multipart()
                    rogue.send_multipart([ident, b"x" * (PREFILL_MAX_MESSAGE + 1)])
                    answered = True
                p.dec.step(5)
                p.pre.step(1)
            assert answered and group.failed, group
            # the frame never reached the worker (without the limit it fails as "undecodable")
            assert group.error is not None and "no Hello from" in group.error, group.error
        finally:
            rogue.close(0)
        assert run_room(p, 13)[1] is Status.SUCCESS
