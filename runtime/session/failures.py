"""Typed failures: what went wrong with a room, carried to the requester as a reason string.

A reason travels inside ``TransferStatus.failure_reason`` as ``"<kind>: <detail>"`` so the
far side can rebuild the same typed :class:`Failure` (and raise the same exception class)
without a schema change for every new kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FailureKind(StrEnum):
    ENGINE_ERROR = "engine_error"  # the transfer engine refused or failed a post
    PEER_GONE = "peer_gone"  # the peer process or connection went away
    TIMEOUT = "timeout"  # the room outlived its deadline
    VALIDATION = "validation"  # a message was well-formed but wrong for this room or peer
    DUPLICATE_ROOM = "duplicate_room"  # a room id already in use
    ABORTED = "aborted"  # the other side (or the local owner) aborted the room
    HANDSHAKE = "handshake"  # the peer was refused at the handshake
    REMOTE = "remote"  # the peer reported a failure whose kind this side does not know


@dataclass(frozen=True, slots=True)
class Failure:
    kind: FailureKind
    detail: str

    @property
    def reason(self) -> str:
        return f"{self.kind.value}: {self.detail}"

    @classmethod
    def parse(cls, reason: str) -> Failure:
        """Inverse of :attr:`reason`; an unknown or missing kind becomes ``REMOTE``."""
        head, sep, tail = reason.partition(": ")
        if sep:
            try:
                return cls(FailureKind(head), tail)
            except ValueError:
                pass
        return cls(FailureKind.REMOTE, reason)


class SessionError(Exception):
    """Base of every error the session layer raises."""


class DuplicateRoomError(SessionError):
    """A room id that is still in use (or just finished) was offered again."""

    def __init__(self, room: int, detail: str = "") -> None:
        self.room = room
        super().__init__(f"room {room} is already in use" + (f" ({detail})" if detail else ""))


class HandshakeError(SessionError):
    """The peers cannot work together; the message names what differs on each side."""


class ProtocolViolation(SessionError):
    """A peer sent something the protocol does not allow at this point."""


class RoomFailedError(SessionError):
    """Raised by blocking helpers when a room ends Failed; carries the typed failure."""

    def __init__(self, room: int, failure: Failure) -> None:
        self.room = room
        self.failure = failure
        super().__init__(f"room {room} failed: {failure.reason}")
