"""``local``: same-host transfers with ``process_vm_writev``; no engine to install.

The writer copies straight from its own memory into the peer process's address space, like
UCX's cma transport: ``post`` hands the rows to one worker thread, which writes them with
``process_vm_writev`` (at most 1024 rows and 4 MiB per call, checking the cancel flag in
between; ctypes releases the GIL, so the owner thread keeps running), then checks the peer
is alive and drops the notification into the peer's inbox directory (see :mod:`.shm`).
Any memory can be registered as a source; a target's memory must come from
:meth:`LocalBackend.allocate` (see below). A dead peer makes the transfer FAILED (the kernel
answers ``ESRCH``); a peer address that is not mapped fails it with ``EFAULT``.

What a peer may make us write is checked in :meth:`LocalBackend.add_peer` (a
:class:`PeerError` naming the problem): its pid holds its inbox open (:mod:`.peer_memory`), every
destination lies in memory its backend allocated, an in-process peer names another live local
backend, and the metadata proves possession of the inbox (:mod:`.possession`); the checks in
full: ``docs/hostile-peers.md``.

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
import select
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from pdwire.runtime.backends import peer_memory, possession, shm
from pdwire.runtime.backends.contract import Backend
from pdwire.runtime.backends.errors import PeerError
from pdwire.runtime.backends.jobs import Job, JobThread, JobTransfers
from pdwire.runtime.backends.metadata import decode_envelope, encode_envelope, pid_alive
from pdwire.runtime.backends.values import (
    DONE,
    EngineNotification,
    Peer,
    PeerMetadata,
    PollResult,
    TransferHandle,
    failed,
)
from pdwire.runtime.backends.wakeup import WAKE_NAME, DatagramWaker, Waker, poke
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

# inbox path -> the live local backend of this process that owns it (same-process peers)
_live: dict[str, LocalBackend] = {}
_live_lock = threading.Lock()

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
    # Not the kernel's need: a peer registering again under its name is refused until its older
    # incarnation's transfers stopped, so a target whose registration is taken back knows every
    # older write to it ended (a decode rank then unmaps the windows it revoked before).
    peers_keyed_by_name = True
    wakes_on_completion = True
    wakes_on_notification = True

    def __init__(self, agent_name: str | None = None, transfer_timeout_s: float = 30.0) -> None:
        super().__init__(agent_name, transfer_timeout_s)
        _allow_writers()
        shm.reap_dead()
        self._stem = shm.make_stem(os.urandom(4).hex())
        self._inbox = shm.Inbox.create(f"{self._stem}.inbox")
        try:  # the secret behind the proof of possession our metadata carries (.possession)
            self._token = possession.create_token(self._inbox.fd)
        except BaseException:
            self._inbox.close()
            raise
        # completions (our worker thread) and notifications (a peer pokes the inbox's socket
        # after dropping one in) wake the owner's poller
        self._waker = Waker()
        self._inbox_waker = DatagramWaker(f"{self._inbox.path}/{WAKE_NAME}")
        self._wakers = (self._waker, self._inbox_waker)
        self._worker = JobThread(f"pdwire-local-{self.agent_name}", on_done=self._waker.set)
        self._processes: set[_Process] = set()  # of the peers added and not yet removed
        with _live_lock:
            _live[self._inbox.path] = self

    # ---- memory
    def _register(self, regions: list[Region]) -> None:
        pass  # the kernel needs no registration: any mapped memory can be written

    def _local_metadata(self, window: list[int] | None) -> PeerMetadata:
        proof = possession.proof(self._token, self.agent_name, os.getpid(), self._inbox.path)
        extra: dict[str, object] = {"inbox": self._inbox.path, "proof": proof}
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
        assert isinstance(inbox, str)  # inbox_problem refuses anything else
        # held from before the checks: what they prove is about the process it refers to, and
        # a write never goes to another process that got the pid after this one exited
        target = _Process.open(md.pid, inbox)
        peer = Peer(md.agent_name, md.regions, md.pid, target, dst_delta=md.window)
        try:
            self._check_writable(peer)
            self._check_possession(peer, md.extra.get("proof", b""))
            if target.gone():
                raise PeerError(f"peer {md.agent_name!r} (pid {md.pid}) exited during the handshake")
        except BaseException:
            target.close()
            raise
        self._processes.add(target)
        return peer

    def add_peer(self, metadata: PeerMetadata, regions: Sequence[Region] | None = None) -> Peer:
        peer = super().add_peer(metadata, regions)
        if regions is not None:  # the caller's region list replaced the checked one: check it too
            try:
                self._check_writable(peer)
            except PeerError:
                self.remove_peer(peer)
                raise
        return peer

    def _check_writable(self, peer: Peer) -> None:
        """Refuse a peer whose pid, inbox or destinations are not a local backend's own (see
        the module docstring): the handshake is where a hostile peer is stopped."""
        who = f"peer {peer.agent_name!r} (pid {peer.pid})"
        inbox = peer.private.inbox
        if peer.pid == os.getpid():
            if inbox == self._inbox.path:
                raise PeerError(f"{who} names this backend itself (its pid and its inbox): refused")
            with _live_lock:
                other = _live.get(inbox)
            if other is None or other.closed:
                raise PeerError(
                    f"{who} names this process, but {inbox!r} is the inbox of no other live local "
                    "backend of it: refused"
                )
            spans = other._allocated_spans()
        else:
            problem = peer_memory.inbox_holder_problem(inbox, peer.pid)
            if problem is not None:
                raise PeerError(f"{who}: inbox {inbox!r}: {problem}")
            try:
                spans = peer_memory.pdwire_spans(peer.pid)
            except OSError as exc:
                raise PeerError(f"{who}: its memory map cannot be read: {exc.strerror}") from None
        problem = peer_memory.destination_problem(_destinations(peer), spans)
        if problem is not None:
            raise PeerError(f"{who}: {problem}; the local backend writes nowhere else")

    def _check_possession(self, peer: Peer, claimed: bytes) -> None:
        """Refuse a peer whose metadata was not made by the backend owning the inbox it names
        (:mod:`.possession`): the /proc checks above prove that pid, inbox and memory are some
        live local backend's, this proves they are the sender's own."""
        inbox = peer.private.inbox
        try:
            uid = os.stat(f"/proc/{peer.pid}").st_uid
        except OSError as exc:
            raise PeerError(
                f"peer {peer.agent_name!r} (pid {peer.pid}) cannot be checked: {exc.strerror}"
            ) from None
        problem = possession.proof_problem(inbox, uid, peer.agent_name, peer.pid, claimed)
        if problem is not None:
            raise possession.NotPossessed(
                f"peer {peer.agent_name!r} (pid {peer.pid}), inbox {inbox!r}: {problem}; refused"
            )

    def _allocated_spans(self) -> list[tuple[int, int]]:
        """[start, end) of this backend's allocate()d memory and its live windows, sorted."""
        spans = []
        for mem in list(self._shared):
            if mem.array is None:
                continue
            spans.append((mem.address, mem.address + mem.nbytes))
            spans += [(w.base, w.base + mem.nbytes) for w in list(mem.windows) if not w.revoked]
        return sorted(spans)

    def peer_gone(self, peer: Peer) -> bool:
        """The process checked at the handshake exited: its pidfd says so (a pid alone could
        have been reused)."""
        return bool(peer.private.gone())

    def _remove_peer(self, peer: Peer) -> None:
        self._processes.discard(peer.private)
        peer.private.close()  # none of its transfers can still run

    # ---- transfers
    def _post(self, handle: TransferHandle, table: DescriptorTable, notification: bytes) -> None:
        peer = handle.peer
        target: _Process = peer.private
        inbox = target.inbox
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
            if target.gone():  # before a byte: the pid may since belong to another process
                return failed(_write_error(errno.ESRCH, peer))
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
            if target.gone():
                return failed(f"peer {peer.agent_name!r} (pid {pid}) died before the notification")
            try:
                shm.send(inbox, self.agent_name, notification)
            except OSError as exc:
                return failed(f"peer {peer.agent_name!r} inbox unavailable: {exc}")
            poke(f"{inbox}/{WAKE_NAME}")
            return DONE

        handle.private = self._submit(handle, run)

    def _receive_notifications(self) -> list[EngineNotification]:
        return [EngineNotification(s, p) for s, p in self._inbox.receive()]

    def _close(self) -> None:
        self._worker.stop()
        self._waker.close()
        self._inbox_waker.close()
        with _live_lock:
            if _live.get(self._inbox.path) is self:
                del _live[self._inbox.path]
        self._inbox.close()
        if not any(t.is_alive() for t in self._worker._threads):  # none stuck that may use them
            for target in self._processes:
                target.close()
        self._processes.clear()


