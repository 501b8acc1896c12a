"""``local``: same-host transfers with ``process_vm_writev``; no engine to install.

The writer copies straight from its own memory into the peer process's address space, like
UCX's cma transport: ``post`` hands the rows to one worker thread, which writes them with
``process_vm_writev`` (at most 1024 rows and 4 MiB per call, checking the cancel flag in
between; ctypes releases the GIL, so the owner thread keeps running), then checks the peer
is alive and drops the notification into the peer's inbox directory (see :mod:`.shm`).
Any memory can be registered on either side. A dead peer makes the transfer FAILED (the
kernel answers ``ESRCH``); a peer address that is not mapped fails it with ``EFAULT``.

Revocation works like on the other engines: memory from :meth:`LocalBackend.allocate` is a
memfd, and a peer given ``local_metadata(for_peer=...)`` writes through its own window,
which :meth:`~.contract.Backend.revoke` remaps to junk pages (see :mod:`.window`).

The kernel lets a process write another's memory only with ptrace permission (same user;
under Yama's ``ptrace_scope`` 1 the target must allow it): each backend therefore allows
any process of the same user to write it (``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``,
a no-op without Yama). Under ``ptrace_scope`` 2 or 3 transfers fail with ``EPERM`` and say so.
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import numpy.typing as npt
from pdwire.runtime.backends import shm
from pdwire.runtime.backends.contract import Backend
from pdwire.runtime.backends.errors import PeerError
from pdwire.runtime.backends.metadata import decode_envelope, encode_envelope, pid_alive
from pdwire.runtime.backends.values import (
    DONE,
    EngineNotification,
    HostBuffer,
    Peer,
    PeerMetadata,
    PollResult,
    TransferHandle,
    failed,
)
from pdwire.runtime.backends.wakeup import WAKE_NAME, DatagramWaker, Waker, poke
from pdwire.runtime.backends.worker import Job, JobTransfers, JobWorker
from pdwire.runtime.descriptors import DescriptorTable, Region

_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_IOV_MAX = 1024  # rows per process_vm_writev call (the kernel's limit per call)
_CALL_BYTES = 4 << 20  # bytes per call: bounds how long a cancel waits for the worker


def _allow_writers() -> None:
    """Let same-user processes write this one under Yama ptrace_scope 1 (no-op elsewhere)."""
    _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)


def _calls(length: npt.NDArray[np.uint64]) -> list[tuple[int, int]]:
    """[start, stop) row ranges, each at most _IOV_MAX rows and, past its first row, _CALL_BYTES."""
    out: list[tuple[int, int]] = []
    ends = np.cumsum(length, dtype=np.uint64)
    start, n, base = 0, len(length), 0
    while start < n:
        limit = min(start + _IOV_MAX, n)
        # rows whose end stays within _CALL_BYTES of the call's start (at least one row)
        stop = int(np.searchsorted(ends[start:limit], base + _CALL_BYTES, side="right")) + start
        stop = max(stop, start + 1)
        out.append((start, stop))
        base = int(ends[stop - 1])
        start = stop
    return out


def _write_error(err: int, peer: Peer) -> str:
    if err == errno.ESRCH:
        return f"peer {peer.agent_name!r} (pid {peer.pid}) is gone"
    if err == errno.EPERM:
        return (
            f"process_vm_writev into peer {peer.agent_name!r} (pid {peer.pid}) is not permitted: "
            "the peer must run as the same user, and kernel.yama.ptrace_scope must be 0 or 1"
        )
    if err == errno.EFAULT:
        return f"a destination of peer {peer.agent_name!r} is not mapped in its process"
    return f"process_vm_writev into peer {peer.agent_name!r} failed: {os.strerror(err)}"


class LocalBackend(JobTransfers, Backend):
    name = "local"
    wakes_on_completion = True
    wakes_on_notification = True

    def __init__(self, agent_name: str | None = None, transfer_timeout_s: float = 30.0) -> None:
        super().__init__(agent_name, transfer_timeout_s)
        _allow_writers()
        shm.reap_dead()
        self._stem = shm.make_stem(os.urandom(4).hex())
        self._inbox = shm.Inbox.create(f"{self._stem}.inbox")
        # completions (our worker thread) and notifications (a peer pokes the inbox's socket
        # after dropping one in) wake the owner's poller
        self._waker = Waker()
        self._inbox_waker = DatagramWaker(f"{self._inbox.path}/{WAKE_NAME}")
        self._worker = JobWorker(f"pdwire-local-{self.agent_name}", on_done=self._waker.set)

    # ---- memory
    def _allocate(self, name: str, nbytes: int) -> HostBuffer:
        return self._shared_buffer(name, nbytes)

    def _register(self, regions: list[Region]) -> None:
        pass  # the kernel needs no registration: any mapped memory can be written

    def _local_metadata(self, window: list[int] | None) -> PeerMetadata:
        extra: dict[str, object] = {"inbox": self._inbox.path}
        if window:
            extra["window"] = window
        return PeerMetadata(
            self.agent_name, encode_envelope(self.name, self.agent_name, self.regions, b"", extra)
        )

    # ---- peers
    def _add_peer(self, metadata: PeerMetadata) -> Peer:
        md = decode_envelope(self.name, metadata)
        if not pid_alive(md.pid):
            raise PeerError(f"peer {md.agent_name!r} (pid {md.pid}) is not running")
        inbox = md.extra.get("inbox")
        problem = shm.inbox_problem(inbox, md.pid)
        if problem is not None:
            raise PeerError(f"peer {md.agent_name!r} published no usable inbox {inbox!r}: {problem}")
        return Peer(md.agent_name, md.regions, md.pid, inbox, dst_delta=md.window)

    def _remove_peer(self, peer: Peer) -> None:
        pass  # nothing is held per peer

    # ---- transfers
    def _post(self, handle: TransferHandle, table: DescriptorTable, notification: bytes) -> None:
        peer = handle.peer
        inbox: str = peer.engine
        n = len(table)
        # iovec arrays (base, length) for both sides, built once; each call passes a slice
        local_iov = np.empty((n, 2), dtype=np.uint64)
        local_iov[:, 0], local_iov[:, 1] = table.src_addr, table.length
        remote_iov = np.empty((n, 2), dtype=np.uint64)
        remote_iov[:, 0], remote_iov[:, 1] = peer.engine_dst(table.dst_addr, table.dst_region), table.length
        calls = _calls(table.length)
        ends = np.cumsum(table.length, dtype=np.uint64)
        write = _libc.process_vm_writev
        pid = peer.pid

        def run(job: Job) -> PollResult:
            for a, b in calls:
                if job.cancel:
                    return failed("cancelled")
                want = int(ends[b - 1]) - (int(ends[a - 1]) if a else 0)
                lp = local_iov[a:b].ctypes.data
                rp = remote_iov[a:b].ctypes.data
                got = write(pid, lp, b - a, rp, b - a, 0)
                if got < 0:
                    return failed(_write_error(ctypes.get_errno(), peer))
                if got != want:  # the kernel stops at the first unmapped destination
                    return failed(_write_error(errno.EFAULT, peer))
            if job.cancel:
                return failed("cancelled")
            if not pid_alive(pid):
                return failed(f"peer {peer.agent_name!r} (pid {pid}) died before the notification")
            try:
                shm.send(inbox, self.agent_name, notification)
            except OSError as exc:
                return failed(f"peer {peer.agent_name!r} inbox unavailable: {exc}")
            poke(f"{inbox}/{WAKE_NAME}")
            return DONE

        handle.engine = self._submit(handle, run)

    def _receive_notifications(self) -> list[EngineNotification]:
        return [EngineNotification(s, p) for s, p in self._inbox.receive()]

    def wakeup_fds(self) -> tuple[int, ...]:
        return () if self.closed else (self._waker.fd, self._inbox_waker.fd)

    def clear_wakeups(self) -> None:
        if not self.closed:
            self._waker.drain()
            self._inbox_waker.drain()

    def _close(self) -> None:
        self._worker.stop()
        self._waker.close()
        self._inbox_waker.close()
        shm.remove_path(self._inbox.path)
