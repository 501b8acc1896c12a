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

from pdwire.demo.content import fill, full_tensors
from pdwire.runtime.backends import shm
from pdwire.runtime.backends.jobs import Job
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.backends.values import DONE, TransferHandle, failed
from pdwire.runtime.engine import DecodeWorker, IndicesError, PrefillWorker, Status
from tests.e2e.conftest import (
    SPEC,
    decode_config,
    prefill_config,
    room_slots,
    send,
    worker_caches,
    worker_pair,
)


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
        handle.private = job

    def close(self) -> None:
        self.gate.set()  # the held job must end first, or close waits its full close_wait_s for it
        super().close()


def test_a_failed_transfer_fails_its_room_once_while_others_are_pending() -> None:
    pb = FirstTransferFails(agent_name="pre")
    # decode speaks 1.3, so that each part is a write of its own (at 1.4 they would be one)
    with worker_pair(pb, decode_versions=((1, 3),)) as p:
        tokens = 40  # 10 pages: one KV chunk, two state components and aux, all posted at once
        src = room_slots(tokens)
        fill(p.pc, src, full_tensors(SPEC, 1, 7, tokens))
        p.ask(7, room_slots(tokens))
        deadline = time.monotonic() + 10
        while p.pre.status(7) is not Status.WAITING_FOR_INPUT:
            assert time.monotonic() < deadline, "the TransferRequest never arrived"
            p.pre.step(5)
        send(p.pre, 7, src)
        assert p.pre.transfers_in_flight == 4  # KV, Mamba, SWA, aux: in flight together
        for _ in range(100):  # the first fails; the other three cannot stop while the gate is shut
            p.pre.step(1)
            p.dec.step(1)
        assert p.pre.draining_rooms == (7,) and p.pre.transfers_in_flight == 3
        assert len(pb._handles) == 3 and all(h.cancel_reason for h in pb._handles.values())  # cancel asked
        assert p.finished == [] and p.pre.stats.rooms_failed == 0  # nobody told while they may write
        pb.gate.set()
        while not p.finished:
            assert time.monotonic() < deadline, "the room never finished on the decode side"
            p.pre.step(5)
            p.dec.step(5)
        ((room, status, failure),) = p.finished
        assert room == 7 and status is Status.FAILED and failure is not None
        assert "injected engine failure" in failure.detail, failure
        assert p.pre.stats.rooms_failed == 1 and p.pre.stats.rooms_ok == 0
        assert p.pre.transfers_in_flight == 0 and pb._handles == {}  # every handle of the room released


def test_an_undecodable_engine_notification_is_recorded_and_the_decode_loop_goes_on() -> None:
    db = LocalBackend(agent_name="dec")
    with db, DecodeWorker(decode_config(), worker_caches(db).memory, backend=db) as dec:
        shm.send(db._inbox.path, "someone", b"not a pdwire frame")
        dec.step(10)  # must not raise: one peer's bad payload cannot stop every room on this rank
        assert dec.stats.engine_notifications == 1
        assert any("undecodable engine notification from someone" in f for f in dec.stats.failures)


def test_a_chunk_of_a_room_that_already_failed_leaves_nothing_behind() -> None:
    pb = LocalBackend(agent_name="pre")
    with pb, PrefillWorker(prefill_config(), worker_caches(pb).memory, backend=pb) as pre:
        src = room_slots(16)
        send(pre, 5, src, 0, 2)
        assert pre.status(5) is Status.BOOTSTRAPPING
        pre.abort(5, "the engine gave up")
        send(pre, 5, src, 2)  # the engine's next chunk arrives late
        assert pre.status(5) is Status.FAILED and pre.draining_rooms == ()  # nothing kept for it


def test_room_zero_is_reserved_and_refused_before_anything_is_sent() -> None:
    db = LocalBackend(agent_name="dec")
    with db, DecodeWorker(decode_config(), worker_caches(db).memory, backend=db) as dec:
        with pytest.raises(IndicesError, match="room 0 is reserved"):
            dec.start_room(0, room_slots(16).request(SPEC), None)  # type: ignore[arg-type]
        assert dec.stats.messages_out == 0 and dec.status(0) is None
