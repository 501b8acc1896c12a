"""The prefill side of one decode peer's control connection: a pure state machine (h11 style;
its moves: ``PREFILL_CONNECTION`` in :mod:`.states`).

The edge hands each decoded message to :meth:`PrefillConnection.receive` and gets back
:mod:`.events`. Every Hello is answered with ours, refused or not, so the peer can name the
cause. A registration is answered with a ``RegisterAck`` from the version that introduced it,
and with a ``TransferStatus`` for the reserved room 0 before that and whenever no version is
agreed (older peers cannot decode the newer type). A bad ``TransferRequest`` is answered Failed
(validation) at once.

Before a registered peer's message is decoded the edge asks :meth:`PrefillConnection.oversized`:
a message larger than the largest legal one for the peer's registered pools
(:mod:`.message_bounds`) is refused undecoded, and the edge drops that peer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdwire import wire
from pdwire.runtime.indices import RESERVED_ROOM
from pdwire.runtime.planner import PeerPlan, PlanError, RankMemory, prepare_peer
from pdwire.runtime.session.actions import AuxPart, KvPart, Part, PeerRef, StatePart
from pdwire.runtime.session.events import (
    AbortRequested,
    AddPeer,
    LeaseRenewed,
    PrefillEvent,
    Problem,
    Registered,
    Requested,
    Send,
)
from pdwire.runtime.session.failures import Failure, FailureKind, HandshakeError, failure_to_wire
from pdwire.runtime.session.hello import (
    LAYOUTS_SINCE,
    LEASES_SINCE,
    REGISTER_ACK_SINCE,
    check_descriptors,
    check_hello,
    rank_of,
)
from pdwire.runtime.session.message_bounds import U32_MAX, MessageLimits, MessageTooLarge, peer_limits
from pdwire.runtime.session.prefill_room import Destination, Target
from pdwire.runtime.session.registration import (
    check_layout_version,
    join_region_descs,
    kv_heads_to_wire,
    remote_memory,
)
from pdwire.runtime.session.stage_layers import HeldLayers
from pdwire.runtime.session.states import PREFILL_CONNECTION, PrefillConnState, StateField
from pdwire.runtime.session.status import Status


@dataclass(frozen=True, slots=True)
class PrefillLocal:
    """This prefill rank, as every connection of it sees it."""

    hello: wire.Hello
    memory: RankMemory
    sender_rank: int
    backend_name: str
    by_descriptor: bool  # the backend addresses memory by descriptor (MoRI)
    lease_s: float = 0.0  # how long a room nobody asked for is held (the room timeout); 0: no leases

    @property
    def page_size(self) -> int:
        return self.memory.kv.page_size if self.memory.kv is not None else 1


class PrefillConnection:
    """One decode peer (one ROUTER identity). See the module notes."""

    state = StateField(PREFILL_CONNECTION)  # every move checked against its table (:mod:`.states`)

    def __init__(self, local: PrefillLocal) -> None:
        self.local = local
        self.state = PrefillConnState.AWAIT_HELLO
        self.version: tuple[int, int] | None = None
        self.peer: PeerRef | None = None  # from the peer's Hello
        self.plan: PeerPlan | None = None  # once registered
        # the peer's receive staging buffer (base, length), from a 1.4 registration; (0, 0): none
        self.scatter: tuple[int, int] = (0, 0)
        self._pending_scatter: tuple[int, int] = (0, 0)
        self.refusal: str | None = None
        self._hello: wire.Hello | None = None  # the peer's accepted Hello, to check its registration
        self._pending: PeerPlan | None = None  # prepared, waiting for the engine's add_peer
        # the largest legal messages of the registered peer (of the pending registration)
        self.limits: MessageLimits | None = None
        self._pending_limits: MessageLimits | None = None

    @property
    def registered(self) -> bool:
        return self.state is PrefillConnState.READY

    # ------------------------------------------------------------------ messages in

    def receive(self, msg: wire.Message) -> list[PrefillEvent]:
        if isinstance(msg, wire.Hello):
            return self._on_hello(msg)
        if isinstance(msg, wire.RegisterInfo):
            return self._on_register(msg)
        if isinstance(msg, wire.TransferRequest):
            return self._on_request(msg)
        if isinstance(msg, wire.Abort):
            return [] if self.peer is None else [AbortRequested(int(msg.room), self.peer)]
        if isinstance(msg, wire.Lease):
            # like an Abort, from any peer whose Hello passed: a room has no owner before a request
            return [] if self.peer is None else [LeaseRenewed(tuple(int(r) for r in msg.rooms), self.peer)]
        return [Problem(f"unexpected {type(msg).__name__} from decode peer {self.peer or '(no Hello yet)'}")]

    def oversized(self, frames: Sequence[bytes]) -> MessageTooLarge | None:
        """Whether ``frames`` (one message from the peer, undecoded) are larger than any legal
        message of that type for the registered peer; None before a registration."""
        if self.limits is None or not self.registered:
            return None
        return self.limits.excess(frames)

    def undecodable(self, error: str) -> list[PrefillEvent]:
        """A message from the peer did not decode; a first one is answered with our Hello so the
        peer can name the skew."""
        events: list[PrefillEvent] = []
        if self.state is PrefillConnState.AWAIT_HELLO:
            events.append(Send(self.local.hello, None))
        events.append(
            Problem(f"undecodable message from decode peer {self.peer or '(no Hello yet)'}: {error}")
        )
        return events

    def _on_hello(self, hello: wire.Hello) -> list[PrefillEvent]:
        self.plan = self._pending = self._hello = None
        self.scatter = self._pending_scatter = (0, 0)
        self.limits = self._pending_limits = None
        try:
            self.version = check_hello(self.local.hello, hello)
            check_descriptors(
                self.version, self.local.backend_name, self.local.by_descriptor, hello.engine_id
            )
            check_layout_version(
                self.version, self.local.memory, hello.engine_id, own_layout=False,
                prefill_tp=self.local.memory.position.tp_size, decode_tp=hello.geometry.tp_size,
            )  # fmt: skip
            position = rank_of(hello.geometry, f"decode {hello.engine_id!r}")
        except HandshakeError as exc:
            self.state, self.version, self.peer, self.refusal = PrefillConnState.REFUSED, None, None, str(exc)
        else:
            self.state, self.refusal = PrefillConnState.AWAIT_REGISTRATION, None
            self.peer = PeerRef(hello.engine_id, position.engine_rank)
            self._hello = hello
        # always answer: the peer runs the same checks and names the cause
        return [Send(self.local.hello, self.version)]

    def _on_register(self, info: wire.RegisterInfo) -> list[PrefillEvent]:
        if self.peer is None or self.version is None:
            return [self._refuse_registration(self.refusal or "RegisterInfo before a Hello")]
        try:
            self._check_against_hello(info)
            remote = remote_memory(info, self.local.memory)
            plan = prepare_peer(self.local.memory, remote)
            descs = join_region_descs(info, remote)
            limits = peer_limits(remote, info.endpoint, self.version)
            scatter = self._scatter_of(info, descs)
            if scatter != (0, 0) and descs:
                descs = (*descs, bytes(info.scatter_mem_descs[0]))
        except (HandshakeError, PlanError) as exc:
            return [self._refuse_registration(f"{type(exc).__name__}: {exc}")]
        except Exception as exc:
            # a registration is the peer's data: whatever it makes the model raise (a zero
            # divisor, an overflow, a wrong type) refuses that peer, never the rank
            reason = f"malformed RegisterInfo ({type(exc).__name__}: {exc})"
            return [self._refuse_registration(reason)]
        self._pending, self._pending_limits, self.state = plan, limits, PrefillConnState.ADDING_PEER
        self._pending_scatter = scatter
        return [AddPeer(self.peer, info.agent_name, bytes(info.agent_metadata), descs)]

    def _scatter_of(self, info: wire.RegisterInfo, descs: tuple[bytes, ...]) -> tuple[int, int]:
        """The peer's receive staging buffer, if it offers one this rank can write: (0, 0) for an
        older version, none given, or a descriptor count that does not match the other regions'
        (the peer then gets direct writes only; nothing else depends on the buffer)."""
        assert self.version is not None
        if self.version < LAYOUTS_SINCE or not info.scatter_len or not info.scatter_base:
            return (0, 0)
        if len(info.scatter_mem_descs) != (1 if descs else 0):
            return (0, 0)
        if int(info.scatter_base) + int(info.scatter_len) > 1 << 64:
            return (0, 0)
        return (int(info.scatter_base), int(info.scatter_len))

    def _check_against_hello(self, info: wire.RegisterInfo) -> None:
        """A registration speaks for the rank that sent the Hello: same engine, same grid
        position (a TP size of 0 or one the Hello did not name would plan writes for another)."""
        hello = self._hello
        assert hello is not None
        if info.engine_id != hello.engine_id:
            raise HandshakeError(
                f"RegisterInfo.engine_id {info.engine_id!r} is not the Hello's {hello.engine_id!r}"
            )
        if info.geometry != hello.geometry:
            raise HandshakeError(
                f"RegisterInfo.geometry {info.geometry} disagrees with the Hello's {hello.geometry}"
            )

    def peer_added(self) -> list[PrefillEvent]:
        """The engine added the peer of the last :class:`~.events.AddPeer`: registered."""
        assert self.state is PrefillConnState.ADDING_PEER and self.peer is not None
        self.plan, self._pending, self.state = self._pending, None, PrefillConnState.READY
        self.scatter, self._pending_scatter = self._pending_scatter, (0, 0)
        self.limits, self._pending_limits = self._pending_limits, None
        return [Send(self._register_answer(None), self.version), Registered(self.peer)]

    def peer_refused(self, reason: str) -> list[PrefillEvent]:
        """The engine could not add the peer: the registration is refused with ``reason``."""
        assert self.state is PrefillConnState.ADDING_PEER
        self._pending, self._pending_limits, self.state = None, None, PrefillConnState.AWAIT_REGISTRATION
        return [self._refuse_registration(reason)]

    def _refuse_registration(self, reason: str) -> Send:
        return Send(self._register_answer(Failure(FailureKind.HANDSHAKE, reason)), self.version)

    def _register_answer(self, failure: Failure | None) -> wire.Message:
        """RegisterAck from its ``since``; a TransferStatus for room 0 before that or without an
        agreed version (a refused Hello leaves it unknown, and every version reads TransferStatus)."""
        kind, reason = failure_to_wire(failure, self.version)
        rank = self.local.sender_rank
        if self.version is not None and self.version >= REGISTER_ACK_SINCE:
            layers: dict[str, Any] = {}
            if failure is None and self.version >= LAYOUTS_SINCE:
                held = HeldLayers.of(self.local.memory)  # decode checks its PP stages with them
                layers["kv_layers"] = np.asarray(held.kv, np.uint32)
                layers["state_layers"] = [np.asarray(ids, np.uint32) for ids in held.state]
                layers["kv_heads"] = kv_heads_to_wire(self.local.memory)  # decode scatters with it
            if failure is None and self.version >= LEASES_SINCE:
                layers["lease_ms"] = min(round(self.local.lease_s * 1000), U32_MAX)  # decode renews by it
            return wire.RegisterAck(
                accepted=failure is None, sender_rank=rank, failure_kind=kind, reason=reason, **layers
            )
        status = wire.Status.SUCCESS if failure is None else wire.Status.FAILED
        return wire.TransferStatus(
            room=RESERVED_ROOM, status=status, sender_rank=rank, failure_kind=kind, reason=reason
        )

    def _on_request(self, req: wire.TransferRequest) -> list[PrefillEvent]:
        room = int(req.room)
        if self.plan is None or self.peer is None or not self.registered:
            failure = Failure(FailureKind.VALIDATION, "TransferRequest from a peer that is not registered")
            return [Send(self.status(room, Status.FAILED, failure), self.version)]
        problem = self._request_problem(self.plan, req)
        if problem is not None:  # the requester is told; its decode rank aborts the room everywhere
            failure = Failure(FailureKind.VALIDATION, problem)
            return [Send(self.status(room, Status.FAILED, failure), self.version)]
        n = len(self.local.memory.state)
        states = [np.zeros(0, np.int32) if s is None else np.asarray(s, np.int32) for s in req.state_indices]
        dst = Destination(
            np.asarray(req.dst_kv_indices, dtype=np.int32),
            tuple(states) if states else tuple(np.zeros(0, np.int32) for _ in range(n)),
            int(req.dst_aux_index),
            int(req.decode_prefix_len) // self.local.page_size,
            self._scatter_range(req),
        )
        target = Target.of(self.peer, self.plan.is_dummy, self.plan.writes_aux, dst)
        return [Requested(room, target, int(req.required_dst_info_num))]

    def _scatter_range(self, req: wire.TransferRequest) -> tuple[int, int, int] | None:
        """The request's range of the peer's receive staging buffer (offset, bytes per page, pages),
        or None: no range, or one outside the buffer (then the room is written directly)."""
        length = self.scatter[1]
        offset, per_page, pages = int(req.scatter_offset), int(req.scatter_page_bytes), int(req.scatter_pages)
        if not length or offset < 0 or per_page <= 0 or pages <= 0:
            return None
        if offset + per_page * pages > length or pages > len(req.dst_kv_indices):
            return None
        return (offset, per_page, pages)

    def _request_problem(self, plan: PeerPlan, req: wire.TransferRequest) -> str | None:
        """What makes a request unplannable as a whole, before any of it is posted."""
        if int(req.room) == RESERVED_ROOM:
            return f"room {RESERVED_ROOM} is reserved for registration answers"
        if bool(req.is_dummy) != plan.is_dummy:
            return f"request says is_dummy={req.is_dummy}, the rank routing says {plan.is_dummy}"
        if int(req.required_dst_info_num) == 0:
            # no request would ever complete the room, and its id would stay taken meanwhile
            return "required_dst_info_num is 0: a room needs at least the request that asks for it"
        prefix, page = int(req.decode_prefix_len), self.local.page_size
        if (
            not plan.is_dummy
            and prefix == 0
            and len(req.dst_kv_indices) == 0
            and self.local.memory.kv is not None
        ):
            return "the request names no KV page and no cached prefix: a room of zero tokens"
        if prefix % page:
            return f"decode_prefix_len {prefix} is not a multiple of the page size {page}"
        n = len(self.local.memory.state)
        if len(req.state_indices) not in (0, n):
            return f"{len(req.state_indices)} state index lists for {n} state components"
        try:
            # chunks are planned one slice at a time: a page named twice across a chunk
            # boundary would be written twice, the later chunk silently winning; aliased
            # registrations must not receive one byte twice either
            plan.check_request(req.dst_kv_indices, list(req.state_indices), int(req.dst_aux_index))
        except PlanError as exc:
            return str(exc)
        return None

    # ------------------------------------------------------------------ actions -> messages

    def status(self, room: int, status: Status, failure: Failure | None = None) -> wire.TransferStatus:
        kind, reason = failure_to_wire(failure, self.version)
        return wire.TransferStatus(
            room=room, status=status, sender_rank=self.local.sender_rank, reason=reason, failure_kind=kind
        )

    def abort_ack(self, room: int) -> wire.AbortAck:
        return wire.AbortAck(room=room, sender_rank=self.local.sender_rank)

    def notification(self, room: int, part: Part) -> wire.Notification:
        """The completion record of one posted part (rides on the engine write, or on the control
        socket when there is nothing to write)."""
        if isinstance(part, KvPart):
            kind, chunk, last, comp = wire.NotificationKind.KV, part.chunk_id, part.is_last, 0
        elif isinstance(part, StatePart):
            kind, chunk, last, comp = wire.NotificationKind.STATE, 0, False, part.component
        else:
            assert isinstance(part, AuxPart)
            kind, chunk, last, comp = wire.NotificationKind.AUX, 0, False, 0
        return wire.Notification(
            room=room,
            kind=kind,
            chunk_id=chunk,
            is_last=last,
            sender_rank=self.local.sender_rank,
            component=comp,
        )

    @property
    def merges_parts(self) -> bool:
        """Whether this peer reads a notification naming several parts (protocol 1.4)."""
        return self.version is not None and self.version >= LAYOUTS_SINCE

    def merged_notification(self, room: int, parts: Sequence[Part]) -> wire.Notification:
        """One notification for ``parts`` of one write (a run of :func:`.merging.runs`): its KV
        chunks consecutive and in order, then state components and aux. Only for a peer that
        :attr:`merges_parts`."""
        kv = [p for p in parts if isinstance(p, KvPart)]
        comps = [p.component for p in parts if isinstance(p, StatePart)]
        aux = any(isinstance(p, AuxPart) for p in parts)
        if any(b.chunk_id != a.chunk_id + 1 for a, b in itertools.pairwise(kv)):
            raise ValueError(f"room {room}: KV chunks {[p.chunk_id for p in kv]} are not one run")
        if kv:
            kind, chunk, last, comp, also = wire.NotificationKind.KV, kv[0].chunk_id, kv[-1].is_last, 0, comps
        elif comps:
            kind, chunk, last, comp, also = wire.NotificationKind.STATE, 0, False, comps[0], comps[1:]
        else:
            kind, chunk, last, comp, also, aux = wire.NotificationKind.AUX, 0, False, 0, [], False
        return wire.Notification(
            room=room,
            kind=kind,
            chunk_id=chunk,
            is_last=last,
            sender_rank=self.local.sender_rank,
            component=comp,
            chunk_count=max(1, len(kv)),
            also_components=np.asarray(also, dtype=np.uint32),
            also_aux=aux,
        )
