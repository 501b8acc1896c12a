"""Per-frame encodings of positional (SGLang-style) layouts: one frame <-> one typed value.

Generated positional codecs call one ``enc_*``/``dec_*`` pair per frame, passing a
:class:`~.errors.Where` that names the backend, message, field and frame; every
failure is raised as that location's typed error. ASCII decimals are read with
:func:`read_int` (and its ``_or``/``_blank`` forms), the common case of :func:`dec_int`. Each
pair is a bijection between the typed values and the frames SGLang's builders produce, so
decode -> encode is byte-exact.
Spellings a lenient Python parser would also take but no builder writes (``" 5"``, ``"05"``,
``"+5"``, trailing bytes after a ``pack_int_lists`` payload, a msgpack array where the
builder writes ``b""``) are refused instead of normalised: they would not round-trip and
usually mean a hand-written peer is wrong.

Encodings (the schema's ``encoding:`` names, see ``codegen/positional.py``):

* ``const``: a fixed ASCII frame (guard, ``"None"`` register marker, status tag).
* ``ascii`` / ``utf8``: text; ``utf8`` on ``optional<str>`` maps ``b""`` to None.
* ``ascii_int``: ``str(int)`` in canonical decimal; ``optional<int>`` maps ``b""`` to None.
* ``flag01``: ``"0"`` / ``"1"``.
* ``native_u64``: one ``struct.pack("Q")`` value, or ``b""`` for None.
* ``native_u64_array`` / ``native_u32_array`` / ``native_i32_array``: ``struct.pack`` or
  ``ndarray.tobytes()`` in the host's byte order (little-endian on every SGLang platform).
* ``le_u32_array``: ``struct.pack("<{n}I")``.
* ``le_list_of_lists``: ``pack_int_lists``: ``<u32 n><u32 bytelen>*n`` then each list,
  little-endian; ``[]`` is ``b""`` and ``[[]]`` is ``01000000 00000000``.
* ``msgpack_blob_list``: msgpack array of bin (or of arrays of bin/nil); ``[]`` is ``b""``.
* ``ascii_csv``: ``",".join(items)``.
* ``raw``: the frame itself (an opaque backend blob).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from enum import IntEnum
from typing import Any, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from ..arrays import integer_array
from .errors import ProfileDecodeError, Where

Buf = bytes | bytearray | memoryview
E = TypeVar("E", bound=IntEnum)
D = TypeVar("D", int, None)

NATIVE_U64 = np.dtype("=u8")
NATIVE_U32 = np.dtype("=u4")
NATIVE_I32 = np.dtype("=i4")
LE_U32 = np.dtype("<u4")
LE_I32 = np.dtype("<i4")
LE_U64 = np.dtype("<u8")

_MAX_DIGITS = 20  # 2**64 - 1 has 20 digits; longer text is out of every range we carry
_BLOBS = msgspec.msgpack.Decoder(list[bytes])
_BLOB_LISTS = msgspec.msgpack.Decoder(list[list[bytes | None]])
_MSGPACK = msgspec.msgpack.Encoder()


def show(buf: Buf, limit: int = 24) -> str:
    """A short, printable rendering of a frame for error messages."""
    b = bytes(buf[:limit])
    return repr(b) + ("..." if len(buf) > limit else "")


# --- fixed frames and text --------------------------------------------------------------------
def expect_const(buf: Buf, literal: bytes, w: Where) -> None:
    if buf != literal:
        raise w.decode_error(f"expected {literal!r}, got {show(buf)}")


def dec_ascii(buf: Buf, w: Where) -> str:
    try:
        return bytes(buf).decode("ascii")
    except UnicodeDecodeError:
        raise w.decode_error(f"not ASCII text: {show(buf)}") from None


def enc_ascii(v: object, w: Where) -> bytes:
    if not isinstance(v, str):
        raise w.encode_error(f"expected str, got {type(v).__name__}")
    try:
        return v.encode("ascii")
    except UnicodeEncodeError:
        raise w.encode_error(f"not ASCII text: {v[:24]!r}") from None


def dec_utf8(buf: Buf, w: Where) -> str:
    try:
        return bytes(buf).decode("utf-8")
    except UnicodeDecodeError:
        raise w.decode_error(f"not UTF-8 text: {show(buf)}") from None


def dec_utf8_opt(buf: Buf, w: Where) -> str | None:
    return dec_utf8(buf, w) if len(buf) else None


def enc_utf8(v: object, w: Where) -> bytes:
    if not isinstance(v, str):
        raise w.encode_error(f"expected str, got {type(v).__name__}")
    try:
        return v.encode("utf-8")
    except UnicodeEncodeError:
        raise w.encode_error("text cannot be encoded as UTF-8 (lone surrogate)") from None


def enc_utf8_opt(v: object, w: Where) -> bytes:
    if v is None:
        return b""
    if v == "":
        # b"" is how None travels; an empty reason would come back as None
        raise w.encode_error('"" cannot be sent (an empty frame reads back as None); use None')
    return enc_utf8(v, w)


def dec_csv(buf: Buf, w: Where) -> list[str]:
    return dec_ascii(buf, w).split(",") if len(buf) else []


def enc_csv(v: object, w: Where) -> bytes:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise w.encode_error("expected list[str]")
    for x in v:
        if x == "" or "," in x:
            raise w.encode_error(f"item {x!r} is empty or contains ',' (it would not read back)")
    return enc_ascii(",".join(v), w)


def enc_raw(v: object, w: Where) -> bytes:
    if not isinstance(v, bytes | bytearray | memoryview):
        raise w.encode_error(f"expected bytes, got {type(v).__name__}")
    return bytes(v)


# --- ASCII decimals -----------------------------------------------------------------------------
def dec_int(buf: Buf, lo: int, hi: int, w: Where) -> int:
    b = bytes(buf)
    digits = b[1:] if b[:1] == b"-" and lo < 0 else b
    canonical = (
        0 < len(digits) <= _MAX_DIGITS
        and digits.isdigit()
        and not (digits[0] == 0x30 and len(digits) > 1)
        and not (digits is not b and digits == b"0")
    )
    if not canonical:
        raise w.decode_error(f"not a canonical ASCII decimal: {show(buf)}")
    value = int(b)
    if not lo <= value <= hi:
        raise w.decode_error(f"{value} is out of range [{lo}, {hi}]")
    return value


def dec_int_opt(buf: Buf, lo: int, hi: int, w: Where) -> int | None:
    return dec_int(buf, lo, hi, w) if len(buf) else None


def dec_int_or(buf: Buf, lo: int, hi: int, default: int, w: Where) -> int:
    return dec_int(buf, lo, hi, w) if len(buf) else default


def enc_int(v: object, lo: int, hi: int, w: Where) -> bytes:
    if isinstance(v, bool) or not isinstance(v, int):
        raise w.encode_error(f"expected int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise w.encode_error(f"{v} is out of range [{lo}, {hi}]")
    return str(int(v)).encode("ascii")


def dec_int_blank(buf: Buf, lo: int, hi: int, default: int, w: Where) -> int:
    """An empty frame is the default; the default's own text is refused (builders send b"")."""
    if not len(buf):
        return default
    value = dec_int(buf, lo, hi, w)
    if value == default:
        raise w.decode_error(f"{value} is sent as an empty frame, not as text")
    return value


