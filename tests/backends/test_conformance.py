"""One conformance suite for every transfer backend.

Each test runs once per backend in ``BACKENDS``, the registry's list: a new backend joins
by being registered. Cross-process cases use a real target process
(:mod:`tests.backends.target`). Engines that cannot import make their tests FAIL, not
skip: CI installs every engine. Select one engine with ``-m 'engine("nixl")'`` or
``-k nixl``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdwire.runtime.backends import (
    Backend,
    BackendClosed,
    DescriptorError,
    PeerError,
    PeerMetadata,
    PollResult,
    RegistrationError,
    TransferError,
    TransferState,
    create_backend,
    shm,
)
from pdwire.runtime.backends.registry import known_backends
from pdwire.runtime.backends.values import CANCELLING, DONE
from pdwire.runtime.descriptors import DescriptorTable

BACKENDS = known_backends()
SHM_BACKENDS = {"local", "mori-fake"}  # backends whose memory lives in /dev/shm
ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def params() -> list[Any]:
    return [pytest.param(b, marks=pytest.mark.engine(b), id=b) for b in BACKENDS]


# --------------------------------------------------------------------------- helpers


def table(src: list[int], dst: list[int], length: list[int], sreg: int = 0, dreg: int = 0) -> DescriptorTable:
    n = len(src)
    return DescriptorTable(
        np.array(src, dtype=np.uint64),
        np.array(dst, dtype=np.uint64),
        np.array(length, dtype=np.uint64),
        np.full(n, sreg, dtype=np.uint32),
        np.full(n, dreg, dtype=np.uint32),
    )


def mib_table(src: int, dst: int, size: int) -> DescriptorTable:
    """``size`` bytes from ``src`` to ``dst`` as 1 MiB descriptors."""
    offsets = range(0, size, MiB)
    return table([src + o for o in offsets], [dst + o for o in offsets], [MiB] * len(offsets))


def sha(a: np.ndarray[Any, Any]) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


class Target:
    """A target process: its metadata, and the notifications it reports."""

    def __init__(self, backend: str, nbytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.backends.target", backend, str(nbytes)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        # A reader thread, because select() on a buffered pipe misses lines already read ahead.
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        hello = self.read(timeout_s=60)
        assert hello is not None, "target process did not start"
        self.pid: int = hello["pid"]
        self.md = PeerMetadata(
            hello["agent"],
            base64.b64decode(hello["md"]),
            tuple(base64.b64decode(d) for d in hello["descs"]),
        )

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def read(self, timeout_s: float) -> dict[str, Any] | None:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            return None
        return json.loads(line) if line else None

    def notifications(self, count: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        end = time.monotonic() + timeout_s
        while len(got) < count and time.monotonic() < end:
            msg = self.read(timeout_s=max(0.0, end - time.monotonic()))
            if msg is None:
                break
            got.append(msg)
        return got

    def close(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            return None
        assert self.proc.stdin is not None
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        msg = self.read(timeout_s=30)
        self.proc.wait(timeout=30)
        return msg

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture
def spawn() -> Iterator[Any]:
    targets: list[Target] = []

    def make(backend: str, nbytes: int) -> Target:
        t = Target(backend, nbytes)
        targets.append(t)
        return t

    yield make
    for t in targets:
        t.kill()


def source(b: Backend, nbytes: int, seed: int = 1) -> Any:
    buf = b.allocate("src", nbytes)
    buf.array[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    b.register([buf.region()])
    return buf


# --------------------------------------------------------------------------- in-process contract


@pytest.mark.parametrize("name", params())
def test_bad_rows_are_rejected_before_anything_moves(name: str, backends: Any) -> None:
    a, b = backends(name, agent_name=f"{name}-a"), backends(name, agent_name=f"{name}-b")
    src = source(a, 64 * 1024)
    dst = b.allocate("dst", 64 * 1024)
    b.register([dst.region(0, 32 * 1024, "lo"), dst.region(32 * 1024, 32 * 1024, "hi")])
    peer = a.add_peer(b.local_metadata())
    s, d = src.address, dst.address
    good = table([s], [d], [4096])
    cases = {
        "src past its region end": table([s, s + 60 * 1024], [d, d], [4096, 8192]),
        "dst crosses into the next region": table([s], [d + 30 * 1024], [4096]),
        "dst in the wrong region": table([s], [d], [4096], dreg=1),
        "region index out of range": table([s], [d], [4096], sreg=3),
        "zero length": table([s], [d], [0]),
        "wrapping length": table([s], [d], [2**64 - 1]),
    }
    for what, t in cases.items():
        with pytest.raises(DescriptorError, match=r"row \d"):
            a.post(peer, t, b"x")
        assert not dst.array.any(), f"bytes moved for a rejected table ({what})"
    with pytest.raises(DescriptorError, match="empty"):
        a.post(peer, DescriptorTable.empty(), b"x")
    h = a.post(peer, good, b"ok")
    assert a.wait(h, 30).state is TransferState.DONE
    assert np.array_equal(dst.array[:4096], src.array[:4096])


@pytest.mark.parametrize("name", params())
def test_typed_errors_for_registration_peers_and_use_after_close(name: str, backends: Any) -> None:
    a, b = backends(name, agent_name=f"{name}-a"), backends(name, agent_name=f"{name}-b")
    buf = a.allocate("x", 8192)
    a.register([buf.region(0, 4096)])
    with pytest.raises(RegistrationError, match="overlaps"):
        a.register([buf.region(2048, 4096, "y")])
    with pytest.raises(RegistrationError):
        a.allocate("empty", 0)
    with pytest.raises(PeerError):
        a.add_peer(PeerMetadata("zz", b"\x01garbage"))
    other = "local" if name != "local" else "mori-fake"
    c = backends(other, agent_name=f"{other}-c")
    with pytest.raises(PeerError, match="runs backend"):
        a.add_peer(PeerMetadata(c.agent_name, c.local_metadata().agent_metadata))
    peer = a.add_peer(b.local_metadata())
    a.remove_peer(peer)
    with pytest.raises(PeerError, match="not added"):
        a.post(peer, table([buf.address], [buf.address], [1]), b"x")
    later = buf.region(4096, 4096, "later")
    a.close()
    a.close()  # idempotent
    with pytest.raises(BackendClosed):
        a.register([later])


# --------------------------------------------------------------------------- cross-process data


@pytest.mark.parametrize("name", params())
def test_large_and_small_descriptors_arrive_intact_before_the_notification(
    name: str, backends: Any, spawn: Any
) -> None:
    big, small_n, page = 24 * MiB, 3000, 4096
    tgt = spawn(name, big + small_n * page)
    a = backends(name, agent_name=f"{name}-init")
    src = source(a, big + small_n * page, seed=7)
    peer = a.add_peer(tgt.md)
    d0 = peer.regions[0].base
    s0 = src.address
    # Large: 4 MiB descriptors into [0, big).
    step = 4 * MiB
    large = table(
        [s0 + o for o in range(0, big, step)], [d0 + o for o in range(0, big, step)], [step] * (big // step)
    )
    # Small: 4 KiB pages scattered into [big, big + small_n * page) in a permuted order.
    perm = np.random.default_rng(3).permutation(small_n)
    small = table(
        [s0 + big + int(i) * page for i in range(small_n)],
        [d0 + big + int(p) * page for p in perm],
        [page] * small_n,
    )
    h1 = a.post(peer, large, f"large:0:{big}".encode())
    h2 = a.post(peer, small, f"small:{big}:{small_n * page}".encode())
    assert a.wait(h1, 60).state is TransferState.DONE
    assert a.wait(h2, 60).state is TransferState.DONE
    expected_small = np.empty(small_n * page, dtype=np.uint8)
    srcpages = src.array[big:].reshape(small_n, page)
    expected_small.reshape(small_n, page)[perm] = srcpages
    notes = {n["payload"]: n for n in tgt.notifications(2)}
    assert set(notes) == {f"large:0:{big}", f"small:{big}:{small_n * page}"}
    assert all(n["sender"] == a.agent_name for n in notes.values())
    assert notes[f"large:0:{big}"]["sha"] == sha(src.array[:big])
    assert notes[f"small:{big}:{small_n * page}"]["sha"] == sha(expected_small)
    a.release(h1)
    a.release(h2)


@pytest.mark.parametrize("name", params())
def test_many_concurrent_transfers_each_notify_once_with_their_payload(
    name: str, backends: Any, spawn: Any
) -> None:
    n, size = 48, 64 * 1024
    tgt = spawn(name, n * size)
    a = backends(name, agent_name=f"{name}-init")
    src = source(a, n * size, seed=11)
    peer = a.add_peer(tgt.md)
    d0 = peer.regions[0].base
    handles = [
        a.post(
            peer, table([src.address + i * size], [d0 + i * size], [size]), f"t{i}:{i * size}:{size}".encode()
        )
        for i in range(n)
    ]
    assert [a.wait(h, 60).state for h in handles] == [TransferState.DONE] * n
    notes = tgt.notifications(n)
    assert sorted(m["payload"] for m in notes) == sorted(f"t{i}:{i * size}:{size}" for i in range(n))
    for m in notes:
        i = int(m["payload"].split(":")[0][1:])
        assert m["sha"] == sha(src.array[i * size : (i + 1) * size]), m["payload"]
    assert tgt.notifications(1, timeout_s=0.3) == [], "a transfer was notified twice"


# --------------------------------------------------------------------------- failures and cleanup


@pytest.mark.parametrize("name", params())
def test_killed_peer_fails_transfers_in_bounded_time_and_a_new_peer_works(
    name: str, backends: Any, spawn: Any
) -> None:
    size = 16 * MiB
    tgt = spawn(name, size)
    a = backends(name, agent_name=f"{name}-init", transfer_timeout_s=20.0)
    src = source(a, size, seed=5)
    peer = a.add_peer(tgt.md)
    full = mib_table(src.address, peer.regions[0].base, size)
    first = a.post(peer, full, f"first:0:{size}".encode())
    assert a.wait(first, 60).state is TransferState.DONE
    # Queue several transfers, then kill the target while they are (or could be) running.
    pending = [a.post(peer, full, f"k{i}:0:{size}".encode()) for i in range(4)]
    tgt.kill()
    after = []
    t0 = time.monotonic()
    for i in range(3):
        with contextlib.suppress(PeerError):  # refusing the post outright is allowed too
            after.append(a.post(peer, full, f"after{i}:0:{size}".encode()))
    states = [a.wait(h, 30).state for h in pending + after]
    assert time.monotonic() - t0 < 30, "failure took longer than the bound"
    assert all(s in (TransferState.DONE, TransferState.FAILED) for s in states)
    assert all(a.poll(h).state is TransferState.FAILED for h in after), "a write to a dead peer reported DONE"
    for h in pending + after:
        a.release(h)
    a.remove_peer(peer)
    # The survivor serves a new peer.
    tgt2 = spawn(name, size)
    peer2 = a.add_peer(tgt2.md)
    h = a.post(peer2, mib_table(src.address, peer2.regions[0].base, size), f"again:0:{size}".encode())
    assert a.wait(h, 60).state is TransferState.DONE
    (note,) = tgt2.notifications(1)
    assert note["payload"] == f"again:0:{size}" and note["sha"] == sha(src.array)


@pytest.mark.parametrize("name", params())
def test_close_releases_everything(name: str, spawn: Any) -> None:
    tgt = spawn(name, MiB)
    a = create_backend(name, agent_name=f"{name}-init")
    try:
        src = source(a, MiB)
        peer = a.add_peer(tgt.md)
        h = a.post(peer, table([src.address], [peer.regions[0].base], [MiB]), b"c:0:1048576")
        a.wait(h, 60)
        h2 = a.post(peer, table([src.address], [peer.regions[0].base], [MiB]), b"c:0:1048576")
    finally:
        a.close()
    assert a.closed and not a.peers and not a._handles
    assert h2.released
    with pytest.raises(BackendClosed):
        a.post(peer, table([src.address], [peer.regions[0].base], [MiB]), b"x")
    closed = tgt.close()
    assert closed == {"closed": True} or (closed is not None and "payload" in closed)
    assert tgt.proc.returncode == 0
    if name in SHM_BACKENDS:
        assert shm.leftover_paths(os.getpid()) == [], "close left /dev/shm entries of this process"
        assert shm.leftover_paths(tgt.pid) == [], "the target left /dev/shm entries after close"


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in sorted(SHM_BACKENDS)])
def test_segments_of_a_killed_process_are_reaped(name: str, spawn: Any, backends: Any) -> None:
    tgt = spawn(name, MiB)
    assert shm.leftover_paths(tgt.pid), "the target should own /dev/shm entries while alive"
    tgt.kill()
    backends(name)  # a new same-host backend reaps entries of dead processes
    assert shm.leftover_paths(tgt.pid) == []


# --------------------------------------------------------------------------- confirmed cancellation

# Backends whose cancel skips a transfer the engine has not started (worker-thread jobs).
# MoRI cannot cancel a posted write and NIXL may refuse to: their transfers may still land.
SKIPS_QUEUED = {"local", "mooncake"}
WATCHDOG_S = 30.0  # opens a held engine if a test never does, so a broken backend fails, not hangs


class _HeldRequest:
    def __init__(self, req: Any) -> None:
        self.req = req

    def release(self) -> None:
        self.req.release()


class _HeldAgent:
    """A NIXL agent whose requests report PROC while the gate is closed."""

    def __init__(self, agent: Any, gate: threading.Event) -> None:
        self._agent, self._gate = agent, gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def initialize_xfer(self, *args: Any) -> _HeldRequest:
        return _HeldRequest(self._agent.initialize_xfer(*args))

    def transfer(self, req: _HeldRequest, *args: Any) -> str:
        return self._held(self._agent.transfer(req.req, *args))

    def check_xfer_state(self, req: _HeldRequest) -> str:
        return self._held(self._agent.check_xfer_state(req.req))

    def _held(self, state: str) -> str:
        return state if self._gate.is_set() or state == "ERR" else "PROC"


class HeldGate(threading.Event):
    """The gate :func:`held` yields; ``entered`` is set once the engine holds a transfer (a
    worker thread took a job up), so a test can act on a transfer that has really started."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()


