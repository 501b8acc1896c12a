"""Round trips of every message of every version: decode(encode(x)) == x, byte-identical re-encoding."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdwire.wire as w
from pdwire.wire import strategies as S

CASES = [(v, name) for v, table in S.STRATEGIES.items() for name in table]


def _join(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


@pytest.mark.parametrize(("version", "name"), CASES, ids=[f"{v[0]}.{v[1]}-{n}" for v, n in CASES])
@settings(max_examples=40)
@given(data=st.data())
def test_round_trip_at_own_version(version: tuple[int, int], name: str, data: st.DataObject) -> None:
    msg = data.draw(S.STRATEGIES[version][name]())
    assert any(type(msg) is mc.cls for mc in w.REGISTRY.codecs[version].values())
    frames = w.encode(msg, version)
    back, sent = w.decode_versioned(_join(frames))
    assert back == msg and sent == version
    assert _join(w.encode(back, version)) == _join(frames)
    # the single-buffer form carries the same content
    assert w.decode_bytes(w.encode_bytes(msg, version)) == msg


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
    assert frames[2] is kv  # the caller's array is the frame: not a copy
    assert memoryview(frames[2]).nbytes == kv.nbytes
    back = w.decode(_join(frames))
    assert np.array_equal(w.decode(frames).dst_kv_indices, kv)  # in process, frames unsent
    strided = np.arange(8192, dtype=np.int32)[::2]  # not contiguous: copied, never sent strided
    frames = w.encode(w.TransferRequest(room=1, sender="d", dst_kv_indices=strided))
    assert frames[2] is not strided and np.array_equal(w.decode(_join(frames)).dst_kv_indices, strided)
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


def _registration(k_base_addrs: object, state_addrs: object) -> w.RegisterInfo:
    """A minimal RegisterInfo carrying ``k_base_addrs`` and one state component at ``state_addrs``."""
    n = len(state_addrs)  # type: ignore[arg-type]
    comp = w.StateComponent(
        type=w.StateType.MAMBA, base_addrs=state_addrs, region_lens=[64] * n, bytes_per_slot=[8] * n
    )  # type: ignore[arg-type]
    return w.RegisterInfo(
        endpoint="e", engine_id="e", agent_name="a", agent_metadata=b"", geometry=w.ParallelGeometry(),
        first_layer=0, num_layers=0, k_base_addrs=k_base_addrs, v_base_addrs=[], bytes_per_page=[],
        region_lens=[], num_pages=0, page_size=1, kv_layout=w.KvLayout.NHD, kv_heads_per_rank=1,
        kv_heads_total=1, bytes_per_head=1, is_mla=True, state_components=[comp],
    )  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize(
    "addrs",
    [[4096, 2**63 + 4096], (2**64 - 1, 0), [2**63]],
    ids=["below-and-above-2**63", "u64-max-and-zero", "bit-63-alone"],
)
def test_u64_lists_keep_every_bit_even_where_numpy_would_promote_to_float(addrs: list[int]) -> None:
    # numpy reads [4096, 2**63 + 4096] as float64: an address with bit 63 set must not be refused
    # as "not integers" (or, worse, rounded)
    import numpy as np

    back = w.decode(w.encode(_registration(list(addrs), addrs)))
    assert isinstance(back, w.RegisterInfo)
    assert back.k_base_addrs.dtype == np.uint64 and [int(x) for x in back.k_base_addrs] == list(addrs)
    assert [int(x) for x in back.state_components[0].base_addrs] == list(addrs)


@pytest.mark.parametrize(
    ("values", "text"),
    [
        ([1, 2**64], "does not fit"),
        ([-1, 2**63], "does not fit"),
        ([1.5, 2], "integers"),
        ([True], "integers"),
    ],
    ids=["past-64-bits", "negative-next-to-2**63", "float", "bool"],
)
def test_lists_that_are_not_u64_are_refused_naming_the_field(values: list[object], text: str) -> None:
    with pytest.raises(w.EncodeError, match=text) as e:
        w.encode(_registration([], values))
    assert "StateComponent.base_addrs" in str(e.value)


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
    # values outside a field's type are refused by the sender, naming message and field
    with pytest.raises(w.EncodeError, match=r"Abort\.room: -1 is outside \[0, 18446744073709551615\]"):
        w.encode(w.Abort(room=-1, sender="x"))