def enc_int_blank(v: object, lo: int, hi: int, default: int, w: Where) -> bytes:
    return b"" if v == default and not isinstance(v, bool) else enc_int(v, lo, hi, w)


def enc_int_opt(v: object, lo: int, hi: int, w: Where) -> bytes:
    return b"" if v is None else enc_int(v, lo, hi, w)


# The generated decoders read every ASCII-decimal frame with one of these three calls (one
# decimal parse for the whole profile instead of a copy per field). The common case, a canonical
# non-negative decimal in a bytes frame, is read here with int(); anything else (a sign, another
# spelling, a value out of range, a memoryview or bytearray frame) goes to the checked function,
# which accepts exactly the same values and raises the error naming ``where[field]``. ``where``
# and ``field`` are passed apart so the common case never looks the location up, and only the
# upper bound is compared there: every integer type's lower bound is 0 or negative, so a value
# read from digits alone is never below it.
def read_int(buf: Buf, lo: int, hi: int, where: Mapping[str, Where], field: str) -> int:
    """:func:`dec_int` of frame ``field``."""
    if type(buf) is bytes and buf.isdigit() and (buf[0] != 48 or len(buf) == 1) and len(buf) <= _MAX_DIGITS:
        value = int(buf)
        if value <= hi:
            return value
    return dec_int(buf, lo, hi, where[field])


