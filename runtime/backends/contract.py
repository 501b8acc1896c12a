"""The transfer-backend contract every engine adapter implements: :class:`Backend`.

Who calls what
--------------
One *owner thread* (the prefill or decode session's thread) calls every method of a
backend instance. Backends are not thread-safe; engines may run their own progress or
worker threads inside, invisibly. The life cycle on each side is::

    b = create_backend("nixl", agent_name="decode-0")
    buf = b.allocate("kv", nbytes)          # or bring your own memory (not for "local")
    b.register([buf.region(), ...])         # region i keeps index i forever
    md = b.local_metadata(for_peer="p0")    # send to the peer (RegisterInfo on the wire)
    peer = b.add_peer(peer_md)              # on the initiator (prefill) side
    h = b.post(peer, table, b"room-7:kv")   # one logical transfer, returns at once
    b.poll(h)                               # PENDING, DONE or FAILED(reason); never blocks
    b.cancel(h)                             # optional: ask the engine to stop; never blocks
    b.release(h)                            # once poll(h) is final
    b.receive_notifications()               # on the target (decode) side
    b.revoke("p0")                          # target side: that peer's late writes land nowhere
    b.release_windows("p0")                 # once nothing it was given can be written: unmapped
    b.close()                               # idempotent; frees everything

Guarantees (the method docstrings below say each in full; docs/backends.md and, for
revocation, docs/fencing.md say why): ``post`` validates every row before any byte moves; a
notification reaches the peer only after every byte of its transfer is visible there, exactly
one per successful ``post``; a final state (DONE or FAILED) means the engine no longer touches
either side's memory for that transfer (``final_states_fence`` says whether an engine keeps
that); ``poll`` and ``cancel`` never block, a cancel (or ``transfer_timeout_s``) is reported
final only once the engine confirms; ``release`` is the last step, not a fence; ``revoke``
cuts one peer's windows off so none of its writes, late or new, lands; ``close`` frees
everything and is idempotent. A FAILED transfer may have written part of its destination, and
nothing afterwards; a dead peer fails its transfers and leaves the backend usable. Buffers
whose numpy views are still referenced are unmapped with the last view (their backing name,
e.g. a /dev/shm file, is removed at close regardless).
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pdwire.runtime.backends.errors import (
    BackendClosed,
    DescriptorError,
    PeerError,
    RegistrationError,
    TransferError,
)
from pdwire.runtime.backends.values import (
    CANCELLING,
    PENDING,
    EngineNotification,
    HostBuffer,
    Peer,
    PeerMetadata,
    PollResult,
    Revocation,
    TransferHandle,
    TransferState,
    failed,
)
from pdwire.runtime.backends.wakeup import DatagramWaker, Waker
from pdwire.runtime.backends.window import SharedMemory, Window
from pdwire.runtime.descriptors import DescriptorTable, MemoryKind, Region, RegionColumns, outside_regions

# --------------------------------------------------------------------------- validation


def check_side(
    side: str,
    addr: npt.NDArray[np.uint64],
    length: npt.NDArray[np.uint64],
    region_idx: npt.NDArray[np.uint32],
    regions: Sequence[Region],
    columns: RegionColumns,
    owner: str,
) -> None:
    """Raise DescriptorError for the first row of one side that is not inside its region."""
    bad = outside_regions(addr, length, region_idx, columns)
    if not bad.any():
        return
    i = int(np.argmax(bad))
    ri = int(region_idx[i])
    if ri >= len(regions):
        raise DescriptorError(
            f"row {i}: {side}_region {ri} does not exist ({owner} registered {len(regions)} regions)"
        )
    r = regions[ri]
    raise DescriptorError(
        f"row {i}: {side} [{int(addr[i]):#x}, +{int(length[i])}) is not inside {owner} region "
        f"{ri} {r.name!r} [{r.base:#x}, {r.end:#x})" + (" (zero length)" if int(length[i]) == 0 else "")
    )


def batches(n: int, max_rows: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of at most ``max_rows`` rows covering ``n`` rows (engine batches)."""
    return [(s, min(s + max_rows, n)) for s in range(0, n, max_rows)]


