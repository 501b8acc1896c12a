"""Typed failures: what went wrong with a room, carried to the requester.

From protocol 1.2 the kind travels typed, in ``TransferStatus.failure_kind`` (and
``RegisterAck.failure_kind``), and ``reason`` holds the detail alone. Peers that agreed on 1.1
or older carry it as a ``"<kind>: <detail>"`` prefix of ``TransferStatus.reason`` so the far
side can rebuild the same typed :class:`Failure`; :func:`failure_to_wire` and
:func:`failure_from_wire` pick the form by the agreed version. The kinds are the wire's own
enum (``pdwire.wire.FailureKind``); ``UNSPECIFIED`` is a failure of unknown kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdwire.wire import FailureKind, features

__all__ = [
    "DuplicateRoomError",
    "Failure",
    "FailureKind",
    "HandshakeError",
    "ProtocolViolation",
    "RegistrationMismatch",
    "RoomFailedError",
    "SessionError",
    "failure_from_wire",
    "failure_to_wire",
]


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a room (or a registration) failed: the wire's :class:`FailureKind` and a detail.

    ``UNSPECIFIED`` is a failure whose kind is not known: a peer older than 1.2 that gave no
    ``"<kind>: "`` prefix, or a status without a reason.
    """

    kind: FailureKind
    detail: str

    @property
    def reason(self) -> str:
        """The detail with its kind as a ``"<kind>: "`` prefix (the form peers before 1.2 carry)."""
        if self.kind == FailureKind.UNSPECIFIED:
            return self.detail
        return f"{self.kind.name.lower()}: {self.detail}"

    @classmethod
    def parse(cls, reason: str) -> Failure:
        """Inverse of :attr:`reason`; an unknown or missing kind becomes ``UNSPECIFIED``."""
        head, sep, tail = reason.partition(": ")
        kind = FailureKind.__members__.get(head.upper()) if sep and head.islower() else None
        if kind is None or kind == FailureKind.UNSPECIFIED:
            return cls(FailureKind.UNSPECIFIED, reason)
        return cls(kind, tail)


TYPED_FAILURES_SINCE = features.field_since("TransferStatus", "failure_kind")


REASON_MAX = 4096
"""Characters of a failure's text sent to a peer: a reason quoting a peer's input (an exception
text) stays far below the peer's control socket message limit."""


def _clipped(text: str) -> str:
    if len(text) <= REASON_MAX:
        return text
    return f"{text[:REASON_MAX]}... ({len(text) - REASON_MAX} more characters)"


def failure_to_wire(failure: Failure | None, version: tuple[int, int] | None) -> tuple[FailureKind, str]:
    """``(failure_kind, reason)`` to send at ``version`` (None: not agreed yet, the oldest form)."""
    if failure is None:
        return FailureKind.UNSPECIFIED, ""
    if version is None or version < TYPED_FAILURES_SINCE:
        return FailureKind.UNSPECIFIED, _clipped(failure.reason)
    return failure.kind, _clipped(failure.detail)


def failure_from_wire(kind: FailureKind | int, reason: str) -> Failure:
    """Inverse of :func:`failure_to_wire`: a typed kind wins; unspecified reads the reason prefix."""
    if kind != FailureKind.UNSPECIFIED:
        # the decoder refuses numbers this build does not know, so the kind is one of ours
        return Failure(FailureKind(kind), reason)
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
