"""Destination page lists the prefill side cannot honour fail the room, never a silent Success.

The prefill worker slices the destination page list chunk by chunk. Without a check at the last
chunk, the tail of a longer list would stay unwritten while both sides report Success; without
a check of the whole list on arrival, a page named twice across a chunk boundary would be
written twice, the later chunk silently winning.
"""

from __future__ import annotations

import time

import numpy as np

from pdwire.demo.content import RoomSlots, fill, full_tensors
from pdwire.runtime.engine import FailureKind, Status
from tests.e2e.conftest import SPEC, room_slots, send, worker_pair


def test_a_longer_destination_page_list_fails_the_room_on_both_sides() -> None:
    with worker_pair() as p:
        src = room_slots(40)  # prefill produces 10 pages
        n = len(src.pages)
        dst = RoomSlots(np.arange(n + 3, dtype=np.int32), src.slot, src.swa_pages, src.aux)
        fill(p.pc, src, full_tensors(SPEC, 1, 7, 40))
        p.ask(7, dst)
        deadline = time.monotonic() + 10
        while p.pre.status(7) is not Status.WAITING_FOR_INPUT:
            assert time.monotonic() < deadline
            p.pre.step(5)
        send(p.pre, 7, src)
        while not (p.finished and p.released):
            assert time.monotonic() < deadline
            p.pre.step(5)
            p.dec.step(5)
        for room, status, failure in (p.finished[0], p.released[0]):
            assert (room, status) == (7, Status.FAILED)
            assert failure is not None and failure.kind is FailureKind.VALIDATION
            assert f"produced {n} KV pages" in failure.detail and f"asked for {n + 3}" in failure.detail


def test_a_page_named_twice_across_chunks_fails_the_room_before_anything_is_written() -> None:
    with worker_pair() as p:
        src = room_slots(40)
        n = len(src.pages)
        pages = np.arange(n, dtype=np.int32)
        pages[-1] = pages[0]  # chunk 0 and the last chunk both name page 0
        p.ask(8, RoomSlots(pages, src.slot, src.swa_pages, src.aux))
        fill(p.pc, src, full_tensors(SPEC, 1, 8, 40))
        half = n // 2
        send(p.pre, 8, src, 0, half)  # ready before the request: posted on its arrival
        send(p.pre, 8, src, half)
        deadline = time.monotonic() + 10
        while not p.finished:
            assert time.monotonic() < deadline
            p.pre.step(5)
            p.dec.step(5)
        ((room, status, failure),) = p.finished
        assert (room, status) == (8, Status.FAILED)
        assert failure is not None and failure.kind is FailureKind.VALIDATION
        assert f"destination index {int(pages[0])} appears twice" in failure.detail
        assert p.pre.stats.posts == 0  # refused on arrival, nothing of it was written
