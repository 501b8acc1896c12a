"""Errors of foreign wire profiles (SGLang's frames): the WireError family plus the backend.

A foreign profile has no header naming it, so every error says which backend's message it
was read or written as, e.g. ``sglang nixl: NixlRegister.kv_data_ptrs (frame 6): ...``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from ..errors import DecodeError, EncodeError, FrameCountError, WireError


class _ProfileError(WireError):
    """Adds the profile and backend to a WireError; mixed in before DecodeError or EncodeError."""

    def __init__(
        self,
        problem: str,
        *,
        profile: str,
        backend: str | None,
        message: str | None = None,
        field: str | None = None,
        frame: int | None = None,
    ) -> None:
        super().__init__(problem, message=message, field=field, frame=frame)
        self.profile = profile
        self.backend = backend
        label = f"{profile} {backend}" if backend else profile
        self.args = (f"{label}: {self.args[0]}",)


_E = TypeVar("_E", bound="_ProfileError")


class ProfileDecodeError(_ProfileError, DecodeError):
    """Bytes that the profile's parser does not accept (or would crash on)."""


class ProfileFrameCountError(ProfileDecodeError, FrameCountError):
    """Too few or too many frames for the message."""


class UnrecognisedMessage(ProfileDecodeError):
    """No message of the profile matches the frames (or the caller named none that fits)."""


class ProfileEncodeError(_ProfileError, EncodeError):
    """A value the profile's builder cannot write (wrong type, out of range, not ASCII)."""


class ConversionError(_ProfileError):
    """A conversion between a profile message and pdwire's own message would lose or invent data.

    ``missing`` lists the pdwire fields the caller must supply (empty when the problem is
    content one side cannot carry).
    """

    def __init__(
        self,
        problem: str,
        *,
        profile: str,
        backend: str | None,
        message: str | None = None,
        field: str | None = None,
        missing: tuple[str, ...] = (),
    ) -> None:
        super().__init__(problem, profile=profile, backend=backend, message=message, field=field)
        self.missing = missing


@dataclass(frozen=True, slots=True)
class Where:
    """One frame of one message of one backend: the location every error names."""

    profile: str
    backend: str
    message: str
    field: str
    frame: int

    def decode_error(self, problem: str) -> ProfileDecodeError:
        return self._error(ProfileDecodeError, problem)

    def encode_error(self, problem: str) -> ProfileEncodeError:
        return self._error(ProfileEncodeError, problem)

    def _error(self, cls: type[_E], problem: str) -> _E:
        return cls(
            problem,
            profile=self.profile,
            backend=self.backend,
            message=self.message,
            field=self.field,
            frame=self.frame,
        )


__all__ = [
    "ConversionError",
    "ProfileDecodeError",
    "ProfileEncodeError",
    "ProfileFrameCountError",
    "UnrecognisedMessage",
    "Where",
]
