"""Round trips of every message of every version: decode(encode(x)) == x, byte-identical re-encoding."""

from __future__ import annotations

from typing import Any

import pdwire.wire as w
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdwire.wire import strategies as S

CASES = [(v, name) for v, table in S.STRATEGIES.items() for name in table]


def _join(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


@pytest.mark.parametrize(("version", "name"), CASES, ids=[f"{v[0]}.{v[1]}-{n}" for v, n in CASES])
@settings(max_examples=40)
@given(data=st.data())
def test_round_trip_at_own_version(version: tuple[int, int], name: str, data: st.DataObject) -> None:
    module = getattr(w, f"v{version[0]}_{version[1]}")
    msg = data.draw(S.STRATEGIES[version][name]())
    frames = module.encode(msg)
    header = w.REGISTRY.codecs[version]
    assert any(type(msg) is mc.cls for mc in header.values())
    back = module.decode(_join(frames))
    assert back == msg
    assert _join(module.encode(back)) == _join(frames)
    # the single-buffer form carries the same content
    single = w.encode_bytes(msg, version)
    assert _join(w.REGISTRY.encode(msg, version)) == _join(frames)
    assert module.decode(_join(w.REGISTRY.encode(msg, version))) == msg
    assert w.decode_bytes(single) == w.decode(_join(frames))


@pytest.mark.parametrize("name", list(S.STRATEGIES[w.NEWEST]))
@settings(max_examples=40)
@given(data=st.data())
def test_newest_top_level_api(name: str, data: st.DataObject) -> None:
    msg = data.draw(S.STRATEGIES[w.NEWEST][name]())
    frames = w.encode(msg)
    decoded, version = w.decode_versioned(_join(frames))
    assert version == w.NEWEST
    assert decoded == msg
    assert _join(w.encode(decoded)) == _join(frames)
    assert w.decode_bytes(w.encode_bytes(msg)) == msg


def test_large_arrays_travel_as_side_frames_without_copy() -> None:
    import numpy as np

    kv = np.arange(4096, dtype=np.int32)
    msg = w.TransferRequest(
        room=1, sender="d", dst_kv_indices=kv, state_indices=[np.arange(3, dtype=np.int32)]
    )
    frames = w.encode(msg)
    assert len(frames) == 3
    assert isinstance(frames[2], memoryview) and frames[2].obj is kv  # the caller's buffer, not a copy
    back = w.decode(_join(frames))
    assert not back.dst_kv_indices.flags.writeable
    assert np.array_equal(back.dst_kv_indices, kv)


def test_lists_and_tuples_are_accepted_as_arrays_but_never_wrapped() -> None:
    import numpy as np

    msg = w.TransferRequest(room=1, sender="d", dst_kv_indices=[1, 2, 3])  # type: ignore[arg-type]
    back = w.decode(w.encode(msg))
    assert back.dst_kv_indices.dtype == np.int32 and list(back.dst_kv_indices) == [1, 2, 3]
    too_big = w.TransferRequest(room=1, sender="d", dst_kv_indices=np.array([2**31], dtype=np.int64))
    with pytest.raises(w.EncodeError, match=r"dst_kv_indices.*do not fit int32"):
        w.encode(too_big)
    with pytest.raises(w.EncodeError, match="one-dimensional"):
        w.encode(w.TransferRequest(room=1, sender="d", dst_kv_indices=np.zeros((2, 2), dtype=np.int32)))
    with pytest.raises(w.EncodeError, match="integers"):
        w.encode(w.TransferRequest(room=1, sender="d", dst_kv_indices=np.zeros(2, dtype=np.float32)))


def test_absent_component_is_distinct_from_empty() -> None:
    import numpy as np

    msg = w.TransferRequest(
        room=9,
        sender="d",
        dst_kv_indices=np.zeros(0, dtype=np.int32),
        state_indices=[None, np.zeros(0, dtype=np.int32)],
    )
    back = w.decode(w.encode(msg))
    assert back.state_indices[0] is None
    assert back.state_indices[1] is not None and len(back.state_indices[1]) == 0


def test_encoding_a_foreign_object_is_a_typed_error() -> None:
    with pytest.raises(w.EncodeError, match="not a pdwire message"):
        w.encode(object())
    # out-of-range scalars are caught by the receiver, naming the field
    with pytest.raises(w.BodyError, match=r"Abort\.room \(frame 1\)"):
        w.decode(w.encode(w.Abort(room=-1, sender="x")))