@contextlib.contextmanager
def held(name: str, b: Any) -> Iterator[HeldGate]:
    """Hold ``b``'s engine: a transfer posted inside can neither finish nor confirm a cancel
    until the yielded gate is set (at the latest when the block ends).

    Worker-thread backends (local, mooncake) start each job as usual, and the job waits on the
    gate before its first step, as an engine stuck at the start of a transfer does (the job
    counts as started: its transfer timeout runs). The MoRI fake's IO engine gets a job that
    waits on the gate, so transfers queue behind it on its one worker thread. NIXL has no such
    thread: its agent is wrapped so that requests report PROC while the gate is closed, as a
    slow transfer does. A new backend adds its own way of holding its engine here.
    """
    gate = HeldGate()
    watchdog = threading.Timer(WATCHDOG_S, gate.set)
    watchdog.start()
    if name == "nixl":
        b._agent = _HeldAgent(b._agent, gate)  # stays: requests made inside are wrapped
        gate.entered.set()  # a request is "in the engine" as soon as it is posted
    elif name == "mori-fake":
        b._engine._worker.submit(lambda job: (gate.entered.set(), gate.wait(), DONE)[2])
    else:
        submit = b._submit
        b._submit = lambda h, run: submit(h, lambda job: (gate.entered.set(), gate.wait(), run(job))[2])
    try:
        yield gate
    finally:
        gate.set()
        watchdog.cancel()


