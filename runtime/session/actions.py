"""Values the pure state machines hand back to the I/O edge.

The machines never touch a socket, an engine or a clock: they return these, and the
driver performs them (encode and send a message, plan and post a transfer, free memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdwire.runtime.session.failures import Failure
from pdwire.runtime.session.status import RoomStatus


@dataclass(frozen=True, slots=True)
class PeerRef:
    """One rank of one engine instance: the unit that handshakes and registers."""

    engine_id: str
    rank: int

    def __str__(self) -> str:
        return f"{self.engine_id}/{self.rank}"


# --- what a prefill rank posts for one target -------------------------------------------


@dataclass(frozen=True, slots=True)
class KvPart:
    """KV pages of one prefill chunk; ``start``/``stop`` are page positions in the prompt."""

    chunk_id: int
    start: int
    stop: int
    is_last: bool


@dataclass(frozen=True, slots=True)
class StatePart:
    component: int


@dataclass(frozen=True, slots=True)
class AuxPart:
    pass


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
    status: RoomStatus
    failure: Failure | None = None


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
    status: RoomStatus
    failure: Failure | None


@dataclass(frozen=True, slots=True)
class ReleaseSlots:
    """A decode room's destination slots are the engine's again: no sender writes into them.

    Follows ``ReleaseRoom(SUCCESS)`` at once (every write completed). For a failed room it
    waits until every sender that could write has fenced (a Failed or Success status, an
    AbortAck, or the sender is gone) or until the fence timeout; ``unfenced`` names the
    senders the timeout gave up on (empty when every sender fenced).
    """

    room: int
    unfenced: tuple[PeerRef, ...] = ()


Action = PostTransfer | CancelTransfers | SendStatus | SendAbort | SendAbortAck | ReleaseRoom | ReleaseSlots
