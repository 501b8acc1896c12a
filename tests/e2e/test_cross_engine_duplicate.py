"""A room id reused by another decode engine is refused without harming the owner's room.

Prefill TP 2 -> decode TP 1: each decode rank reads from both prefill ranks. Engine A owns
room 7; engine B asks for room 7 too. Both prefill ranks refuse B (duplicate_room); B's decode
room, failed by the first refusal, aborts its attempt at the other prefill rank. That abort
must not fail A's room: only a requester of a room may abort it.
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.demo_content import fill, full_tensors
from pdwire.runtime.demo_rank import model_fingerprint
from pdwire.runtime.session.decode_worker import DecodeWorker
from pdwire.runtime.session.handshake import Identity
from pdwire.runtime.session.prefill_worker import PrefillWorker
from pdwire.runtime.session.status import RoomStatus

from pdwire import wire
from tests.e2e.conftest import SPEC, room_slots, serving, worker_caches


def test_another_engines_duplicate_and_its_abort_leave_the_owners_room_alone() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    model = model_fingerprint(SPEC)
    pbs = [LocalBackend(agent_name=f"pre{r}") for r in range(2)]
    pcs = [worker_caches(b, 2, r) for r, b in enumerate(pbs)]
    pres = [
        PrefillWorker(Identity(wire.Role.PREFILL, "pre", 2, r, model), pcs[r], pbs[r], ctx, room_timeout_s=20)
        for r in range(2)
    ]
    fin_a: list[tuple[Any, ...]] = []
    fin_b: list[tuple[Any, ...]] = []
    decs: list[DecodeWorker] = []
    for name, fin in (("decA", fin_a), ("decB", fin_b)):
        db = LocalBackend(agent_name=name)
        decs.append(
            DecodeWorker(
                Identity(wire.Role.DECODE, name, 1, 0, model),
                worker_caches(db),
                db,
                ctx,
                room_timeout_s=20,
                on_finished=lambda *a, fin=fin: fin.append(a),
            )
        )
    dec_a, dec_b = decs
    released: dict[int, list[tuple[Any, ...]]] = {0: [], 1: []}
    for r, p in enumerate(pres):
        p.on_release = lambda *a, r=r: released[r].append(a)
    try:
        with serving(pres[0]), serving(pres[1]):
            eng = dec_a.connect([p.endpoint for p in pres], timeout_s=10)
            assert dec_b.connect([p.endpoint for p in pres], timeout_s=10) == eng
        tokens = 40
        src = room_slots(tokens)
        for pc in pcs:
            fill(pc, src, full_tensors(SPEC, 1, 7, tokens))
        dec_a.start_room(7, room_slots(tokens), eng)
        deadline = time.monotonic() + 10
        while not all(7 in p.session.rooms and len(p.session.rooms[7].targets) == 1 for p in pres):
            assert time.monotonic() < deadline
            for p in pres:
                p.step(2)
        # another decode engine reuses room id 7
        dec_b.start_room(7, room_slots(tokens), eng)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (fin_b and any(released.values())):
            for w in (*pres, dec_a, dec_b):
                w.step(2)
        for _ in range(50):
            for w in (*pres, dec_a, dec_b):
                w.step(1)
        # now the engine produces room 7's data for engine A
        for p in pres:
            p.chunk_ready(7, src, 0, len(src.pages), True)
        deadline = time.monotonic() + 10
        while not fin_a and time.monotonic() < deadline:
            for w in (*pres, dec_a, dec_b):
                w.step(2)
        assert fin_b and fin_b[0][1] is RoomStatus.FAILED  # B refused: correct
        assert fin_a and fin_a[0][1] is RoomStatus.SUCCESS, f"owner's room killed: {fin_a}"
    finally:
        for w in (*pres, *decs):
            w.close()
        for b in pbs:
            b.close()
        for d in decs:
            d.backend.close()
        ctx.term()