def pair(name: str, backends: Any, size: int, **kw: Any) -> tuple[Backend, Backend, Any, Any, Any]:
    """Initiator ``a`` (random source) and an in-process target ``b`` whose zeroed buffer it can write."""
    a, b = backends(name, agent_name=f"{name}-a", **kw), backends(name, agent_name=f"{name}-b")
    src = source(a, size, seed=13)
    dst = b.allocate("dst", size)
    b.register([dst.region()])
    return a, b, src, dst, a.add_peer(b.local_metadata())


def assert_quiet_after(final: PollResult, dst: Any, src: Any, b: Backend) -> None:
    """A final state means the engine is done with the memory: nothing lands afterwards."""
    assert final.finished
    probe = dst.array[::4096].copy()  # one byte a page, taken in microseconds: before any straggler
    snapshot = dst.array.copy()
    time.sleep(0.5)  # room for a straggling write to show itself
    assert np.array_equal(dst.array[::4096], probe), "bytes landed after poll() reported a final state"
    assert np.array_equal(dst.array, snapshot), "bytes landed after poll() reported a final state"
    if final.state is TransferState.DONE:
        assert np.array_equal(dst.array, src.array[: dst.nbytes])
    else:
        assert b.receive_notifications() == [], "a FAILED transfer delivered its notification"


