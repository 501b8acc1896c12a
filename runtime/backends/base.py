"""The transfer-backend contract every engine adapter implements.

Who calls what
--------------
One *owner thread* (the prefill or decode session's thread) calls every method of a
backend instance. Backends are not thread-safe; engines may run their own progress or
worker threads inside, invisibly. The life cycle on each side is::

    b = create_backend("nixl", agent_name="decode-0")
    buf = b.allocate("kv", nbytes)          # or bring your own memory (not for "local")
    b.register([buf.region(), ...])         # region i keeps index i forever
    md = b.local_metadata()                 # send to the peer (RegisterInfo on the wire)
    peer = b.add_peer(peer_md)              # on the initiator (prefill) side
    h = b.post(peer, table, b"room-7:kv")   # one logical transfer, returns at once
    b.poll(h)                               # PENDING, DONE or FAILED(reason); never blocks
    b.release(h)
    b.receive_notifications()               # on the target (decode) side
    b.close()                               # idempotent; frees everything

Guarantees
----------
* ``post`` validates every row before any byte moves: src inside the local region named
  by ``src_region``, dst inside the peer's region named by ``dst_region``; otherwise one
  :class:`DescriptorError` naming the row and region (nothing is posted).
* A notification is delivered to the peer only after every byte of its transfer is
  visible in the peer's memory. Receiving ``(agent, payload)`` from
  :meth:`Backend.receive_notifications` therefore means the data of that transfer is
  readable. Exactly one notification per successful ``post``; none for a failed one.
* ``poll`` never blocks and every transfer ends: a transfer that is not DONE within
  ``transfer_timeout_s`` of its post is reported FAILED (and the engine request is
  cancelled where the engine allows). A dead peer makes its transfers FAILED; the
  backend stays usable for other and new peers.
* ``close`` releases every handle, peer, registration and buffer it created, and is
  idempotent. Buffers whose numpy views are still referenced are unmapped when the last
  view dies (the backing name, e.g. a /dev/shm file, is removed at close regardless).
"""

from __future__ import annotations

import abc
import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from pdwire.runtime.descriptors import DescriptorTable, MemoryKind, Region, RegionColumns, outside_regions

# --------------------------------------------------------------------------- errors


class BackendError(Exception):
    """Base of every error a backend raises on purpose."""


class BackendUnavailable(BackendError):
    """The named backend does not exist or its engine cannot be imported here."""


class BackendClosed(BackendError):
    """The backend was used after ``close()``."""


class RegistrationError(BackendError):
    """A region could not be registered (overlap, not backend memory, engine refusal)."""


class PeerError(BackendError):
    """Bad peer metadata, an unknown or removed peer, or a peer that is gone."""


class DescriptorError(BackendError):
    """A descriptor row lies outside the region it names; raised before anything moves."""


class TransferError(BackendError):
    """The engine refused to start a transfer or an unknown handle was used."""


# --------------------------------------------------------------------------- values


