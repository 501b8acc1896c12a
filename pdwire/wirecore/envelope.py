"""The envelope layout's frame logic, shared by every generated version module.

A message is ``[header, body, *side_frames]``: the 12-byte header (:mod:`.header`), a
msgpack array whose positions are the fields' stable ids, and one frame per large packed
array. The single-buffer form is ``header + body`` with every array inline.

Generated code supplies one :class:`MessageCodec` per (version, message type); a
:class:`Registry` ties every version of a protocol together: it reads the header first,
dispatches on (version, type) before touching the body, upgrades older minors to the newest
model and down-converts when encoding for an older peer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from .arrays import Buffer, Cursor, SideFrames
from .errors import (
    BodyError,
    DowngradeError,
    EncodeError,
    FrameCountError,
    HeaderError,
    UnknownMessageType,
    UnsupportedVersion,
    WireError,
    WrongProtocol,
)
from .header import HEADER_SIZE, MAGIC, MAX_SIDE_FRAMES, pack_header, parse_header
from .msgspec_errors import body_error
from .negotiate import Version, describe

Frames = Sequence[Buffer]
Step = Callable[[Any], Any]


class MessageCodec(NamedTuple):
    """Everything needed to encode and decode one message type at one version."""

    name: str
    type_id: int
    protocol_id: int
    version: Version
    cls: type
    to_wire: Callable[[Any, SideFrames | None], list[Any]]
    decoder: msgspec.msgpack.Decoder[Any]
    from_wire: Callable[[Any, Cursor], Any]
    slots: tuple[str, ...]  # field name by id, for error messages
    header: bytes  # header frame with zero side frames


def make_header(protocol_id: int, version: Version, type_id: int) -> bytes:
    return pack_header(MAGIC, protocol_id, version[0], version[1], type_id, 0)


_ENCODER = msgspec.msgpack.Encoder()


def encode_with(mc: MessageCodec, msg: Any) -> list[Buffer]:
    side: SideFrames = []
    try:
        body = _ENCODER.encode(mc.to_wire(msg, side))
    except WireError:
        raise
    except Exception as exc:  # msgspec/numpy refuse a wrongly typed value
        raise EncodeError(f"cannot encode: {exc}", message=mc.name) from None
    if not side:
        return [mc.header, body]
    if len(side) > MAX_SIDE_FRAMES:
        raise EncodeError(f"{len(side)} side frames exceed {MAX_SIDE_FRAMES}", message=mc.name)
    v = mc.version
    return [pack_header(MAGIC, mc.protocol_id, v[0], v[1], mc.type_id, len(side)), body, *side]


def encode_bytes_with(mc: MessageCodec, msg: Any) -> bytes:
    try:
        body = _ENCODER.encode(mc.to_wire(msg, None))
    except WireError:
        raise
    except Exception as exc:
        raise EncodeError(f"cannot encode: {exc}", message=mc.name) from None
    return mc.header + body


def decode_with(mc: MessageCodec, frames: Frames, strict: bool = True) -> Any:
    """Decode the body (and side frames) of a message whose header was already checked.

    ``strict=False`` (a newer minor) tolerates side frames of fields this version skips.
    """
    try:
        wire = mc.decoder.decode(frames[1])
    except msgspec.MsgspecError as exc:
        raise body_error(exc, mc.name, mc.slots) from None
    except WireError:
        raise
    except Exception as exc:  # e.g. RecursionError, a frame without the buffer protocol
        raise BodyError(f"undecodable body: {exc!r}", message=mc.name, frame=1) from None
    cursor = Cursor(frames, mc.name)
    try:
        msg = mc.from_wire(wire, cursor)
    except WireError:
        raise
    except Exception as exc:
        raise BodyError(f"undecodable body: {exc!r}", message=mc.name, frame=1) from None
    cursor.finish(strict)
    return msg


def split_bytes(buf: Buffer) -> list[Buffer]:
    """The single-buffer form as frames: header and body, without copying."""
    view = memoryview(buf)
    if len(view) < HEADER_SIZE:
        raise HeaderError(f"buffer is {len(view)} bytes, shorter than the {HEADER_SIZE}-byte header", frame=0)
    return [view[:HEADER_SIZE], view[HEADER_SIZE:]]


class Registry:
    """All versions of one protocol: dispatch, upgrade, down-conversion.

    ``codecs`` maps each version to its message codecs by type id; ``up``/``down`` map
    ``(message name, target version)`` to the step function converting from the adjacent
    version (absent: the class is shared, the step is the identity). ``frozen_types`` are
    type ids (the handshake) decodable at any major with the newest layout.
    """

    def __init__(
        self,
        *,
        protocol: str,
        protocol_id: int,
        codecs: Mapping[Version, Mapping[int, MessageCodec]],
        up: Mapping[tuple[str, Version], Step],
        down: Mapping[tuple[str, Version], Step],
        frozen_types: frozenset[int] = frozenset(),
    ) -> None:
        self.protocol = protocol
        self.protocol_id = protocol_id
        self.versions: list[Version] = sorted(codecs)
        self.newest = self.versions[-1]
        self.codecs = codecs
        self.up = up
        self.down = down
        self.frozen_types = frozen_types
        self.by_class: dict[type, MessageCodec] = {}
        for v in self.versions:  # later versions win: a shared class encodes at the newest
            for mc in codecs[v].values():
                self.by_class[mc.cls] = mc
        self.dispatch: dict[tuple[int, int, int], tuple[MessageCodec, Step | None]] = {}
        for v in self.versions:
            for tid, mc in codecs[v].items():
                self.dispatch[(v[0], v[1], tid)] = (mc, self._chain(mc.name, v, self.newest))

    # --- conversion between versions -------------------------------------------------
    def _chain(self, name: str, frm: Version, to: Version) -> Step | None:
        i, j = self.versions.index(frm), self.versions.index(to)
        steps: list[Step] = []
        if i < j:
            steps = [self.up[(name, v)] for v in self.versions[i + 1 : j + 1] if (name, v) in self.up]
        elif i > j:
            steps = [self.down[(name, v)] for v in reversed(self.versions[j:i]) if (name, v) in self.down]
        if not steps:
            return None
        if len(steps) == 1:
            return steps[0]

        def run(msg: Any) -> Any:
            for s in steps:
                msg = s(msg)
            return msg

        return run

    def convert(self, msg: Any, version: Version) -> tuple[MessageCodec, Any]:
        """Convert ``msg`` to the model of ``version``; the codec to encode it with."""
        mc = self.by_class.get(type(msg))
        if mc is None:
            raise EncodeError(f"{type(msg).__name__} is not a {self.protocol} message")
        version = (int(version[0]), int(version[1]))
        target = self.codecs.get(version)
        if target is None:
            raise EncodeError(
                f"version {version[0]}.{version[1]} is not one this build writes ({describe(self.versions)})",
                message=mc.name,
            )
        out = target.get(mc.type_id)
        if out is None:
            raise DowngradeError(f"does not exist at version {version[0]}.{version[1]}", message=mc.name)
        step = self._chain(mc.name, mc.version, version) if mc.version != version else None
        return out, (msg if step is None else step(msg))

    # --- public codec ----------------------------------------------------------------
    def encode(self, msg: Any, version: Version | None = None) -> list[Buffer]:
        mc = self.by_class.get(type(msg))
        if mc is None:
            raise EncodeError(f"{type(msg).__name__} is not a {self.protocol} message")
        if version is None or version == mc.version:
            return encode_with(mc, msg)
        return encode_with(*self.convert(msg, version))

    def encode_bytes(self, msg: Any, version: Version | None = None) -> bytes:
        mc = self.by_class.get(type(msg))
        if mc is None:
            raise EncodeError(f"{type(msg).__name__} is not a {self.protocol} message")
        if version is None or version == mc.version:
            return encode_bytes_with(mc, msg)
        return encode_bytes_with(*self.convert(msg, version))

    def decode(self, frames: Frames) -> Any:
        msg, _ = self.decode_versioned(frames)
        return msg

    def decode_versioned(self, frames: Frames) -> tuple[Any, Version]:
        """Decode to the newest model; also return the version the sender wrote."""
        n = len(frames)
        if n < 2:
            raise FrameCountError(f"{n} frame(s); a message is a header frame and a body frame at least")
        pid, major, minor, tid, side = parse_header(frames[0])
        if pid != self.protocol_id:
            raise WrongProtocol(f"protocol id {pid}, expected {self.protocol_id} ({self.protocol})", frame=0)
        if n != 2 + side:
            raise FrameCountError(f"header announces {side} side frame(s), got {n - 2}", frame=0)
        entry = self.dispatch.get((major, minor, tid))
        if entry is None:
            entry = self._resolve(major, minor, tid)
        mc, step = entry
        msg = decode_with(mc, frames, (major, minor) <= mc.version)
        return (msg if step is None else step(msg)), (major, minor)

    def decode_bytes(self, buf: Buffer) -> Any:
        return self.decode(split_bytes(buf))

    def _resolve(self, major: int, minor: int, tid: int) -> tuple[MessageCodec, Step | None]:
        same_major = [v for v in self.versions if v[0] == major]
        if tid in self.frozen_types and not same_major:
            return self.dispatch[(*self.newest, tid)]
        if not same_major or minor < same_major[0][1]:
            raise UnsupportedVersion(
                f"version {major}.{minor} is not supported; this build reads {describe(self.versions)}",
                frame=0,
            )
        best = same_major[-1]
        entry = self.dispatch.get((best[0], best[1], tid))
        if entry is None or minor <= best[1]:
            raise UnknownMessageType(f"message type {tid} is not known at version {major}.{minor}", frame=0)
        return entry  # a newer minor: read what this version knows, skip the rest


def single_version_decoder(
    codecs: Mapping[int, MessageCodec], version: Version, protocol_id: int
) -> Callable[[Frames], Any]:
    """A decoder for exactly one version's model, as that version shipped.

    It reads messages of the same major at this minor or any newer one (skipping fields it
    does not know) and refuses older minors, which need the upgrade of the full codec.
    """

    def decode(frames: Frames) -> Any:
        n = len(frames)
        if n < 2:
            raise FrameCountError(f"{n} frame(s); a message is a header frame and a body frame at least")
        pid, major, minor, tid, side = parse_header(frames[0])
        if pid != protocol_id:
            raise WrongProtocol(f"protocol id {pid}, expected {protocol_id}", frame=0)
        if n != 2 + side:
            raise FrameCountError(f"header announces {side} side frame(s), got {n - 2}", frame=0)
        if major != version[0] or minor < version[1]:
            raise UnsupportedVersion(
                f"version {major}.{minor} cannot be read by the {version[0]}.{version[1]} model", frame=0
            )
        mc = codecs.get(tid)
        if mc is None:
            raise UnknownMessageType(
                f"message type {tid} is not known at version {version[0]}.{version[1]}", frame=0
            )
        return decode_with(mc, frames, minor == version[1])

    return decode
