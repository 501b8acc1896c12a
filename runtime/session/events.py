"""What the per-peer connection machines hand back to the edge: messages to send and typed events.

A connection machine (:mod:`.prefill_connection`, :mod:`.decode_connection`) turns each
decoded message from its peer into a list of these; the edge sends every :class:`Send` (encoded
at the version it names), does what the others ask for, and feeds room events to the session.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdwire import wire
from pdwire.runtime.config import ParallelRank
from pdwire.runtime.session.actions import PeerRef
from pdwire.runtime.session.failures import Failure
from pdwire.runtime.session.prefill_room import Target
from pdwire.runtime.session.stage_layers import HeldLayers
from pdwire.runtime.session.status import Status


@dataclass(frozen=True, slots=True)
class Send:
    """Encode ``message`` at ``version`` (None: the newest; only a Hello goes out before a version
    is agreed) and send it to the connection's peer."""

    message: wire.Message
    version: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class Problem:
    """Something the peer sent that changes nothing but belongs in the rank's failure log."""

    text: str


# --- prefill side: one decode peer -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddPeer:
    """Make the decode rank writable in the transfer engine, then answer with
    ``peer_added()`` or ``peer_refused(reason)`` on the connection."""

    peer: PeerRef
    agent_name: str
    agent_metadata: bytes
    region_descs: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Registered:
    """The decode rank is registered: requests from it can be planned and posted."""

    peer: PeerRef


@dataclass(frozen=True, slots=True)
class Requested:
    """A valid TransferRequest: ``target`` carries the destination indices it asked for."""

    room: int
    target: Target
    required: int


@dataclass(frozen=True, slots=True)
class AbortRequested:
    room: int
    peer: PeerRef


@dataclass(frozen=True, slots=True)
class LeaseRenewed:
    """The peer's engine still holds a request for each of ``rooms`` and has not asked yet."""

    rooms: tuple[int, ...]
    peer: PeerRef


# --- decode side: one prefill rank -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The handshake finished: the prefill rank took this rank's registration."""

    peer: PeerRef
    position: ParallelRank
    version: tuple[int, int]
    layers: HeldLayers | None = None  # the layers it holds (from 1.4; None: an older peer)


@dataclass(frozen=True, slots=True)
class Refused:
    """The handshake failed; ``reason`` names the cause (the peer's, when it refused)."""

    reason: str


@dataclass(frozen=True, slots=True)
class StatusReceived:
    room: int
    sender: int
    status: Status
    failure: Failure | None


@dataclass(frozen=True, slots=True)
class Completed:
    """A part of a room completed (an engine notification or one on the control socket)."""

    room: int
    sender: int
    kind: wire.NotificationKind
    chunk_id: int
    is_last: bool
    component: int
    # protocol 1.4: the same write completed these parts too (see DecodeRoom.on_notification)
    chunk_count: int = 1
    also_components: tuple[int, ...] = ()
    also_aux: bool = False
    # protocol 1.4: KV pages [scatter_first, + scatter_pages) of the room's page list were
    # written to its receive staging range, for this rank to copy into place first
    scatter_first: int = 0
    scatter_pages: int = 0


@dataclass(frozen=True, slots=True)
class AbortAcked:
    room: int
    sender: int


PrefillEvent = Send | Problem | AddPeer | Registered | Requested | AbortRequested | LeaseRenewed
DecodeEvent = Send | Problem | Ready | Refused | StatusReceived | Completed | AbortAcked


def completion(msg: wire.Message) -> Completed | Problem:
    """A notification as a completion event (engine notifications arrive outside any link)."""
    if not isinstance(msg, wire.Notification):
        return Problem(f"a notification carried a {type(msg).__name__}")
    return Completed(
        int(msg.room),
        int(msg.sender_rank),
        wire.NotificationKind(msg.kind),
        int(msg.chunk_id),
        bool(msg.is_last),
        int(msg.component),
        int(msg.chunk_count),
        tuple(int(c) for c in msg.also_components),
        bool(msg.also_aux),
        int(msg.scatter_first_page),
        int(msg.scatter_pages),
    )