def check_no_overlap(existing: Sequence[Region], new: Sequence[Region]) -> None:
    spans = sorted([*existing, *new], key=lambda r: r.base)
    for a, b in itertools.pairwise(spans):
        if b.base < a.end and a.kind == b.kind and a.device_id == b.device_id:
            raise RegistrationError(f"region {b.name!r} [{b.base:#x}, {b.end:#x}) overlaps region {a.name!r}")
    for r in new:
        if r.length <= 0 or r.base <= 0:
            raise RegistrationError(f"region {r.name!r} has base {r.base:#x} and length {r.length}")


# --------------------------------------------------------------------------- the interface


@dataclass(eq=False)
class _PeerWindows:
    """What one peer was given by ``local_metadata(for_peer=...)`` since its last revocation."""

    windows: dict[int, Window] = field(default_factory=dict)  # id(SharedMemory) -> its window
    deltas: list[int] = field(default_factory=list)  # per registered region; 0 = not windowed
    tokens: list[Any] = field(default_factory=list)  # the engine's registrations of the windows
    unwindowed: list[str] = field(default_factory=list)  # regions outside allocate()'d memory


def _no_windows(peer: str) -> str:
    return f"no windows were published to {peer!r}: nothing it writes can be revoked"


def _unwindowed(regions: list[str]) -> str:
    return (
        f"regions {regions} cannot be windowed (only memory from allocate() of an engine "
        "that writes through addresses can): writes into them cannot be revoked"
    )