@pytest.mark.parametrize("name", params())
def test_cancel_returns_at_once_and_poll_is_pending_until_the_engine_confirms(
    name: str, backends: Any
) -> None:
    size = 4 * MiB
    a, b, src, dst, peer = pair(name, backends, size)
    with held(name, a) as gate:
        h = a.post(peer, mib_table(src.address, dst.address, size), b"held")
        a.cancel(h)
        assert not gate.is_set(), "cancel() waited for the engine"
        assert a.poll(h) == CANCELLING  # the engine cannot have confirmed: it is held
        a.cancel(h)  # idempotent
        assert a.poll(h) == CANCELLING
        gate.set()
        final = a.wait(h, 30)
    assert final.state is TransferState.FAILED or (name == "nixl" and final.state is TransferState.DONE)
    if final.state is TransferState.FAILED:
        assert final.reason == "cancelled"
    if name in SKIPS_QUEUED:
        assert not dst.array.any(), "a transfer cancelled before it started moved bytes"
    assert_quiet_after(final, dst, src, b)
    assert a.poll(h) == final  # final states never change
    a.release(h)


@pytest.mark.parametrize("name", params())
def test_a_transfer_cancelled_mid_way_writes_nothing_after_its_final_state(name: str, backends: Any) -> None:
    # Many rows (engines check for a cancel between rows or batches), big enough that a tail
    # written after a premature final state would outlast the snapshot below.
    size, page = 64 * MiB, 64 * 1024
    a, b, src, dst, peer = pair(name, backends, size)
    rows = size // page
    t = table([src.address + i * page for i in range(rows)], [dst.address + i * page for i in range(rows)],
              [page] * rows)  # fmt: skip
    h = a.post(peer, t, b"big")
    end = time.monotonic() + 30
    while not dst.array[:page].any() and not a.poll(h).finished and time.monotonic() < end:
        pass  # cancel once the first bytes landed: the engine is (likely) inside the transfer
    a.cancel(h)
    final = a.wait(h, 60)
    assert_quiet_after(final, dst, src, b)
    a.release(h)


