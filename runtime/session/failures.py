"""Typed failures: what went wrong with a room, carried to the requester.

From protocol 1.2 the kind travels typed, in ``TransferStatus.failure_kind`` (and
``RegisterAck.failure_kind``), and ``reason`` holds the detail alone. Peers that agreed on 1.1
or older carry it as a ``"<kind>: <detail>"`` prefix of ``TransferStatus.reason`` so the far
side can rebuild the same typed :class:`Failure`; :func:`failure_to_wire` and
:func:`failure_from_wire` pick the form by the agreed version. A kind the wire enum lacks
(``REMOTE``) always travels in the prefix form with ``failure_kind`` unspecified.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pdwire import wire


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


TYPED_FAILURES_SINCE = (1, 2)  # first version with FailureKind on the wire


def failure_to_wire(failure: Failure | None, version: tuple[int, int] | None) -> tuple[wire.FailureKind, str]:
    """``(failure_kind, reason)`` to send at ``version`` (None: not agreed yet, the oldest form)."""
    if failure is None:
        return wire.FailureKind.UNSPECIFIED, ""
    kind = wire.FailureKind.__members__.get(failure.kind.name)
    if kind is None or version is None or version < TYPED_FAILURES_SINCE:
        return wire.FailureKind.UNSPECIFIED, failure.reason
    return kind, failure.detail


def failure_from_wire(kind: wire.FailureKind, reason: str) -> Failure:
    """Inverse of :func:`failure_to_wire`: a typed kind wins; unspecified reads the reason prefix."""
    if kind != wire.FailureKind.UNSPECIFIED:
        try:
            return Failure(FailureKind[wire.FailureKind(kind).name], reason)
        except (KeyError, ValueError):  # a kind this build does not know: keep it, untyped
            return Failure(FailureKind.REMOTE, f"{int(kind)}: {reason}")
    return Failure.parse(reason)


class SessionError(Exception):
    """Base of every error the session layer raises."""


class DuplicateRoomError(SessionError):
    """A room id that is still in use (or just finished) was offered again."""

    def __init__(self, room: int, detail: str = "") -> None:
        self.room = room
        super().__init__(f"room {room} is already in use" + (f" ({detail})" if detail else ""))


class HandshakeError(SessionError):
    """The peers cannot work together; the message names what differs on each side."""


class RegistrationMismatch(HandshakeError):
    """A registration disagrees with this side's model (1.2 self-description) or with itself
    (per-layer values of one tensor that differ, at any version).

    ``component`` is ``"state_components[i] (kind)"``, ``tensor`` the tensor name (or "" for
    the whole component) and ``field`` the StateComponent field that differs.
    """

    def __init__(self, component: str, tensor: str, field: str, detail: str) -> None:
        self.component, self.tensor, self.field = component, tensor, field
        where = f"RegisterInfo.{component}" + (f", tensor {tensor!r}" if tensor else "")
        super().__init__(f"{where}, field {field}: {detail}")


class ProtocolViolation(SessionError):
    """A peer sent something the protocol does not allow at this point."""


class RoomFailedError(SessionError):
    """Raised by blocking helpers when a room ends Failed; carries the typed failure."""

    def __init__(self, room: int, failure: Failure) -> None:
        self.room = room
        self.failure = failure
        super().__init__(f"room {room} failed: {failure.reason}")
