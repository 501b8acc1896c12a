"""The sender refuses what the peer would: values outside a field's type, versions and frames of
the wrong kind. Every refusal is one typed error naming what is wrong, never a TypeError."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pdwire.wire as w


def _status(**kw: Any) -> w.TransferStatus:
    return w.TransferStatus(**{"room": 1, "status": w.Status.SUCCESS, "sender_rank": 0, **kw})


@pytest.mark.parametrize(
    ("msg", "where", "problem"),
    [
        (
            w.TransferRequest(room=-1, sender="d", dst_kv_indices=np.int32([])),
            "TransferRequest.room",
            "-1 is outside",
        ),
        (_status(sender_rank=2**40), "TransferStatus.sender_rank", f"{2**40} is outside [0, 4294967295]"),
        (_status(status=42), "TransferStatus.status", "42 is not a Status"),
        (_status(status="success"), "TransferStatus.status", "expected Status, got str"),
        (_status(room=1.5), "TransferStatus.room", "expected an integer, got float"),
        (_status(room=True), "TransferStatus.room", "expected an integer, got bool"),
        (_status(reason=b"x"), "TransferStatus.reason", "expected str, got bytes"),
        (w.Abort(room=1, sender=None), "Abort.sender", "expected str, got NoneType"),  # type: ignore[arg-type]
        (
            w.Notification(room=1, kind=w.NotificationKind.KV, is_last=1),
            "Notification.is_last",
            "expected bool",
        ),
        (
            w.Notification(room=1, kind=w.NotificationKind.KV, chunk_id=2**32),
            "Notification.chunk_id",
            "is outside [0, 4294967295]",
        ),
    ],
)
def test_values_outside_a_fields_type_are_refused_by_the_sender(msg: Any, where: str, problem: str) -> None:
    for encode in (w.encode, w.encode_bytes, lambda m: w.encode(m, (1, 1))):
        with pytest.raises(w.EncodeError) as info:
            encode(msg)
        assert str(info.value).startswith(f"{where}: ") and problem in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "older", "problem"),
    [
        ("room", 2**64, (1, 0), f"{2**64} is outside [0, {2**64 - 1}]"),
        ("room", -1, (1, 1), "-1 is outside"),
        ("decode_prefix_len", 2**70, (1, 3), "is outside [0, "),
        ("scatter_offset", -(2**63) - 1, (1, 4), f"{-(2**63) - 1} is outside [{-(2**63)}, {2**63 - 1}]"),
        ("scatter_offset", 2**63, (1, 4), f"{2**63} is outside"),  # msgpack would carry it as a u64
    ],
)
def test_64_bit_fields_are_refused_past_their_type_at_every_entry_point(
    field: str, value: int, older: tuple[int, int], problem: str
) -> None:
    # A top-level encoder leaves the bound msgpack shares (u64's upper, i64's lower) to msgspec:
    # its OverflowError must still come back as the field's own EncodeError, on every path.
    msg = w.TransferRequest(**{"room": 1, "sender": "d", "dst_kv_indices": np.int32([3]), field: value})
    for encode in (
        w.encode,
        w.encode_bytes,
        lambda m: w.encode(m, older),
        lambda m: w.check_sendable(m, w.REGISTRY.newest),
    ):
        with pytest.raises(w.EncodeError) as info:
            encode(msg)
        assert str(info.value).startswith(f"TransferRequest.{field}: "), str(info.value)
        assert problem in str(info.value), str(info.value)


def test_nested_values_are_checked_too() -> None:
    geometry = w.ParallelGeometry(tp_size=-2)
    hello = w.Hello(
        protocol="pdwire",
        versions=[w.Version(major=1, minor=3)],
        role=w.Role.DECODE,
        engine_id="e",
        geometry=geometry,
        model=w.ModelFingerprint(model_name="m", revision="r", dtype="bf16", num_layers=1),
    )
    with pytest.raises(w.EncodeError, match=r"^ParallelGeometry\.tp_size: -2 is outside"):
        w.encode(hello)


def test_an_int_naming_an_enum_value_is_accepted_and_travels_as_that_value() -> None:
    msg = _status(status=4)
    assert w.decode(w.encode(msg)).status is w.Status.SUCCESS


@pytest.mark.parametrize("version", ["1.3", 1.3, (1,), (1, 2, 3), ("1", "3"), (True, 1)])
def test_a_version_of_the_wrong_type_is_a_typed_error(version: Any) -> None:
    with pytest.raises(w.EncodeError, match="version must be a \\(major, minor\\) tuple of ints"):
        w.encode(_status(), version)
    with pytest.raises(w.EncodeError, match="version must be"):
        w.encode_bytes(_status(), version)
    with pytest.raises(w.EncodeError, match="version must be"):
        w.check_sendable(_status(), version)


def test_a_list_version_is_read_like_a_tuple_and_an_unknown_one_is_named() -> None:
    assert w.decode_versioned(w.encode(_status(), [1, 2]))[1] == (1, 2)
    with pytest.raises(w.EncodeError, match=r"version 1\.9 is not one this build writes \(1\.0-1\."):
        w.encode(_status(), (1, 9))


@pytest.mark.parametrize(
    ("frames", "problem"),
    [
        (b"PDWR\x01\x00\x01\x03\x04\x00\x00\x00\x94", "expected a list of frames"),
        (bytearray(b"xx"), "decode_bytes reads the single-buffer form"),
        ("frames", "got str"),
        (None, "got NoneType"),
        (42, "got int"),
        ([5, b""], "frame 0"),
        ([b"PDWR\x01\x00\x01\x03\x04\x00\x00\x00", 5], "frame 1"),
        ([b"PDWR\x01\x00\x01\x03\x04\x00\x00\x00", object()], "is not a buffer"),
    ],
)
def test_frames_that_are_not_a_list_of_buffers_are_a_wire_error(frames: Any, problem: str) -> None:
    for decode in (w.decode, w.decode_versioned):
        with pytest.raises(w.FrameError, match=problem if "frame" not in problem else None) as info:
            decode(frames)
        assert isinstance(info.value, w.WireError)
        if problem.startswith("frame "):
            assert info.value.frame == int(problem.split()[1])


def test_decode_bytes_refuses_what_is_not_one_buffer() -> None:
    with pytest.raises(w.FrameError, match="expected one buffer, got list"):
        w.decode_bytes([b"x"])  # type: ignore[arg-type]


def test_a_message_checked_against_an_older_minor() -> None:
    failed = _status(status=w.Status.FAILED, failure_kind=w.FailureKind.TIMEOUT)
    w.check_sendable(failed, (1, 2))
    with pytest.raises(w.DowngradeError, match=r"TransferStatus\.failure_kind"):
        w.check_sendable(failed, (1, 1))
    with pytest.raises(w.DowngradeError, match=r"RegisterAck: does not exist at version 1\.1"):
        w.check_sendable(w.RegisterAck(accepted=True, sender_rank=0), (1, 1))
