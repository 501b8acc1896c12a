"""Prefill and decode workers in one process over real sockets, with an injected engine failure.

One transfer of a room fails while the room's other transfers are still pending: the room
must fail once, with the engine's reason on the decode side, and only after the prefill
worker cancelled the others and the engine confirmed they stopped.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq
from pdwire.runtime.backends import shm
from pdwire.runtime.backends.base import DONE, TransferHandle, failed
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.backends.worker import Job
from pdwire.runtime.demo_content import fill, full_tensors
from pdwire.runtime.demo_rank import model_fingerprint
from pdwire.runtime.session.decode_worker import DecodeWorker
from pdwire.runtime.session.failures import Failure, FailureKind, SessionError
from pdwire.runtime.session.handshake import Identity
from pdwire.runtime.session.prefill_worker import PrefillWorker
from pdwire.runtime.session.status import RoomStatus

from pdwire import wire
from tests.e2e.conftest import SPEC, room_slots, worker_caches, worker_pair


class FirstTransferFails(LocalBackend):
    """The first posted transfer fails at its first poll without writing; the others queue on
    the worker thread behind a job that waits for ``gate``."""

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        self.gate = threading.Event()
        self._worker.submit(lambda job: (self.gate.wait(), DONE)[1])

    def _post(self, handle: TransferHandle, table: Any, notification: bytes) -> None:
        if handle.id != 1:
            super()._post(handle, table, notification)
            return
        job = Job(lambda job: DONE, status=failed("injected engine failure"))
        job.finished.set()
        handle.engine = job

    def close(self) -> None:
        self.gate.set()  # the held job must end first, or close waits its full close_wait_s for it
        super().close()


def test_a_failed_transfer_fails_its_room_once_while_others_are_pending() -> None:
    pb = FirstTransferFails(agent_name="pre")
    with worker_pair(pb) as p:
        tokens = 40  # 10 pages: one KV chunk, two state components and aux, all posted at once
        src = room_slots(tokens)
        fill(p.pc, src, full_tensors(SPEC, 1, 7, tokens))
        p.dec.start_room(7, room_slots(tokens), p.engine)
        deadline = time.monotonic() + 10
        while 7 not in p.pre.session.rooms or not p.pre._requests:
            assert time.monotonic() < deadline, "the TransferRequest never arrived"
            p.pre.step(5)
        p.pre.chunk_ready(7, src, 0, len(src.pages), True)
        assert len(p.pre._handles) == 4  # KV, Mamba, SWA, aux: in flight together
        for _ in range(100):  # the first fails; the other three cannot stop while the gate is shut
            p.pre.step(1)
            p.dec.step(1)
        assert 7 in p.pre.session.rooms and p.pre.session.rooms[7].draining
        assert len(p.pre._handles) == 3 and all(h.cancel_reason for h in p.pre._handles.values())
        assert p.finished == [] and p.pre.stats.rooms_failed == 0  # nobody told while they may write
        pb.gate.set()
        while not p.finished:
            assert time.monotonic() < deadline, "the room never finished on the decode side"
            p.pre.step(5)
            p.dec.step(5)
        ((room, status, failure),) = p.finished
        assert room == 7 and status is RoomStatus.FAILED and failure is not None
        assert "injected engine failure" in failure.detail, failure
        assert p.pre.stats.rooms_failed == 1 and p.pre.stats.rooms_ok == 0
        assert p.pre._handles == {} and pb._handles == {}  # every handle of the room released


def test_an_undecodable_engine_notification_is_recorded_and_the_decode_loop_goes_on() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    db = LocalBackend(agent_name="dec")
    dec = DecodeWorker(
        Identity(wire.Role.DECODE, "dec", 1, 0, model_fingerprint(SPEC)), worker_caches(db), db, ctx
    )
    try:
        shm.send(db._inbox.path, "someone", b"not a pdwire frame")
        dec.step(10)  # must not raise: one peer's bad payload cannot stop every room on this rank
        assert dec.stats.engine_notifications == 1
        assert any("undecodable engine notification from someone" in f for f in dec.stats.failures)
    finally:
        dec.close()
        db.close()
        ctx.term()


def test_a_chunk_of_a_room_that_already_failed_leaves_nothing_behind() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pb = LocalBackend(agent_name="pre")
    pre = PrefillWorker(
        Identity(wire.Role.PREFILL, "pre", 1, 0, model_fingerprint(SPEC)), worker_caches(pb), pb, ctx
    )
    try:
        src = room_slots(16)
        pre.chunk_ready(5, src, 0, 2, False)
        assert 5 in pre.session.rooms and 5 in pre._sources
        pre._run(pre.session.fail_room(5, Failure(FailureKind.ABORTED, "the engine gave up")))
        pre.chunk_ready(5, src, 2, len(src.pages), True)  # the engine's next chunk arrives late
        assert 5 not in pre.session.rooms
        assert 5 not in pre._sources
    finally:
        pre.close()
        pb.close()
        ctx.term()


def test_room_zero_is_reserved_and_refused_before_anything_is_sent() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    db = LocalBackend(agent_name="dec")
    dec = DecodeWorker(
        Identity(wire.Role.DECODE, "dec", 1, 0, model_fingerprint(SPEC)), worker_caches(db), db, ctx
    )
    try:
        with pytest.raises(SessionError, match="room 0 is reserved"):
            dec.start_room(0, room_slots(16), "any-engine")
        assert dec.stats.messages_out == 0 and not dec.session.rooms
    finally:
        dec.close()
        db.close()
        ctx.term()
