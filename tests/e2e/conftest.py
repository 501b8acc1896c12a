"""Shared process clusters: starting rank processes is the expensive part, so groups are started
once per module and reused by every case that needs the same (engine, TP, model). Also the
in-process worker pair (one-rank caches, a prefill worker stepped on a thread while decode
connects, and what each side reported)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
import zmq

from pdwire.demo.cluster import Cluster, Group, RoomResult
from pdwire.demo.content import RoomSlots, pages_for
from pdwire.demo.model import Capacity, ModelSpec, RankCaches, build_caches, bytes_needed
from pdwire.demo.rank import model_fingerprint
from pdwire.runtime.backends import Backend, available_backends
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.engine import (
    DecodeConfig,
    DecodeWorker,
    Failure,
    ParallelRank,
    PrefillConfig,
    PrefillGroup,
    PrefillWorker,
    Status,
)

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# Small on purpose: every byte is generated, moved and verified on a 2-core machine.
SPEC = ModelSpec(
    layers=2, kv_heads=4, head_dim=16, page_size=4, conv_blocks=(8, 8, 16), ssm_heads=4, swa_window_pages=3
)
CAP = Capacity(pages=256, slots=24, swa_pages=64, aux_items=24)
WORKER_CAP = Capacity(pages=16, slots=3, swa_pages=8, aux_items=2)  # in-process workers: a room or two
ROOM_TIMEOUT_S = 10.0  # in-process workers: far beyond any room here on a loaded 2-core machine


@dataclass
class Pool:
    """Groups of one cluster, started on first use and connected on first use."""

    cluster: Cluster
    groups: dict[tuple[str, int, bool], Group] = field(default_factory=dict)
    connected: set[tuple[str, str]] = field(default_factory=set)
    next_room: int = 1

    def group(self, role: str, tp: int, mla: bool) -> Group:
        key = (role, tp, mla)
        if key not in self.groups:
            engine = f"{role}-tp{tp}-{'mla' if mla else 'gqa'}"
            self.groups[key] = self.cluster.start(role, tp, engine, spec=replace(SPEC, mla=mla))
        return self.groups[key]

    def pair(self, p: int, d: int, mla: bool) -> tuple[Group, Group]:
        pre, dec = self.group("prefill", p, mla), self.group("decode", d, mla)
        if (dec.engine_id, pre.engine_id) not in self.connected:
            assert self.cluster.connect(dec, pre) == [""] * d
            self.connected.add((dec.engine_id, pre.engine_id))
        return pre, dec

    def rooms(self, dec: Group, pre: Group, lengths: list[int]) -> list[RoomResult]:
        out = []
        for n in lengths:
            out.append(self.cluster.submit(dec, pre, self.next_room, n))
            self.next_room += 1
        return self.cluster.wait_rooms(out, 120)


def assert_rooms_ok(results: list[RoomResult], ranks: int | None = None) -> None:
    """Every room succeeded (on every decode rank ``0..ranks-1``, when given)."""
    for r in results:
        assert r.ok, f"room {r.room}: {r.statuses} {r.reason} {r.problems[:3]}"
        if ranks is not None:
            assert set(r.statuses) == set(range(ranks))


def assert_pair_byte_exact(pool: Pool, p: int, d: int, mla: bool) -> None:
    """Prefill TP ``p`` to decode TP ``d`` moves requests every decode rank verifies byte for byte."""
    pre, dec = pool.pair(p, d, mla)
    assert_rooms_ok(pool.rooms(dec, pre, [3, 17, 40]), d)  # a partial page, several chunks, a long one


@contextmanager
def running_pool(backend: str) -> Iterator[Pool]:
    """A pool over one backend's cluster, checked for a clean shutdown at the end."""
    with Cluster(SPEC, CAP, backend, room_timeout_s=30.0) as cluster:
        p = Pool(cluster)
        yield p
        assert_clean_shutdown(p)  # no stray byte on any decode rank, no failure logged anywhere


def worker_caches(backend: Backend, tp: int = 1, rank: int = 0) -> RankCaches:
    """Rank ``rank`` of ``tp``'s caches of SPEC in memory from ``backend``, for in-process workers
    (the worker registers it)."""
    buf = backend.allocate("caches", bytes_needed(SPEC, tp, rank, WORKER_CAP))
    return build_caches(SPEC, tp, rank, WORKER_CAP, buf.array)


def prefill_config(engine: str = "pre", tp: int = 1, rank: int = 0, **kw: Any) -> PrefillConfig:
    """Rank ``rank`` of ``tp`` of prefill engine ``engine`` serving SPEC."""
    kw.setdefault("room_timeout_s", ROOM_TIMEOUT_S)
    return PrefillConfig(engine_id=engine, rank=ParallelRank(tp, rank), model=model_fingerprint(SPEC), **kw)


def decode_config(engine: str = "dec", tp: int = 1, rank: int = 0, **kw: Any) -> DecodeConfig:
    """Rank ``rank`` of ``tp`` of decode engine ``engine`` serving SPEC."""
    kw.setdefault("room_timeout_s", ROOM_TIMEOUT_S)
    return DecodeConfig(engine_id=engine, rank=ParallelRank(tp, rank), model=model_fingerprint(SPEC), **kw)


def send(pre: PrefillWorker, room: int, src: RoomSlots, start: int = 0, stop: int | None = None) -> None:
    """Chunked prefill produced pages ``[start, stop)`` of ``src`` (to the end: the last chunk)."""
    stop = len(src.pages) if stop is None else stop
    if stop < len(src.pages):
        pre.send_chunk(room, src.pages[start:stop], last=False)
    else:
        state = src.state_indices(SPEC)
        pre.send_chunk(room, src.pages[start:stop], last=True, state=state, aux_index=src.aux)


