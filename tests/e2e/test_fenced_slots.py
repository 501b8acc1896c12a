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

from pdwire.runtime.backends.base import DONE, TransferHandle
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.demo_content import RoomSlots, fill, full_tensors, verify

from tests.e2e.conftest import SPEC, WorkerPair, room_slots, worker_pair

TOKENS = 40  # 10 pages: one KV chunk, two state components and aux, posted together


class CannotCancel(LocalBackend):
    """Posted writes run to their end whatever happens; the worker thread waits for ``gate`` first."""

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        self.gate = threading.Event()
        self._worker.submit(lambda job: (self.gate.wait(), DONE)[1])

    def _cancel(self, handle: TransferHandle) -> None:
        pass  # the engine cannot stop it: poll reports it final once it ended

    def close(self) -> None:
        self.gate.set()  # the held writes must end first, or close waits its full close_wait_s for them
        super().close()


def start(p: WorkerPair, room: int, slots: RoomSlots) -> None:
    """Decode asks for ``room``; once prefill has the request, chunked prefill produces it whole."""
    src = room_slots(TOKENS)
    fill(p.pc, src, full_tensors(SPEC, 1, room, TOKENS))
    p.dec.start_room(room, slots, p.engine)
    p.step_until(lambda: room in p.pre._requests, f"room {room}'s TransferRequest")
    p.pre.chunk_ready(room, src, 0, len(src.pages), True)


def test_slots_of_an_aborted_room_are_released_after_prefill_stopped_and_reused_byte_exact() -> None:
    pb = CannotCancel("pre")
    with worker_pair(pb) as p:
        slots = room_slots(TOKENS)
        start(p, 7, slots)
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
        pb.gate.set()  # the failed room's writes now land in decode's slots
        p.step_until(lambda: "decode slots 7" in p.events, "room 7's slots")
        assert p.events == ["decode finished 7 FAILED", "prefill released 7 FAILED", "decode slots 7"]
        assert p.pre._handles == {} and p.pre.stats.rooms_failed == 1
        # What the fence held back: room 7's bytes did land, after the room had failed.
        assert verify(p.dc, slots, full_tensors(SPEC, 1, 7, TOKENS)) == []
        start(p, 8, slots)  # the same slots for the next room
        p.step_until(lambda: "decode finished 8 SUCCESS" in p.events, "room 8")
        p.step_until(lambda: p.dec.session.stray_completions == 4, "room 7's late notifications")
        assert verify(p.dc, slots, full_tensors(SPEC, 1, 8, TOKENS)) == []
        assert p.events[-2:] == ["decode finished 8 SUCCESS", "decode slots 8"]
        assert p.dec.stats.unfenced_releases == 0
        assert p.dec.stats.failures == ["room 7: aborted: the engine gave up on it"]


def test_a_prefill_rank_that_never_fences_gets_the_slots_released_at_the_fence_timeout_loudly() -> None:
    with worker_pair(CannotCancel("pre"), decode_kw={"room_timeout_s": 1.0, "fence_timeout_s": 0.5}) as p:
        start(p, 9, room_slots(TOKENS))
        p.dec.abort(9, "the engine gave up on it")
        p.step_until(lambda: "decode slots 9" in p.events, "the fence timeout")
        assert p.events == ["decode finished 9 FAILED", "decode slots 9"]
        assert p.pre.session.rooms[9].draining  # its writes still could not stop
        assert p.dec.stats.unfenced_releases == 1
        assert p.dec.stats.failures == [
            "room 9: aborted: the engine gave up on it",
            "room 9: destination slots released after the fence timeout, unfenced by pre/0",
        ]
