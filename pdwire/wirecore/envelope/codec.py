"""The envelope layout's frame logic, shared by every generated major module.

A message is ``[header, body, *side_frames]``: the 12-byte header (:mod:`.header`), a
msgpack array whose positions are the fields' stable ids, and one frame per large packed
array. The single-buffer form is ``header + body`` with every array inline.

One model per major: a generated major module declares each message once (its newest
minor's struct, wire struct, encoder and decoders) in a :class:`MessageSpec`, plus what the
older minors need: ``at`` (the message as minor ``v`` carries it: hooks, dropped fields,
refusals), ``trim`` (cut a body to minor ``v``'s positions) and, for minors whose body still
holds fields removed later, a :class:`Legacy` layout. :func:`major_codecs` turns those into
one :class:`MessageCodec` per (version, type id); a :class:`Registry` ties every version of a
protocol together: it reads the header first and dispatches on (version, type) before
touching the body.

An older minor's body is read with the newest wire struct (msgspec fills the positions it
lacks with their defaults) and then checked with ``at``: content the claimed version cannot
carry is refused, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from ..arrays import Buffer, Cursor, Frames, SideFrame, SideFrames
from ..errors import (
    BodyError,
    DowngradeError,
    EncodeError,
    FrameCountError,
    FrameError,
    HeaderError,
    UnknownMessageType,
    UnsupportedVersion,
    WireError,
    WrongProtocol,
)
from ..types import Version, as_version
from .header import HEADER_SIZE, MAGIC, MAX_SIDE_FRAMES, pack_header, parse_header
from .msgspec_errors import body_error
from .negotiate import describe

Step = Callable[[Any], Any]
ToWire = Callable[[Any, SideFrames | None], list[Any]]
FromWire = Callable[[Any, Cursor], Any]
# (wire struct, frames, index of the next side frame) -> (message, index after its side frames)
FastFromWire = Callable[[Any, Frames, int], tuple[Any, int]]
# header bytes -> (body decoder, fast generated decoder, frame count, check after decoding, version)
_Entry = tuple[Callable[[Any], Any], FastFromWire, int, Step | None, Version]


# --- what generated major modules declare ---------------------------------------------------
class Legacy(NamedTuple):
    """The layout of a minor whose body still carries fields the model no longer has."""

    to_wire: ToWire
    wire: type  # the wire struct of that minor
    from_wire: FromWire
    slots: tuple[str, ...]


class MessageSpec(NamedTuple):
    """One top-level message of one major, as the generated module declares it."""

    name: str
    type_id: int
    since: int  # the minor it appeared in
    cls: type
    to_wire: ToWire
    wire: type  # the newest minor's wire struct
    from_wire: FromWire
    fast_from_wire: FastFromWire
    slots: tuple[str, ...]  # field name by id (newest), for error messages
    at: Callable[[Any, int], Any] | None = None  # the message as minor v carries it
    trim: Callable[[list[Any], int], Any] | None = None  # cut a newest body to minor v
    legacy: Mapping[int, Legacy] = {}
    # the scalar fields whose 64-bit bounds the encoder leaves to msgpack (see encode_with)
    scalars: Sequence[Scalar] = ()


class MessageCodec(NamedTuple):
    """Everything to encode and decode one message type at one version (built by :func:`major_codecs`)."""

    name: str
    type_id: int
    protocol_id: int
    version: Version
    cls: type
    to_wire: ToWire
    decoder: msgspec.msgpack.Decoder[Any]
    from_wire: FromWire
    fast_from_wire: FastFromWire | None  # None: every message takes the checked path
    after: Step | None  # applied to what the decoders return (an older minor's check)
    slots: tuple[str, ...]
    headers: tuple[bytes, ...]  # header frame by side-frame count, for the first HEADERS_CACHED counts
    lone_cursor: Cursor  # shared by messages without side frames (never mutated: any reference fails)
    scalars: Sequence[Scalar] = ()  # what names a field whose int msgpack refused


# Header frames are precomputed for this many side-frame counts (0 .. HEADERS_CACHED - 1) per
# message codec: encoding indexes a tuple and decoding dispatches on the header bytes.
HEADERS_CACHED = 16


def _older_to_wire(spec: MessageSpec, v: int) -> ToWire:
    at, trim, enc = spec.at, spec.trim, spec.to_wire
    if at is None and trim is None:
        return enc

    def to_wire(msg: Any, side: SideFrames | None) -> list[Any]:
        body = enc(msg if at is None else at(msg, v), side)
        if trim is not None:
            trim(body, v)
        return body

    return to_wire


def _older_check(spec: MessageSpec, v: int, version: Version) -> Step | None:
    """What runs after decoding a message of minor ``v`` with the newest struct."""
    at = spec.at
    if at is None:
        return None

    def check(msg: Any) -> Any:
        try:
            return at(msg, v)
        except DowngradeError as exc:
            raise BodyError(
                f"carries what version {version[0]}.{version[1]} does not have: {exc.problem}",
                message=spec.name,
                field=exc.field,
                frame=1,
            ) from None

    return check


def major_codecs(
    protocol_id: int, major: int, minors: Sequence[int], specs: Sequence[MessageSpec]
) -> dict[Version, dict[int, MessageCodec]]:
    """One codec per (version, type id) of a major from its message declarations."""
    newest = max(minors)
    out: dict[Version, dict[int, MessageCodec]] = {}
    for v in minors:
        version = (major, v)
        table: dict[int, MessageCodec] = {}
        for s in specs:
            if s.since > v:
                continue
            mc = MessageCodec(
                name=s.name,
                type_id=s.type_id,
                protocol_id=protocol_id,
                version=version,
                cls=s.cls,
                to_wire=s.to_wire if v == newest else _older_to_wire(s, v),
                decoder=msgspec.msgpack.Decoder(s.wire),
                from_wire=s.from_wire,
                fast_from_wire=s.fast_from_wire,
                after=None if v == newest else _older_check(s, v, version),
                slots=s.slots,
                headers=tuple(
                    pack_header(MAGIC, protocol_id, major, v, s.type_id, k) for k in range(HEADERS_CACHED)
                ),
                lone_cursor=Cursor((b"", b""), s.name),
                scalars=s.scalars,
            )
            legacy = s.legacy.get(v)
            if legacy is not None:  # its own layout, and always the checked decoder
                mc = mc._replace(
                    to_wire=legacy.to_wire,
                    decoder=msgspec.msgpack.Decoder(legacy.wire),
                    from_wire=legacy.from_wire,
                    fast_from_wire=None,
                    after=None,
                    slots=legacy.slots,
                )
            table[s.type_id] = mc
        out[version] = table
    return out


# --- helpers the generated `at` functions call ------------------------------------------------
def _is_default(value: Any, default: Any) -> bool:
    if isinstance(default, list) or isinstance(value, np.ndarray):
        return len(value) == 0
    return bool(value is default or value == default)


def absent(value: Any, default: Any, where: str, since: Version, version: int) -> None:
    """Refuse a value of a field that minor ``version`` of ``since``'s major does not have."""
    if not _is_default(value, default):
        shown = value.tolist() if isinstance(value, np.ndarray) else value
        text = repr(shown)
        raise DowngradeError(
            f"added in {since[0]}.{since[1]}: version {since[0]}.{version} cannot carry "
            f"{text if len(text) <= 60 else text[:57] + '...'}",
            field=where,
        )


