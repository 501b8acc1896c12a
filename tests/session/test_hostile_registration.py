"""A hostile or broken decode peer's registration, fed to the pure prefill connection machine.

A RegisterInfo is the peer's data: whatever field is wrong (a TP size of 0, a geometry other
than its Hello's, numbers at the edges of their type, lists of the wrong length) must end in a
typed refusal of that peer, never an exception out of the machine (which would stop the rank).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdwire import wire
from pdwire.runtime.session.events import AddPeer, Send
from pdwire.runtime.session.prefill_connection import PrefillConnection, PrefillConnState
from tests.session.test_connections import (
    _REFERENCE,
    PREFILL_INPUTS,
    prefill_local,
    registered,
    request,
    trip,
)

HELLO = PREFILL_INPUTS["hello"]
INFO = PREFILL_INPUTS["register"]
VERSION = _REFERENCE.p.version
assert isinstance(INFO, wire.RegisterInfo) and VERSION is not None


def hello_then(info: wire.RegisterInfo) -> tuple[PrefillConnection, list[Any]]:
    c = PrefillConnection(prefill_local())
    c.receive(HELLO)
    assert c.state is PrefillConnState.AWAIT_REGISTRATION
    return c, c.receive(info)


def refusal_reason(events: list[Any]) -> str:
    (answer,) = events
    assert isinstance(answer, Send)
    msg = answer.message
    if isinstance(msg, wire.RegisterAck):
        assert not msg.accepted
    else:
        assert isinstance(msg, wire.TransferStatus) and msg.status == wire.Status.FAILED
    return str(msg.reason)


def geometry(**kw: int) -> wire.ParallelGeometry:
    return msgspec.structs.replace(INFO.geometry, **kw)


def test_a_registration_with_tp_size_zero_is_refused_by_name() -> None:
    c, events = hello_then(msgspec.structs.replace(INFO, geometry=geometry(tp_size=0)))
    assert "geometry" in refusal_reason(events)
    assert c.state is PrefillConnState.AWAIT_REGISTRATION and c.plan is None


def test_a_registration_for_another_grid_position_than_the_hello_is_refused() -> None:
    _, events = hello_then(msgspec.structs.replace(INFO, geometry=geometry(tp_size=2, tp_rank=1)))
    assert "disagrees with the Hello" in refusal_reason(events)


def test_a_registration_under_another_engine_id_than_the_hello_is_refused() -> None:
    _, events = hello_then(msgspec.structs.replace(INFO, engine_id="someone-else"))
    assert "engine_id" in refusal_reason(events)


def test_the_unmutated_registration_is_still_accepted() -> None:
    c, events = hello_then(INFO)
    assert any(isinstance(e, AddPeer) for e in events)
    c.peer_added()
    assert c.registered


_EDGE_INTS = st.sampled_from([0, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1])


def _mutant(value: Any) -> st.SearchStrategy[Any]:
    """Values of the field's own shape (what still decodes), at the edges of their range."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return _EDGE_INTS | st.integers(0, 2**64 - 1)
    if isinstance(value, list | tuple):
        items = list(value)
        if items and isinstance(items[0], int):
            return st.lists(_EDGE_INTS, max_size=6) | st.just(items[:-1]) | st.just([*items, *items[:1]])
        return st.just(items[:-1]) | st.just([*items, *items]) | st.just([])
    if isinstance(value, msgspec.Struct):
        names = list(value.__struct_fields__)
        return st.sampled_from(names).flatmap(
            lambda n: _mutant(getattr(value, n)).map(lambda v: msgspec.structs.replace(value, **{n: v}))
        )
    return st.just(value)


_FIELDS = list(INFO.__struct_fields__)


@st.composite
def mutated_registration(draw: st.DrawFn) -> wire.RegisterInfo:
    info = INFO
    for name in draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3)):
        value = getattr(info, name)
        if isinstance(value, list) and value and isinstance(value[0], msgspec.Struct):
            i = draw(st.integers(0, len(value) - 1))
            items = list(value)
            items[i] = draw(_mutant(items[i]))
            new: Any = items
        else:
            new = draw(_mutant(value))
        info = msgspec.structs.replace(info, **{name: new})
    return info


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_registration())
def test_any_mutated_registration_ends_in_a_typed_refusal_or_a_planned_peer(info: wire.RegisterInfo) -> None:
    try:
        decoded = trip(info, VERSION)  # only what a peer can put on the wire reaches the machine
    except (
        wire.WireError,
        msgspec.ValidationError,
        msgspec.EncodeError,
        OverflowError,
        TypeError,
        ValueError,
    ):
        assume(False)
        return
    assert isinstance(decoded, wire.RegisterInfo)
    c, events = hello_then(decoded)  # must not raise
    adds = [e for e in events if isinstance(e, AddPeer)]
    if adds:
        assert c.state is PrefillConnState.ADDING_PEER and len(events) == 1
    else:
        refusal_reason(events)
        assert c.state is PrefillConnState.AWAIT_REGISTRATION and c.plan is None
    c.receive(HELLO)  # the connection still serves: a new Hello starts over
    assert c.state is PrefillConnState.AWAIT_REGISTRATION


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"required_dst_info_num": 0}, "required_dst_info_num is 0"),
        ({"dst_kv_indices": [], "decode_prefix_len": 0}, "zero tokens"),
        # indices past the decode rank's registered pools: refused before any chunk is planned
        ({"dst_kv_indices": [0, 1, 1 << 20]}, "past the registered pool"),
        ({"dst_aux_index": 1 << 20}, "past the registered pool"),
    ],
)
def test_a_request_nobody_can_serve_is_refused_at_once(change: dict[str, Any], needle: str) -> None:
    h = registered()
    events = h.p.receive(trip(request(h, **change), h.p.version))
    (answer,) = events  # no room is made: the requester is told at once
    assert isinstance(answer, Send) and isinstance(answer.message, wire.TransferStatus)
    assert answer.message.status == wire.Status.FAILED and needle in str(answer.message.reason)
