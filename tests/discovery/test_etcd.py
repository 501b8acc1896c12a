"""etcd discovery against a real etcd server: leases, prefix watches, restarts, lost connectivity."""

from __future__ import annotations

import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pdwire import wire
from pdwire.discovery import (
    Change,
    Discovery,
    EtcdDiscovery,
    Geometry,
    Joined,
    Left,
    RankEntry,
    Rejected,
    Restarted,
    encode_entry,
)
from pdwire.discovery.membership import RegistryBack, RegistryLost
from tests.support.etcd_server import EtcdServer

ROOT = Path(__file__).resolve().parents[2]
FAST = {"request_timeout_s": 0.5, "watch_idle_s": 1.0}


def entry(engine: str = "p", tp_rank: int = 0, inc: str = "i1") -> RankEntry:
    return RankEntry(
        role=wire.Role.PREFILL,
        engine_id=engine,
        geometry=Geometry(2, tp_rank),
        control=f"tcp://127.0.0.1:{17000 + tp_rank}",
        incarnation=inc,
        backend="nixl",
        protocol=("1.3",),
    )


def wait_for(
    disc: Discovery, pred: Callable[[Change], bool], timeout_s: float, seen: list[Change] | None = None
) -> Change:
    """Poll until a change satisfies ``pred``; every change polled is appended to ``seen``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = disc.poll(0.1)
        if seen is not None:
            seen += batch
        for c in batch:
            if pred(c):
                return c
    raise AssertionError(f"no matching change within {timeout_s}s; saw {seen}")


@contextmanager
def registrant(spec: str, engine: str, tp_rank: int) -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.discovery.registrant", spec, engine, str(tp_rank)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)  # fail, never hang, if it stays silent
        assert ready, f"registrant said nothing within 30 s, exit {proc.poll()}"
        line = proc.stdout.readline()
        assert line.startswith("registered "), f"registrant said {line!r}, exit {proc.poll()}"
        yield proc, line.split()[1]
    finally:
        proc.kill()
        proc.wait(10)


def test_register_watch_and_a_clean_withdraw(etcd: EtcdServer, prefix: str) -> None:
    watcher = EtcdDiscovery([etcd.endpoint], prefix=prefix, roles=(wire.Role.PREFILL,), **FAST)
    rank = EtcdDiscovery([etcd.endpoint], prefix=prefix, roles=(), ttl_s=30, **FAST)
    try:
        rank.register(entry())
        joined = wait_for(watcher, lambda c: isinstance(c, Joined), 10)
        assert isinstance(joined, Joined) and joined.entry == entry()
        assert joined.key == f"{prefix}/prefill/p/tp0.pp0"
        assert '"engine_id":"p"' in etcd.etcdctl("get", joined.key, "--print-value-only")
        # a second rank of the same process shares the lease
        rank.register(entry(tp_rank=1))
        wait_for(watcher, lambda c: isinstance(c, Joined) and c.entry.geometry.tp_rank == 1, 10)
        assert watcher.membership.complete_groups(wire.Role.PREFILL)["p"].control_endpoints() == [
            "tcp://127.0.0.1:17000",
            "tcp://127.0.0.1:17001",
        ]
        # a withdrawal revokes the lease: the ranks leave at once, not when the 30 s TTL runs out
        rank.withdraw()
        seen: list[Change] = []
        wait_for(watcher, lambda c: isinstance(c, Left), 10, seen)
        if len([c for c in seen if isinstance(c, Left)]) < 2:
            wait_for(watcher, lambda c: isinstance(c, Left), 10, seen)
        assert sorted(c.key for c in seen if isinstance(c, Left)) == [
            joined.key,
            f"{prefix}/prefill/p/tp1.pp0",
        ]
        assert etcd.etcdctl("get", "--prefix", prefix) == ""
    finally:
        rank.close()
        watcher.close()


def test_a_killed_rank_disappears_within_its_ttl_and_a_restarted_one_is_picked_up(
    etcd: EtcdServer, prefix: str
) -> None:
    spec = etcd.spec(prefix, ttl_s=2)
    watcher = EtcdDiscovery([etcd.endpoint], prefix=prefix, roles=(wire.Role.PREFILL,), **FAST)
    try:
        with registrant(spec, "p", 1) as (proc, inc1):
            wait_for(watcher, lambda c: isinstance(c, Joined) and c.entry.incarnation == inc1, 10)
            proc.kill()  # no withdrawal: only the lease's expiry can remove it
            killed = time.monotonic()
            left = wait_for(watcher, lambda c: isinstance(c, Left), 15)
            gone_after = time.monotonic() - killed
        assert isinstance(left, Left) and left.entry.incarnation == inc1
        print(f"killed rank left after {gone_after:.1f}s (ttl 2s)")
        # a longer lease, so that a restart (a process start on a loaded machine) beats its expiry
        spec = etcd.spec(prefix, ttl_s=8)
        with registrant(spec, "p", 1) as (proc, inc2):
            joined = wait_for(watcher, lambda c: isinstance(c, Joined), 10)
            assert isinstance(joined, Joined) and joined.entry.incarnation == inc2 != inc1
            # killed and restarted before the old lease expired: the new incarnation replaces it ...
            proc.kill()
            with registrant(spec, "p", 1) as (_, inc3):
                restarted = wait_for(watcher, lambda c: isinstance(c, Restarted), 10)
                assert isinstance(restarted, Restarted)
                assert (restarted.old.incarnation, restarted.new.incarnation) == (inc2, inc3)
                # ... and the old lease's expiry does not take the new entry with it
                time.sleep(9)
                assert [type(c) for c in watcher.poll()] == []
                [(_key, e)] = watcher.membership.entries().items()
                assert e.incarnation == inc3
    finally:
        watcher.close()


def test_malformed_entries_are_refused_by_name_and_hurt_no_one_else(etcd: EtcdServer, prefix: str) -> None:
    watcher = EtcdDiscovery([etcd.endpoint], prefix=prefix, roles=(wire.Role.PREFILL,), **FAST)
    rank = EtcdDiscovery([etcd.endpoint], prefix=prefix, roles=(), **FAST)
    try:
        rank.register(entry())
        wait_for(watcher, lambda c: isinstance(c, Joined), 10)
        bad = encode_entry(entry(tp_rank=1))[1].replace(b'"tp_size":2', b'"tp_size":"2"')
        etcd.etcdctl("put", f"{prefix}/prefill/p/tp1.pp0", bad.decode())
        rejected = wait_for(watcher, lambda c: isinstance(c, Rejected), 10)
        assert isinstance(rejected, Rejected) and "$.geometry.tp_size" in str(rejected.error)
        etcd.etcdctl("put", f"{prefix}/prefill/p/tp1.pp0", encode_entry(entry(tp_rank=0))[1].decode())
        rejected = wait_for(watcher, lambda c: isinstance(c, Rejected), 10)
        assert "key and entry disagree" in str(rejected.error)
        etcd.etcdctl("put", f"{prefix}/prefill/p/tp1.pp0", encode_entry(entry(tp_rank=1))[1].decode())
        wait_for(watcher, lambda c: isinstance(c, Joined) and c.entry.geometry.tp_rank == 1, 10)
        assert watcher.membership.complete_groups(wire.Role.PREFILL)["p"].control_endpoints() == [
            "tcp://127.0.0.1:17000",
            "tcp://127.0.0.1:17001",
        ]
    finally:
        rank.close()
        watcher.close()


def test_a_lost_registry_is_reported_retried_and_recovered(own_etcd: EtcdServer, prefix: str) -> None:
    etcd = own_etcd
    watcher = EtcdDiscovery([etcd.endpoint], prefix=prefix, roles=(wire.Role.PREFILL,), **FAST)
    rank = EtcdDiscovery([etcd.endpoint], prefix=prefix, roles=(), ttl_s=3, **FAST)
    try:
        rank.register(entry())
        wait_for(watcher, lambda c: isinstance(c, Joined), 10)
        # a hung server: requests time out, nothing raises, the view stays
        etcd.pause()
        wait_for(watcher, lambda c: isinstance(c, RegistryLost), 10)
        wait_for(rank, lambda c: isinstance(c, RegistryLost), 10)
        assert len(watcher.membership.entries()) == 1
        etcd.resume()
        seen: list[Change] = []
        wait_for(watcher, lambda c: isinstance(c, RegistryBack), 15, seen)
        wait_for(rank, lambda c: isinstance(c, RegistryBack), 15)
        # a server that is gone and comes back on the same ports and data
        etcd.stop()
        wait_for(watcher, lambda c: isinstance(c, RegistryLost), 10)
        time.sleep(4)  # longer than the lease TTL
        etcd.start()
        wait_for(watcher, lambda c: isinstance(c, RegistryBack), 20, seen)
        # whether the lease survived the restart or not, the rank is registered again
        deadline = time.monotonic() + 15
        while not watcher.membership.entries() and time.monotonic() < deadline:
            watcher.poll(0.2)
        assert [e.incarnation for e in watcher.membership.entries().values()] == ["i1"]
        assert '"incarnation":"i1"' in etcd.etcdctl(
            "get", f"{prefix}/prefill/p/tp0.pp0", "--print-value-only"
        )
    finally:
        rank.close()
        watcher.close()


def test_an_unreachable_registry_at_start_is_retried_not_raised(tmp_path: Path, prefix: str) -> None:
    server = EtcdServer(tmp_path)  # ports chosen, not started yet
    disc = EtcdDiscovery([server.endpoint], prefix=prefix, roles=(wire.Role.PREFILL,), **FAST)
    try:
        disc.register(entry())
        wait_for(disc, lambda c: isinstance(c, RegistryLost), 10)
        with server:
            joined = wait_for(disc, lambda c: isinstance(c, Joined), 20)
            assert isinstance(joined, Joined) and joined.entry == entry()
    finally:
        disc.close()
