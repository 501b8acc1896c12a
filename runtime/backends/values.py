"""The values a backend hands out and takes: poll results, peers, handles, buffers, notifications.

Named so they do not collide with the wire's messages: :class:`PollResult` is what
``Backend.poll`` returns for one engine transfer (the wire's ``TransferStatus`` is a room's
status between workers), and :class:`EngineNotification` is a payload that arrived through the
engine (the wire's ``Notification`` is the message it usually carries).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from pdwire.runtime.backends.errors import RegistrationError
from pdwire.runtime.descriptors import MemoryKind, Region, RegionColumns


class TransferState(StrEnum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class PollResult:
    state: TransferState
    reason: str = ""

    @property
    def finished(self) -> bool:
        return self.state is not TransferState.PENDING


PENDING = PollResult(TransferState.PENDING)
CANCELLING = PollResult(TransferState.PENDING, "cancelling")  # cancel asked, engine not done yet
DONE = PollResult(TransferState.DONE)


def failed(reason: str) -> PollResult:
    return PollResult(TransferState.FAILED, reason)


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
class Revocation:
    """What :meth:`Backend.revoke` did for one peer.

    ``effective``: every region that peer was given lies in a revoked window, so none of
    its writes, late or new, can reach the memory (``reason`` says which region could not
    be windowed otherwise). ``settles_at`` (``time.monotonic()`` clock): copies already
    inside the kernel when the windows were remapped have finished by then; reuse the
    memory from that moment on, not before.
    """

    peer: str
    effective: bool
    reason: str
    settles_at: float


@dataclass(frozen=True, slots=True)
class EngineNotification:
    peer_agent_name: str
    payload: bytes


@dataclass(eq=False)
class Peer:
    """A peer added with :meth:`Backend.add_peer`; pass it to :meth:`Backend.post`."""

    agent_name: str
    regions: tuple[Region, ...]
    pid: int
    private: Any = None  # the backend's own state for this peer (mapped segments, engine names, ...)
    removed: bool = False
    # per region: window address - published address (mod 2**64), when the peer gave us windows
    dst_delta: npt.NDArray[np.uint64] | None = None
    _columns: tuple[tuple[Region, ...], RegionColumns] | None = field(default=None, init=False, repr=False)

    @property
    def columns(self) -> RegionColumns:
        """``regions`` as u64 columns, rebuilt only when ``regions`` is replaced."""
        if self._columns is None or self._columns[0] is not self.regions:
            self._columns = (self.regions, RegionColumns.of(self.regions))
        return self._columns[1]

    def engine_dst(
        self, dst_addr: npt.NDArray[np.uint64], dst_region: npt.NDArray[np.uint32]
    ) -> npt.NDArray[np.uint64]:
        """Destination addresses as the engine must write them: through the peer's windows."""
        if self.dst_delta is None:
            return dst_addr
        return dst_addr + self.dst_delta[dst_region]  # u64 wraps like the delta was taken


@dataclass(eq=False)
class TransferHandle:
    """One posted transfer. Opaque to callers; backends keep their state in ``private``."""

    id: int
    peer: Peer
    nbytes: int
    ndescs: int
    deadline: float
    private: Any = None
    status: PollResult = field(default=PENDING)
    released: bool = False
    cancel_reason: str | None = None  # set once a cancel was asked: the FAILED reason to report


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