class Backend(abc.ABC):
    """Base class: bookkeeping, validation and timeouts; engines implement the ``_`` hooks.

    Constructor arguments common to all backends (passed through ``create_backend``):
    ``agent_name`` (unique per process on a host; generated when omitted) and
    ``transfer_timeout_s`` (every transfer not DONE by then is cancelled, then FAILED).
    """

    name: str = "?"
    # How long close() waits for the engine to confirm that released or cancelled transfers
    # stopped before it tears the engine down anyway.
    close_wait_s: float = 10.0

    def __init__(self, agent_name: str | None = None, transfer_timeout_s: float = 30.0) -> None:
        self.agent_name = agent_name or f"{self.name}-{os.getpid()}-{os.urandom(4).hex()}"
        self.transfer_timeout_s = float(transfer_timeout_s)
        self.regions: list[Region] = []
        self._region_columns = RegionColumns.of(())
        self._peers: dict[str, Peer] = {}
        self._handles: dict[int, TransferHandle] = {}
        # Released (or peer-removed) while the engine might still touch their memory: their
        # engine requests and peers are freed only once the engine confirms they stopped.
        self._draining: dict[int, TransferHandle] = {}
        self._removing: list[Peer] = []
        self._next_id = 1
        self._closed = False
        self._shared: list[SharedMemory] = []  # what allocate() handed out: windowable
        self._windows: dict[str, _PeerWindows] = {}
        # revoked windows, still mapped (junk) until release_windows() says no write can come
        self._junk: dict[str, list[_PeerWindows]] = {}
        self._window_keys = itertools.count(1)
        self.windows_released = 0  # windows unmapped by release_windows()

    # ---- memory
    def allocate(self, name: str, nbytes: int) -> HostBuffer:
        """Allocate ``nbytes`` of pre-faulted, zeroed host memory this backend can register."""
        self._check_open()
        if nbytes <= 0:
            raise RegistrationError(f"buffer {name!r}: nbytes must be positive, got {nbytes}")
        return self._allocate(name, nbytes)

    def _allocate(self, name: str, nbytes: int) -> HostBuffer:
        """Memfd-backed memory, so that peers can get windows (an engine that takes its memory
        elsewhere, MoRI's allocator, overrides this)."""
        try:
            mem = SharedMemory(name, nbytes)
        except OSError as exc:
            raise RegistrationError(f"cannot allocate {nbytes} bytes for {name!r}: {exc}") from None
        self._shared.append(mem)
        assert mem.array is not None
        return HostBuffer(name, mem.array)

    def register(self, regions: Sequence[Region]) -> list[int]:
        """Register regions; returns their indices (the ``src_region`` / ``dst_region`` values).

        Indices follow registration order across calls. Call :meth:`local_metadata`
        after the last ``register`` so the peer sees every region.
        """
        self._check_open()
        regions = list(regions)
        check_no_overlap(self.regions, regions)
        for r in regions:
            if r.kind is MemoryKind.VRAM and not self.supports_vram:
                raise RegistrationError(f"region {r.name!r} is VRAM; backend {self.name!r} handles DRAM only")
        self._register(regions)
        first = len(self.regions)
        self.regions.extend(regions)
        self._region_columns = RegionColumns.of(self.regions)
        return list(range(first, len(self.regions)))

    supports_vram: bool = False

    @property
    def registration_fences_older(self) -> bool:
        """Whether a writer of this engine accepts a target's new registration only once every
        transfer to the target's older registrations is final (peers keyed by name, and final
        states that fence): the target may then unmap windows it revoked before registering."""
        return self.peers_keyed_by_name and self.final_states_fence

    # The engine keeps one entry per remote agent name (NIXL, MoRI): a peer cannot be replaced
    # by a same-named one while the old one's transfers may still run.
    peers_keyed_by_name: bool = False
    # Whether this engine's final states mean its writes stopped (the contract's promise). An
    # engine that cannot keep it (Mooncake writes after reporting FAILED) says so here: its
    # initiators' failure reports are no fence, and the target must revoke them instead.
    final_states_fence: bool = True
    # Whether every notification of a DONE transfer reaches the target. One that can be lost
    # (Mooncake logs a send that failed during a cut and still reports the batch done) makes
    # decode take a sender's Success status, sent after all its writes completed, as their proof.
    notifications_reliable: bool = True
    # Whether :meth:`wakeup_fds` turn readable when a posted transfer may have become final
    # (``wakes_on_completion``) or a notification may have arrived (``wakes_on_notification``):
    # a worker then blocks in its poller instead of polling the engine (see :mod:`.wakeup`).
    wakes_on_completion: bool = False
    wakes_on_notification: bool = False
    _wakers: tuple[Waker | DatagramWaker, ...] = ()  # what wakeup_fds() lists, set by the engine
    # After a window is remapped, a copy already inside the kernel may still finish into the
    # pages it pinned (process_vm_writev pins 16 at a time, then copies): reuse waits this long.
    revoke_grace_s: float = 0.05

    # ---- peers
    def local_metadata(self, for_peer: str | None = None) -> PeerMetadata:
        """This side's metadata for a peer. With ``for_peer`` the peer is given its own windows
        onto the registered memory (opened on first use, and again after :meth:`revoke`), so
        that it can be revoked alone; without it, the registered addresses themselves."""
        self._check_open()
        if for_peer is None:
            return self._local_metadata(None)
        pw = self._windows.setdefault(for_peer, _PeerWindows())
        self._cover(pw)
        return self._local_metadata(pw.deltas)

    def _cover(self, pw: _PeerWindows) -> None:
        """Give the peer a window onto every region registered since its windows were opened."""
        new: list[Region] = []
        for r in self.regions[len(pw.deltas) :]:
            mem = next((m for m in self._shared if m.contains(r.base, r.length)), None)
            if mem is None or r.kind is not MemoryKind.DRAM:
                pw.deltas.append(0)
                pw.unwindowed.append(r.name)
                continue
            w = pw.windows.get(id(mem))
            if w is None:
                try:
                    w = pw.windows[id(mem)] = mem.open_window()
                except OSError as exc:
                    raise RegistrationError(f"cannot open a window onto {mem.name!r}: {exc}") from None
            pw.deltas.append(w.delta)
            new.append(Region(w.base + (r.base - mem.address), r.length, r.kind, r.device_id, r.name))
        if new:
            pw.tokens.append(self._register_window(new))

    def revocation_blocker(self, for_peer: str) -> str | None:
        """Why :meth:`revoke` of ``for_peer`` would not be effective (None: it would be): ask
        before revoking, so that a peer that cannot be cut off is left undisturbed."""
        pw = self._windows.get(for_peer)
        if pw is None:
            return _no_windows(for_peer)
        return _unwindowed(pw.unwindowed) if pw.unwindowed else None

    def revoke(self, for_peer: str) -> Revocation:
        """Cut ``for_peer`` off the memory: its windows are deregistered from the engine and
        remapped to junk pages, so none of its writes, in flight or posted later from the
        metadata it has, changes a byte of the memory. Never waits for the peer; reuse the
        memory from ``settles_at`` on, and only if ``effective``. Idempotent per window set:
        a second call without new metadata in between has nothing left to revoke."""
        self._check_open()
        now = time.monotonic()
        pw = self._windows.pop(for_peer, None)
        if pw is None:
            return Revocation(for_peer, False, _no_windows(for_peer), now)
        problems: list[str] = []
        for token in pw.tokens:
            try:
                self._unregister_window(token)  # first: on RDMA this is what invalidates the key
            except Exception as exc:
                problems.append(f"the engine refused to deregister a window: {exc}")
        for w in pw.windows.values():
            try:
                w.revoke()
            except OSError as exc:
                problems.append(str(exc))
        if pw.unwindowed:
            problems.append(_unwindowed(pw.unwindowed))
        pw.tokens = []  # deregistered (or refused): release_windows() does not try again
        self._junk.setdefault(for_peer, []).append(pw)
        return Revocation(for_peer, not problems, "; ".join(problems), now + self.revoke_grace_s)

    def release_windows(self, for_peer: str, *, live: bool = True, junk: bool = True) -> int:
        """Unmap the windows given to ``for_peer``: with ``junk`` its revoked ones (junk since
        :meth:`revoke`), with ``live`` its current ones (deregistered from the engine first). Returns how
        many windows went. Call it only once nothing ``for_peer`` was given can still be written:
        every transfer of the peer through them ended (a writer that fenced its writes), or the
        writer is proven stopped; freed addresses are reused by the next mapping, so a late write
        would land there. Never waits; idempotent."""
        sets = self._junk.pop(for_peer, []) if junk else []
        if live and for_peer in self._windows:
            pw = self._windows.pop(for_peer)
            for token in pw.tokens:
                with contextlib.suppress(Exception):  # an engine that refuses keeps a stale entry only
                    self._unregister_window(token)
            sets.append(pw)
        gone = 0
        for pw in sets:
            for w in pw.windows.values():
                if not w.unmapped:
                    w.unmap()
                    gone += 1
        self.windows_released += gone
        return gone

    def new_window_key(self, label: str) -> str:
        """A ``for_peer`` key no other caller of this backend has: ``label#n``, n counting up
        per backend (two workers sharing one backend never name each other's windows)."""
        return f"{label}#{next(self._window_keys)}"

    def window_counts(self) -> tuple[int, int]:
        """(live, junk) windows this backend holds mapped: live ones are published to a peer,
        junk ones were revoked and wait for :meth:`release_windows`."""
        live = sum(len(pw.windows) for pw in self._windows.values())
        junk = sum(len(pw.windows) for sets in self._junk.values() for pw in sets)
        return live, junk

    def add_peer(self, metadata: PeerMetadata, regions: Sequence[Region] | None = None) -> Peer:
        """Make a peer writable. ``regions`` overrides the list carried in the metadata
        (for callers that learn the peer's layout elsewhere); it must not be longer.
        Adding an agent name again replaces the old entry (e.g. after it registered more)."""
        self._check_open()
        if metadata.agent_name == self.agent_name:
            raise PeerError(f"peer {metadata.agent_name!r} has this backend's own agent name")
        self._reap()  # a previous incarnation whose transfers stopped since is forgotten now
        old = self._peers.get(metadata.agent_name)
        if old is not None:
            self.remove_peer(old)
        if self.peers_keyed_by_name and any(p.agent_name == metadata.agent_name for p in self._removing):
            # The engine holds one entry per name, and the old incarnation's is still in use by
            # transfers that have not stopped: replacing it now would tear it down under them.
            raise PeerError(
                f"peer {metadata.agent_name!r}: its previous incarnation's transfers are still "
                "stopping; register again once they have (they end at their transfer timeout at the latest)"
            )
        peer = self._add_peer(metadata)
        if regions is not None:
            regions = tuple(regions)
            if len(regions) > len(peer.regions) and peer.regions:
                raise PeerError(
                    f"peer {peer.agent_name!r}: {len(regions)} regions supplied, "
                    f"its metadata has {len(peer.regions)}"
                )
            peer.regions = regions
        self._peers[peer.agent_name] = peer
        return peer

    def remove_peer(self, peer: Peer) -> None:
        """Forget a peer: nothing can be posted to it any more and its pending transfers are
        cancelled (``poll`` reports them FAILED once the engine confirms). The engine's state
        for the peer (connections, mapped memory) is freed once none of its transfers can
        still run. Never blocks; idempotent."""
        if peer.removed:
            return
        peer.removed = True
        if self._peers.get(peer.agent_name) is peer:
            del self._peers[peer.agent_name]
        for h in [*self._handles.values(), *self._draining.values()]:
            if h.peer is peer:
                self._request_cancel(h, f"peer {peer.agent_name!r} was removed")
        self._removing.append(peer)
        self._reap()

    def peer_gone(self, peer: Peer) -> bool:
        """Whether ``peer``'s process is proven to have exited (the local backend: the pidfd it
        holds since the handshake turned readable). False: not proven, which is all an engine
        that reaches its peers over the network can say; a live duplicate of a registered rank
        is then refused until the old connection's heartbeats stop."""
        return False

    @property
    def peers(self) -> dict[str, Peer]:
        return dict(self._peers)

    # ---- transfers
    def post(self, peer: Peer, table: DescriptorTable, notification: bytes) -> TransferHandle:
        """Start one logical WRITE of every row of ``table`` to ``peer``.

        ``notification`` is delivered to the peer once all bytes are visible there.
        Large tables are split into bounded engine batches inside the backend. Raises
        DescriptorError (bad rows), PeerError (unknown/removed peer) or TransferError
        (engine refused); otherwise engine failures show up as FAILED from :meth:`poll`.
        """
        h = self._admit(peer, table, notification)
        self._post(h, table, bytes(notification))
        self._handles[h.id] = h
        return h

    def _admit(self, peer: Peer, table: DescriptorTable, notification: bytes) -> TransferHandle:
        """Every check ``post`` makes before anything moves; returns an unposted handle."""
        self._check_open()
        self._reap()
        if peer.removed or self._peers.get(peer.agent_name) is not peer:
            raise PeerError(f"peer {peer.agent_name!r} is not added to backend {self.agent_name!r}")
        if not isinstance(notification, bytes | bytearray):
            raise TransferError(f"notification must be bytes, got {type(notification).__name__}")
        if len(table) == 0:
            raise DescriptorError("empty descriptor table: nothing to transfer, no notification can be sent")
        n, who = table.length, f"peer {peer.agent_name!r}"
        check_side("src", table.src_addr, n, table.src_region, self.regions, self._region_columns, "locally")
        check_side("dst", table.dst_addr, n, table.dst_region, peer.regions, peer.columns, who)
        h = TransferHandle(
            self._next_id, peer, table.total_bytes, len(table), time.monotonic() + self.transfer_timeout_s
        )
        self._next_id += 1
        return h

    def poll(self, handle: TransferHandle) -> PollResult:
        """Non-blocking. PENDING until DONE or FAILED; final states never change.

        A final state means the engine no longer touches either side's memory for this
        transfer. Past the transfer's deadline the transfer is cancelled (as by
        :meth:`cancel`) and reported PENDING ("cancelling") until the engine confirms.
        """
        return self._advance(self._own(handle))

    def cancel(self, handle: TransferHandle) -> None:
        """Ask the engine to stop a transfer; returns at once (never waits for the engine).

        Afterwards :meth:`poll` reports PENDING ("cancelling") until the engine confirms it
        no longer touches either side's memory, then FAILED ("cancelled"), or DONE if the
        transfer completed first (its notification may then have been delivered). No-op on
        a final or already cancelled transfer.
        """
        self._request_cancel(self._own(handle), "cancelled")

    def _request_cancel(self, h: TransferHandle, reason: str) -> None:
        if h.status.finished or h.cancel_reason is not None:
            return
        h.cancel_reason = reason
        self._cancel(h)

    def _advance(self, h: TransferHandle) -> PollResult:
        """One look at the engine: the handle's state now, final only once the engine is done."""
        if h.status.finished:
            return h.status
        if h.cancel_reason is None and time.monotonic() > self._deadline(h):
            # Reporting FAILED now would let the caller reuse memory the engine may still
            # write; the timeout goes through the same confirmed cancel as cancel().
            self._request_cancel(
                h, f"transfer {h.id} to {h.peer.agent_name!r} not done after {self.transfer_timeout_s}s"
            )
        status = self._poll(h)
        if not status.finished:
            return PENDING if h.cancel_reason is None else CANCELLING
        if h.cancel_reason is not None and status.state is TransferState.FAILED:
            status = failed(h.cancel_reason)  # why it was stopped says more than the engine's "cancelled"
        h.status = status
        return status

    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> PollResult:
        """Poll until finished or ``timeout_s`` passes (returns PENDING then). Convenience."""
        end = time.monotonic() + (self.transfer_timeout_s + 1 if timeout_s is None else timeout_s)
        pause = 1e-5
        while True:
            st = self.poll(handle)
            if st.finished or time.monotonic() > end:
                return st
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def release(self, handle: TransferHandle) -> None:
        """Free a handle; it cannot be polled afterwards. Idempotent; never blocks.

        A final handle's engine request is freed at once. A transfer that is not final is
        cancelled (its notification may or may not arrive) and its engine request is kept
        until the engine confirms it stopped: later calls on this backend retry, and
        :meth:`close` waits for it. Release does not say when the memory is safe to reuse;
        cancel and poll to a final state for that.
        """
        if handle.released:
            return
        if self._handles.pop(handle.id, None) is None:
            return
        handle.released = True
        if self._advance(handle).finished:
            self._release(handle)
            return
        self._request_cancel(handle, "released while pending")
        self._draining[handle.id] = handle

    def _reap(self) -> None:
        """Free what waited for the engine: released transfers that stopped, then peers
        none of whose transfers can still run."""
        for h in list(self._draining.values()):
            if self._advance(h).finished:
                del self._draining[h.id]
                self._release(h)
        for peer in list(self._removing):
            if not any(h.peer is peer for h in self._unconfirmed()):
                self._removing.remove(peer)
                self._remove_peer(peer)

    def _unconfirmed(self) -> list[TransferHandle]:
        return [h for h in (*self._handles.values(), *self._draining.values()) if not h.status.finished]

    def wakeup_fds(self) -> tuple[int, ...]:
        """File descriptors a poller can wait on for this engine's news (none: poll it)."""
        return () if self._closed else tuple(w.fd for w in self._wakers)

    def clear_wakeups(self) -> None:
        """Drain :meth:`wakeup_fds` (call before looking at the engine, so news that comes
        after the look makes them readable again)."""
        if not self._closed:
            for w in self._wakers:
                w.drain()

    def receive_notifications(self) -> list[EngineNotification]:
        """Notifications that arrived since the last call, oldest first per sender."""
        self._check_open()
        return self._receive_notifications()

    def close(self) -> None:
        """Release every handle, peer, registration and buffer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for h in list(self._handles.values()):
                self.release(h)
            for p in list(self._peers.values()):
                self.remove_peer(p)
            # The one place that waits: engine teardown must not pull memory from under a
            # transfer that is still stopping.
            end = time.monotonic() + self.close_wait_s
            pause = 1e-4
            while (self._draining or self._removing) and time.monotonic() < end:
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
                self._reap()
            # Whatever the engine never confirmed is left to its own teardown: its requests
            # and its peers' state are not freed here (freeing them could fault a writer).
            self._draining.clear()
            self._removing.clear()
        finally:
            self._close()
            # After the engine: windows are remapped to junk, never unmapped under a writer.
            for mem in self._shared:
                mem.close()
            self._shared.clear()
            self._windows.clear()
            self._junk.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _deadline(self, handle: TransferHandle) -> float:
        """When a transfer times out: ``transfer_timeout_s`` after its post, unless the engine
        knows better (worker-thread engines count from when a thread started the job)."""
        return handle.deadline

    # ---- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosed(f"backend {self.name!r} agent {self.agent_name!r} is closed")

    def _own(self, handle: TransferHandle) -> TransferHandle:
        if handle.released or self._handles.get(handle.id) is not handle:
            raise TransferError(f"transfer handle {handle.id} is not live on backend {self.agent_name!r}")
        return handle

    # ---- engine hooks
    @abc.abstractmethod
    def _register(self, regions: list[Region]) -> None: ...

    @abc.abstractmethod
    def _local_metadata(self, window: list[int] | None) -> PeerMetadata:
        """This side's metadata; ``window`` (one offset per region, 0 = none) goes into the
        envelope's ``extra["window"]`` so the initiator writes through the windows."""

    def _register_window(self, regions: list[Region]) -> Any:
        """Register one peer's window regions with the engine; returns what deregisters them.
        Engines that write through addresses without registration keep the default."""
        return None

    def _unregister_window(self, token: Any) -> None:  # noqa: B027 (optional hook)
        """Deregister what :meth:`_register_window` returned (called by :meth:`revoke`)."""

    @abc.abstractmethod
    def _add_peer(self, metadata: PeerMetadata) -> Peer: ...

    @abc.abstractmethod
    def _remove_peer(self, peer: Peer) -> None: ...

    @abc.abstractmethod
    def _post(self, handle: TransferHandle, table: DescriptorTable, notification: bytes) -> None: ...

    @abc.abstractmethod
    def _poll(self, handle: TransferHandle) -> PollResult:
        """The engine's state of a transfer; never blocks. Return DONE or FAILED only when the
        engine no longer touches either side's memory for it (after :meth:`_cancel` too)."""

    @abc.abstractmethod
    def _cancel(self, handle: TransferHandle) -> None:
        """Ask the engine to stop a transfer that is not final; must not block. Called at
        most once per handle; :meth:`_poll` confirms when it stopped."""

    @abc.abstractmethod
    def _release(self, handle: TransferHandle) -> None:
        """Free the engine's request of a transfer :meth:`_poll` reported final."""

    @abc.abstractmethod
    def _receive_notifications(self) -> list[EngineNotification]: ...

    @abc.abstractmethod
    def _close(self) -> None: ...
