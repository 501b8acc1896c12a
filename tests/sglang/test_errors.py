"""Bad input: exactly one typed WireError naming backend, message, field and frame."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pdwire.wire import sglang
from pdwire.wirecore.errors import DecodeError, EncodeError
from pdwire.wirecore.positional.errors import UnrecognisedMessage

IP = b"10.0.0.1"
MOONCAKE_TI = [b"7", IP, b"1", b"s", np.int32([1, 2]).tobytes(), b"3", b"", b"1", b"0", b""]
NIXL_ST = [b"KV_STATUS", b"9", b"4", b"0", b""]


def _with(frames: list[bytes], i: int, value: bytes) -> list[bytes]:
    return [*frames[:i], value, *frames[i + 1 :]]


@pytest.mark.parametrize(
    ("frames", "backend", "field", "frame", "text"),
    [
        (_with(MOONCAKE_TI, 0, b" 7"), "mooncake", "room", 0, "canonical"),
        (_with(MOONCAKE_TI, 0, b"18446744073709551616"), "mooncake", "room", 0, "out of range"),
        (_with(MOONCAKE_TI, 4, b"\x01\x00\x00"), "mooncake", "kv_indices", 4, "multiple of 4"),
        (_with(MOONCAKE_TI, 5, b"None"), "mooncake", "aux_index", 5, "canonical"),
        (_with(MOONCAKE_TI, 5, b""), "mooncake", "aux_index", 5, "crashes"),
        (
            _with(MOONCAKE_TI, 6, bytes.fromhex("0100000004000000050000")),
            "mooncake",
            "state_indices",
            6,
            "truncated",
        ),
        (
            _with(MOONCAKE_TI, 6, bytes.fromhex("010000000000000000")),
            "mooncake",
            "state_indices",
            6,
            "trailing",
        ),
        (_with(MOONCAKE_TI, 6, bytes.fromhex("00000000")), "mooncake", "state_indices", 6, "empty frame"),
        (_with(MOONCAKE_TI, 6, bytes.fromhex("ffffffff")), "mooncake", "state_indices", 6, "header"),
        (_with(MOONCAKE_TI, 1, "hôte".encode()), "mooncake", "local_ip", 1, "ASCII"),
        (_with(NIXL_ST, 2, b"7"), "nixl", "status", 2, "KVPoll"),
        (_with(NIXL_ST, 4, b"\xff\xfe"), "nixl", "reason", 4, "UTF-8"),
        (_with(NIXL_ST, 2, b"04"), "nixl", "status", 2, "canonical"),
    ],
)
def test_malformed_frame_names_backend_message_field_frame(
    frames: list[bytes], backend: str, field: str, frame: int, text: str
) -> None:
    with pytest.raises(DecodeError, match=text) as info:
        sglang.decode(frames, backend)
    err = info.value
    assert (err.field, err.frame) == (field, frame)
    assert err.message is not None and backend in str(err) and err.message in str(err)


def test_nixl_item_length_mismatch_is_refused_like_sglang() -> None:
    msg = sglang.NixlRegister(
        local_ip="h",
        rank_port=1,
        agent_name="a",
        agent_metadata=b"",
        kv_data_ptrs=[1, 2],
        aux_data_ptrs=[],
        state_data_ptrs=[],
        gpu_id=0,
        attn_tp_size=1,
        engine_rank=0,
        kv_item_len=8,
        state_item_lens=[],
        state_dim_per_tensor=[],
        kv_mem_kinds=[],
        kv_item_lens=[8],
    )
    with pytest.raises(EncodeError, match="1 item lengths for 2 KV pointers"):
        sglang.encode(msg)
    good = sglang.encode(
        sglang.NixlRegister(
            **{**{f: getattr(msg, f) for f in msg.__struct_fields__}, "kv_item_lens": [8, 16]}
        )
    )
    bad = _with(good, 19, np.array([8], "=u8").tobytes())
    with pytest.raises(DecodeError, match="ValueError") as info:
        sglang.decode(bad)
    assert info.value.frame == 19


def test_mori_prefix_zero_travels_empty_and_text_zero_is_refused() -> None:
    msg = sglang.MoriTransferInfo(
        room=1,
        local_ip="h",
        rank_port=1,
        engine_key="k",
        kv_indices=[1],
        aux_index=0,
        state_indices=[],
        decode_prefix_len=0,
    )
    frames = sglang.encode(msg)
    assert frames[9] == b""
    with pytest.raises(DecodeError, match="empty frame") as info:
        sglang.decode(_with(frames, 9, b"0"), "mori")
    assert info.value.frame == 9
    # absent trailing frames take the parser's defaults: required_dst_info_num 1, no prefix
    short = sglang.decode(frames[:8], "mori")
    assert (short.required_dst_info_num, short.decode_prefix_len) == (1, 0)


@pytest.mark.parametrize(
    ("field", "value", "text"),
    [
        ("kv_indices", [2**31], "does not fit int32"),
        ("state_indices", [[1], None], "None list"),
        ("room", 2**64, "out of range"),
        ("aux_index", True, "expected int"),
        ("local_ip", "hôte", "ASCII"),
    ],
)
def test_encode_refuses_what_sglang_cannot_send(field: str, value: object, text: str) -> None:
    base = dict(
        room=1,
        local_ip="h",
        rank_port=1,
        session_id="s",
        kv_indices=[1],
        aux_index=0,
        required_dst_info_num=1,
        state_indices=[],
    )
    msg = sglang.MooncakeTransferInfo(**{**base, field: value})
    with pytest.raises(EncodeError, match=text) as info:
        sglang.encode(msg)
    assert info.value.field == field and "mooncake" in str(info.value)


def test_pointer_limits_round_trip_and_overflow_is_refused() -> None:
    ptrs = [2**63, 2**64 - 1, 0]
    msg = sglang.MooncakeRegister(
        local_ip="h",
        rank_port=1,
        session_id="s",
        kv_data_ptrs=ptrs,
        aux_data_ptrs=[],
        state_data_ptrs=[[2**63]],
        dst_tp_rank=0,
        attn_tp_size=1,
        kv_item_len=1,
    )
    back = sglang.decode(sglang.encode(msg))
    assert [int(x) for x in back.kv_data_ptrs] == ptrs
    with pytest.raises(EncodeError, match="does not fit") as info:
        sglang.encode(msgspec.structs.replace(back, kv_data_ptrs=[-1]))
    assert (info.value.field, info.value.frame) == ("kv_data_ptrs", 4)
    with pytest.raises(EncodeError, match="does not fit"):
        sglang.encode(msgspec.structs.replace(back, kv_data_ptrs=[2**64]))


def test_unrecognised_and_misrouted_messages() -> None:
    with pytest.raises(UnrecognisedMessage, match="no message matches"):
        sglang.decode([b"WATERMARK", b"1", b"2", b"s"])
    with pytest.raises(UnrecognisedMessage, match="unknown backend"):
        sglang.decode(NIXL_ST, "gloo")
    with pytest.raises(UnrecognisedMessage, match=r"no profile version 3\.0"):
        sglang.decode(NIXL_ST, version=(3, 0))
    with pytest.raises(UnrecognisedMessage, match="no message matches"):
        sglang.decode(NIXL_ST, version=(1, 0))  # NIXL had no status message before 2.0
    with pytest.raises(DecodeError, match="one buffer"):
        sglang.decode(b"KV_STATUS")  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="expected b'NixlMsgGuard'"):
        sglang.decode([b"MoriMsgGuard", b"None", *[b""] * 17], message="NixlRegister")


def test_mooncake_dummy_with_state_is_refused() -> None:
    frames = _with(_with(_with(MOONCAKE_TI, 4, b""), 5, b""), 6, bytes.fromhex("010000000400000005000000"))
    with pytest.raises(DecodeError, match="dummy") as info:
        sglang.decode(frames, "mooncake")
    assert info.value.field == "state_indices"
