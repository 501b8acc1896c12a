"""Hypothesis round trips and malformed-input fuzz for every message of every profile version."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdwire.wire import sglang
from pdwire.wire.sglang.strategies import STRATEGIES
from pdwire.wirecore.errors import WireError
from pdwire.wirecore.positional.errors import ProfileFrameCountError

CASES = [(v, name) for v, by_name in STRATEGIES.items() for name in by_name]
# what a cross-frame problem's field becomes so that the message is sendable
_NEUTRAL: dict[str, Any] = {
    "aux_index": 0,
    "kv_item_lens": np.empty(0, np.uint64),
    "staging_slot_layer_ids": np.empty(0, np.uint64),
    "state_indices": [],
    "flat_state_indices": np.empty(0, np.int32),
    "device_kv_indices": np.empty(0, np.int32),
    "kv_mem_kinds": [],
}


def sendable(msg: Any) -> Any:
    for _ in range(len(_NEUTRAL)):
        problems = sglang.problems(msg)
        if not problems:
            return msg
        msg = msgspec.structs.replace(msg, **{problems[0][0]: _NEUTRAL[problems[0][0]]})
    raise AssertionError(sglang.problems(msg))


def _id(case: tuple[tuple[int, int], str]) -> str:
    return f"{case[1]}-{case[0][0]}.{case[0][1]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
@given(data=st.data())
def test_encode_decode_round_trip(case: tuple[tuple[int, int], str], data: st.DataObject) -> None:
    version, name = case
    msg = sendable(data.draw(STRATEGIES[version][name]()))
    frames = sglang.encode(msg)
    assert all(isinstance(f, bytes) for f in frames)
    back = sglang.decode(frames, msg.BACKEND, version=version, message=name)
    assert back == msg
    assert sglang.encode(back) == frames
    # decoding a copy held in bytearrays gives read-only arrays equal to the bytes version
    again = sglang.decode([bytearray(f) for f in frames], msg.BACKEND, version=version, message=name)
    assert again == msg
    for value in msgspec.structs.asdict(again).values():
        if isinstance(value, np.ndarray):
            assert not value.flags.writeable


@pytest.mark.parametrize("case", CASES, ids=_id)
@given(data=st.data())
def test_mutated_frame_is_decoded_or_named(case: tuple[tuple[int, int], str], data: st.DataObject) -> None:
    """One corrupted frame: either still a valid message, or a WireError naming that frame."""
    version, name = case
    msg = sendable(data.draw(STRATEGIES[version][name]()))
    frames = sglang.encode(msg)
    i = data.draw(st.integers(0, len(frames) - 1))
    kind = data.draw(st.sampled_from(["random", "truncate", "extend", "empty"]))
    f = frames[i]
    if kind == "random":
        new = data.draw(st.binary(max_size=40))
    elif kind == "truncate":
        new = f[: data.draw(st.integers(0, max(0, len(f) - 1)))]
    elif kind == "extend":
        new = f + data.draw(st.binary(min_size=1, max_size=9))
    else:
        new = b""
    bad = [*frames[:i], new, *frames[i + 1 :]]
    try:
        back = sglang.decode(bad, msg.BACKEND, version=version, message=name)
    except WireError as exc:
        assert exc.message == name and msg.BACKEND in str(exc) and name in str(exc)
        # a cross-frame rule may name the other frame of the pair
        assert exc.frame == i or exc.field in _NEUTRAL, exc
        return
    assert type(back) is type(msg)


@pytest.mark.parametrize("case", CASES, ids=_id)
@given(data=st.data())
def test_frame_count_outside_the_layout_is_a_typed_error(
    case: tuple[tuple[int, int], str], data: st.DataObject
) -> None:
    version, name = case
    msg = sendable(data.draw(STRATEGIES[version][name]()))
    frames = sglang.encode(msg)
    spec = sglang.CODEC.spec_of(msg)
    extra = [*frames, *([b""] * (spec.max_frames - len(frames))), b"x"]
    with pytest.raises(ProfileFrameCountError, match=name):
        sglang.decode(extra, msg.BACKEND, version=version, message=name)
    short = frames[: spec.min_frames - 1]
    with pytest.raises(ProfileFrameCountError, match=f"{len(short)} frames"):
        sglang.decode(short, msg.BACKEND, version=version, message=name)


@given(
    frames=st.lists(
        st.one_of(
            st.binary(max_size=24),
            st.sampled_from(
                [b"None", b"NixlMsgGuard", b"MoriMsgGuard", b"KV_STATUS", b"0", b"18446744073709551616"]
            ),
        ),
        max_size=26,
    ),
    backend=st.sampled_from([None, *sglang.BACKENDS]),
    version=st.sampled_from(sglang.VERSIONS),
)
def test_arbitrary_frames_give_only_wire_errors(
    frames: list[bytes], backend: str | None, version: tuple[int, int]
) -> None:
    try:
        msg = sglang.decode(frames, backend, version=version)
    except WireError:
        return
    assert sglang.encode(msg)  # whatever decodes can be written again
