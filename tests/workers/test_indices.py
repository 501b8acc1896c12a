"""Request indices and rooms: what an engine hands a worker per request, checked once, up front."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdwire.runtime.engine import RESERVED_ROOM, IndicesError, RequestIndices, room_for_request


@given(st.text(min_size=1))
def test_rooms_from_request_ids_are_never_the_reserved_room_and_fit_63_bits(request_id: str) -> None:
    room = room_for_request(request_id)
    assert room != RESERVED_ROOM and 0 < room < 1 << 63
    assert room_for_request(request_id) == room


def test_rooms_are_the_same_in_another_process() -> None:
    code = "from pdwire.runtime.indices import room_for_request as r; print(r('cmpl-1234-0'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == room_for_request("cmpl-1234-0")
    assert room_for_request("cmpl-1234-0") != room_for_request("cmpl-1234-1")


def test_absent_and_empty_state_stay_distinct_and_arrays_are_copied_to_int32() -> None:
    pages = np.array([3, 1, 2], dtype=np.int64)
    r = RequestIndices(pages, state=[None, [], [7]], aux_index=2, decode_prefix_len=16)
    pages[0] = 99  # the engine reuses its array: the request keeps what it was given
    assert r.kv_pages.dtype == np.int32 and r.kv_pages.tolist() == [3, 1, 2]
    assert r.state[0] is None and r.state[1] is not None and len(r.state[1]) == 0
    assert r.sent_components() == (2,)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"kv_pages": [[1, 2]]}, "one-dimensional"),
        ({"kv_pages": [1.5]}, "integers"),
        ({"kv_pages": [-1]}, "negative"),
        ({"kv_pages": [1 << 31]}, "exceeds int32"),
        ({"kv_pages": [1], "state": [[-2]]}, r"state\[0\]: index -2"),
        ({"kv_pages": [1], "state": np.zeros(2)}, "one entry"),
        ({"kv_pages": [1], "aux_index": -1}, "aux_index"),
        ({"kv_pages": [1], "decode_prefix_len": -4}, "decode_prefix_len"),
    ],
)
def test_bad_indices_are_refused_naming_what(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(IndicesError, match=needle):
        RequestIndices(**kw)  # type: ignore[arg-type]


def test_bad_request_ids() -> None:
    with pytest.raises(IndicesError):
        room_for_request("")
