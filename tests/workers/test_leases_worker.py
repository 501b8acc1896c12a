"""Leases between real workers over real sockets (the local backend): a decode rank that queues a
request keeps the prefill's room alive past the prefill's room timeout and then receives it byte
for byte; a room nobody renews is freed once its lease runs out (decode gone, or a 1.4 decode
that renews nothing); a room declined while its group still connects is freed at once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from pdwire.runtime import engine as pd
from tests.e2e.test_engine_api import LAYERS, MODEL, pump, rank_memory

Worker = pd.PrefillWorker | pd.DecodeWorker
LEASE_S = 1.0  # the prefill's room timeout, i.e. its lease


class Pair:
    def __init__(self, decode_versions: tuple[tuple[int, int], ...] = ()) -> None:
        self.pm = rank_memory("pre", 1, 0, list(range(LAYERS)))
        self.dm = rank_memory("dec", 1, 0, list(range(LAYERS)))
        self.released: dict[int, tuple[pd.Status, pd.Failure | None, float]] = {}
        self.finished: dict[int, pd.Status] = {}
        cfg = pd.PrefillConfig(engine_id="pre", rank=pd.ParallelRank(), model=MODEL, room_timeout_s=LEASE_S)
        self.pre = pd.PrefillWorker(cfg, self.pm.memory, backend=self.pm.backend, on_released=self._released)
        dcfg = pd.DecodeConfig(engine_id="dec", rank=pd.ParallelRank(), model=MODEL, versions=decode_versions)
        self.dec = pd.DecodeWorker(dcfg, self.dm.memory, backend=self.dm.backend, on_finished=self._finished)

    def _released(self, room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        self.released[room] = (status, failure, time.monotonic())

    def _finished(self, room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        self.finished[room] = status

    def run_for(self, seconds: float, workers: list[Worker] | None = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for w in workers or [self.pre, self.dec]:
                w.step(2)

    def pump(self, until: Callable[[], bool], what: str) -> None:
        pump([self.pre, self.dec], until, what)

    def connect(self) -> pd.PrefillGroup:
        group = self.dec.connect([self.pre.endpoint])
        self.pump(lambda: group.ready, "the handshake")
        return group

    def produce(self, room: int, pages: list[int], slot: int) -> None:
        for layer in range(LAYERS):
            self.pm.k[layer][pages] = np.uint8((room * 7 + layer) % 251)
            self.pm.conv[layer][slot] = np.uint8((room + layer) % 251)
        self.pre.send_chunk(room, pages, last=True, state=[[slot]], aux_index=0)

    def close(self) -> None:
        self.dec.close()
        self.pre.close()
        for m in (self.pm, self.dm):
            m.backend.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def timed_out(p: Pair, room: int) -> bool:
    got = p.released.get(room)
    return got is not None and got[1] is not None and got[1].kind is pd.FailureKind.TIMEOUT


def test_a_held_room_outlives_the_prefill_room_timeout_and_then_arrives_byte_for_byte(pair: Pair) -> None:
    group = pair.dec.connect([pair.pre.endpoint])
    pair.produce(5, [0, 1], 0)
    pair.produce(6, [2, 3], 1)  # the control: produced alike, never held
    pair.dec.hold(5, group)  # held while the group still connects: renewed once it is ready
    pair.run_for(3 * LEASE_S)
    assert timed_out(pair, 6), pair.released  # nobody renewed it: freed at its timeout
    assert 5 not in pair.released and pair.pre.status(5) is pd.Status.BOOTSTRAPPING
    # a third of the lease per renewal, one Lease per renewal: not one per step
    assert 3 <= pair.dec.stats.leases_sent <= 3 * 3 + 2, pair.dec.stats.leases_sent
    assert pair.pre.stats.leases == pair.dec.stats.leases_sent
    assert pair.pre.stats.rooms_renewed == pair.pre.stats.leases
    pair.dec.start_room(5, pd.RequestIndices([4, 5], state=[[2]], aux_index=1), group)
    sent = pair.dec.stats.leases_sent
    pair.pump(lambda: 5 in pair.finished and 5 in pair.released, "room 5 on both sides")
    assert pair.finished[5] is pd.Status.SUCCESS and pair.released[5][0] is pd.Status.SUCCESS
    for layer in range(LAYERS):
        assert np.array_equal(pair.dm.k[layer][[4, 5]], pair.pm.k[layer][[0, 1]])
        assert np.array_equal(pair.dm.conv[layer][2], pair.pm.conv[layer][0])
    pair.run_for(LEASE_S)
    assert pair.dec.stats.leases_sent == sent  # asked for: no longer renewed


def test_a_room_whose_decode_went_away_is_freed_once_its_lease_runs_out(pair: Pair) -> None:
    group = pair.connect()
    pair.produce(7, [0, 1], 0)
    pair.dec.hold(7, group)
    pair.run_for(2 * LEASE_S)
    assert 7 not in pair.released
    pair.dec.close()  # the decode engine is gone: nobody renews the room
    gone = time.monotonic()
    pair.run_for(2 * LEASE_S, [pair.pre])
    assert timed_out(pair, 7)
    assert pair.released[7][2] - gone <= LEASE_S + 0.2  # within a lease of its last renewal


def test_a_room_declined_while_its_group_connects_is_freed_at_once(pair: Pair) -> None:
    pair.produce(8, [0, 1], 0)
    group = pair.dec.connect([pair.pre.endpoint])
    pair.dec.hold(8, group)
    pair.dec.decline(8, group, "the request was aborted in the decode queue")  # not ready yet
    t0 = time.monotonic()
    pair.pump(lambda: 8 in pair.released, "room 8's release")
    status, failure, at = pair.released[8]
    assert status is pd.Status.FAILED and failure is not None and failure.kind is pd.FailureKind.ABORTED
    assert at - t0 < 0.5 * LEASE_S and pair.dec.stats.declines_sent == 1
    pair.run_for(LEASE_S)
    assert pair.dec.stats.leases_sent == 0  # declined before its group was ready: never renewed


def test_a_1_4_decode_renews_nothing_and_its_rooms_keep_the_fixed_timeout() -> None:
    p = Pair(decode_versions=((1, 4),))
    try:
        group = p.connect()
        assert p.dec.stats.versions == ["pre/0=1.4"]
        p.produce(9, [0, 1], 0)
        p.dec.hold(9, group)
        p.run_for(2 * LEASE_S)
        assert timed_out(p, 9) and p.dec.stats.leases_sent == 0 and p.pre.stats.leases == 0
        p.produce(10, [2, 3], 1)  # inside its timeout a 1.4 pair works as before
        p.dec.start_room(10, pd.RequestIndices([4, 5], state=[[2]], aux_index=1), group)
        p.pump(lambda: 10 in p.finished, "room 10")
        assert p.finished[10] is pd.Status.SUCCESS
    finally:
        p.close()


def test_a_room_whose_start_is_refused_is_renewed_no_more(pair: Pair) -> None:
    group = pair.connect()
    pair.produce(11, [0, 1], 0)
    pair.dec.hold(11, group)
    pair.run_for(0.2)
    assert pair.dec.stats.leases_sent == 1  # renewed at once
    with pytest.raises(pd.IndicesError):  # refused before anything is sent
        pair.dec.start_room(11, pd.RequestIndices([4, 5], state=[[2], [3]]), group)
    pair.run_for(LEASE_S)
    assert pair.dec.stats.leases_sent == 1 and timed_out(pair, 11)  # the engine must decline it


def test_a_tp_2_prefill_is_renewed_on_both_ranks_and_its_room_then_arrives() -> None:
    prefills, mems = [], []
    for r in range(2):
        m = rank_memory(f"pre-tp-{r}", 2, r, list(range(LAYERS)))
        for layer in range(LAYERS):
            m.k[layer][[0, 1]] = np.uint8(10 * r + layer + 1)
        cfg = pd.PrefillConfig(
            engine_id="pre", rank=pd.ParallelRank(2, r), model=MODEL, room_timeout_s=LEASE_S
        )
        prefills.append(pd.PrefillWorker(cfg, m.memory, backend=m.backend))
        mems.append(m)
    dm = rank_memory("dec-tp", 1, 0, list(range(LAYERS)))
    finished: list[tuple[int, pd.Status, pd.Failure | None]] = []
    dcfg = pd.DecodeConfig(engine_id="dec", rank=pd.ParallelRank(), model=MODEL)
    dec = pd.DecodeWorker(dcfg, dm.memory, backend=dm.backend, on_finished=lambda *a: finished.append(a))
    workers: list[Worker] = [*prefills, dec]
    try:
        group = dec.connect([w.endpoint for w in prefills])
        pump(workers, lambda: group.ready, "the handshake")
        for w in prefills:
            w.send_chunk(12, [0, 1], last=True, state=[[0]], aux_index=0)
        dec.hold(12, group)
        end = time.monotonic() + 3 * LEASE_S
        while time.monotonic() < end:
            for w in workers:
                w.step(2)
        # one Lease per prefill rank and interval; neither rank let the room go
        assert all(w.stats.rooms_renewed >= 3 for w in prefills), [w.stats.leases for w in prefills]
        assert dec.stats.leases_sent == sum(w.stats.leases for w in prefills)
        assert all(w.status(12) is pd.Status.BOOTSTRAPPING for w in prefills)
        dec.start_room(12, pd.RequestIndices([4, 5], state=[[1]], aux_index=1), group)
        pump(workers, lambda: bool(finished), "room 12")
        assert finished == [(12, pd.Status.SUCCESS, None)]
        for layer in range(LAYERS):  # each decode head from its prefill rank
            got = dm.k[layer][[4, 5]]
            assert (got[:, :, 0] == layer + 1).all() and (got[:, :, 1] == 10 + layer + 1).all()
    finally:
        dec.close()
        for w in prefills:
            w.close()
        for m in (*mems, dm):
            m.backend.close()
