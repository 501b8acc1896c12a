"""The decode side of one prefill rank's control connection: a pure state machine (h11 style;
its moves: ``DECODE_CONNECTION`` in :mod:`.states`).

:meth:`DecodeConnection.start` says the Hello to send; each decoded message goes to
:meth:`DecodeConnection.receive`, which returns :mod:`.events`. The answer to our RegisterInfo
(a ``RegisterAck`` from the version that introduced it, a ``TransferStatus`` for the reserved
room 0 before) makes the connection ready, or it is refused with the cause named.

After this rank revoked the prefill rank, :meth:`reregister` sends a RegisterInfo with new
windows; a refusal (a NIXL prefill rank refuses while its old transfers to this rank are still
stopping) leaves it in ``RETRY`` and the edge registers again later. Room messages keep flowing
meanwhile; only a ready connection takes new rooms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdwire import wire
from pdwire.runtime.config import ParallelRank
from pdwire.runtime.indices import RESERVED_ROOM
from pdwire.runtime.planner import HeadGeometry, RankMemory
from pdwire.runtime.session.actions import PeerRef, SendRequest
from pdwire.runtime.session.events import (
    AbortAcked,
    DecodeEvent,
    Problem,
    Ready,
    Refused,
    Send,
    StatusReceived,
    completion,
)
from pdwire.runtime.session.failures import Failure, HandshakeError, failure_from_wire
from pdwire.runtime.session.hello import (
    LAYOUTS_SINCE,
    LEASES_SINCE,
    REGISTER_ACK_SINCE,
    check_descriptors,
    check_hello,
    rank_of,
)
from pdwire.runtime.session.registration import check_layout_version, heads_from_wire, register_info
from pdwire.runtime.session.stage_layers import HeldLayers
from pdwire.runtime.session.states import DECODE_CONNECTION, DecodeConnState, StateField
from pdwire.runtime.session.status import Status


@dataclass(frozen=True, slots=True)
class DecodeLocal:
    """This decode rank, as every link of it sees it: what it says and what it registers."""

    hello: wire.Hello
    memory: RankMemory
    endpoint: str  # the name it gives itself in RegisterInfo and TransferRequests
    backend_name: str
    agent_name: str
    agent_metadata: bytes
    region_descs: tuple[bytes, ...] = ()
    scatter: tuple[int, int] = (0, 0)  # the receive staging buffer (base, length); (0, 0): none

    def register_info(self, version: tuple[int, int]) -> wire.RegisterInfo:
        return register_info(
            self.memory,
            endpoint=self.endpoint,
            engine_id=self.hello.engine_id,
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata,
            region_descs=self.region_descs,
            version=version,
            geometry=self.geometry,
            scatter=self.scatter,
        )

    @property
    def geometry(self) -> wire.ParallelGeometry:
        return self.hello.geometry


@dataclass(frozen=True, slots=True)
class Expected:
    """Which prefill rank an endpoint must be, by the caller's topology."""

    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0