def room_slots(tokens: int) -> RoomSlots:
    """Slots for one room of ``tokens`` tokens: pages and SWA pages from 0, Mamba slot 1, aux 0."""
    pages, swa = pages_for(SPEC, tokens)
    return RoomSlots(np.arange(pages, dtype=np.int32), 1, np.arange(swa, dtype=np.int32), 0)


@contextmanager
def serving(pre: PrefillWorker) -> Iterator[None]:
    """Step ``pre`` on a thread until the block ends (it answers the handshake while connect() blocks)."""
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            pre.step(5)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


Outcome = tuple[int, Status, Failure | None]  # (room, status, failure): how a worker reports a room's end


@dataclass
class WorkerPair:
    """A prefill and a decode worker of one rank each, in this process over real sockets, and
    everything the two told their engines (each worker keeps its own stats)."""

    pre: PrefillWorker
    dec: DecodeWorker
    pb: Backend
    db: Backend
    pc: RankCaches
    dc: RankCaches
    group: PrefillGroup | None  # what connect() returned; None when the pair was built unconnected
    finished: list[Outcome]  # decode's on_finished, in order
    released: list[Outcome]  # prefill's on_release, in order
    slots_released: list[int]  # decode's on_slots_released, in order
    events: list[str]  # the three above as text, interleaved in the order they happened

    def ask(self, room: int, slots: RoomSlots, **kw: Any) -> None:
        """Decode asks the connected prefill rank for ``room`` into ``slots``."""
        assert self.group is not None, "the pair was built unconnected"
        self.dec.start_room(room, slots.request(SPEC), self.group, **kw)

    def step_until(self, done: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
        """Step both workers until ``done()``; at the timeout fail naming ``what`` and the events so far."""
        end = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < end, f"timed out waiting for {what}; events: {self.events}"
            self.pre.step(2)
            self.dec.step(2)


@contextmanager
def worker_pair(
    pb: Backend | None = None,
    db: Backend | None = None,
    *,
    adjust_decode_caches: Callable[[RankCaches], None] | None = None,
    decode_versions: tuple[tuple[int, int], ...] = (),
    prefill_kw: Mapping[str, Any] | None = None,
    decode_kw: Mapping[str, Any] | None = None,
    connect: bool = True,
) -> Iterator[WorkerPair]:
    """Engine "pre" rank 0 of 1 on ``pb`` and engine "dec" rank 0 of 1 on ``db`` (local backends
    unless given), connected unless ``connect`` is false (the test connects, maybe expecting a refusal).

    ``adjust_decode_caches`` changes decode's caches after they are registered and before the
    workers exist (a decode build that describes its memory differently); ``decode_versions``
    are the protocol versions decode offers (empty: all). ``prefill_kw`` and ``decode_kw`` go to
    the workers' configs (``room_timeout_s`` defaults to ROOM_TIMEOUT_S). The pair owns both backends and
    closes them after the workers; a fake backend that holds its engine's thread lets it go in
    its own ``close``, so that a failed set-up is torn down as fast as a finished test.
    """
    ctx: zmq.Context[Any] = zmq.Context()
    pb = pb if pb is not None else LocalBackend(agent_name="pre")
    db = db if db is not None else LocalBackend(agent_name="dec")
    finished: list[Outcome] = []
    released: list[Outcome] = []
    slots_released: list[int] = []
    events: list[str] = []

    def on_finished(room: int, status: Status, failure: Failure | None) -> None:
        finished.append((room, status, failure))
        events.append(f"decode finished {room} {status.name}")

    def on_release(room: int, status: Status, failure: Failure | None) -> None:
        released.append((room, status, failure))
        events.append(f"prefill released {room} {status.name}")

    def on_slots_released(room: int) -> None:
        slots_released.append(room)
        events.append(f"decode slots {room}")

    pre: PrefillWorker | None = None
    dec: DecodeWorker | None = None
    try:
        pc, dc = worker_caches(pb), worker_caches(db)
        if adjust_decode_caches is not None:
            adjust_decode_caches(dc)
        pre = PrefillWorker(
            prefill_config(**(prefill_kw or {})), pc.memory, backend=pb, context=ctx, on_released=on_release
        )
        dec = DecodeWorker(
            decode_config(versions=decode_versions, **(decode_kw or {})),
            dc.memory,
            backend=db,
            context=ctx,
            on_finished=on_finished,
            on_slots_released=on_slots_released,
        )
        group = None
        if connect:
            with serving(pre):  # the prefill rank answers the handshake while connect() blocks
                group = dec.wait_ready(dec.connect([pre.endpoint], timeout_s=10))
        yield WorkerPair(pre, dec, pb, db, pc, dc, group, finished, released, slots_released, events)
    finally:
        # Workers before backends (prefill releases its handles into its backend), backends
        # before the context, whose term() waits for every socket to close.
        if pre is not None:
            pre.close()
        if dec is not None:
            dec.close()
        pb.close()
        db.close()
        ctx.term()


def assert_clean_shutdown(pool: Pool) -> None:
    """Every decode rank's memory outside verified rooms is untouched; no rank logged a failure."""
    for g in list(pool.groups.values()):
        finals = pool.cluster.stop(g)
        for rank, (stats, problems) in finals.items():
            assert problems == [], f"{g.engine_id} rank {rank}: {problems}"
            assert stats["failures"] == [], f"{g.engine_id} rank {rank}: {stats['failures']}"


@pytest.fixture(scope="module", params=["nixl", "local"])
def pool(request: pytest.FixtureRequest) -> Iterator[Pool]:
    if request.param not in available_backends():
        pytest.fail(f"backend {request.param} does not import here: CI must install it (./dev setup)")
    with running_pool(request.param) as p:
        yield p