def read_int_or(buf: Buf, lo: int, hi: int, default: D, where: Mapping[str, Where], field: str) -> int | D:
    """:func:`dec_int_or` (``default=None``: :func:`dec_int_opt`) of frame ``field``."""
    if not buf:
        return default
    if type(buf) is bytes and buf.isdigit() and (buf[0] != 48 or len(buf) == 1) and len(buf) <= _MAX_DIGITS:
        value = int(buf)
        if value <= hi:
            return value
    return dec_int(buf, lo, hi, where[field])


def read_int_blank(buf: Buf, lo: int, hi: int, default: int, where: Mapping[str, Where], field: str) -> int:
    """:func:`dec_int_blank` of frame ``field``."""
    if not buf:
        return default
    if type(buf) is bytes and buf.isdigit() and (buf[0] != 48 or len(buf) == 1) and len(buf) <= _MAX_DIGITS:
        value = int(buf)
        if value <= hi and value != default:
            return value
    return dec_int_blank(buf, lo, hi, default, where[field])


def dec_enum(buf: Buf, cls: type[E], w: Where) -> E:
    value = dec_int(buf, -(2**31), 2**31 - 1, w)
    try:
        return cls(value)
    except ValueError:
        raise w.decode_error(f"{value} is not a {cls.__name__} ({', '.join(m.name for m in cls)})") from None


def enc_enum(v: object, cls: type[E], w: Where) -> bytes:
    if isinstance(v, cls):
        return str(int(v)).encode("ascii")
    if isinstance(v, int) and not isinstance(v, bool) and v in {int(m) for m in cls}:
        return str(v).encode("ascii")
    raise w.encode_error(f"{v!r} is not a {cls.__name__}")


def dec_flag(buf: Buf, w: Where) -> bool:
    if buf == b"1":
        return True
    if buf == b"0":
        return False
    raise w.decode_error(f'expected "0" or "1", got {show(buf)}')


def dec_flag_opt(buf: Buf, w: Where) -> bool | None:
    return dec_flag(buf, w) if len(buf) else None


def enc_flag(v: object, w: Where) -> bytes:
    if not isinstance(v, bool):
        raise w.encode_error(f"expected bool, got {type(v).__name__}")
    return b"1" if v else b"0"


def enc_flag_opt(v: object, w: Where) -> bytes:
    return b"" if v is None else enc_flag(v, w)


# --- native single values and arrays ----------------------------------------------------------
def dec_u64_opt(buf: Buf, w: Where) -> int | None:
    if not len(buf):
        return None
    if len(buf) != 8:
        raise w.decode_error(f"expected 8 bytes (one native u64) or an empty frame, got {len(buf)}")
    return int(struct.unpack("=Q", buf)[0])


def enc_u64_opt(v: object, w: Where) -> bytes:
    if v is None:
        return b""
    return struct.pack("=Q", _check_int(v, 0, 2**64 - 1, w))


def _check_int(v: object, lo: int, hi: int, w: Where) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise w.encode_error(f"expected int, got {type(v).__name__}")
    if not lo <= int(v) <= hi:
        raise w.encode_error(f"{int(v)} is out of range [{lo}, {hi}]")
    return int(v)


def dec_array(buf: Buf, dtype: np.dtype[Any], w: Where) -> npt.NDArray[Any]:
    if type(buf) is bytes and not len(buf) % dtype.itemsize:
        return np.frombuffer(buf, dtype)  # read-only already: a view of immutable bytes
    size = dtype.itemsize
    if len(buf) % size:
        raise w.decode_error(f"length {len(buf)} is not a multiple of {size} ({dtype.name} items)")
    out = np.frombuffer(buf, dtype)
    if out.flags.writeable:  # a bytearray or writable memoryview: never hand out a mutable alias
        out = out.view()
        out.flags.writeable = False
    return out


def enc_array(v: object, dtype: np.dtype[Any], w: Where) -> bytes:
    if type(v) is np.ndarray and v.dtype == dtype and v.ndim == 1:
        return v.tobytes()
    if type(v) is list:
        fast = _int_list_bytes(v, dtype)
        if fast is not None:
            return fast
    return _as_array(v, dtype, w).tobytes()