class TransferState(StrEnum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class TransferStatus:
    state: TransferState
    reason: str = ""

    @property
    def finished(self) -> bool:
        return self.state is not TransferState.PENDING


PENDING = TransferStatus(TransferState.PENDING)
DONE = TransferStatus(TransferState.DONE)


def failed(reason: str) -> TransferStatus:
    return TransferStatus(TransferState.FAILED, reason)


@dataclass(frozen=True, slots=True)
class PeerMetadata:
    """What one side publishes so the other can write into it.

    Maps 1:1 onto the wire's RegisterInfo: ``agent_name``, an opaque ``agent_metadata``
    blob (a versioned pdwire envelope holding the engine's own metadata and the region
    list in registration order), and ``region_descs``: one engine-native memory
    descriptor blob per region for engines that address memory by descriptor (MoRI);
    empty for the others.
    """

    agent_name: str
    agent_metadata: bytes
    region_descs: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class Notification:
    peer_agent_name: str
    payload: bytes


@dataclass(eq=False)
class Peer:
    """A peer added with :meth:`Backend.add_peer`; pass it to :meth:`Backend.post`."""

    agent_name: str
    regions: tuple[Region, ...]
    pid: int
    engine: Any = None  # backend-private state (mapped segments, engine names, ...)
    removed: bool = False
    _columns: tuple[tuple[Region, ...], RegionColumns] | None = field(default=None, init=False, repr=False)

    @property
    def columns(self) -> RegionColumns:
        """``regions`` as u64 columns, rebuilt only when ``regions`` is replaced."""
        if self._columns is None or self._columns[0] is not self.regions:
            self._columns = (self.regions, RegionColumns.of(self.regions))
        return self._columns[1]


@dataclass(eq=False)
class TransferHandle:
    """One posted transfer. Opaque to callers; backends keep their state in ``engine``."""

    id: int
    peer: Peer
    nbytes: int
    ndescs: int
    deadline: float
    engine: Any = None
    status: TransferStatus = field(default=PENDING)
    released: bool = False


class HostBuffer:
    """Writable host memory handed out by :meth:`Backend.allocate`.

    ``array`` is a flat ``uint8`` numpy view (wrap it as a torch tensor with
    ``torch.frombuffer(buf.array, dtype=torch.uint8)`` or view it with any dtype);
    ``address`` is the absolute virtual address of byte 0.
    """

    def __init__(self, name: str, array: npt.NDArray[np.uint8]) -> None:
        self.name = name
        self.array = array

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def region(self, offset: int = 0, length: int | None = None, name: str | None = None) -> Region:
        length = self.nbytes - offset if length is None else length
        if offset < 0 or length <= 0 or offset + length > self.nbytes:
            raise RegistrationError(
                f"region [{offset}, {offset + length}) is outside buffer {self.name!r} of {self.nbytes} bytes"
            )
        return Region(self.address + offset, length, MemoryKind.DRAM, 0, name or self.name)


# --------------------------------------------------------------------------- metadata envelope

ENVELOPE_VERSION = 1


class _Envelope(msgspec.Struct, array_like=True):
    version: int
    backend: str
    agent_name: str
    pid: int
    regions: list[tuple[int, int, str, int, str]]
    engine: bytes
    extra: dict[str, Any] = {}


def encode_envelope(
    backend: str,
    agent_name: str,
    regions: Sequence[Region],
    engine: bytes,
    extra: dict[str, Any] | None = None,
) -> bytes:
    rows = [(r.base, r.length, r.kind.value, r.device_id, r.name) for r in regions]
    env = _Envelope(ENVELOPE_VERSION, backend, agent_name, os.getpid(), rows, engine, extra or {})
    return msgspec.msgpack.encode(env)


@dataclass(frozen=True, slots=True)
class DecodedMetadata:
    agent_name: str
    pid: int
    regions: tuple[Region, ...]
    engine: bytes
    extra: dict[str, Any]


def decode_envelope(backend: str, md: PeerMetadata) -> DecodedMetadata:
    try:
        env = msgspec.msgpack.decode(md.agent_metadata, type=_Envelope)
    except msgspec.DecodeError as exc:
        raise PeerError(f"agent metadata of {md.agent_name!r} is not a pdwire envelope: {exc}") from None
    if env.version != ENVELOPE_VERSION:
        raise PeerError(
            f"agent metadata of {md.agent_name!r} has envelope version {env.version}, "
            f"this build reads {ENVELOPE_VERSION}"
        )
    if env.backend != backend:
        raise PeerError(f"peer {md.agent_name!r} runs backend {env.backend!r}, this side runs {backend!r}")
    if env.agent_name != md.agent_name:
        raise PeerError(f"metadata names agent {env.agent_name!r} but was sent as {md.agent_name!r}")
    regions = tuple(Region(b, n, MemoryKind(k), d, nm) for b, n, k, d, nm in env.regions)
    return DecodedMetadata(env.agent_name, env.pid, regions, env.engine, env.extra)


def pid_alive(pid: int) -> bool:
    """Whether a process of this host still exists (the local engines' liveness probe)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def validate_table(
    table: DescriptorTable, local: Sequence[Region], local_columns: RegionColumns, peer: Peer
) -> None:
    check_side("src", table.src_addr, table.length, table.src_region, local, local_columns, "locally")
    check_side(
        "dst",
        table.dst_addr,
        table.length,
        table.dst_region,
        peer.regions,
        peer.columns,
        f"peer {peer.agent_name!r}",
    )


def check_no_overlap(existing: Sequence[Region], new: Sequence[Region]) -> None:
    spans = sorted([*existing, *new], key=lambda r: r.base)
    for a, b in itertools.pairwise(spans):
        if b.base < a.end and a.kind == b.kind and a.device_id == b.device_id:
            raise RegistrationError(f"region {b.name!r} [{b.base:#x}, {b.end:#x}) overlaps region {a.name!r}")
    for r in new:
        if r.length <= 0 or r.base <= 0:
            raise RegistrationError(f"region {r.name!r} has base {r.base:#x} and length {r.length}")


# --------------------------------------------------------------------------- the interface


class Backend(abc.ABC):
    """Base class: bookkeeping, validation and timeouts; engines implement the ``_`` hooks.

    Constructor arguments common to all backends (passed through ``create_backend``):
    ``agent_name`` (unique per process on a host; generated when omitted) and
    ``transfer_timeout_s`` (every transfer not DONE by then is FAILED).
    """

    name: str = "?"

    def __init__(self, agent_name: str | None = None, transfer_timeout_s: float = 30.0) -> None:
        self.agent_name = agent_name or f"{self.name}-{os.getpid()}-{os.urandom(4).hex()}"
        self.transfer_timeout_s = float(transfer_timeout_s)
        self.regions: list[Region] = []
        self._region_columns = RegionColumns.of(())
        self._peers: dict[str, Peer] = {}
        self._handles: dict[int, TransferHandle] = {}
        self._next_id = 1
        self._closed = False

    # ---- memory
    def allocate(self, name: str, nbytes: int) -> HostBuffer:
        """Allocate ``nbytes`` of pre-faulted, zeroed host memory this backend can register."""
        self._check_open()
        if nbytes <= 0:
            raise RegistrationError(f"buffer {name!r}: nbytes must be positive, got {nbytes}")
        return self._allocate(name, nbytes)

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

    # ---- peers
    def local_metadata(self) -> PeerMetadata:
        self._check_open()
        return self._local_metadata()

    def add_peer(self, metadata: PeerMetadata, regions: Sequence[Region] | None = None) -> Peer:
        """Make a peer writable. ``regions`` overrides the list carried in the metadata
        (for callers that learn the peer's layout elsewhere); it must not be longer.
        Adding an agent name again replaces the old entry (e.g. after it registered more)."""
        self._check_open()
        if metadata.agent_name == self.agent_name:
            raise PeerError(f"peer {metadata.agent_name!r} has this backend's own agent name")
        old = self._peers.get(metadata.agent_name)
        if old is not None:
            self.remove_peer(old)
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
        """Forget a peer; its pending transfers become FAILED. Idempotent."""
        if peer.removed:
            return
        for h in list(self._handles.values()):
            if h.peer is peer and not h.status.finished:
                self._abort(h)
                h.status = failed(f"peer {peer.agent_name!r} was removed")
        peer.removed = True
        self._peers.pop(peer.agent_name, None)
        self._remove_peer(peer)

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
        if peer.removed or self._peers.get(peer.agent_name) is not peer:
            raise PeerError(f"peer {peer.agent_name!r} is not added to backend {self.agent_name!r}")
        if not isinstance(notification, bytes | bytearray):
            raise TransferError(f"notification must be bytes, got {type(notification).__name__}")
        if len(table) == 0:
            raise DescriptorError("empty descriptor table: nothing to transfer, no notification can be sent")
        validate_table(table, self.regions, self._region_columns, peer)
        h = TransferHandle(
            self._next_id, peer, table.total_bytes, len(table), time.monotonic() + self.transfer_timeout_s
        )
        self._next_id += 1
        return h

    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Non-blocking. PENDING until DONE or FAILED; final states never change."""
        h = self._own(handle)
        if h.status.finished:
            return h.status
        status = self._poll(h)
        if not status.finished and time.monotonic() > h.deadline:
            self._abort(h)
            status = failed(
                f"transfer {h.id} to {h.peer.agent_name!r} not done after {self.transfer_timeout_s}s"
            )
        h.status = status
        return status

    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> TransferStatus:
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
        """Free a handle. A still-PENDING transfer is cancelled where the engine allows;
        its notification may or may not arrive. Idempotent."""
        if handle.released:
            return
        if self._handles.pop(handle.id, None) is None:
            return
        if not handle.status.finished:
            self._abort(handle)
            handle.status = failed("released while pending")
        handle.released = True
        self._release(handle)

    def receive_notifications(self) -> list[Notification]:
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
        finally:
            self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
    def _allocate(self, name: str, nbytes: int) -> HostBuffer: ...

    @abc.abstractmethod
    def _register(self, regions: list[Region]) -> None: ...

    @abc.abstractmethod
    def _local_metadata(self) -> PeerMetadata: ...

    @abc.abstractmethod
    def _add_peer(self, metadata: PeerMetadata) -> Peer: ...

    @abc.abstractmethod
    def _remove_peer(self, peer: Peer) -> None: ...

    @abc.abstractmethod
    def _post(self, handle: TransferHandle, table: DescriptorTable, notification: bytes) -> None: ...

    @abc.abstractmethod
    def _poll(self, handle: TransferHandle) -> TransferStatus: ...

    @abc.abstractmethod
    def _abort(self, handle: TransferHandle) -> None:
        """Best-effort cancel of a pending transfer; must not block for long."""

    @abc.abstractmethod
    def _release(self, handle: TransferHandle) -> None: ...

    @abc.abstractmethod
    def _receive_notifications(self) -> list[Notification]: ...

    @abc.abstractmethod
    def _close(self) -> None: ...


def aligned_zeros(nbytes: int, align: int = 4096) -> npt.NDArray[np.uint8]:
    """Zeroed, page-aligned, pre-faulted host memory (writing the zeros faults every page in)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    arr = raw[off : off + nbytes]
    arr.fill(0)
    return arr


def batches(n: int, max_rows: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of at most ``max_rows`` rows covering ``n`` rows."""
    return [(s, min(s + max_rows, n)) for s in range(0, n, max_rows)]
