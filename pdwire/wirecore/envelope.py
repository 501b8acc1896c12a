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

import itertools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import msgspec

from .arrays import Buffer, Cursor, Frames, SideCounter, SideFrames
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

Step = Callable[[Any], Any]
_count = itertools.count
# header bytes -> (body decoder, fast generated decoder, frame count, step to newest, version)
_Entry = tuple[Callable[[Any], Any], Callable[[Any, Frames, SideCounter], Any], int, Step | None, Version]


class MessageCodec(NamedTuple):
    """Everything to encode and decode one message type at one version (built by :func:`codec`)."""

    name: str
    type_id: int
    protocol_id: int
    version: Version
    cls: type
    to_wire: Callable[[Any, SideFrames | None], list[Any]]
    decoder: msgspec.msgpack.Decoder[Any]
    from_wire: Callable[[Any, Cursor], Any]
    # the same without checks of its own: any surprise raises and from_wire runs instead
    fast_from_wire: Callable[[Any, Frames, SideCounter], Any]
    slots: tuple[str, ...]  # field name by id, for error messages
    headers: tuple[bytes, ...]  # header frame by side-frame count, for the first HEADERS_CACHED counts
    lone_cursor: Cursor  # shared by messages without side frames (never mutated: any reference fails)

    @property
    def header(self) -> bytes:
        """The header frame with zero side frames."""
        return self.headers[0]


# Header frames are precomputed for this many side-frame counts (0 .. HEADERS_CACHED - 1) per
# message codec: encoding indexes a tuple and decoding dispatches on the header bytes.
HEADERS_CACHED = 16


def make_header(protocol_id: int, version: Version, type_id: int, side: int = 0) -> bytes:
    return pack_header(MAGIC, protocol_id, version[0], version[1], type_id, side)


def codec(
    *,
    name: str,
    type_id: int,
    protocol_id: int,
    version: Version,
    cls: type,
    to_wire: Callable[[Any, SideFrames | None], list[Any]],
    decoder: msgspec.msgpack.Decoder[Any],
    from_wire: Callable[[Any, Cursor], Any],
    fast_from_wire: Callable[[Any, Frames, SideCounter], Any],
    slots: tuple[str, ...],
) -> MessageCodec:
    """A :class:`MessageCodec` with its precomputed header frames."""
    headers = tuple(make_header(protocol_id, version, type_id, k) for k in range(HEADERS_CACHED))
    lone = Cursor((b"", b""), name)
    return MessageCodec(
        name,
        type_id,
        protocol_id,
        version,
        cls,
        to_wire,
        decoder,
        from_wire,
        fast_from_wire,
        slots,
        headers,
        lone,
    )


_encode = msgspec.msgpack.Encoder().encode


def encode_with(mc: MessageCodec, msg: Any) -> list[Buffer]:
    side: SideFrames = []
    try:
        body = _encode(mc.to_wire(msg, side))
    except WireError:
        raise
    except Exception as exc:  # msgspec/numpy refuse a wrongly typed value
        raise EncodeError(f"cannot encode: {exc}", message=mc.name) from None
    n = len(side)
    if not n:
        return [mc.headers[0], body]
    if n < HEADERS_CACHED:
        return [mc.headers[n], body, *side]
    if n > MAX_SIDE_FRAMES:
        raise EncodeError(f"{n} side frames exceed {MAX_SIDE_FRAMES}", message=mc.name)
    v = mc.version
    return [pack_header(MAGIC, mc.protocol_id, v[0], v[1], mc.type_id, n), body, *side]


def encode_bytes_with(mc: MessageCodec, msg: Any) -> bytes:
    try:
        body = _encode(mc.to_wire(msg, None))
    except WireError:
        raise
    except Exception as exc:
        raise EncodeError(f"cannot encode: {exc}", message=mc.name) from None
    return mc.headers[0] + body


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
    lone = len(frames) == 2
    cursor = mc.lone_cursor if lone else Cursor(frames, mc.name)
    try:
        msg = mc.from_wire(wire, cursor)
    except WireError:
        raise
    except Exception as exc:
        raise BodyError(f"undecodable body: {exc!r}", message=mc.name, frame=1) from None
    if not lone:
        cursor.finish(strict)
    return msg


def split_bytes(buf: Buffer) -> list[Buffer]:
    """The single-buffer form as frames: header and body, without copying."""
    view = memoryview(buf)
    if len(view) < HEADER_SIZE:
        raise HeaderError(f"buffer is {len(view)} bytes, shorter than the {HEADER_SIZE}-byte header", frame=0)
    return [bytes(view[:HEADER_SIZE]), view[HEADER_SIZE:]]  # a 12-byte copy: the header dispatches by value


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
        # exact header frame -> (codec, step to the newest model, frame count, version): one
        # dict lookup checks magic, protocol, version, type and side-frame count together
        self.by_header: dict[bytes, _Entry] = {}
        for v in self.versions:
            for tid, mc in codecs[v].items():
                step = self._chain(mc.name, v, self.newest)
                self.dispatch[(v[0], v[1], tid)] = (mc, step)
                for k, header in enumerate(mc.headers):
                    self.by_header[header] = (mc.decoder.decode, mc.fast_from_wire, k + 2, step, v)

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
        if mc is not None and (version is None or version == mc.version):
            # the common case inline; any failure repeats through encode_with, which
            # classifies it (encoding has no side effects outside its own side list)
            side: SideFrames = []
            try:
                body = _encode(mc.to_wire(msg, side))
            except Exception:
                return encode_with(mc, msg)
            n = len(side)
            if n < HEADERS_CACHED:
                return [mc.headers[n], body, *side]
            return encode_with(mc, msg)
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

    def _fast(self, frames: Frames) -> tuple[Any, Version] | None:
        """The common case: a ``bytes`` header this build writes itself (see :meth:`decode`)."""
        n = len(frames)
        if n < 2:
            return None
        header = frames[0]
        if type(header) is not bytes:
            return None
        entry = self.by_header.get(header)
        if entry is None or n != entry[2]:
            return None
        try:
            k = _count(2)
            msg = entry[1](entry[0](frames[1]), frames, k)
            if next(k) != n:  # a side frame no field referenced
                return None
        except Exception:
            return None
        step = entry[3]
        return (msg if step is None else step(msg)), entry[4]

    def decode(self, frames: Frames) -> Any:
        """Decode multipart frames into the newest model (older minors are upgraded).

        The common case runs in this one frame: a ``bytes`` header this build writes itself
        (one dict lookup on its bytes checks magic, protocol, version, type and side-frame
        count at once) and the generated decoder without checks of its own. Any surprise
        falls through to the checked path, which repeats the work and raises the classified
        error; decoding has no side effects, so repeating it is safe.
        """
        n = len(frames)
        if n >= 2:
            header = frames[0]
            if type(header) is bytes:
                entry = self.by_header.get(header)
                if entry is not None and n == entry[2]:
                    try:
                        k = _count(2)
                        msg = entry[1](entry[0](frames[1]), frames, k)
                        ok = next(k) == n  # else a side frame no field referenced
                    except Exception:
                        ok = False
                    if ok:
                        step = entry[3]
                        return msg if step is None else step(msg)
        return self._checked(frames)[0]

    def decode_versioned(self, frames: Frames) -> tuple[Any, Version]:
        """Decode to the newest model; also return the version the sender wrote."""
        fast = self._fast(frames)
        return fast if fast is not None else self._checked(frames)

    def _checked(self, frames: Frames) -> tuple[Any, Version]:
        """Every header check spelled out; raises the classified error."""
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
