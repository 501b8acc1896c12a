"""Decode-side scatter through real workers (one process, real sockets, the local backend and NIXL).

Prefill TP 2 -> decode TP 1, NHD pages: each prefill rank holds half the heads, so its bytes for
one token land in every other head slice of the decode page (one engine row per token, layer
and K/V when written in place). Scattering, each prefill rank writes whole pages into decode's
receive staging range in decode's destination order, and decode copies them into place. Every
decode byte must be what joining the prefill ranks' heads gives, the engine rows must shrink to
about one per page, the staging ranges must be free again after the room, and a decode rank
whose buffer holds only part of a room, or that speaks 1.3, must still get every byte right.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from pdwire import wire
from pdwire.runtime import engine as pd
from pdwire.runtime.session.events import Completed
from tests.workers import nhd_ranks
from tests.workers.nhd_ranks import Rank

LAYERS, HEADS, HEAD_BYTES, PAGE, POOL = 3, 4, 64, 16, 48
SHAPE = nhd_ranks.Shape(LAYERS, HEADS, HEAD_BYTES, PAGE, POOL)
PAGES = 24
MODEL = pd.ModelFingerprint(model_name="scatter", revision="r", dtype="u8", num_layers=LAYERS)
ROOM_BYTES_PER_PREFILL_RANK = PAGES * 2 * LAYERS * PAGE * (HEADS // 2) * HEAD_BYTES


def rank(backend_name: str, name: str, tp: int, r: int, fill: int | None) -> Rank:
    return nhd_ranks.rank(SHAPE, backend_name, name, tp, r, fill)


Worker = pd.PrefillWorker | pd.DecodeWorker


def pump(workers: list[Worker], until: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + 30
    while not until():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        for w in workers:
            w.step(1)


@dataclass
class Setup:
    prefill: list[Rank]
    decode: Rank
    pres: list[pd.PrefillWorker]
    dec: pd.DecodeWorker
    group: pd.PrefillGroup
    finished: list[tuple[int, pd.Status]]
    slots: list[int]


def start(backend: str, scatter_bytes: int, versions: tuple[tuple[int, int], ...] = ()) -> Setup:
    prs = [rank(backend, f"pre{r}", 2, r, fill=10 + r) for r in range(2)]
    dr = rank(backend, "dec", 1, 0, fill=None)
    pres = [
        pd.PrefillWorker(
            pd.PrefillConfig(engine_id="p", rank=pd.ParallelRank(2, r), model=MODEL),
            p.memory,
            backend=p.backend,
        )
        for r, p in enumerate(prs)
    ]
    finished: list[tuple[int, pd.Status]] = []
    slots: list[int] = []
    dec = pd.DecodeWorker(
        pd.DecodeConfig(
            engine_id="d",
            rank=pd.ParallelRank(1, 0),
            model=MODEL,
            scatter_bytes=scatter_bytes,
            versions=versions,
        ),
        dr.memory,
        backend=dr.backend,
        on_finished=lambda room, st, f: finished.append((room, st)),
        on_slots_released=slots.append,
    )
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for p in pres:
                p.step(1)

    serving = threading.Thread(target=serve)
    serving.start()
    try:
        group = dec.wait_ready(dec.connect([p.endpoint for p in pres]))
    finally:
        stop.set()
        serving.join()
    return Setup(prs, dr, pres, dec, group, finished, slots)


def close(s: Setup) -> None:
    for w in [*s.pres, s.dec]:
        w.close()
    for r in [*s.prefill, s.decode]:
        r.backend.close()


@pytest.fixture(params=["local", "nixl"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


SRC = np.random.default_rng(1).permutation(POOL)[:PAGES].astype(np.int32)
DST = np.random.default_rng(2).permutation(POOL)[:PAGES].astype(np.int32)


def run_room(s: Setup, room: int) -> None:
    s.dec.start_room(room, pd.RequestIndices(DST), s.group)
    workers: list[Worker] = [*s.pres, s.dec]
    pump(workers, lambda: all(p.status(room) is pd.Status.WAITING_FOR_INPUT for p in s.pres), "the requests")
    assert s.dec.scatter_in_use > 0 or not s.dec.stats.versions[0].endswith("=1.4")
    for p in s.pres:
        p.send_chunk(room, SRC[:8], last=False)
        p.send_chunk(room, SRC[8:], last=True)
    pump(workers, lambda: (room, pd.Status.SUCCESS) in s.finished and room in s.slots, "the room")


def assert_joined(s: Setup) -> None:
    """Every decode page of the room holds both prefill ranks' heads; every other page is untouched."""
    untouched = np.setdiff1d(np.arange(POOL), DST)
    for layer in range(2 * LAYERS):
        want = np.concatenate([p.pools[layer][SRC] for p in s.prefill], axis=2)
        assert np.array_equal(s.decode.pools[layer][DST], want), layer
        assert not s.decode.pools[layer][untouched].any()