@pytest.mark.parametrize("name", params())
def test_a_timed_out_transfer_is_cancelled_and_failed_only_once_confirmed(name: str, backends: Any) -> None:
    size = 4 * MiB
    a, b, src, dst, peer = pair(name, backends, size, transfer_timeout_s=0.2)
    with held(name, a) as gate:
        h = a.post(peer, mib_table(src.address, dst.address, size), b"late")
        time.sleep(0.3)  # past its deadline
        assert a.poll(h) == CANCELLING  # not FAILED while the engine may still write
        assert not gate.is_set(), "poll() waited for the engine"
        assert a.poll(h) == CANCELLING
        gate.set()
        final = a.wait(h, 30)
    if final.state is TransferState.FAILED:
        assert "not done after 0.2s" in final.reason, final
    else:
        assert name == "nixl", f"{name}: a transfer held past its deadline reported {final}"
    if name in SKIPS_QUEUED:
        assert not dst.array.any()
    assert_quiet_after(final, dst, src, b)


@pytest.mark.parametrize("name", params())
def test_releasing_or_removing_the_peer_of_a_running_transfer_never_blocks(name: str, backends: Any) -> None:
    size = 4 * MiB
    a, b, src, dst, peer = pair(name, backends, size)
    with held(name, a) as gate:
        released = a.post(peer, mib_table(src.address, dst.address, size), b"released")
        removed = a.post(peer, mib_table(src.address, dst.address, size), b"removed")
        a.release(released)
        assert released.released and not gate.is_set(), "release() waited for the engine"
        with pytest.raises(TransferError):
            a.poll(released)
        a.remove_peer(peer)
        assert not gate.is_set(), "remove_peer() waited for the engine"
        assert a.poll(removed) == CANCELLING
        gate.set()
        final = a.wait(removed, 30)
    if final.state is TransferState.FAILED:
        assert "was removed" in final.reason, final
    if name in SKIPS_QUEUED:
        assert not dst.array.any()
    assert_quiet_after(final, dst, src, b)
    a.release(removed)
    # The released transfer's engine request is freed once confirmed (at the latest at close),
    # and the backend keeps serving new peers meanwhile.
    peer2 = a.add_peer(b.local_metadata())
    h = a.post(peer2, mib_table(src.address, dst.address, size), b"again")
    assert a.wait(h, 30).state is TransferState.DONE
    assert not a._draining, "a confirmed, released transfer was never freed"


