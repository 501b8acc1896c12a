"""The one exception family every codec failure belongs to.

Every decoder failure is a :class:`WireError` subclass whose text names the message, the
field and the frame; nothing from msgspec, struct or numpy escapes the codec.
"""

from __future__ import annotations


class WireError(Exception):
    """Base of every pdwire wire error.

    Attributes: ``message`` (message type name, when known), ``field`` (field name or
    path), ``frame`` (index of the offending frame in the multipart message).
    """

    def __init__(
        self, problem: str, *, message: str | None = None, field: str | None = None, frame: int | None = None
    ) -> None:
        self.problem = problem
        self.message = message
        self.field = field
        self.frame = frame
        where = ".".join(x for x in (message, field) if x)
        if frame is not None:
            where = f"{where} (frame {frame})" if where else f"frame {frame}"
        super().__init__(f"{where}: {problem}" if where else problem)


class DecodeError(WireError):
    """The bytes received are not a valid message."""


class HeaderError(DecodeError):
    """The header frame is missing, truncated or oversized."""


class BadMagic(HeaderError):
    """The header frame does not start with the pdwire magic."""


class WrongProtocol(HeaderError):
    """The header names another protocol."""


class UnknownMessageType(DecodeError):
    """The header's message type id is not known at that version."""


class UnsupportedVersion(DecodeError):
    """The header's major version is not one this build reads."""


class FrameError(DecodeError):
    """The frames are not a list of buffers, or one of them is not a buffer."""


class FrameCountError(DecodeError):
    """Frames are missing or extra relative to what the header and body declare."""


class BodyError(DecodeError):
    """The body is malformed: truncated, trailing bytes, wrong type, out of range."""


class BadEnumValue(BodyError):
    """An enum field carries a number this version does not define."""


class ArrayError(BodyError):
    """A packed array has a length that is not a multiple of its element size, or a bad frame reference."""


class EncodeError(WireError):
    """A message cannot be encoded (wrong value type, out-of-range array element)."""


class DowngradeError(EncodeError):
    """The content cannot be represented at the requested (older) version."""


class NegotiationError(WireError):
    """The handshake cannot agree."""


class VersionMismatch(NegotiationError):
    """The two peers share no protocol version; the text names both sides' versions."""

    def __init__(self, problem: str, *, ours: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> None:
        super().__init__(problem, message="Hello", field="versions")
        self.ours = ours
        self.theirs = theirs


class ProtocolNameMismatch(NegotiationError):
    """The peer speaks another protocol."""


__all__ = [
    "ArrayError",
    "BadEnumValue",
    "BadMagic",
    "BodyError",
    "DecodeError",
    "DowngradeError",
    "EncodeError",
    "FrameCountError",
    "FrameError",
    "HeaderError",
    "NegotiationError",
    "ProtocolNameMismatch",
    "UnknownMessageType",
    "UnsupportedVersion",
    "VersionMismatch",
    "WireError",
    "WrongProtocol",
]