class _Process:
    """The peer's process as checked at the handshake (a pidfd, where the kernel has them) and
    its inbox."""

    def __init__(self, pid: int, inbox: str, pidfd: int) -> None:
        self.pid, self.inbox, self.pidfd = pid, inbox, pidfd

    @classmethod
    def open(cls, pid: int, inbox: str) -> _Process:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise PeerError(f"pid {pid} is not running") from None
        except (OSError, AttributeError):
            pidfd = -1  # a kernel before 5.3: liveness by pid alone
        return cls(pid, inbox, pidfd)

    def gone(self) -> bool:
        """Whether the process exited (a pidfd turns readable then)."""
        if self.pidfd < 0:
            return not pid_alive(self.pid)
        poller = select.poll()  # (select() cannot take a descriptor past 1023)
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _destinations(peer: Peer) -> Iterator[tuple[int, str, int, int]]:
    """(index, name, start, length) of each region of ``peer`` as it would be written: through
    its window when it gave one (u64 arithmetic, as :meth:`Peer.engine_dst` does)."""
    for i, r in enumerate(peer.regions):
        delta = 0 if peer.dst_delta is None or i >= len(peer.dst_delta) else int(peer.dst_delta[i])
        yield i, r.name, (r.base + delta) % (1 << 64), r.length