@pytest.mark.parametrize("name", params())
def test_a_restarted_peer_is_taken_back_only_once_its_old_incarnations_transfers_stopped(
    name: str, backends: Any
) -> None:
    # A decode rank crashes with a write to it in flight and comes back under the same agent
    # name. An engine that keys remote agents by name must not tear the old entry down under
    # that write, and must take the new rank once the write stopped (no stale refusal).
    size = MiB
    a, b1, src, dst1, old = pair(name, backends, size)
    with held(name, a) as gate:
        h = a.post(old, mib_table(src.address, dst1.address, size), b"old")
        assert gate.entered.wait(10)  # started: a job still queued would just be skipped
        b2 = backends(name, agent_name=b1.agent_name)  # the new incarnation, same name
        dst2 = b2.allocate("dst", size)
        b2.register([dst2.region()])
        if a.peers_keyed_by_name:
            with pytest.raises(PeerError, match="previous incarnation's transfers are still stopping"):
                a.add_peer(b2.local_metadata())
        else:
            a.add_peer(b2.local_metadata())  # nothing is shared by name: replaced at once
        assert a.poll(h) == CANCELLING  # the old incarnation's write was cancelled, not dropped
        gate.set()
        assert a.wait(h, 30).finished
    a.release(h)
    new = a.add_peer(b2.local_metadata())  # taken back now, without any other call in between
    h2 = a.post(new, mib_table(src.address, dst2.address, size), b"new")
    assert a.wait(h2, 30).state is TransferState.DONE
    assert np.array_equal(dst2.array, src.array[:size])
    a.release(h2)