def enum_at(value: Any, since: Mapping[int, int], where: str, major: int, version: int) -> None:
    """Refuse an enum value that minor ``version`` does not have (``since``: value -> minor)."""
    first = since.get(int(value), 0)
    if first > version:
        name = getattr(value, "name", str(value))
        raise DowngradeError(
            f"value {name} does not exist before {major}.{first} (version {major}.{version} peers refuse it)",
            field=where,
        )


def apply_hook(msg: Any, values: Mapping[str, Any], old: dict[str, Any] | None) -> Any:
    """What a downgrade hook returned: values of the model's fields replace them, values of
    fields the model no longer has go to ``old`` (a legacy layout writes them)."""
    if not values:
        return msg
    fields = set(msg.__struct_fields__)
    if old is not None:
        old.update({k: val for k, val in values.items() if k not in fields})
    changes = {k: val for k, val in values.items() if k in fields}
    return msgspec.structs.replace(msg, **changes) if changes else msg


def reset(msg: Any, defaults: Mapping[str, Any]) -> Any:
    """``msg`` with the given fields at their defaults (a copy, only when one differs)."""
    changes = {k: d for k, d in defaults.items() if not _is_default(getattr(msg, k), d)}
    return msgspec.structs.replace(msg, **changes) if changes else msg


