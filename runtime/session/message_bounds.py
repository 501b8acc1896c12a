"""The largest legal message a registered decode peer may send, from its registration (why a
second bound beside ``ZMQ_MAXMSGSIZE``: docs/hostile-peers.md).

Every destination index of a request is distinct and inside its pool, so a KV list is at most
the pool's page count and a state list its component's item count. The size is not typed in:
it is what the generated encoder writes for the largest legal request at the agreed version
(:func:`request_limit`), long lists probed at :data:`PROBE_ITEMS` items and grown by their item
size (a huge pool costs no memory here), each msgpack object allowed :data:`HEADER_SLACK`
(another conforming writer may frame the same values less tightly). Pure; the header peek
reads the 12-byte first frame only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from pdwire import wire
from pdwire.runtime.planner import Indexing, RankMemory
from pdwire.runtime.session.hello import LAYOUTS_SINCE
from pdwire.wirecore.envelope.header import parse_header

PROBE_ITEMS = 1024  # past the 1 KiB side-frame threshold: each longer list is a side frame of 4 bytes an item
HEADER_SLACK = 8  # msgpack: a header is 1 byte at its narrowest, 9 (a u64) at its widest
SENDER_ALLOWANCE = 256  # bytes of TransferRequest.sender at least: an endpoint is "host:port"
_ITEM = np.dtype(np.int32).itemsize  # every index list of TransferRequest is i32[] (schema/pdwire.yaml)

U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
I32_MIN = -(1 << 31)
I64_MIN = -(1 << 63)


class MessageTooLarge(Exception):
    """A registered peer sent a message larger than the largest legal one for its registration."""


def _items(region_lens: Sequence[int], stride: int) -> int:
    """An upper bound of the items a registration of these lengths holds at ``stride``."""
    return max((int(n) // max(int(stride), 1) + 1 for n in region_lens), default=0)


def index_list_bounds(remote: RankMemory) -> tuple[int, tuple[int, ...]]:
    """(KV pages, per state component items): the longest index list a legal request names for
    each, from the decode rank's registered memory (upper bounds: a list longer than its pool
    must repeat an index or pass the pool's end, which ``check_request`` refuses)."""
    kv = 0 if remote.kv is None else _items(remote.kv.region_lens, remote.kv.stride)
    state = []
    for pool in remote.state:
        if pool.indexing is Indexing.SLOT:
            state.append(1)
        else:
            state.append(max((_items(t.region_lens, t.stride) for t in pool.tensors), default=0))
    return kv, tuple(state)


def _objects(value: Any) -> int:
    """msgpack objects in a decoded body: each has a header another writer may widen."""
    if isinstance(value, list):
        return 1 + sum(_objects(v) for v in value)
    return 1


def _encoded(version: tuple[int, int], sender: str, kv: int, state: Sequence[int]) -> list[Any]:
    def ids(n: int) -> np.ndarray[Any, np.dtype[np.int32]]:
        return np.zeros(min(n, PROBE_ITEMS), np.int32)

    probe = wire.TransferRequest(
        room=U64_MAX,
        sender=sender,
        dst_kv_indices=ids(kv),
        dst_aux_index=I32_MIN,
        required_dst_info_num=U32_MAX,
        decode_prefix_len=U64_MAX,
        is_dummy=True,
        state_indices=[ids(n) for n in state],
    )
    if version >= LAYOUTS_SINCE:  # the receive staging range: fixed-size integers at their widest
        probe.scatter_offset, probe.scatter_page_bytes, probe.scatter_pages = I64_MIN, U64_MAX, U32_MAX
    try:
        return wire.encode(probe, version)
    except wire.DowngradeError:
        # an older minor cannot carry this many components: no legal request of it can either,
        # and the newest form is the larger bound
        return wire.encode(probe, wire.NEWEST)


def request_limit(remote: RankMemory, endpoint: str, version: tuple[int, int]) -> tuple[int, int]:
    """(type id, bytes) of the largest legal ``TransferRequest`` of a decode rank registered with
    ``remote`` memory and ``endpoint``, at the agreed ``version``: all its frames together."""
    kv, state = index_list_bounds(remote)
    sender = "x" * max(len(endpoint.encode()), SENDER_ALLOWANCE)
    frames = _encoded(version, sender, kv, state)
    type_id = parse_header(bytes(frames[0]))[3]
    size = sum(memoryview(f).nbytes for f in frames)
    grown = sum(max(n - PROBE_ITEMS, 0) for n in (kv, *state)) * _ITEM
    slack = HEADER_SLACK * _objects(msgspec.msgpack.decode(bytes(frames[1])))
    return type_id, size + grown + slack


@dataclass(frozen=True, slots=True)
class MessageLimits:
    """Per message type id: (name, largest legal size in bytes) for one registered peer. Types
    without an entry (Hello, RegisterInfo, Abort: nothing of the registration bounds them) are
    bounded by the socket alone."""

    by_type: Mapping[int, tuple[str, int]]

    def excess(self, frames: Sequence[bytes]) -> MessageTooLarge | None:
        """The refusal of ``frames`` (one message, without the ROUTER identity), or None. Reads
        the header frame only: a frame that is no header is left to the decoder to refuse."""
        if not frames:
            return None
        try:
            type_id = parse_header(frames[0])[3]
        except wire.WireError:
            return None
        bound = self.by_type.get(type_id)
        size = sum(len(f) for f in frames)
        if bound is None or size <= bound[1]:
            return None
        name, limit = bound
        return MessageTooLarge(
            f"a {name} of {size} bytes, more than the largest legal one for its registered pools "
            f"({limit} bytes): refused before decoding"
        )


def peer_limits(remote: RankMemory, endpoint: str, version: tuple[int, int]) -> MessageLimits:
    type_id, limit = request_limit(remote, endpoint, version)
    return MessageLimits({type_id: ("TransferRequest", limit)})
