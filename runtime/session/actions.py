"""Values the pure state machines hand back to the I/O edge.

The machines never touch a socket, an engine or a clock: they return these, and the
driver performs them (encode and send a message, plan and post a transfer, free memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pdwire.runtime.indices import RequestIndices
from pdwire.runtime.session.failures import Failure
from pdwire.runtime.session.status import Status

I32 = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class PeerRef:
    """One rank of one engine instance: the unit that handshakes and registers. ``rank`` is the
    peer's engine-wide rank (``ParallelRank.engine_rank``)."""

    engine_id: str
    rank: int

    def __str__(self) -> str:
        return f"{self.engine_id}/{self.rank}"


# --- what a prefill rank posts for one target -------------------------------------------
# A part carries the source and destination indices it writes, so the edge plans and posts it
# from the action alone. Equality is the part's identity (which chunk, which component); the
# index arrays ride along and are not compared.


def _no_indices() -> I32:
    return np.zeros(0, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class KvPart:
    """KV pages of one prefill chunk; ``start``/``stop`` are page positions in the prompt, ``src``
    and ``dst`` the pages this target gets of them (none of those decode already holds)."""

    chunk_id: int
    start: int
    stop: int
    is_last: bool
    src: I32 = field(default_factory=_no_indices, compare=False, repr=False)
    dst: I32 = field(default_factory=_no_indices, compare=False, repr=False)
    dst_first: int = field(default=0, compare=False)  # where ``dst`` starts in the room's page list
    # (offset in the decode rank's receive staging buffer, bytes per page) where these pages may
    # be written for decode to scatter (protocol 1.4); (-1, 0): only in place
    scatter_at: tuple[int, int] = field(default=(-1, 0), compare=False)


@dataclass(frozen=True, slots=True)
class StatePart:
    """One state component: source and destination indices (one each for a slot component)."""

    component: int
    src: I32 = field(default_factory=_no_indices, compare=False, repr=False)
    dst: I32 = field(default_factory=_no_indices, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class AuxPart:
    """The request's aux item: source and destination item indices."""

    src: int = field(default=0, compare=False)
    dst: int = field(default=0, compare=False)


Part = KvPart | StatePart | AuxPart


# --- actions ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PostTransfer:
    """Plan ``part`` of ``room`` for ``peer`` and post it; report back under ``xfer_id``."""

    xfer_id: int
    room: int
    peer: PeerRef
    part: Part


@dataclass(frozen=True, slots=True)
class CancelTransfers:
    """Ask the engine to stop these transfers of a failed room, and keep polling them.

    The room ends only once each of them was reported done or failed, i.e. once the engine
    confirmed it no longer touches either side's memory.
    """

    room: int
    xfer_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SendStatus:
    peer: PeerRef
    room: int
    status: Status
    failure: Failure | None = None


@dataclass(frozen=True, slots=True, eq=False)
class SendRequest:
    """Decode asks one prefill rank for ``room``: a TransferRequest with ``indices`` (empty for a
    dummy sender, which is told only so that its room advances)."""

    peer: PeerRef
    room: int
    is_dummy: bool
    required: int  # required_dst_info_num: how many decode ranks that prefill rank waits for
    indices: RequestIndices


@dataclass(frozen=True, slots=True)
class SendAbort:
    peer: PeerRef
    room: int
    failure: Failure


@dataclass(frozen=True, slots=True)
class SendAbortAck:
    peer: PeerRef
    room: int


@dataclass(frozen=True, slots=True)
class ReleaseRoom:
    """The room is over, with its final status; emitted exactly once per room.

    On a prefill rank nothing of the room is in flight any more: its source buffers may be
    freed. On a decode rank it tells the engine the outcome; the destination slots are the
    engine's again only with :class:`ReleaseSlots`.
    """

    room: int
    status: Status
    failure: Failure | None


@dataclass(frozen=True, slots=True)
class ReleaseSlots:
    """A decode room's destination slots are the engine's again: no sender writes into them
    (at once after a success; for a failed room once every sender fenced, :mod:`.decode_room`).
    ``revoked`` names the senders fenced by revocation."""

    room: int
    revoked: tuple[PeerRef, ...] = ()


@dataclass(frozen=True, slots=True)
class RevokePeer:
    """Cut ``peer`` off this decode rank's memory (``Backend.revoke``): it may still write into a
    failed room's slots and cannot say that it stopped. The edge answers as
    :mod:`.decode_session` says; the peer writes here again only after it registered again."""

    peer: PeerRef


Action = (
    PostTransfer
    | CancelTransfers
    | SendStatus
    | SendRequest
    | SendAbort
    | SendAbortAck
    | ReleaseRoom
    | ReleaseSlots
    | RevokePeer
)
