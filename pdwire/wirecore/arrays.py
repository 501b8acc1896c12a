"""Packed little-endian numeric arrays: encoding, zero-copy decoding, equality.

On the wire a packed array is either inline msgpack ``bin`` in the body or, when at least
:data:`SIDE_FRAME_MIN_BYTES` long and the caller allows it, a frame of its own that the
body references by frame index. Decoding never copies: arrays are ``np.frombuffer`` views
(read-only) of the received bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from .errors import ArrayError, EncodeError, FrameCountError

# Arrays at least this long travel as their own frame in the multipart form (never copied
# into the body). The choice is deterministic, so re-encoding a decoded message is byte-identical.
SIDE_FRAME_MIN_BYTES = 1024

I32 = np.dtype("<i4")
U32 = np.dtype("<u4")
U64 = np.dtype("<u8")

Buffer = bytes | bytearray | memoryview
WireArray = bytes | memoryview | int
# An encoded side frame is the caller's own 1-D C-contiguous array of the wire dtype: any
# buffer-protocol object is a ZMQ frame, and handing over the array itself costs nothing
# (a byte-formatted memoryview costs two C calls per array). ``memoryview(f).nbytes`` is
# its size on the wire; ``len()`` of an array counts items.
SideFrame = Buffer | npt.NDArray[Any]
SideFrames = list[SideFrame]
Frames = Sequence[Buffer]


class Bail(Exception):
    """Raised by the fast decoder when it meets anything unusual; the checked decoder then runs."""


def bail() -> Any:
    raise Bail


_EMPTY: dict[np.dtype[Any], npt.NDArray[Any]] = {}


def empty(dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """A shared, read-only empty array of ``dtype`` (a default value)."""
    arr = _EMPTY.get(dtype)
    if arr is None:
        arr = np.empty(0, dtype=dtype)
        arr.flags.writeable = False
        _EMPTY[dtype] = arr
    return arr


for _dt in (I32, U32, U64):
    empty(_dt)


def empty_u32() -> npt.NDArray[np.uint32]:
    return empty(U32)


def empty_u64() -> npt.NDArray[np.uint64]:
    return empty(U64)


def integer_array(value: object) -> npt.NDArray[Any]:
    """``value`` as an integer ndarray, never through floats; ValueError says what is wrong.

    numpy promotes a list that mixes values below 2**63 with values at or above it (a u64
    address with bit 63 set) to float64, losing bits, and one past 64 bits to object; such a
    flat list is converted item by item instead. An ndarray is returned as it is when it holds
    integers. Callers check the shape and the range of their own dtype.
    """
    try:
        arr = np.asarray(value)
    except Exception:  # ragged nesting, or an int numpy cannot hold: look at the items below
        if not isinstance(value, list | tuple):
            raise ValueError(f"cannot be read as an array: {type(value).__name__}") from None
        arr = np.asarray(value, dtype=object)
    if arr.size == 0 or arr.dtype.kind in "iu":
        return arr
    if isinstance(value, np.ndarray) or arr.ndim != 1:
        raise ValueError(f"must hold integers, got dtype {arr.dtype}")
    items = list(value)  # type: ignore[call-overload]
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int | np.integer):
            raise ValueError(f"must hold integers, got {type(x).__name__}")
    ints = [int(x) for x in items]
    lo, hi = min(ints), max(ints)
    if lo < -(2**63) or hi > 2**64 - 1 or (lo < 0 and hi > 2**63 - 1):
        bad = lo if lo < -(2**63) or hi <= 2**64 - 1 else hi
        raise ValueError(f"{bad} does not fit a 64-bit integer next to {hi if bad == lo else lo}")
    return np.asarray(ints, dtype=np.uint64 if hi > 2**63 - 1 else np.int64)


def _coerce(value: object, dtype: np.dtype[Any], where: str) -> npt.NDArray[Any]:
    """Convert ``value`` to a 1-D C-contiguous array of ``dtype`` without ever wrapping a number."""
    try:
        arr = integer_array(value)
    except ValueError as exc:
        raise EncodeError(str(exc), field=where) from None
    if arr.ndim != 1:
        raise EncodeError(f"must be one-dimensional, got shape {arr.shape}", field=where)
    if arr.size == 0:
        return empty(dtype)
    info = np.iinfo(dtype)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < info.min or hi > info.max:
        raise EncodeError(f"values [{lo}, {hi}] do not fit {dtype.name}", field=where)
    return np.ascontiguousarray(arr, dtype=dtype)


_ndarray = np.ndarray
_frombuffer = np.frombuffer


def pack(value: object, dtype: np.dtype[Any], side: SideFrames | None, where: str) -> WireArray:
    """Encode one packed array: inline bytes, or a side-frame index when ``side`` is given and it is large."""
    # fast path: a 1-D ndarray of exactly ``dtype`` (numpy caches the builtin dtypes, so
    # identity decides); tobytes() copies any layout, a side frame checks contiguity
    if type(value) is _ndarray and value.dtype is dtype and value.ndim == 1:
        if value.nbytes < SIDE_FRAME_MIN_BYTES:
            return value.tobytes()
        return side_frame(value, dtype, side, where)
    return _pack_slow(value, dtype, side, where)


def side_frame(arr: npt.NDArray[Any], dtype: np.dtype[Any], side: SideFrames | None, where: str) -> WireArray:
    """A large 1-D array of ``dtype``: its own frame (the array itself, never copied), or inline
    when ``side`` is None."""
    if arr.strides[0] != arr.itemsize:  # strided (a large array's only way to be non-contiguous)
        return _pack_slow(arr, dtype, side, where)
    if side is None:
        return arr.data
    return push(side, arr)


def push(side: SideFrames, arr: npt.NDArray[Any]) -> int:
    """Append a large contiguous array (checked by the caller) as a side frame; its frame index."""
    side.append(arr)
    return len(side) + 1  # frames 0 and 1 are the header and the body


def _pack_slow(value: object, dtype: np.dtype[Any], side: SideFrames | None, where: str) -> WireArray:
    if type(value) is np.ndarray and value.dtype == dtype and value.ndim == 1 and value.flags.c_contiguous:
        arr: npt.NDArray[Any] = value
    else:
        arr = _coerce(value, dtype, where)
    if arr.nbytes < SIDE_FRAME_MIN_BYTES:
        return arr.data
    return side_frame(arr, dtype, side, where)


class Cursor(msgspec.Struct, gc=False):
    """Decode-side state: the received frames and which side frames the body referenced.

    References must increase (no frame is read twice, none out of order). A message of the
    reader's own minor must reference every side frame; one of a newer minor may carry
    frames for fields this reader skips. A msgspec struct: built in C, far cheaper per
    message than a Python class.
    """

    frames: Sequence[Buffer]
    message: str
    next: int = 2
    used: int = 0

    def array(self, value: bytes | int, dtype: np.dtype[Any], itemsize: int, field: str) -> npt.NDArray[Any]:
        return view(value, dtype, itemsize, self, field)

    def side(self, index: int, dtype: np.dtype[Any], itemsize: int, field: str) -> npt.NDArray[Any]:
        if index < self.next:
            raise ArrayError(
                f"references frame {index}; side frames are referenced once, in order (next >= {self.next})",
                message=self.message,
                field=field,
                frame=1,
            )
        frames = self.frames
        if index >= len(frames):
            raise FrameCountError(
                f"references missing frame {index}", message=self.message, field=field, frame=index
            )
        buf = frames[index]
        self.next = index + 1
        self.used += 1
        if len(buf) % itemsize:
            raise ArrayError(
                f"{len(buf)} bytes is not a multiple of {dtype.name}'s {itemsize}",
                message=self.message,
                field=field,
                frame=index,
            )
        return _frombuffer(buf, dtype)

    def finish(self, strict: bool = True) -> None:
        if strict and self.used != len(self.frames) - 2:
            raise FrameCountError(
                f"{len(self.frames) - 2} side frame(s) received but the body references {self.used}",
                message=self.message,
                frame=len(self.frames) - 1,
            )


def view(value: bytes | int, dtype: np.dtype[Any], itemsize: int, c: Cursor, field: str) -> npt.NDArray[Any]:
    """Decode one packed array (the checked path): a read-only view of inline bytes or of its side frame."""
    if isinstance(value, bytes):
        if len(value) % itemsize:
            raise ArrayError(
                f"{len(value)} bytes is not a multiple of {dtype.name}'s {itemsize}",
                message=c.message,
                field=field,
                frame=1,
            )
        return _frombuffer(value, dtype) if value else _EMPTY[dtype]
    return c.side(value, dtype, itemsize, field)


def values_equal(a: object, b: object) -> bool:
    """Structural equality that treats numpy arrays by dtype and content (generated ``__eq__`` uses it)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is not type(b) and not (isinstance(a, int) and isinstance(b, int)):
        return False
    return bool(a == b)
