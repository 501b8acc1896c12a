"""A failed room's destination slots come back only once no prefill write can land in them.

Prefill and decode workers in one process over real sockets and the local backend. The prefill
engine cannot cancel a posted write (as with MoRI, or a Mooncake chunk in flight) and its worker
thread is held by a gate, so the room's writes are still pending when decode aborts the room.
Decode must report the room Failed at once but keep its slots until the prefill rank
acknowledges the abort, which it does only once its writes stopped; a room reusing the slots
afterwards must verify byte for byte. A prefill rank that never fences is revoked at the fence
timeout: the slots come back, and its late writes change none of their bytes.
"""

from __future__ import annotations

import threading

import pytest

from pdwire.demo.content import RoomSlots, fill, full_tensors, verify
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.backends.values import DONE, TransferHandle
from pdwire.runtime.config import ConfigError
from pdwire.runtime.engine import DuplicateRoomError, Status
from tests.e2e.conftest import SPEC, WorkerPair, room_slots, send, worker_pair

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
    p.ask(room, slots)
    p.step_until(lambda: p.pre.status(room) is Status.WAITING_FOR_INPUT, f"room {room}'s TransferRequest")
    send(p.pre, room, src)


def test_slots_of_an_aborted_room_are_released_after_prefill_stopped_and_reused_byte_exact() -> None:
    pb = CannotCancel("pre")
    with worker_pair(pb) as p:
        slots = room_slots(TOKENS)
        start(p, 7, slots)
        # KV, Mamba, SWA, aux: one write (protocol 1.4), posted, held on the engine's thread
        assert p.pre.transfers_in_flight == 1 and p.pre.stats.merged_parts == 3
        p.dec.abort(7, "the engine gave up on it")
        assert p.events == ["decode finished 7 FAILED"]  # the engine learns at once (it may retry)
        for _ in range(200):
            p.pre.step(1)
            p.dec.step(1)
        # The writes cannot stop while held: prefill answers nothing and decode keeps the slots.
        assert p.events == ["decode finished 7 FAILED"]
        assert p.pre.draining_rooms == (7,) and p.pre.transfers_in_flight == 1
        assert p.dec.quarantined_rooms == (7,)
        pb.gate.set()  # the failed room's writes now land in decode's slots
        p.step_until(lambda: "decode slots 7" in p.events, "room 7's slots")
        assert p.events == ["decode finished 7 FAILED", "prefill released 7 FAILED", "decode slots 7"]
        assert p.pre.transfers_in_flight == 0 and p.pre.stats.rooms_failed == 1
        # What the fence held back: room 7's bytes did land, after the room had failed.
        assert verify(p.dc, slots, full_tensors(SPEC, 1, 7, TOKENS)) == []
        start(p, 8, slots)  # the same slots for the next room
        p.step_until(lambda: "decode finished 8 SUCCESS" in p.events, "room 8")
        p.step_until(lambda: p.dec.stray_completions == 1, "room 7's late notification (one write)")
        assert verify(p.dc, slots, full_tensors(SPEC, 1, 8, TOKENS)) == []
        assert p.events[-2:] == ["decode finished 8 SUCCESS", "decode slots 8"]
        assert p.dec.stats.revocations == 0  # its AbortAck fenced it: nobody was cut off
        assert p.dec.stats.failures == ["room 7: aborted: the engine gave up on it"]


def test_a_prefill_rank_that_never_fences_is_revoked_and_its_late_writes_land_nowhere() -> None:
    with worker_pair(CannotCancel("pre"), decode_kw={"room_timeout_s": 1.0, "fence_timeout_s": 0.5}) as p:
        slots = room_slots(TOKENS)
        start(p, 9, slots)
        p.dec.abort(9, "the engine gave up on it")
        p.step_until(lambda: "decode slots 9" in p.events, "the revocation at the fence timeout")
        assert p.events == ["decode finished 9 FAILED", "decode slots 9"]
        assert p.pre.draining_rooms == (9,)  # its writes still could not stop
        assert p.dec.stats.revocations == 1 and p.dec.stats.unrevocable == 0
        # the engine reuses the slots at once; then the revoked rank's held writes run
        reuse = full_tensors(SPEC, 1, 99, TOKENS)
        fill(p.dc, slots, reuse)
        p.pb.gate.set()  # type: ignore[attr-defined]
        p.step_until(lambda: p.pre.draining_rooms == (), "room 9's writes to end")
        assert verify(p.dc, slots, reuse) == [], "a revoked rank's late write reached reused slots"
        # the rank registered again (new windows) and serves the same slots byte for byte
        p.step_until(lambda: p.dec.unready_peers == (), "the registration after the revocation")
        start(p, 10, slots)
        p.step_until(lambda: "decode finished 10 SUCCESS" in p.events, "room 10")
        assert verify(p.dc, slots, full_tensors(SPEC, 1, 10, TOKENS)) == []
        assert p.dec.stats.failures[0] == "room 9: aborted: the engine gave up on it"


class EngineOwned(LocalBackend):
    """Decode memory the engine allocated itself: no window onto it can be revoked."""

    def revocation_blocker(self, for_peer: str) -> str | None:
        return "regions [0] cannot be windowed (engine-owned memory, as SGLang's own tensors)"


def test_a_room_an_unrevocable_writer_keeps_quarantined_is_forgotten_when_the_engine_reclaims_it() -> None:
    with worker_pair(
        CannotCancel("pre"), EngineOwned("dec"), decode_kw={"room_timeout_s": 1.0, "fence_timeout_s": 0.3}
    ) as p:
        slots = room_slots(TOKENS)
        start(p, 11, slots)
        with pytest.raises(ConfigError, match="still live"):
            p.dec.reclaim(11)  # a live room is aborted first, never reclaimed under its writers
        p.dec.abort(11, "the engine gave up on it")
        p.step_until(lambda: p.dec.stats.unrevocable == 1, "the revocation attempt at the fence timeout")
        for _ in range(50):  # a timeout never releases the slots of an unrevocable writer's room
            p.pre.step(1)
            p.dec.step(1)
        assert p.dec.quarantined_rooms == (11,) and p.events == ["decode finished 11 FAILED"]
        assert p.dec.reclaim(11) is True
        assert p.dec.quarantined_rooms == () and p.dec.stats.reclaimed == 1
        assert p.dec.reclaim(11) is False  # once: the room is not quarantined any more
        assert "room 11: reclaimed by the engine before its writers fenced (waiting for: pre/0)" in str(
            p.dec.stats.failures
        )
        with pytest.raises(DuplicateRoomError):  # its late messages may still come: the id waits
            p.dec.check_free(11)
        # the writer's held write and its AbortAck arrive late: stray, no callback, no failure
        p.pb.gate.set()  # type: ignore[attr-defined]
        p.step_until(lambda: p.pre.draining_rooms == (), "room 11's writes to end")
        p.step_until(lambda: "prefill released 11 FAILED" in p.events, "prefill's own release")
        for _ in range(50):
            p.pre.step(1)
            p.dec.step(1)
        assert "decode slots 11" not in p.events  # the engine has the slots: no second hand-over
        assert p.dec.quarantined_rooms == () and p.dec.stats.rooms_failed == 1
