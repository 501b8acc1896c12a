"""The per-registration message bound (``runtime/session/message_bounds.py``), in memory.

The largest request a registered peer can legally send (every index list at its longest, every
integer at its widest) fits under the bound at every version; one larger for its pools does not
and is refused from its header frame, before decoding. The real-socket test is in
``tests/e2e/test_message_bounds.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from pdwire import wire
from pdwire.runtime.planner import PlanError
from pdwire.runtime.session.message_bounds import (
    PROBE_ITEMS,
    U32_MAX,
    U64_MAX,
    MessageLimits,
    MessageTooLarge,
    index_list_bounds,
    request_limit,
)
from pdwire.wirecore.envelope.header import parse_header
from tests.session.test_connections import VERSIONS, decode_local, handshake, prefill_local, registered

REQUEST_TYPE = parse_header(
    bytes(wire.encode(wire.TransferRequest(room=1, sender="", dst_kv_indices=[]))[0])
)[3]


def frames_of(msg: wire.Message, version: tuple[int, int]) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) for f in wire.encode(msg, version)]


def longest_legal(plan: Any, n: int) -> int:
    """The longest list 0..k-1 the plan accepts for the KV pool, k <= n."""
    for k in range(n, -1, -1):
        try:
            plan.check_request(np.arange(k, dtype=np.int32), [], None)
        except PlanError:
            continue
        return k
    raise AssertionError("no list is legal")


def largest_request(h: Any) -> wire.TransferRequest:
    """The largest request the registered peer of ``h`` may send: its longest legal lists."""
    plan = h.p.plan
    kv, state = index_list_bounds(plan.remote)
    pages = longest_legal(plan, kv)
    lists = [np.arange(n, dtype=np.int32) for n in state]
    for i in range(len(lists)):  # shrink each state list until its component accepts it
        while True:
            try:
                plan.check_request(np.zeros(0, np.int32), lists, None)
                break
            except PlanError as exc:
                if f"state[{i}]" not in str(exc):
                    break
                lists[i] = lists[i][:-1]
    plan.check_request(np.arange(pages, dtype=np.int32), lists, None)
    return wire.TransferRequest(
        room=U64_MAX,
        sender="decode:dec/0",
        dst_kv_indices=np.arange(pages, dtype=np.int32),
        dst_aux_index=-(1 << 31),
        required_dst_info_num=U32_MAX,
        decode_prefix_len=U64_MAX,
        state_indices=lists,
    )


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"{v[0]}.{v[1]}")
def test_the_largest_legal_request_fits_and_one_more_page_list_does_not(version: tuple[int, int]) -> None:
    # 1.0 carries one flat state: the Mamba-only model it can serve
    memory = {} if version >= (1, 1) else {"components": 1, "sub_blocks": False}
    h = handshake(prefill_local(**memory), decode_local(versions=(version,), **memory))
    h.run()
    assert h.p.registered and h.p.version == version and h.p.limits is not None
    req = largest_request(h)
    legal = frames_of(req, version)
    assert h.p.oversized(legal) is None
    kv, _ = index_list_bounds(h.p.plan.remote)
    req.dst_kv_indices = np.arange(4 * kv + 1024, dtype=np.int32)  # past the pool, and then some
    error = h.p.oversized(frames_of(req, version))
    assert isinstance(error, MessageTooLarge) and "TransferRequest" in str(error)
    assert "largest legal one for its registered pools" in str(error)


def test_the_bound_grows_with_the_pools_without_building_them() -> None:
    """A registration naming a huge pool: the bound is computed from the item counts (the probe
    stays small), and is larger by exactly the items' bytes."""
    h = registered()
    remote, version = h.p.plan.remote, h.p.version
    assert remote.kv is not None
    type_id, small = request_limit(remote, "e", version)
    assert type_id == REQUEST_TYPE
    kv = remote.kv

    def grown(factor: int) -> Any:
        return dataclasses.replace(
            remote, kv=dataclasses.replace(kv, region_lens=tuple(n * factor for n in kv.region_lens))
        )

    (big, before), (bigger, after) = (
        (request_limit(grown(f), "e", version)[1], index_list_bounds(grown(f))[0]) for f in (1000, 2000)
    )
    assert before > PROBE_ITEMS and small < big < bigger
    assert bigger - big == (after - before) * 4  # 4 bytes an i32 page index, nothing allocated for them


def test_only_registered_peers_and_bounded_types_are_checked() -> None:
    h = handshake(prefill_local(), decode_local())
    huge = wire.TransferRequest(room=1, sender="x", dst_kv_indices=np.arange(1 << 16, dtype=np.int32))
    assert h.p.oversized(frames_of(huge, wire.NEWEST)) is None  # not registered: nothing known yet
    h.run()
    assert h.p.oversized(frames_of(huge, wire.NEWEST)) is not None
    abort = wire.Abort(room=1, sender="x", reason="r" * (1 << 16))  # nothing of the registration bounds it
    assert h.p.oversized(frames_of(abort, wire.NEWEST)) is None
    assert h.p.oversized([b"not a header", b"x" * (1 << 20)]) is None  # left to the decoder to refuse
    assert h.p.oversized([]) is None


def test_a_new_hello_forgets_the_bound() -> None:
    h = registered()
    assert h.p.limits is not None
    h.p.receive(h.d.local.hello)
    assert h.p.limits is None and not h.p.registered


def test_limits_read_only_the_header() -> None:
    limits = MessageLimits({REQUEST_TYPE: ("TransferRequest", 100)})
    header = frames_of(wire.TransferRequest(room=1, sender="", dst_kv_indices=[]), wire.NEWEST)[0]
    assert limits.excess([header, b"x" * 88]) is None  # 100 bytes in all
    error = limits.excess([header, b"x" * 89])
    assert error is not None and "101 bytes" in str(error) and "(100 bytes)" in str(error)
