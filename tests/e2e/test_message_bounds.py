"""A registered peer's request larger than its registered pools allow is refused undecoded.

A decode peer in its own process (``tests/e2e/oversized_peer.py``) registers properly with a
real prefill rank, then sends a ``TransferRequest`` of 1M destination pages (4 MiB: under the
socket's 32 MiB, far past the 16 pages its pools hold). The prefill rank refuses it from its
header frame (``MessageTooLarge``), drops that peer only, and keeps serving its real decode peer.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdwire.runtime.workers.prefill import CONTROL_MAX_MESSAGE
from tests.e2e.conftest import WorkerPair, worker_pair
from tests.e2e.test_hostile_peers import run_room

ROOT = Path(__file__).resolve().parents[2]
PAGES = 1 << 20


def _line(proc: subprocess.Popen[str], p: WorkerPair, timeout_s: float = 60) -> dict[str, Any]:
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    while not select.select([proc.stdout], [], [], 0)[0]:
        assert time.monotonic() < end, "the peer said nothing"
        assert proc.poll() is None, f"the peer exited with {proc.returncode}"
        p.pre.step(5)
        p.dec.step(0)
    value = json.loads(proc.stdout.readline())
    assert isinstance(value, dict)
    return value


def test_a_request_too_large_for_the_registered_pools_drops_that_peer_only() -> None:
    with worker_pair() as p:
        argv = [sys.executable, "-m", "tests.e2e.oversized_peer", p.pre.endpoint, str(PAGES)]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            ack = _line(proc, p)
            assert ack["accepted"], ack
            big = _line(proc, p)
            assert 4 * PAGES < big["sent"] < CONTROL_MAX_MESSAGE  # the socket lets it through
            assert big["answer"] is None  # no room made, nothing answered: the peer is dropped
            after = _line(proc, p)  # its connection is forgotten: it is no registered peer any more
            assert after["answer"]["room"] == 79 and after["answer"]["status"] == "FAILED", after
            assert "not registered" in after["answer"]["reason"], after
        finally:
            proc.wait(30)
        assert p.pre.stats.messages_too_large == 1 and p.pre.stats.peers_failed == 1
        (text,) = [f for f in p.pre.stats.failures if "MessageTooLarge" in f]
        assert text.startswith("decode peer big/0 dropped: MessageTooLarge:"), text
        assert f"TransferRequest of {big['sent']} bytes" in text and "refused before decoding" in text, text
        assert 78 not in p.pre.session.rooms  # nothing of it was decoded into a room
        assert run_room(p, 3)[1].name == "SUCCESS"  # the rank and its real peer go on
