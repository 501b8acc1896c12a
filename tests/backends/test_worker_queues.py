"""Worker-thread backends (local, mooncake): what queueing behind other transfers means.

A transfer's timeout counts from when a worker thread started it, not from its post: time
spent queued behind other transfers is the caller's backlog. Mooncake gives each peer its own
threads, so a stuck peer never holds up another.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pdwire.runtime.backends import TransferState
from pdwire.runtime.backends.values import DONE, PENDING
from tests.backends.test_conformance import MiB, mib_table, pair

WORKER_BACKENDS = ["local", "mooncake"]


def hold_workers(name: str, a: Any, peer: Any, gate: threading.Event) -> None:
    """Occupy every worker thread that would run transfers to ``peer`` until ``gate`` opens."""
    worker, threads = (a._worker, 1) if name == "local" else (peer.private.worker, a.threads_per_peer)
    for _ in range(threads):
        worker.submit(lambda job: (gate.wait(30), DONE)[1])


@pytest.mark.parametrize("name", WORKER_BACKENDS)
def test_time_queued_behind_other_transfers_does_not_count_against_the_timeout(
    name: str, backends: Any
) -> None:
    size = MiB
    a, _b, src, dst, peer = pair(name, backends, size, transfer_timeout_s=0.3)
    gate = threading.Event()
    hold_workers(name, a, peer, gate)
    h = a.post(peer, mib_table(src.address, dst.address, size), b"queued")
    try:
        a.wait(h, timeout_s=0.6)  # twice the timeout, all of it queued
        assert a.poll(h) == PENDING, "a transfer that never started was timed out"
    finally:
        gate.set()
    assert a.wait(h, timeout_s=30).state is TransferState.DONE


def test_a_stuck_mooncake_peer_does_not_hold_up_another(backends: Any) -> None:
    size = MiB
    a, _stuck, src, dst, to_stuck = pair("mooncake", backends, size)
    other = backends("mooncake", agent_name="mooncake-other")
    dst2 = other.allocate("dst", size)
    other.register([dst2.region()])
    to_other = a.add_peer(other.local_metadata())
    gate = threading.Event()
    hold_workers("mooncake", a, to_stuck, gate)
    try:
        held = a.post(to_stuck, mib_table(src.address, dst.address, size), b"held")
        h = a.post(to_other, mib_table(src.address, dst2.address, size), b"free")
        assert a.wait(h, timeout_s=30).state is TransferState.DONE
        assert (dst2.array == src.array[:size]).all()
        assert a.poll(held) == PENDING
    finally:
        gate.set()
    assert a.wait(held, timeout_s=30).state is TransferState.DONE


def test_mooncake_runs_a_peers_transfers_side_by_side(backends: Any) -> None:
    # two transfers to one peer: with one of its two threads held, the other still runs
    size = MiB
    a, _b, src, dst, peer = pair("mooncake", backends, size)
    gate = threading.Event()
    peer.private.worker.submit(lambda job: (gate.wait(30), DONE)[1])
    try:
        h = a.post(peer, mib_table(src.address, dst.address, size), b"beside")
        assert a.wait(h, timeout_s=30).state is TransferState.DONE
    finally:
        gate.set()