def test_strided_destinations_are_scattered_by_the_decode_rank(backend: str) -> None:
    s = start(backend, scatter_bytes=4 << 20)
    try:
        run_room(s, 7)
        assert_joined(s)
        for p in s.pres:
            assert p.stats.scattered_parts == 2  # both KV chunks of the room
            assert p.stats.scattered_bytes == ROOM_BYTES_PER_PREFILL_RANK
            # in place: one row per token, layer and K/V; scattered: at most one per page
            assert p.stats.planned_descriptors >= PAGES * PAGE * 2 * LAYERS
            assert p.stats.descriptors <= PAGES * 2 * LAYERS
        assert s.dec.stats.scattered_pages == 2 * PAGES
        assert s.dec.stats.scattered_bytes == 2 * ROOM_BYTES_PER_PREFILL_RANK
        assert s.dec.scatter_in_use == 0  # the ranges came back with the slots
    finally:
        close(s)


def test_a_buffer_smaller_than_the_room_scatters_its_first_pages_and_writes_the_rest(backend: str) -> None:
    # room for 8 pages of one prefill rank's bytes at most: the first chunk (8 pages) of one rank
    # is scattered, everything else goes in place; the bytes are the same
    page_bytes = ROOM_BYTES_PER_PREFILL_RANK // PAGES
    s = start(backend, scatter_bytes=8 * page_bytes + 4096)
    try:
        run_room(s, 3)
        assert_joined(s)
        assert s.dec.stats.scattered_pages == 8
        assert sum(p.stats.scattered_parts for p in s.pres) == 1
        run_room(s, 4)  # the range is reused for the next room
        assert_joined(s)
        assert s.dec.stats.scattered_pages == 16
        assert s.dec.scatter_in_use == 0
    finally:
        close(s)


def test_a_decode_rank_at_protocol_1_3_gets_every_byte_in_place(backend: str) -> None:
    s = start(backend, scatter_bytes=4 << 20, versions=((1, 3),))
    try:
        run_room(s, 5)
        assert_joined(s)
        assert s.dec.stats.versions and all(v.endswith("=1.3") for v in s.dec.stats.versions)
        assert s.dec.stats.scattered_pages == 0
        assert all(p.stats.scattered_parts == 0 for p in s.pres)
    finally:
        close(s)


def test_a_notification_naming_pages_outside_the_reservation_fails_the_room_typed() -> None:
    """A prefill rank (buggy or hostile) naming staged pages its room's range does not hold: the
    decode rank copies nothing, fails that room with a reason naming the range, and serves on."""
    s = start("local", scatter_bytes=4 << 20)
    try:
        s.dec.start_room(11, pd.RequestIndices(DST), s.group)
        workers: list[Worker] = [*s.pres, s.dec]
        pump(
            workers, lambda: all(p.status(11) is pd.Status.WAITING_FOR_INPUT for p in s.pres), "the requests"
        )
        before = [p.copy() for p in s.decode.pools]
        forged = Completed(
            11, 0, wire.NotificationKind.KV, 0, True, 0, scatter_first=PAGES - 2, scatter_pages=4
        )
        s.dec.rooms.on_event(forged)
        pump(workers, lambda: (11, pd.Status.FAILED) in s.finished, "the failed room")
        assert any("pages [22, 26)" in f and "[0, 24)" in f for f in s.dec.stats.failures)
        assert all(np.array_equal(a, b) for a, b in zip(before, s.decode.pools, strict=True))
        pump(workers, lambda: 11 in s.slots, "the fence")
        assert s.dec.scatter_in_use == 0
        run_room(s, 12)  # the rank serves on
        assert_joined(s)
    finally:
        close(s)


def test_a_cached_prefix_shifts_the_staged_pages_with_the_page_list(backend: str) -> None:
    """Decode holds the first 3 pages already (``decode_prefix_len``): its page list and its
    staging range start after them, the prefill ranks skip them, and the page positions the
    notifications name are positions in that shorter list; every byte lands, the prefix pages
    stay as they were."""
    skip = 3
    s = start(backend, scatter_bytes=4 << 20)
    try:
        indices = pd.RequestIndices(DST[skip:], decode_prefix_len=skip * PAGE)
        s.dec.start_room(21, indices, s.group)
        workers: list[Worker] = [*s.pres, s.dec]
        pump(
            workers, lambda: all(p.status(21) is pd.Status.WAITING_FOR_INPUT for p in s.pres), "the requests"
        )
        for p in s.pres:
            p.send_chunk(21, SRC[:8], last=False)
            p.send_chunk(21, SRC[8:], last=True)
        pump(workers, lambda: (21, pd.Status.SUCCESS) in s.finished and 21 in s.slots, "the room")
        for layer in range(2 * LAYERS):
            want = np.concatenate([p.pools[layer][SRC[skip:]] for p in s.prefill], axis=2)
            assert np.array_equal(s.decode.pools[layer][DST[skip:]], want), layer
            assert not s.decode.pools[layer][DST[:skip]].any()  # the cached prefix: not written
        assert s.dec.stats.scattered_pages == 2 * (PAGES - skip)
        assert s.dec.scatter_in_use == 0
    finally:
        close(s)