# --- encode-side checks of scalars ------------------------------------------------------------
# (field name, kind, lower bound or enum class, upper bound): kind "int", "bool", "str", "enum";
# an optional field's entry is preceded by "?"
Scalar = tuple[str, str, Any, Any]


def refuse_scalars(msg: Any, name: str, scalars: Sequence[Scalar]) -> tuple[Any, ...]:
    """The generated encoders' slow path: raise EncodeError for the first field whose value is
    outside its type, naming message and field. When every value is acceptable after all (an
    int given for an enum field that names one of its values), return the values in
    ``scalars`` order: the encoder's inline check stopped at the first surprise, so the locals
    it binds for the body are set from these."""
    values = []
    for field, kind, lo, hi in scalars:
        value = getattr(msg, field)
        values.append(value)
        if kind.startswith("?"):
            if value is None:
                continue
            kind = kind[1:]
        problem = _scalar_problem(value, kind, lo, hi)
        if problem is not None:
            raise EncodeError(problem, message=name, field=field)
    return tuple(values)


def _scalar_problem(value: Any, kind: str, lo: Any, hi: Any) -> str | None:
    if kind == "bool":
        return None if type(value) is bool else f"expected bool, got {type(value).__name__} {value!r}"
    if kind == "str":
        return None if isinstance(value, str) else f"expected str, got {type(value).__name__}"
    if kind == "enum":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"expected {lo.__name__}, got {type(value).__name__} {value!r}"
        try:
            lo(value)
        except ValueError:
            return f"{value} is not a {lo.__name__} (values: {', '.join(f'{m.name}={m.value}' for m in lo)})"
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected an integer, got {type(value).__name__} {value!r}"
    if not lo <= value <= hi:
        return f"{value} is outside [{lo}, {hi}]"
    return None


# --- encoding and decoding --------------------------------------------------------------------
_encode = msgspec.msgpack.Encoder().encode


def _body(mc: MessageCodec, msg: Any, side: SideFrames | None) -> bytes:
    """The encoded body, or the error for a value msgspec or numpy refused. A top-level encoder
    leaves the 64-bit bounds msgpack shares to msgspec's OverflowError: the scalar table names
    the field."""
    try:
        return _encode(mc.to_wire(msg, side))
    except WireError:
        raise
    except Exception as exc:  # msgspec/numpy refuse a wrongly typed value
        if isinstance(exc, OverflowError) and mc.scalars:
            refuse_scalars(msg, mc.name, mc.scalars)  # raises, naming the field out of range
        raise EncodeError(f"cannot encode: {exc}", message=mc.name) from None


def encode_with(mc: MessageCodec, msg: Any) -> list[SideFrame]:
    side: SideFrames = []
    body = _body(mc, msg, side)
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
    return mc.headers[0] + _body(mc, msg, None)


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
    except Exception as exc:  # e.g. RecursionError
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
    return msg if mc.after is None else mc.after(msg)


def split_bytes(buf: Buffer) -> list[Buffer]:
    """The single-buffer form as frames: header and body, without copying."""
    try:
        view = memoryview(buf)
    except TypeError:
        raise FrameError(f"expected one buffer, got {type(buf).__name__}") from None
    if len(view) < HEADER_SIZE:
        raise HeaderError(f"buffer is {len(view)} bytes, shorter than the {HEADER_SIZE}-byte header", frame=0)
    return [bytes(view[:HEADER_SIZE]), view[HEADER_SIZE:]]  # a 12-byte copy: the header dispatches by value


def as_frames(frames: Any) -> list[Buffer]:
    """``frames`` as a list of buffers, or :class:`FrameError` saying what is not one."""
    if isinstance(frames, bytes | bytearray | memoryview | str) or not isinstance(frames, Sequence | list):
        what = type(frames).__name__
        hint = "; decode_bytes reads the single-buffer form" if isinstance(frames, bytes | bytearray) else ""
        raise FrameError(f"expected a list of frames (as recv_multipart returns), got {what}{hint}")
    out: list[Buffer] = []
    for i, f in enumerate(frames):
        if type(f) is bytes or isinstance(f, bytearray | memoryview):
            out.append(f)
            continue
        buffer = getattr(f, "buffer", None)  # a zmq.Frame
        if isinstance(buffer, memoryview):
            out.append(buffer)
            continue
        try:
            view = memoryview(f)
        except TypeError:
            raise FrameError(f"frame of type {type(f).__name__} is not a buffer", frame=i) from None
        out.append(_as_bytes(view, i))
    return out


