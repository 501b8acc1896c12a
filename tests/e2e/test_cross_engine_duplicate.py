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

from pdwire.demo.content import fill, full_tensors
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.engine import DecodeWorker, PrefillWorker, Status
from tests.e2e.conftest import SPEC, decode_config, prefill_config, room_slots, send, serving, worker_caches


def test_another_engines_duplicate_and_its_abort_leave_the_owners_room_alone() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pbs = [LocalBackend(agent_name=f"pre{r}") for r in range(2)]
    pcs = [worker_caches(b, 2, r) for r, b in enumerate(pbs)]
    released: dict[int, list[tuple[Any, ...]]] = {0: [], 1: []}
    pres = [
        PrefillWorker(
            prefill_config("pre", 2, r, room_timeout_s=20),
            pcs[r].memory,
            backend=pbs[r],
            context=ctx,
            on_released=lambda *a, r=r: released[r].append(a),
        )
        for r in range(2)
    ]
    fin_a: list[tuple[Any, ...]] = []
    fin_b: list[tuple[Any, ...]] = []
    decs: list[DecodeWorker] = []
    dbs: list[LocalBackend] = []
    for name, fin in (("decA", fin_a), ("decB", fin_b)):
        db = LocalBackend(agent_name=name)
        dbs.append(db)
        decs.append(
            DecodeWorker(
                decode_config(name, room_timeout_s=20),
                worker_caches(db).memory,
                backend=db,
                context=ctx,
                on_finished=lambda *a, fin=fin: fin.append(a),
            )
        )
    dec_a, dec_b = decs
    try:
        with serving(pres[0]), serving(pres[1]):
            group = dec_a.wait_ready(dec_a.connect([p.endpoint for p in pres], timeout_s=10))
            group_b = dec_b.wait_ready(dec_b.connect([p.endpoint for p in pres], timeout_s=10))
            assert (group_b.engine_id, group_b.dp_rank) == (group.engine_id, group.dp_rank)
        tokens = 40
        src = room_slots(tokens)
        for pc in pcs:
            fill(pc, src, full_tensors(SPEC, 1, 7, tokens))
        dec_a.start_room(7, room_slots(tokens).request(SPEC), group)
        deadline = time.monotonic() + 10
        while not all(p.status(7) is Status.WAITING_FOR_INPUT for p in pres):
            assert time.monotonic() < deadline
            for p in pres:
                p.step(2)
        # another decode engine reuses room id 7
        dec_b.start_room(7, room_slots(tokens).request(SPEC), group)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (fin_b and any(released.values())):
            for w in (*pres, dec_a, dec_b):
                w.step(2)
        for _ in range(50):
            for w in (*pres, dec_a, dec_b):
                w.step(1)
        # now the engine produces room 7's data for engine A
        for p in pres:
            send(p, 7, src)
        deadline = time.monotonic() + 10
        while not fin_a and time.monotonic() < deadline:
            for w in (*pres, dec_a, dec_b):
                w.step(2)
        assert fin_b and fin_b[0][1] is Status.FAILED  # B refused: correct
        assert fin_a and fin_a[0][1] is Status.SUCCESS, f"owner's room killed: {fin_a}"
    finally:
        for w in (*pres, *decs):
            w.close()
        for b in (*pbs, *dbs):
            b.close()
        ctx.term()