_INT_ONLY = frozenset({int})


def _int_list_bytes(v: list[Any], dtype: np.dtype[Any]) -> bytes | None:
    """A list of plain ints that all fit ``dtype``, packed; None for anything else.

    The common case of :func:`_as_array` without its per-case checks: numpy refuses
    out-of-range Python ints with OverflowError, and only exact ``int`` items are taken (bools,
    floats and other number types go to the checked path, which refuses or converts them).
    """
    if not set(map(type, v)) <= _INT_ONLY:
        return None
    try:
        return np.array(v, dtype=dtype).tobytes()
    except OverflowError:
        return None


def _as_array(v: object, dtype: np.dtype[Any], w: Where) -> npt.NDArray[Any]:
    """An integer sequence as ``dtype``, refusing values that do not fit (SGLang's struct.error)."""
    if isinstance(v, np.ndarray):
        if v.dtype == dtype and v.ndim == 1:
            return v
        if v.ndim != 1 or (v.size and v.dtype.kind not in "iu"):
            raise w.encode_error(f"expected a 1-D integer array, got {v.dtype} with shape {v.shape}")
        arr: npt.NDArray[Any] = v
    elif isinstance(v, list | tuple):
        try:
            arr = integer_array(v)  # never through floats: u64 values past 2**63 stay exact
        except ValueError as exc:
            raise w.encode_error(str(exc)) from None
        if arr.ndim != 1:
            raise w.encode_error("expected a flat list of integers")
    else:
        raise w.encode_error(f"expected an integer array or list, got {type(v).__name__}")
    if arr.size:
        info = np.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < int(info.min) or hi > int(info.max):
            bad = lo if lo < int(info.min) else hi
            raise w.encode_error(f"{bad} does not fit {dtype.name} [{info.min}, {info.max}]")
    return arr.astype(dtype, copy=False)