def _as_bytes(view: memoryview, i: int) -> memoryview:
    """An encoder's array side frame (or any typed buffer) read as bytes, so that lengths are
    byte counts."""
    if view.format == "B":
        return view
    try:
        return view.cast("B")
    except TypeError:
        raise FrameError(f"frame {i} is a buffer that is not contiguous", frame=i) from None


def _version_arg(version: Any) -> Version:
    pair = as_version(version)  # also a wire Version (what hello_versions() lists)
    if pair is not None:
        return pair
    hint = " (write (1, 3) for version 1.3)" if isinstance(version, str) else ""
    raise EncodeError(f"version must be a (major, minor) tuple of ints or a Version, got {version!r}{hint}")


def _fast_decoder(
    by_header: Mapping[bytes, _Entry], checked: Callable[[Any], tuple[Any, Version]], versioned: bool
) -> Callable[[Frames], Any]:
    """A registry's ``decode`` (``versioned``: ``decode_versioned``): a closure over its header
    table, so the common case reads locals (no bound method, no attribute lookups on the registry).

    The common case runs in this one frame: a ``bytes`` header this build writes itself (one
    dict lookup on its bytes checks magic, protocol, version, type and side-frame count at
    once) and the generated decoder without checks of its own. Any surprise falls through to
    ``checked``, which repeats the work and raises the classified error; decoding has no side
    effects, so repeating it is safe.
    """
    lookup = by_header.get

    def decode(frames: Frames) -> Any:
        if type(frames) is list:
            try:  # a header that is not bytes finds no entry or is unhashable
                entry = lookup(frames[0])
                if entry is not None:
                    body, fast, count, after, version = entry
                    msg, end = fast(body(frames[1]), frames, 2)
                    if end == count == len(frames):  # every side frame referenced, and no more
                        msg = msg if after is None else after(msg)
                        return (msg, version) if versioned else msg
            except Exception:
                pass
        return checked(frames) if versioned else checked(frames)[0]

    return decode


