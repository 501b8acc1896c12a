"""Destination page lists the prefill side cannot honour fail the room, never a silent Success.

The prefill worker slices the destination page list chunk by chunk. Without a check at the last
chunk, the tail of a longer list would stay unwritten while both sides report Success; without
a check of the whole list on arrival, a page named twice across a chunk boundary would be
written twice, the later chunk silently winning.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import zmq
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.demo_content import RoomSlots, fill, full_tensors
from pdwire.runtime.demo_rank import model_fingerprint
from pdwire.runtime.session.decode_worker import DecodeWorker
from pdwire.runtime.session.failures import FailureKind
from pdwire.runtime.session.handshake import Identity
from pdwire.runtime.session.prefill_worker import PrefillWorker
from pdwire.runtime.session.status import RoomStatus

from pdwire import wire
from tests.e2e.conftest import SPEC, room_slots, serving, worker_caches


def test_a_longer_destination_page_list_fails_the_room_on_both_sides() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pb, db = LocalBackend(agent_name="pre"), LocalBackend(agent_name="dec")
    model = model_fingerprint(SPEC)
    finished: list[tuple[Any, ...]] = []
    released: list[tuple[Any, ...]] = []
    pc, dc = worker_caches(pb), worker_caches(db)
    pre = PrefillWorker(
        Identity(wire.Role.PREFILL, "pre", 1, 0, model),
        pc,
        pb,
        ctx,
        room_timeout_s=10,
        on_release=lambda *a: released.append(a),
    )
    dec = DecodeWorker(
        Identity(wire.Role.DECODE, "dec", 1, 0, model),
        dc,
        db,
        ctx,
        room_timeout_s=10,
        on_finished=lambda *a: finished.append(a),
    )
    try:
        with serving(pre):
            engine = dec.connect([pre.endpoint], timeout_s=10)
        src = room_slots(40)  # prefill produces 10 pages
        n = len(src.pages)
        dst = RoomSlots(np.arange(n + 3, dtype=np.int32), src.slot, src.swa_pages, src.aux)
        fill(pc, src, full_tensors(SPEC, 1, 7, 40))
        dec.start_room(7, dst, engine)
        deadline = time.monotonic() + 10
        while 7 not in pre.session.rooms or not pre._requests:
            assert time.monotonic() < deadline
            pre.step(5)
        pre.chunk_ready(7, src, 0, n, True)
        while not (finished and released):
            assert time.monotonic() < deadline
            pre.step(5)
            dec.step(5)
        for room, status, failure in (finished[0], released[0]):
            assert (room, status) == (7, RoomStatus.FAILED)
            assert failure.kind is FailureKind.VALIDATION
            assert f"produced {n} KV pages" in failure.detail and f"asked for {n + 3}" in failure.detail
    finally:
        pre.close()
        dec.close()
        pb.close()
        db.close()
        ctx.term()


def test_a_page_named_twice_across_chunks_fails_the_room_before_anything_is_written() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pb, db = LocalBackend(agent_name="pre"), LocalBackend(agent_name="dec")
    model = model_fingerprint(SPEC)
    finished: list[tuple[Any, ...]] = []
    pc, dc = worker_caches(pb), worker_caches(db)
    pre = PrefillWorker(Identity(wire.Role.PREFILL, "pre", 1, 0, model), pc, pb, ctx, room_timeout_s=10)
    dec = DecodeWorker(
        Identity(wire.Role.DECODE, "dec", 1, 0, model),
        dc,
        db,
        ctx,
        room_timeout_s=10,
        on_finished=lambda *a: finished.append(a),
    )
    try:
        with serving(pre):
            engine = dec.connect([pre.endpoint], timeout_s=10)
        src = room_slots(40)
        n = len(src.pages)
        pages = np.arange(n, dtype=np.int32)
        pages[-1] = pages[0]  # chunk 0 and the last chunk both name page 0
        dec.start_room(8, RoomSlots(pages, src.slot, src.swa_pages, src.aux), engine)
        fill(pc, src, full_tensors(SPEC, 1, 8, 40))
        half = n // 2
        pre.chunk_ready(8, src, 0, half, False)  # ready before the request: posted on its arrival
        pre.chunk_ready(8, src, half, n, True)
        deadline = time.monotonic() + 10
        while not finished:
            assert time.monotonic() < deadline
            pre.step(5)
            dec.step(5)
        ((room, status, failure),) = finished
        assert (room, status) == (8, RoomStatus.FAILED) and failure.kind is FailureKind.VALIDATION
        assert f"destination index {int(pages[0])} appears twice" in failure.detail
        assert pre.stats.posts == 0  # refused on arrival, nothing of it was written
    finally:
        pre.close()
        dec.close()
        pb.close()
        db.close()
        ctx.term()
