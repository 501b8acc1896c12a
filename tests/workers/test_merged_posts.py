"""Parts ready together go as one engine write with one notification (protocol 1.4), through
real workers and sockets on the local backend and NIXL; a decode rank speaking 1.4 gets one
write per part. Either way every decode byte is what slicing the prefill pages gives.

Prefill TP 1 -> decode TP 2: three KV chunks are produced before the decode ranks ask, so once
they do, each one's three chunks (and, staged or not, nothing else) are ready at once.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pdwire.runtime import engine as pd
from pdwire.runtime.backends.nixl import NixlBackend
from tests.workers.test_staging_worker import LAYERS, MODEL, POOL, pump, rank

PAGES = 24
SRC = np.random.default_rng(5).permutation(POOL)[:PAGES].astype(np.int32)
DST = np.random.default_rng(6).permutation(POOL)[:PAGES].astype(np.int32)


@pytest.mark.parametrize("backend", ["local", "nixl"])
@pytest.mark.parametrize(("versions", "staging"), [((), 0), (((1, 3),), 0), ((), 256 << 10)])
def test_parts_ready_together_share_one_write_unless_the_peer_speaks_1_3(
    backend: str, versions: tuple[tuple[int, int], ...], staging: int
) -> None:
    pr = rank(backend, "pre", 1, 0, fill=9)
    drs = [rank(backend, f"dec{r}", 2, r, fill=None) for r in range(2)]
    finished: list[tuple[int, pd.Status]] = []
    pre = pd.PrefillWorker(
        pd.PrefillConfig(engine_id="p", rank=pd.ParallelRank(1, 0), model=MODEL, staging_bytes=staging),
        pr.memory,
        backend=pr.backend,
    )
    decs = [
        pd.DecodeWorker(
            pd.DecodeConfig(engine_id="d", rank=pd.ParallelRank(2, r), model=MODEL, versions=versions),
            d.memory,
            backend=d.backend,
            on_finished=lambda room, st, f: finished.append((room, st)),
        )
        for r, d in enumerate(drs)
    ]
    try:
        stop = threading.Event()
        serving = threading.Thread(target=lambda: [pre.step(2) for _ in iter(stop.is_set, True)])
        serving.start()
        try:
            groups = [d.wait_ready(d.connect([pre.endpoint])) for d in decs]
        finally:
            stop.set()
            serving.join()
        for i, (lo, hi) in enumerate(((0, 8), (8, 16), (16, PAGES))):
            pre.send_chunk(3, SRC[lo:hi], last=i == 2)
        assert pre.stats.posts == 0  # nobody asked yet: the chunks wait
        for d, g in zip(decs, groups, strict=True):
            d.start_room(3, pd.RequestIndices(DST), g)
        pump([pre, *decs], lambda: len(finished) == 2, "the room")
        assert finished == [(3, pd.Status.SUCCESS)] * 2
        for r, d in enumerate(drs):
            for layer in range(2 * LAYERS):
                assert np.array_equal(d.pools[layer][DST], pr.pools[layer][SRC][:, :, 2 * r : 2 * r + 2])
        s = pre.stats
        if staging:  # staged chunks are cut to a quarter of the buffer (6 per decode rank), and
            # written one by one: joined they would not fit the buffer, and each is few rows already
            assert s.staged_parts == s.posts == 12 and s.merged_parts == 0
            return
        assert s.posts + s.merged_parts == 6  # three chunks for each decode rank
        if versions:  # 1.3: one notification names one part
            assert (s.posts, s.merged_parts) == (6, 0)
            assert sum(d.stats.engine_notifications for d in decs) == 6
            if isinstance(
                pre.backend, NixlBackend
            ):  # each decode rank's layout repeats: its 2nd and 3rd writes go prepped
                assert pre.backend.prepped_posts == 4
        else:
            assert (s.posts, s.merged_parts) == (2, 4)  # one write per decode rank
            assert sum(d.stats.engine_notifications for d in decs) == 2
    finally:
        for w in [pre, *decs]:
            w.close()
        for x in [pr, *drs]:
            x.backend.close()