# --- pack_int_lists -------------------------------------------------------------------------------
def dec_lists(buf: Buf, dtype: np.dtype[Any], w: Where) -> list[npt.NDArray[Any]]:
    total = len(buf)
    if total == 0:
        return []
    if type(buf) is bytes and total >= 4:
        fast = _dec_lists_bytes(buf, total, dtype)
        if fast is not None:
            return fast
    if total < 4:
        raise w.decode_error(f"pack_int_lists frame of {total} bytes has no complete count")
    mv = memoryview(buf).cast("B")
    n = int.from_bytes(mv[0:4], "little")
    header = 4 + 4 * n
    if n == 0:
        raise w.decode_error("pack_int_lists count 0: an empty outer list is written as an empty frame")
    if header > total:
        raise w.decode_error(f"pack_int_lists count {n} needs a {header}-byte header, frame has {total}")
    lens = [int(x) for x in np.frombuffer(mv, LE_U32, count=n, offset=4)]
    size = dtype.itemsize
    for i, ln in enumerate(lens):
        if ln % size:
            raise w.decode_error(f"pack_int_lists list {i}: {ln} bytes is not a multiple of {size}")
    if header + sum(lens) != total:
        raise w.decode_error(
            f"pack_int_lists header says {header + sum(lens)} bytes, frame has {total} "
            + ("(truncated)" if header + sum(lens) > total else "(trailing bytes)")
        )
    out: list[npt.NDArray[Any]] = []
    off = header
    readonly = isinstance(buf, bytes)
    for ln in lens:
        a = np.frombuffer(mv, dtype, count=ln // size, offset=off) if ln else np.empty(0, dtype)
        if not readonly or not ln:
            a.flags.writeable = False
        out.append(a)
        off += ln
    return out


def _dec_lists_bytes(buf: bytes, total: int, dtype: np.dtype[Any]) -> list[npt.NDArray[Any]] | None:
    """:func:`dec_lists` of a well-formed bytes frame (views of immutable bytes are read-only);
    None when anything is off, for the checked path to name."""
    n = int.from_bytes(buf[:4], "little")
    header = 4 + 4 * n
    if n == 0 or header > total:
        return None
    lens = struct.unpack_from(f"<{n}I", buf, 4)
    size = dtype.itemsize
    if header + sum(lens) != total:
        return None
    out: list[npt.NDArray[Any]] = []
    off = header
    frombuffer = np.frombuffer
    for ln in lens:
        if ln % size:
            return None
        out.append(frombuffer(buf, dtype, ln // size, off) if ln else _empty(dtype))
        off += ln
    return out


def _empty(dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    a = np.empty(0, dtype)
    a.flags.writeable = False
    return a


def enc_lists(v: object, dtype: np.dtype[Any], w: Where) -> bytes:
    if not isinstance(v, list | tuple):
        raise w.encode_error(f"expected a list of integer lists, got {type(v).__name__}")
    if not v:
        return b""
    bodies = []
    le = dtype.newbyteorder("<")
    for item in v:
        if type(item) is np.ndarray and item.dtype == le and item.ndim == 1:
            bodies.append(item.tobytes())
            continue
        if type(item) is list:
            fast = _int_list_bytes(item, le)
            if fast is not None:
                bodies.append(fast)
                continue
        if item is None:
            # SGLang's Mooncake builder crashes here; NIXL/MoRI send [] (convert None first)
            raise w.encode_error("a None list cannot be packed (pack_int_lists needs a list)")
        bodies.append(_as_array(item, dtype, w).astype(dtype.newbyteorder("<"), copy=False).tobytes())
    header = struct.pack(f"<{len(bodies) + 1}I", len(bodies), *(len(b) for b in bodies))
    return header + b"".join(bodies)


# --- msgpack lists of opaque blobs --------------------------------------------------------------
def dec_blobs(buf: Buf, w: Where) -> list[bytes]:
    if not len(buf):
        return []
    try:
        out = _BLOBS.decode(buf)
    except msgspec.DecodeError as exc:
        raise w.decode_error(f"not a msgpack array of bin: {exc}") from None
    _canonical(buf, out, w)
    return out


def dec_blob_lists(buf: Buf, w: Where) -> list[list[bytes | None]]:
    if not len(buf):
        return []
    try:
        out = _BLOB_LISTS.decode(buf)
    except msgspec.DecodeError as exc:
        raise w.decode_error(f"not a msgpack array of arrays of bin/nil: {exc}") from None
    _canonical(buf, out, w)
    return out


def _canonical(buf: Buf, value: object, w: Where) -> None:
    if _MSGPACK.encode(value) != buf:
        raise w.decode_error("msgpack is not in the canonical form SGLang's msgspec encoder writes")


def enc_blobs(v: object, w: Where) -> bytes:
    if not isinstance(v, list) or not all(isinstance(x, bytes) for x in v):
        raise w.encode_error("expected list[bytes]")
    return _MSGPACK.encode(v) if v else b""


def enc_blob_lists(v: object, w: Where) -> bytes:
    ok = isinstance(v, list) and all(
        isinstance(c, list) and all(x is None or isinstance(x, bytes) for x in c) for c in v
    )
    if not ok:
        raise w.encode_error("expected list[list[bytes | None]]")
    return _MSGPACK.encode(v) if v else b""


def frame_count(n: int, lo: int, hi: int) -> str | None:
    """The problem with a message of ``n`` frames when ``lo..hi`` are allowed, or None."""
    if n < lo:
        return f"{n} frames, at least {lo} expected"
    if n > hi:
        return f"{n} frames, at most {hi} expected"
    return None


def as_buffers(frames: Sequence[object], profile: str, backend: str | None) -> list[Buf]:
    """Frames as bytes-like objects (a ``zmq.Frame`` is read through its ``.buffer``)."""
    if isinstance(frames, bytes | bytearray | memoryview | str):
        raise ProfileDecodeError(
            "expected a sequence of frames, got one buffer", profile=profile, backend=backend
        )
    if all(type(f) is bytes for f in frames):  # the common case (zmq copy=True), checked cheaply
        return list(frames)  # type: ignore[arg-type]
    out: list[Buf] = []
    for i, f in enumerate(frames):
        if isinstance(f, bytes | bytearray | memoryview):
            out.append(f)
            continue
        buffer = getattr(f, "buffer", None)
        if not isinstance(buffer, memoryview):
            raise ProfileDecodeError(
                f"frame of type {type(f).__name__} is not bytes-like",
                profile=profile,
                backend=backend,
                frame=i,
            )
        out.append(buffer)
    return out
