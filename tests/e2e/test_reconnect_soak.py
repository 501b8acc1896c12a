"""Reconnect cycles between real rank processes leave nothing behind: RSS, open fds, threads and
mappings of both the decode and the prefill rank stay flat after a warm-up.

Two kinds of cycle, each followed by a room verified byte for byte:

* connect again: the decode rank connects to the same prefill rank once more; the new link
  replaces the old one (``DecodeLinks._close_replaced``), whose windows go;
* prefill restart: the prefill rank is killed (SIGKILL) and a new process is started on the same
  port; the decode rank loses the link, reconnects in the background and registers anew.

Every cycle samples ``/proc/<pid>`` of both ranks (``VmRSS``, ``fd/``, ``task/``, ``maps``). The
assertion is on the slope: over the last ``SLOPE_CYCLES`` cycles each figure grows less than a
fixed slack far below one window's size (a window maps the caches plus the 64 MiB receive staging
buffer; before windows were given back, RSS grew by one such window per cycle).

Cycles per case: ``PDWIRE_RECONNECT_CYCLES`` (default 40 for connect-again, a third of it for
restarts, which start a process each; ``PDWIRE_RECONNECT_CYCLES=1000`` for the long soak).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pdwire.demo.cluster import Cluster, Group, RoomResult
from pdwire.runtime.backends import available_backends
from tests.e2e.conftest import CAP, SPEC

CYCLES = int(os.environ.get("PDWIRE_RECONNECT_CYCLES", "40"))
RESTARTS = max(12, CYCLES // 3)
WARMUP = 4  # allocator arenas, UCX and zmq pools reach their size in the first cycles
SLOPE_CYCLES = 8
# Growth allowed over the last SLOPE_CYCLES cycles: one window is 64 MiB of staging + the caches
SLACK = {"rss_kib": 8 << 10, "fds": 2, "threads": 1, "maps": 4}


@dataclass(frozen=True)
class Sample:
    rss_kib: int
    fds: int
    threads: int
    maps: int


def sample(pid: int) -> Sample:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        maps = sum(1 for _ in f)
    return Sample(rss, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task")), maps)


def slope_problems(name: str, samples: list[Sample]) -> list[str]:
    """Figures of ``samples`` (one per cycle) that grew by more than their slack over the last
    SLOPE_CYCLES cycles (the warm-up cycles are not looked at)."""
    assert len(samples) > WARMUP + SLOPE_CYCLES, len(samples)
    out = []
    for field, slack in SLACK.items():
        series = [getattr(s, field) for s in samples]
        # the least of three samples at each end: a socket zmq's reaper closes a moment after a
        # cycle, a thread that is just exiting, are no growth
        grew = min(series[-3:]) - min(series[-SLOPE_CYCLES - 3 : -SLOPE_CYCLES])
        if grew > slack:
            out.append(f"{name} {field} grew {grew} over {SLOPE_CYCLES} cycles (slack {slack}): {series}")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=["local", "nixl", "mooncake"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param not in available_backends():
        pytest.fail(f"backend {request.param} does not import here: CI must install it (./dev setup)")
    return str(request.param)


@pytest.fixture
def cluster(backend: str) -> Iterator[Cluster]:
    with Cluster(SPEC, CAP, backend, room_timeout_s=10.0) as c:
        yield c


class Rooms:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.next = 1

    def one(self, dec: Group, pre: Group, timeout_s: float = 30.0) -> RoomResult:
        (r,) = self.cluster.wait_rooms([self.cluster.submit(dec, pre, self.next, 9)], timeout_s)
        self.next += 1
        return r

    def until_ok(self, dec: Group, pre: Group, timeout_s: float) -> None:
        """Rooms until one succeeds (a rank that is not reconnected yet fails them at once)."""
        end = time.monotonic() + timeout_s
        while True:
            r = self.one(dec, pre)
            if r.ok:
                return
            assert time.monotonic() < end, f"no room succeeded within {timeout_s}s: {r.reason}"
            time.sleep(0.2)


def _pid(g: Group) -> int:
    pid = g.procs[0].pid
    assert pid is not None
    return pid


def _report(what: str, dec: list[Sample], pre: list[Sample]) -> None:
    for name, s in (("decode", dec), ("prefill", pre)):
        if not s:
            continue
        a, b = s[WARMUP], s[-1]
        n = len(s) - 1 - WARMUP
        rss = f"{a.rss_kib // 1024}->{b.rss_kib // 1024} MiB"
        print(
            f"{what} {name}: after warm-up, over {n} cycles: rss {rss}, "
            f"fds {a.fds}->{b.fds}, threads {a.threads}->{b.threads}, maps {a.maps}->{b.maps}"
        )


@pytest.mark.slow
def test_connecting_again_many_times_leaves_nothing_behind(cluster: Cluster, backend: str) -> None:
    pre = cluster.start("prefill", 1, f"soak-pre-{backend}")
    dec = cluster.start("decode", 1, f"soak-dec-{backend}")
    rooms = Rooms(cluster)
    assert cluster.connect(dec, pre) == [""]
    dec_s, pre_s = [], []
    for _ in range(CYCLES):
        assert cluster.connect(dec, pre) == [""]
        r = rooms.one(dec, pre)
        assert r.ok, r.reason
        dec_s.append(sample(_pid(dec)))
        pre_s.append(sample(_pid(pre)))
    _report(f"connect again x{CYCLES} ({backend})", dec_s, pre_s)
    problems = slope_problems("decode", dec_s) + slope_problems("prefill", pre_s)
    assert problems == [], "\n".join(problems)
    (stats, end_problems), *_ = cluster.stop(dec).values()
    assert end_problems == [] and stats["revocations"] == 0 and stats["rooms_ok"] == CYCLES


@pytest.mark.slow
def test_restarting_the_prefill_rank_many_times_leaves_nothing_behind_on_decode(
    cluster: Cluster, backend: str
) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    pre = cluster.start("prefill", 1, f"rs-pre-{backend}", bind=bind)
    dec = cluster.start("decode", 1, f"rs-dec-{backend}")
    rooms = Rooms(cluster)
    assert cluster.connect(dec, pre) == [""]
    rooms.until_ok(dec, pre, 30)
    dec_s = []
    for _ in range(RESTARTS):
        cluster.kill(pre, 0)
        pre = cluster.start("prefill", 1, pre.engine_id, bind=bind)
        rooms.until_ok(dec, pre, 60)  # reconnected in the background to the new process
        dec_s.append(sample(_pid(dec)))
    _report(f"prefill restart x{RESTARTS} ({backend})", dec_s, [])
    problems = slope_problems("decode", dec_s)
    assert problems == [], "\n".join(problems)
    (stats, end_problems), *_ = cluster.stop(dec).values()
    assert end_problems == [] and stats["reconnects"] >= RESTARTS


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["local", "nixl"])
def test_prefill_killed_with_a_room_in_flight_many_times_leaves_nothing_behind_on_decode(engine: str) -> None:
    # each cycle revokes the killed rank (its room was unfenced): the revoked windows are junk
    # until the rank's endpoint accepts a registration again, and are unmapped then. (Mooncake's
    # failures are no fence, so its revoked windows stay mapped as junk: not part of this test.)
    if engine not in available_backends():
        pytest.fail(f"backend {engine} does not import here: CI must install it (./dev setup)")
    bind = f"tcp://127.0.0.1:{free_port()}"
    slow = {"chunk_delay_s": 0.25, "chunk_pages": 1, "bind": bind}
    with Cluster(SPEC, CAP, engine, room_timeout_s=10.0) as cluster:
        pre = cluster.start("prefill", 1, f"kr-pre-{engine}", **slow)
        dec = cluster.start("decode", 1, f"kr-dec-{engine}")
        rooms = Rooms(cluster)
        assert cluster.connect(dec, pre) == [""]
        rooms.until_ok(dec, pre, 30)
        dec_s = []
        for _ in range(RESTARTS):
            doomed = cluster.submit(dec, pre, rooms.next, 48)  # 12 chunks, one every 250 ms
            rooms.next += 1
            time.sleep(0.5)
            cluster.kill(pre, 0)
            (r,) = cluster.wait_rooms([doomed], 30)
            assert not r.ok and r.reasons[0].startswith("peer_gone:"), r.reasons
            pre = cluster.start("prefill", 1, pre.engine_id, **slow)
            rooms.until_ok(dec, pre, 60)
            dec_s.append(sample(_pid(dec)))
        _report(f"prefill killed mid-room x{RESTARTS} ({engine})", dec_s, [])
        problems = slope_problems("decode", dec_s)
        assert problems == [], "\n".join(problems)
        (stats, end_problems), *_ = cluster.stop(dec).values()
        assert end_problems == [] and stats["revocations"] >= RESTARTS and stats["unrevocable"] == 0


@pytest.mark.slow
def test_restarting_the_decode_rank_many_times_leaves_nothing_behind_on_prefill() -> None:
    # Each new decode process registers under the same rank: the prefill rank retires the old
    # one's registration and backend peer (its pidfd, its inbox) and serves the new one. Local
    # only: NIXL's and Mooncake's engines keep their connections to a dead process open (2 and 4
    # sockets in CLOSE-WAIT per restarted decode process, no call of theirs closes them;
    # docs/fencing.md).
    with Cluster(SPEC, CAP, "local", room_timeout_s=10.0) as cluster:
        pre = cluster.start("prefill", 1, "dr-pre")
        rooms = Rooms(cluster)
        pre_s = []
        for _ in range(RESTARTS):
            dec = cluster.start("decode", 1, "dr-dec")
            assert cluster.connect(dec, pre) == [""]
            rooms.until_ok(dec, pre, 30)
            cluster.kill(dec, 0)
            pre_s.append(sample(_pid(pre)))
        _report(f"decode restart x{RESTARTS} (local)", [], pre_s)
        problems = slope_problems("prefill", pre_s)
        assert problems == [], "\n".join(problems)
        (stats, end_problems), *_ = cluster.stop(pre).values()
        assert end_problems == [] and stats["restarts"] == RESTARTS - 1
