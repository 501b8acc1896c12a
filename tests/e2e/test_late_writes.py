"""Late writes of a stopped prefill rank land nowhere, on every engine.

A prefill rank is stopped (SIGSTOP) in the middle of a room. Decode notices at the peer
timeout (its heartbeats go unanswered), fails the room typed ``peer_gone``, revokes the rank
and, once that settled, gives the slots back: they are wiped to the sentinel and, being the
decode rank's only slots, reused at once by a room from another prefill engine, verified byte
for byte and wiped again. Then the stopped rank resumes and posts the rest of its room
through the metadata it holds. At the end not one byte of the decode rank's memory may differ
from the sentinel (the rank checks every byte when it stops).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from pdwire.demo.cluster import Cluster
from pdwire.demo.content import pages_for
from pdwire.demo.model import Capacity
from tests.e2e.conftest import CAP, SPEC, assert_rooms_ok

ROOM_S = 30.0  # far beyond the peer timeout (5 s): the loss, not the deadline, fails the room
TOKENS = 48  # 12 pages, one chunk of one page every 250 ms: the room lasts about 3 s


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(SPEC, CAP, "local", room_timeout_s=ROOM_S, chunk_pages=1) as c:
        yield c


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "nixl", "mooncake"])
def test_a_stopped_prefill_rank_is_revoked_and_its_late_writes_change_no_reused_byte(
    cluster: Cluster, backend: str
) -> None:
    pages, swa = pages_for(SPEC, TOKENS)
    one_room = Capacity(pages=pages, slots=2, swa_pages=swa, aux_items=1)  # Mamba slot 0 is the dummy
    stopped = cluster.start("prefill", 1, f"lw-stopped-{backend}", backend=backend, chunk_delay_s=0.25)
    spare = cluster.start("prefill", 1, f"lw-spare-{backend}", backend=backend)
    dec = cluster.start("decode", 1, f"lw-dec-{backend}", backend=backend, capacity=one_room)
    assert cluster.connect(dec, stopped) == [""] and cluster.connect(dec, spare) == [""]
    pid = stopped.procs[0].pid
    assert pid is not None
    doomed = cluster.submit(dec, stopped, 1, TOKENS)
    time.sleep(1.0)  # a few chunks posted, the rest still to come
    os.kill(pid, signal.SIGSTOP)
    try:
        (r,) = cluster.wait_rooms([doomed], ROOM_S + 10)
        assert r.statuses == {0: "FAILED"} and r.reasons[0].startswith("peer_gone:"), r.reasons
        cluster.wait_slots_released(dec, 1, 30)  # fenced by the revocation
        assert_rooms_ok(cluster.wait_rooms([cluster.submit(dec, spare, 2, TOKENS)], 60))  # same slots
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(3.0)  # the resumed rank posts the rest of room 1 through its old metadata
    stats, problems = cluster.stop(dec)[0]
    assert problems == [], problems  # not one byte of the reused memory changed
    assert stats["revocations"] == 1 and stats["unrevocable"] == 0 and stats["rooms_ok"] == 1
    cluster.stop(spare)
    cluster.stop(stopped)
