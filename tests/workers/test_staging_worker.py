"""Staged parts through real workers (one process, real sockets, the local backend and NIXL).

Prefill TP 1 -> decode TP 2, NHD pages: per token, layer and K/V a head slice of 128 bytes, the
case staging is for. The staging buffer is made small (256 KiB) so that KV chunks are cut to four
pages and parts wait for space: every decode byte must still be what slicing the prefill pages
gives, staged parts show in the stats, and the staging buffer is empty again once the room is
over. A room aborted while staged parts wait or are in flight drains: nothing waiting is posted,
the buffer comes back only after the engine confirmed every staged write stopped, and decode's
slots come back once prefill fenced.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from pdwire.runtime import engine as pd
from pdwire.runtime.staging.torch_copy import TorchCopier
from tests.workers import nhd_ranks
from tests.workers.nhd_ranks import Rank

LAYERS, HEADS, HEAD_BYTES, PAGE, POOL = 4, 4, 64, 16, 64
SHAPE = nhd_ranks.Shape(LAYERS, HEADS, HEAD_BYTES, PAGE, POOL)
PAGES = 24
STAGING = 256 << 10  # 64 KiB parts (4 pages for one decode rank), four at a time
MODEL = pd.ModelFingerprint(model_name="staging", revision="r", dtype="u8", num_layers=LAYERS)


def rank(backend_name: str, name: str, tp: int, r: int, fill: int | None) -> Rank:
    return nhd_ranks.rank(SHAPE, backend_name, name, tp, r, fill)


def pump(workers: list[pd.PrefillWorker | pd.DecodeWorker], until: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + 30
    while not until():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        for w in workers:
            w.step(1)


@pytest.fixture(params=["local", "nixl", "local+torch"])
def setup(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    name, _, copy_with = request.param.partition("+")
    pr = rank(name, "pre", 1, 0, fill=3)
    drs = [rank(name, f"dec{r}", 2, r, fill=None) for r in range(2)]
    released: list[tuple[int, pd.Status]] = []
    finished: list[tuple[int, pd.Status]] = []
    slots: list[int] = []
    copier = None
    if copy_with == "torch":  # the cache as torch tensors, staged by index ops on their device
        import torch

        copier = TorchCopier([torch.from_numpy(pool) for pool in pr.pools])
    pre = pd.PrefillWorker(
        pd.PrefillConfig(engine_id="p", rank=pd.ParallelRank(1, 0), model=MODEL, staging_bytes=STAGING),
        pr.memory, backend=pr.backend, on_released=lambda room, st, f: released.append((room, st)),
        copier=copier,
    )  # fmt: skip
    decs = [
        pd.DecodeWorker(
            pd.DecodeConfig(engine_id="d", rank=pd.ParallelRank(2, r), model=MODEL),
            d.memory,
            backend=d.backend,
            on_finished=lambda room, st, f: finished.append((room, st)),
            on_slots_released=slots.append,
        )
        for r, d in enumerate(drs)
    ]
    import threading

    stop = threading.Event()
    serving = threading.Thread(target=lambda: [pre.step(2) for _ in iter(stop.is_set, True)])
    serving.start()
    try:
        groups = [d.wait_ready(d.connect([pre.endpoint])) for d in decs]
    finally:
        stop.set()
        serving.join()
    yield pr, drs, pre, decs, groups, released, finished, slots
    for w in [pre, *decs]:
        w.close()
    for r in [pr, *drs]:
        r.backend.close()


SRC = np.random.default_rng(1).permutation(POOL)[:PAGES].astype(np.int32)
DST = np.random.default_rng(2).permutation(POOL)[:PAGES].astype(np.int32)


def test_staged_parts_land_byte_for_byte_through_a_small_staging_buffer(setup) -> None:  # type: ignore[no-untyped-def]
    pr, drs, pre, decs, groups, released, finished, _slots = setup
    for d, g in zip(decs, groups, strict=True):
        d.start_room(7, pd.RequestIndices(DST), g)
    pump([pre, *decs], lambda: pre.status(7) is pd.Status.WAITING_FOR_INPUT, "both requests")
    # whole destination pages (gathered by prefill): decode reserves none of its receive staging
    assert all(d.scatter_in_use == 0 for d in decs)
    pre.send_chunk(7, SRC[:16], last=False)
    pre.send_chunk(7, SRC[16:], last=True)
    pump([pre, *decs], lambda: len(finished) == 2 and len(released) == 1, "the room")
    assert {st for _, st in finished} == {pd.Status.SUCCESS} and released == [(7, pd.Status.SUCCESS)]
    for r, d in enumerate(drs):
        for layer in range(2 * LAYERS):
            want = pr.pools[layer][SRC][:, :, 2 * r : 2 * r + 2]
            assert np.array_equal(d.pools[layer][DST], want), (r, layer)
            untouched = np.setdiff1d(np.arange(POOL), DST)
            assert not d.pools[layer][untouched].any()
    s = pre.stats
    assert s.staged_parts == PAGES // 4 * 2  # KV chunks of four pages, two decode ranks
    assert s.staging_waits > 0  # the buffer holds four parts at a time
    assert s.descriptors < s.planned_descriptors // 8
    assert s.bytes_posted == 2 * PAGES * 2 * LAYERS * PAGE * 2 * HEAD_BYTES
    assert pre.staging_in_use == 0 and pre.staged_parts_waiting == 0
    staging = [r for r in pr.backend.regions if r.name == "pdwire-staging"]
    assert len(staging) == 1
    if isinstance(pre._stager._copier, TorchCopier):  # the buffer is the copier's, on its device
        assert staging[0].base == pre._stager._copier._buffers[0].data_ptr()


def test_an_aborted_room_drains_its_staged_parts_before_anything_is_reused(setup) -> None:  # type: ignore[no-untyped-def]
    _pr, _drs, pre, decs, groups, released, finished, slots = setup
    for d, g in zip(decs, groups, strict=True):
        d.start_room(9, pd.RequestIndices(DST), g)
    pump([pre, *decs], lambda: pre.status(9) is pd.Status.WAITING_FOR_INPUT, "both requests")
    pre.send_chunk(9, SRC, last=True)
    assert pre.staged_parts_waiting > 0 and pre.staging_in_use > 0
    pre.abort(9)
    assert pre.staged_parts_waiting == 0  # waiting parts are never posted
    pump([pre, *decs], lambda: len(released) == 1 and len(slots) == 2, "the drain and the fence")
    assert released == [(9, pd.Status.FAILED)]
    assert {st for _, st in finished} == {pd.Status.FAILED}
    assert pre.staging_in_use == 0 and pre.transfers_in_flight == 0
