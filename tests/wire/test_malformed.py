"""Malformed input: every failure is one WireError subclass naming message, field and frame."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdwire.wire as w
from pdwire.wire import strategies as S
from pdwire.wirecore.envelope.header import MAGIC, pack_header


def _req(n: int = 300) -> list[bytes]:
    msg = w.TransferRequest(
        room=7,
        sender="dec0",
        dst_kv_indices=np.arange(n, dtype=np.int32),
        state_indices=[np.array([3], dtype=np.int32), None],
    )
    return [bytes(f) for f in w.encode(msg)]


def _header(frames: list[bytes]) -> tuple[Any, ...]:
    return struct.unpack("<4sHBBHH", frames[0])


def _reheader(frames: list[bytes], **kw: int) -> list[bytes]:
    magic, pid, major, minor, tid, side = _header(frames)
    vals = {"pid": pid, "major": major, "minor": minor, "tid": tid, "side": side, **kw}
    return [
        pack_header(magic, vals["pid"], vals["major"], vals["minor"], vals["tid"], vals["side"]),
        *frames[1:],
    ]


def test_header_errors() -> None:
    frames = _req()
    with pytest.raises(w.HeaderError, match=r"frame 0.*11 bytes"):
        w.decode([frames[0][:11], *frames[1:]])
    with pytest.raises(w.BadMagic, match="bad magic"):
        w.decode([b"XXXX" + frames[0][4:], *frames[1:]])
    with pytest.raises(w.WrongProtocol, match="protocol id 9"):
        w.decode(_reheader(frames, pid=9))
    with pytest.raises(w.FrameCountError, match="1 frame"):
        w.decode(frames[:1])
    with pytest.raises(w.HeaderError):
        w.decode_bytes(b"PDW")


def test_body_errors_name_message_field_and_frame() -> None:
    frames = _req(3)
    body = msgspec.msgpack.decode(frames[1])
    bad = list(body)
    bad[2] = b"\x00\x01\x02"  # 3 bytes of i32
    with pytest.raises(w.ArrayError, match=r"TransferRequest\.dst_kv_indices \(frame 1\): 3 bytes"):
        w.decode([frames[0], msgspec.msgpack.encode(bad)])
    with pytest.raises(w.BodyError, match=r"TransferRequest \(frame 1\): body is truncated"):
        w.decode([frames[0], frames[1][:-1]])
    with pytest.raises(w.BodyError, match="trailing"):
        w.decode([frames[0], frames[1] + b"\x00"])
    bad = list(body)
    bad[0] = "seven"
    with pytest.raises(w.BodyError, match=r"TransferRequest\.room"):
        w.decode([frames[0], msgspec.msgpack.encode(bad)])
    status = [bytes(f) for f in w.encode(w.TransferStatus(room=1, status=w.Status.SUCCESS, sender_rank=0))]
    sbody = list(msgspec.msgpack.decode(status[1]))
    sbody[1] = 42
    with pytest.raises(w.BadEnumValue, match=r"TransferStatus\.status \(frame 1\): Invalid enum value 42"):
        w.decode([status[0], msgspec.msgpack.encode(sbody)])


def test_side_frame_errors() -> None:
    frames = _req(1024)
    assert len(frames) == 3
    with pytest.raises(w.FrameCountError, match="announces 1 side frame"):
        w.decode(frames[:2])
    with pytest.raises(w.FrameCountError, match="announces 1 side frame"):
        w.decode([*frames, frames[2]])
    with pytest.raises(w.FrameCountError, match=r"2 side frame.*references 1"):
        w.decode(_reheader([*frames, frames[2]], side=2))
    with pytest.raises(w.ArrayError, match=r"dst_kv_indices \(frame 2\): 4095 bytes"):
        w.decode([frames[0], frames[1], frames[2][:-1]])
    body = list(msgspec.msgpack.decode(frames[1]))
    body[2] = 5
    with pytest.raises(w.FrameCountError, match="missing frame 5"):
        w.decode([frames[0], msgspec.msgpack.encode(body), frames[2]])
    body = list(msgspec.msgpack.decode(frames[1]))
    body[8] = [2]  # a second reference to the frame dst_kv_indices already used
    with pytest.raises(w.ArrayError, match="referenced once"):
        w.decode(_reheader([frames[0], msgspec.msgpack.encode(body), frames[2]], side=1))


def test_length_prefixes_larger_than_the_frame_never_allocate() -> None:
    header = _req(3)[0]
    tracemalloc.start()
    try:
        for body in (
            b"\xdd\xff\xff\xff\xff",
            b"\x99\x07\xa1x\xc6\xff\xff\xff\xf0",
            b"\x99\x07\xdb\x7f\xff\xff\xff",
        ):
            before = tracemalloc.get_traced_memory()[1]
            with pytest.raises(w.BodyError):
                w.decode([header, body])
            assert tracemalloc.get_traced_memory()[1] - before < 64 * 1024
    finally:
        tracemalloc.stop()


# every message of every version; the valid message itself is drawn by hypothesis too, so a
# failure shrinks and replays like any other
MESSAGES = [(v, name) for v in S.STRATEGIES for name in S.STRATEGIES[v]]


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    version, name = draw(st.sampled_from(MESSAGES))
    frames = [bytes(f) for f in w.REGISTRY.encode(draw(S.STRATEGIES[version][name]()), version)]
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["truncate", "flip", "drop", "dup", "swap", "junk", "header"]))
        i = draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        if op == "truncate":
            frames[i] = f[: draw(st.integers(0, max(0, len(f) - 1)))]
        elif op == "flip" and f:
            pos = draw(st.integers(0, len(f) - 1))
            frames[i] = f[:pos] + bytes([f[pos] ^ (1 << draw(st.integers(0, 7)))]) + f[pos + 1 :]
        elif op == "drop" and len(frames) > 1:
            del frames[i]
        elif op == "dup":
            frames.insert(i, f)
        elif op == "swap" and len(frames) > 1:
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "junk":
            frames[i] = draw(st.binary(max_size=32))
        elif op == "header":
            frames[0] = MAGIC + draw(st.binary(min_size=8, max_size=8))
    return frames


@settings(max_examples=400)
@given(frames=mutated())
def test_mutated_frames_raise_only_wire_errors(frames: list[bytes]) -> None:
    for decode in (w.decode, w.decode_versioned):
        try:
            decode(frames)
        except w.WireError as exc:
            assert str(exc)
    with contextlib.suppress(w.WireError):
        w.decode_bytes(b"".join(frames))