class DecodeConnection:
    """One prefill rank, seen from this decode rank. See the module notes."""

    state = StateField(DECODE_CONNECTION)  # every move checked against its table (:mod:`.states`)

    def __init__(
        self, local: DecodeLocal, endpoint: str, deadline: float, expected: Expected | None = None
    ) -> None:
        self.local = local
        self.endpoint = endpoint
        self.deadline = deadline
        self.expected = expected
        self.state = DecodeConnState.HELLO_SENT
        self.version: tuple[int, int] | None = None
        self.peer: PeerRef | None = None
        self.position: ParallelRank | None = None
        self.refusal: str | None = None
        self._registration: wire.RegisterInfo | None = None  # the first RegisterInfo, once sent
        # from the RegisterAck (1.4): the prefill rank's KV head geometry and layers, from which
        # this rank computes where its staged bytes go (None: it sent none, it does not scatter)
        self.prefill_heads: HeadGeometry | None = None
        self.prefill_kv_layers: tuple[int, ...] = ()
        # from the RegisterAck (1.5): how long the prefill rank holds a room nobody asked for,
        # renewed by a Lease (0: it takes none)
        self.lease_s = 0.0

    @property
    def ready(self) -> bool:
        return self.state is DecodeConnState.READY

    @property
    def handshaking(self) -> bool:
        return self.state in (DecodeConnState.HELLO_SENT, DecodeConnState.REGISTERING)

    def start(self) -> list[DecodeEvent]:
        """The first message: our Hello (every version of pdwire reads any Hello)."""
        return [Send(self.local.hello, None)]

    # ------------------------------------------------------------------ messages in

    def receive(self, msg: wire.Message) -> list[DecodeEvent]:
        if self.state is DecodeConnState.HELLO_SENT:
            return self._on_hello(msg)
        if self.state is DecodeConnState.REGISTERING:
            return self._on_answer(msg)
        if self.state is DecodeConnState.REFUSED:
            return []
        if self.state is DecodeConnState.REREGISTERING and (answer := self._answer(msg)) is not None:
            return self._on_reanswer(*answer)
        return self._on_room_message(msg)

    def reregister(self, local: DecodeLocal) -> list[DecodeEvent]:
        """Register again with ``local``'s new metadata (the old windows were revoked)."""
        if self.state not in (DecodeConnState.READY, DecodeConnState.RETRY):
            return []
        assert self.version is not None
        self.local = local
        info = local.register_info(self.version)
        self.state = DecodeConnState.REREGISTERING
        return [Send(info, self.version)]

    def _answer(self, msg: wire.Message) -> tuple[wire.RegisterAck | wire.TransferStatus, bool] | None:
        """``msg`` as the answer to a RegisterInfo, and whether it accepted it; None if it is
        none: a ``RegisterAck`` from the version that introduced it, a ``TransferStatus`` for
        the reserved room 0 before."""
        assert self.version is not None
        if self.version >= REGISTER_ACK_SINCE:
            return (msg, bool(msg.accepted)) if isinstance(msg, wire.RegisterAck) else None
        if isinstance(msg, wire.TransferStatus) and int(msg.room) == RESERVED_ROOM:
            return msg, msg.status == wire.Status.SUCCESS
        return None

    def _on_reanswer(self, msg: wire.RegisterAck | wire.TransferStatus, accepted: bool) -> list[DecodeEvent]:
        assert self.peer is not None and self.position is not None and self.version is not None
        if not accepted:
            self.state = DecodeConnState.RETRY
            why = failure_from_wire(msg.failure_kind, msg.reason)
            text = f"prefill {self.peer} refused the registration again (retried later): {why.reason}"
            return [Problem(text)]
        self.state = DecodeConnState.READY
        return [Ready(self.peer, self.position, self.version)]

    def undecodable(self, error: str) -> list[DecodeEvent]:
        if self.state is DecodeConnState.REFUSED:
            return []
        if self.handshaking:
            return self._refuse(f"{self.endpoint} sent an undecodable message during the handshake: {error}")
        return [Problem(f"undecodable message from {self.peer}: {error}")]

    def transport_refused(self, reason: str) -> list[DecodeEvent]:
        """The socket refused the handshake (CURVE keys, one side unauthenticated): a handshake
        in progress is refused now, naming it, rather than at its deadline."""
        return self._refuse(reason) if self.handshaking else []

    def on_tick(self, now: float) -> list[DecodeEvent]:
        if not self.handshaking or now < self.deadline:
            return []
        what = "Hello" if self.state is DecodeConnState.HELLO_SENT else "registration answer"
        return self._refuse(f"no {what} from {self.endpoint} within the handshake timeout")

    def _refuse(self, reason: str) -> list[DecodeEvent]:
        self.state, self.refusal = DecodeConnState.REFUSED, reason
        return [Refused(reason)]

    def _on_hello(self, msg: wire.Message) -> list[DecodeEvent]:
        if not isinstance(msg, wire.Hello):
            return self._refuse(f"{self.endpoint} answered a Hello with {type(msg).__name__}")
        try:
            version = check_hello(self.local.hello, msg)
            position = rank_of(msg.geometry, f"prefill {msg.engine_id!r}")
            self._check_expected(position)
            check_descriptors(version, self.local.backend_name, bool(self.local.region_descs), msg.engine_id)
            check_layout_version(
                version, self.local.memory, msg.engine_id, own_layout=True,
                prefill_tp=msg.geometry.tp_size, decode_tp=self.local.geometry.tp_size,
            )  # fmt: skip
            info = self.local.register_info(version)
            try:
                wire.encode(info, version)  # refused here, by name, rather than at the edge
            except wire.WireError as exc:  # e.g. DowngradeError: this memory does not fit an older version
                raise HandshakeError(
                    f"RegisterInfo cannot be sent to {msg.engine_id!r} at version "
                    f"{version[0]}.{version[1]}: {exc}"
                ) from exc
        except HandshakeError as exc:
            return self._refuse(str(exc))
        self.version, self.position = version, position
        self.peer = PeerRef(msg.engine_id, position.engine_rank)
        self.state = DecodeConnState.REGISTERING
        self._registration = info
        return [Send(info, version)]

    def register_again(self) -> list[DecodeEvent]:
        """Send a refused first registration once more, inside the same handshake deadline: the
        edge closed its own older connection to that rank, which the prefill rank may not have
        seen go yet (it refuses a registration while a live connection holds the rank). Nothing
        unless the Hello passed and the registration was refused."""
        if self.state is not DecodeConnState.REFUSED or self._registration is None:
            return []
        assert self.version is not None
        self.state, self.refusal = DecodeConnState.REGISTERING, None
        return [Send(self._registration, self.version)]

    def _check_expected(self, pos: ParallelRank) -> None:
        e = self.expected
        if e is None:
            return
        if (pos.tp_size, pos.tp_rank, pos.pp_size, pos.pp_rank) != (
            e.tp_size,
            e.tp_rank,
            e.pp_size,
            e.pp_rank,
        ):
            raise HandshakeError(
                f"{self.endpoint} says it is prefill rank ({pos}), expected tp {e.tp_rank}/{e.tp_size}, "
                f"pp {e.pp_rank}/{e.pp_size}"
            )

    def _on_answer(self, received: wire.Message) -> list[DecodeEvent]:
        assert self.version is not None and self.peer is not None and self.position is not None
        answer = self._answer(received)
        if answer is None:
            return self._refuse(f"{self.endpoint} answered RegisterInfo with {type(received).__name__}")
        msg, accepted = answer
        if not accepted:
            why = failure_from_wire(msg.failure_kind, msg.reason)
            return self._refuse(f"prefill {self.peer.engine_id!r} refused the registration: {why.reason}")
        self.state = DecodeConnState.READY
        layers = None
        if self.version >= LAYOUTS_SINCE and isinstance(msg, wire.RegisterAck):
            state = tuple(tuple(ids.tolist()) for ids in msg.state_layers)
            layers = HeldLayers(tuple(msg.kv_layers.tolist()), state)
            self.prefill_kv_layers = layers.kv
            try:
                self.prefill_heads = None if msg.kv_heads is None else heads_from_wire(msg.kv_heads)
            except ValueError:  # a value outside the enum: no scatter from this rank
                self.prefill_heads = None
        if self.version >= LEASES_SINCE and isinstance(msg, wire.RegisterAck):
            self.lease_s = int(msg.lease_ms) / 1000
        return [Ready(self.peer, self.position, self.version, layers)]

    def _on_room_message(self, msg: wire.Message) -> list[DecodeEvent]:
        if isinstance(msg, wire.TransferStatus):
            if int(msg.room) == RESERVED_ROOM:
                return []  # a repeated registration answer: nothing is waiting for it
            status = Status(int(msg.status))
            failure = failure_from_wire(msg.failure_kind, msg.reason) if status == Status.FAILED else None
            return [StatusReceived(int(msg.room), int(msg.sender_rank), status, failure)]
        if isinstance(msg, wire.Notification):
            return [completion(msg)]
        if isinstance(msg, wire.AbortAck):
            return [AbortAcked(int(msg.room), int(msg.sender_rank))]
        if isinstance(msg, wire.RegisterAck):
            return []  # a repeated registration answer
        return [Problem(f"unexpected {type(msg).__name__} from {self.peer}")]

    # ------------------------------------------------------------------ actions -> messages

    def transfer_request(
        self, a: SendRequest, scatter: tuple[int, int, int] | None = None
    ) -> wire.TransferRequest:
        """``scatter``: the room's receive staging range for this rank (offset, bytes per page,
        pages), only for a peer that agreed on 1.4."""
        r = a.indices
        empty = np.zeros(0, dtype=np.int32)
        offset, page_bytes, pages = (-1, 0, 0) if scatter is None else scatter
        return wire.TransferRequest(
            room=a.room,
            sender=self.local.endpoint,
            dst_kv_indices=empty if a.is_dummy else r.kv_pages,
            dst_aux_index=-1 if a.is_dummy or r.aux_index is None else r.aux_index,
            required_dst_info_num=a.required,
            decode_prefix_len=r.decode_prefix_len,
            is_dummy=a.is_dummy,
            state_indices=[] if a.is_dummy else list(r.state),
            scatter_offset=offset,
            scatter_page_bytes=page_bytes,
            scatter_pages=pages,
        )

    def abort(self, room: int, failure: Failure) -> wire.Abort:
        return wire.Abort(room=room, sender=self.local.endpoint, reason=failure.reason)

    def lease(self, rooms: Sequence[int]) -> wire.Lease:
        """Renew ``rooms`` (only for a peer whose :attr:`lease_s` is not 0: it agreed on 1.5)."""
        return wire.Lease(rooms=np.asarray(rooms, dtype=np.uint64))
