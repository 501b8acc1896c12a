"""A failed room's destination slots come back only once no prefill write can land in them.

Prefill and decode workers in one process over real sockets and the local backend. The prefill
engine cannot cancel a posted write (as with MoRI, or a Mooncake chunk in flight) and its worker
thread is held by a gate, so the room's writes are still pending when decode aborts the room.
Decode must report the room Failed at once but keep its slots until the prefill rank
acknowledges the abort, which it does only once its writes stopped; a room reusing the slots
afterwards must verify byte for byte. A prefill rank that never fences gets the slots released
at the fence timeout, counted and named.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import zmq
from pdwire.runtime.backends.base import DONE, TransferHandle
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.demo_content import RoomSlots, fill, full_tensors, verify
from pdwire.runtime.demo_model import RankCaches
from pdwire.runtime.demo_rank import model_fingerprint
from pdwire.runtime.session.decode_worker import DecodeWorker
from pdwire.runtime.session.handshake import Identity
from pdwire.runtime.session.prefill_worker import PrefillWorker

from pdwire import wire
from tests.e2e.conftest import SPEC, room_slots, serving, worker_caches

TOKENS = 40  # 10 pages: one KV chunk, two state components and aux, posted together


class CannotCancel(LocalBackend):
    """Posted writes run to their end whatever happens; the worker thread waits for ``gate`` first."""

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        self.gate = threading.Event()
        self._worker.submit(lambda job: (self.gate.wait(), DONE)[1])

    def _cancel(self, handle: TransferHandle) -> None:
        pass  # the engine cannot stop it: poll reports it final once it ended


@dataclass
class Pair:
    pre: PrefillWorker
    dec: DecodeWorker
    pb: CannotCancel
    pc: RankCaches
    dc: RankCaches
    engine: str
    events: list[str] = field(default_factory=list)  # what each side reported, in order

    def step_until(self, done: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
        end = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < end, f"timed out waiting for {what}; events: {self.events}"
            self.pre.step(2)
            self.dec.step(2)

    def start(self, room: int, slots: RoomSlots) -> None:
        """Decode asks for ``room``; once prefill has the request, chunked prefill produces it whole."""
        src = room_slots(TOKENS)
        fill(self.pc, src, full_tensors(SPEC, 1, room, TOKENS))
        self.dec.start_room(room, slots, self.engine)
        self.step_until(lambda: room in self.pre._requests, f"room {room}'s TransferRequest")
        self.pre.chunk_ready(room, src, 0, len(src.pages), True)


@contextmanager
def pair(**decode_kw: Any) -> Iterator[Pair]:
    ctx: zmq.Context[Any] = zmq.Context()
    pb, db = CannotCancel("pre"), LocalBackend(agent_name="dec")
    model = model_fingerprint(SPEC)
    pc, dc = worker_caches(pb), worker_caches(db)
    events: list[str] = []
    pre = PrefillWorker(
        Identity(wire.Role.PREFILL, "pre", 1, 0, model),
        pc,
        pb,
        ctx,
        room_timeout_s=10,
        on_release=lambda room, st, _f: events.append(f"prefill released {room} {st.name}"),
    )
    dec = DecodeWorker(
        Identity(wire.Role.DECODE, "dec", 1, 0, model),
        dc,
        db,
        ctx,
        on_finished=lambda room, st, _f: events.append(f"decode finished {room} {st.name}"),
        on_slots_released=lambda room: events.append(f"decode slots {room}"),
        **decode_kw,
    )
    try:
        with serving(pre):
            engine = dec.connect([pre.endpoint], timeout_s=10)
        yield Pair(pre, dec, pb, pc, dc, engine, events)
    finally:
        pb.gate.set()
        pre.close()
        dec.close()
        pb.close()
        db.close()
        ctx.term()


def test_slots_of_an_aborted_room_are_released_after_prefill_stopped_and_reused_byte_exact() -> None:
    with pair(room_timeout_s=10) as p:
        slots = room_slots(TOKENS)
        p.start(7, slots)
        assert len(p.pre._handles) == 4  # KV, Mamba, SWA, aux: posted, held on the engine's thread
        p.dec.abort(7, "the engine gave up on it")
        assert p.events == ["decode finished 7 FAILED"]  # the engine learns at once (it may retry)
        for _ in range(200):
            p.pre.step(1)
            p.dec.step(1)
        # The writes cannot stop while held: prefill answers nothing and decode keeps the slots.
        assert p.events == ["decode finished 7 FAILED"]
        assert p.pre.session.rooms[7].draining and len(p.pre._handles) == 4
        assert list(p.dec.session.quarantined) == [7]
        p.pb.gate.set()  # the failed room's writes now land in decode's slots
        p.step_until(lambda: "decode slots 7" in p.events, "room 7's slots")
        assert p.events == ["decode finished 7 FAILED", "prefill released 7 FAILED", "decode slots 7"]
        assert p.pre._handles == {} and p.pre.stats.rooms_failed == 1
        # What the fence held back: room 7's bytes did land, after the room had failed.
        assert verify(p.dc, slots, full_tensors(SPEC, 1, 7, TOKENS)) == []
        p.start(8, slots)  # the same slots for the next room
        p.step_until(lambda: "decode finished 8 SUCCESS" in p.events, "room 8")
        p.step_until(lambda: p.dec.session.stray_completions == 4, "room 7's late notifications")
        assert verify(p.dc, slots, full_tensors(SPEC, 1, 8, TOKENS)) == []
        assert p.events[-2:] == ["decode finished 8 SUCCESS", "decode slots 8"]
        assert p.dec.stats.unfenced_releases == 0
        assert p.dec.stats.failures == ["room 7: aborted: the engine gave up on it"]


def test_a_prefill_rank_that_never_fences_gets_the_slots_released_at_the_fence_timeout_loudly() -> None:
    with pair(room_timeout_s=1.0, fence_timeout_s=0.5) as p:
        p.start(9, room_slots(TOKENS))
        p.dec.abort(9, "the engine gave up on it")
        p.step_until(lambda: "decode slots 9" in p.events, "the fence timeout")
        assert p.events == ["decode finished 9 FAILED", "decode slots 9"]
        assert p.pre.session.rooms[9].draining  # its writes still could not stop
        assert p.dec.stats.unfenced_releases == 1
        assert p.dec.stats.failures == [
            "room 9: aborted: the engine gave up on it",
            "room 9: destination slots released after the fence timeout, unfenced by pre/0",
        ]