class Registry:
    """All versions of one protocol: dispatch, older minors, down-conversion.

    ``codecs`` maps each version to its message codecs by type id. ``frozen_types`` are type
    ids (the handshake) decodable at any major with the newest layout.
    """

    def __init__(
        self,
        *,
        protocol: str,
        protocol_id: int,
        codecs: Mapping[Version, Mapping[int, MessageCodec]],
        frozen_types: frozenset[int] = frozenset(),
    ) -> None:
        self.protocol = protocol
        self.protocol_id = protocol_id
        self.versions: list[Version] = sorted(codecs)
        self.newest = self.versions[-1]
        self.codecs = codecs
        self.frozen_types = frozen_types
        self.by_class: dict[type, MessageCodec] = {}
        for v in self.versions:  # later versions win: a class encodes at its major's newest minor
            for mc in codecs[v].values():
                self.by_class[mc.cls] = mc
        # class -> (encoder, header frames, codec) at the newest minor: what encode() reads
        # for the common case, without a named tuple's attribute lookups
        self._encoders = {cls: (mc.to_wire, mc.headers, mc) for cls, mc in self.by_class.items()}
        self.dispatch: dict[tuple[int, int, int], MessageCodec] = {}
        # exact header frame -> (body decoder, fast decoder, frame count, check, version): one
        # dict lookup checks magic, protocol, version, type and side-frame count together
        self.by_header: dict[bytes, _Entry] = {}
        for v in self.versions:
            for tid, mc in codecs[v].items():
                self.dispatch[(v[0], v[1], tid)] = mc
                if mc.fast_from_wire is None:
                    continue
                for k, header in enumerate(mc.headers):
                    self.by_header[header] = (mc.decoder.decode, mc.fast_from_wire, k + 2, mc.after, v)
        self.decode: Callable[[Frames], Any] = _fast_decoder(self.by_header, self._checked, False)
        """Decode multipart frames into the model of their major (see :func:`_fast_decoder`)."""
        self.decode_versioned: Callable[[Frames], tuple[Any, Version]] = _fast_decoder(
            self.by_header, self._checked, True
        )
        """Decode to the model of the frames' major; also return the version the sender wrote."""

    # --- down-conversion ------------------------------------------------------------------
    def target(self, msg: Any, version: Any) -> MessageCodec:
        """The codec that writes ``msg`` at ``version``; a typed error when it cannot."""
        mc = self.by_class.get(type(msg))
        if mc is None:
            raise EncodeError(f"{type(msg).__name__} is not a {self.protocol} message")
        major, minor = _version_arg(version)
        table = self.codecs.get((major, minor))
        if table is None:
            raise EncodeError(
                f"version {major}.{minor} is not one this build writes ({describe(self.versions)})",
                message=mc.name,
            )
        if major != mc.version[0]:
            raise EncodeError(
                f"a message of the {mc.version[0]}.x model cannot be written at {major}.{minor}",
                message=mc.name,
            )
        out = table.get(mc.type_id)
        if out is None:
            raise DowngradeError(f"does not exist at version {major}.{minor}", message=mc.name)
        return out

    def check(self, msg: Any, version: Any) -> None:
        """Raise :class:`DowngradeError` unless ``msg`` can be sent at ``version`` as it is."""
        encode_with(self.target(msg, version), msg)  # msgpack's own range checks included

    # --- public codec ----------------------------------------------------------------------
    def encode(self, msg: Any, version: Any = None) -> list[SideFrame]:
        fast = self._encoders.get(type(msg))
        if fast is not None and (version is None or version == fast[2].version):
            # the common case inline; any failure repeats through encode_with, which
            # classifies it (encoding has no side effects outside its own side list)
            side: SideFrames = []
            try:  # HEADERS_CACHED side frames or more: an IndexError, and encode_with packs the header
                body = _encode(fast[0](msg, side))
                return [fast[1][len(side)], body, *side]
            except Exception:
                return encode_with(fast[2], msg)
        if version is None:
            raise EncodeError(f"{type(msg).__name__} is not a {self.protocol} message")
        return encode_with(self.target(msg, version), msg)

    def encode_bytes(self, msg: Any, version: Any = None) -> bytes:
        mc = self.by_class.get(type(msg))
        if mc is None:
            raise EncodeError(f"{type(msg).__name__} is not a {self.protocol} message")
        if version is None or version == mc.version:
            return encode_bytes_with(mc, msg)
        return encode_bytes_with(self.target(msg, version), msg)

    def _checked(self, frames: Any) -> tuple[Any, Version]:
        """Every check spelled out; raises the classified error."""
        frames = as_frames(frames)
        n = len(frames)
        if n < 2:
            raise FrameCountError(f"{n} frame(s); a message is a header frame and a body frame at least")
        pid, major, minor, tid, side = parse_header(frames[0])
        if pid != self.protocol_id:
            raise WrongProtocol(f"protocol id {pid}, expected {self.protocol_id} ({self.protocol})", frame=0)
        if n != 2 + side:
            raise FrameCountError(f"header announces {side} side frame(s), got {n - 2}", frame=0)
        mc = self.dispatch.get((major, minor, tid))
        if mc is None:
            mc = self._resolve(major, minor, tid)
        msg = decode_with(mc, frames, (major, minor) <= mc.version)
        return msg, (major, minor)

    def decode_bytes(self, buf: Buffer) -> Any:
        return self.decode(split_bytes(buf))

    def _resolve(self, major: int, minor: int, tid: int) -> MessageCodec:
        same_major = [v for v in self.versions if v[0] == major]
        if tid in self.frozen_types and not same_major:
            return self.dispatch[(*self.newest, tid)]
        if not same_major or minor < same_major[0][1]:
            raise UnsupportedVersion(
                f"version {major}.{minor} is not supported; this build reads {describe(self.versions)}",
                frame=0,
            )
        best = same_major[-1]
        mc = self.dispatch.get((best[0], best[1], tid))
        if mc is None or minor <= best[1]:
            raise UnknownMessageType(f"message type {tid} is not known at version {major}.{minor}", frame=0)
        return mc  # a newer minor: read what this version knows, skip the rest
