"""The prefill rank's I/O edge: a ZMQ ROUTER, a transfer backend, and the pure session.

Every control message is built and parsed by the generated codecs (``pdwire.wire``); this
module only moves their frames. Per connection (one decode rank) it runs the handshake
(Hello both ways, then RegisterInfo answered by a ``RegisterAck`` when the peers agreed on
1.2 or newer, by a ``TransferStatus`` for the reserved room 0 for 1.1 and 1.0 peers, which
cannot decode the newer type: Success, or Failed with the reason), keeps the prepared
planner peer, and turns the session's actions into encoded messages and backend posts.
Failures travel typed (``failure_kind``) from 1.2 and as a ``"<kind>: "`` reason prefix to
older peers (``failures.failure_to_wire``).

A part whose plan is empty (nothing to write: a replicated tensor another prefill rank
writes, a prefix-cache hit) cannot ride on an engine write, so its Notification travels on
the control socket instead; decode counts it the same way.

A failed room's transfers are cancelled with ``Backend.cancel`` and polled like any other
until the engine confirms each stopped; the room's Failed statuses, AbortAcks and the
release of its source slots (``on_release``) wait for that (see :mod:`.prefill_room`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from pdwire.runtime.backends import Backend, BackendError, Peer, PeerMetadata, TransferHandle, TransferState
from pdwire.runtime.demo_content import RoomSlots
from pdwire.runtime.demo_model import RankCaches
from pdwire.runtime.descriptors import DescriptorTable
from pdwire.runtime.planner import (
    IndexListMismatch,
    PeerPlan,
    PlanError,
    PlanGroup,
    check_unique_destinations,
    prepare_peer,
)
from pdwire.runtime.session.actions import (
    Action,
    AuxPart,
    CancelTransfers,
    KvPart,
    PeerRef,
    PostTransfer,
    ReleaseRoom,
    SendAbortAck,
    SendStatus,
    StatePart,
)
from pdwire.runtime.session.failures import Failure, FailureKind, HandshakeError, failure_to_wire
from pdwire.runtime.session.handshake import (
    REGISTER_ACK_SINCE,
    REGISTER_ROOM,
    Identity,
    check_descriptors,
    check_hello,
    join_region_descs,
    remote_memory,
)
from pdwire.runtime.session.poll_backoff import PollBackoff
from pdwire.runtime.session.prefill_room import Target
from pdwire.runtime.session.prefill_session import PrefillSession
from pdwire.runtime.session.status import RoomStatus

from pdwire import wire


@dataclass
class _Conn:
    identity: bytes
    version: tuple[int, int] | None = None
    hello: wire.Hello | None = None
    refused: str | None = None
    peer: PeerRef | None = None
    backend_peer: Peer | None = None
    plan: PeerPlan | None = None


@dataclass
class PrefillStats:
    rooms_ok: int = 0
    rooms_failed: int = 0
    posts: int = 0
    control_notifications: int = 0
    bytes_posted: int = 0
    descriptors: int = 0
    messages_in: int = 0
    messages_out: int = 0
    failures: list[str] = field(default_factory=list)


class PrefillWorker:
    def __init__(
        self,
        identity: Identity,
        caches: RankCaches,
        backend: Backend,
        ctx: zmq.Context[Any],
        *,
        room_timeout_s: float = 30.0,
        on_release: Callable[[int, RoomStatus, Failure | None], None] | None = None,
    ) -> None:
        self.identity = identity
        self.hello = identity.hello()
        self.caches = caches
        self.backend = backend
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.poller = zmq.Poller()  # the driver may register its own sockets or fds here too
        self.poller.register(self.sock, zmq.POLLIN)
        self._backoff = PollBackoff()
        self.session = PrefillSession(room_timeout_s)
        self.sender_rank = identity.tp_rank  # unique rank: tp_rank * (pp*cp) + ...; PP = CP = 1 here
        self.on_release = on_release
        self.stats = PrefillStats()
        self._conns: dict[bytes, _Conn] = {}
        self._by_peer: dict[PeerRef, _Conn] = {}
        self._sources: dict[int, RoomSlots] = {}
        # room -> peer -> its request / its state plan (planned once, on the first state part);
        # keyed by room first so releasing a room touches only that room's entries
        self._requests: dict[int, dict[PeerRef, wire.TransferRequest]] = {}
        self._state_plans: dict[int, dict[PeerRef, tuple[PlanGroup, ...]]] = {}
        self._handles: dict[int, TransferHandle] = {}
        self._done_now: list[int] = []  # parts completed without an engine write
        # room -> [first post, last completion] (perf_counter): the data-movement span, for
        # separating control-plane time from transfer time in benchmarks
        self.spans: dict[int, list[float]] = {}

    # ------------------------------------------------------------------ engine side

    def chunk_ready(self, room: int, source: RoomSlots, start: int, stop: int, is_last: bool) -> None:
        """Chunked prefill produced pages ``[start, stop)`` of ``room`` (held in ``source``)."""
        self._sources.setdefault(room, source)
        self._run(self.session.on_chunk(room, start, stop, is_last, time.monotonic()))
        if room not in self.session.rooms:
            # a chunk of a room that already ended (failed, aborted): nothing will release it
            self._sources.pop(room, None)

    # ------------------------------------------------------------------ the loop

    def step(self, timeout_ms: int) -> dict[Any, int]:
        """Poll once: control messages, transfer completions, deadlines. Returns poll events."""
        if self._done_now:
            events = dict(self.poller.poll(0))
        elif self._handles:  # engine completions have nothing to wait on: look again soon
            events = self._backoff.poll(self.poller, timeout_ms / 1000)
        else:
            events = dict(self.poller.poll(timeout_ms))
        if events.get(self.sock):
            self._drain()
        if self._service() or events:
            self._backoff.progress(len(self._handles))
        return events

    def _drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats.messages_in += 1
            self._on_frames(frames[0], frames[1:])

    def _service(self) -> bool:
        """Completions and deadlines; whether any transfer or control-socket part finished."""
        progressed = bool(self._done_now)
        # Only this loop drops handles (a room never ends with one in flight), so the snapshot holds.
        for x, h in list(self._handles.items()):
            st = self.backend.poll(h)
            if st.state is TransferState.PENDING:
                continue
            progressed = True
            del self._handles[x]
            self.backend.release(h)  # final: the engine is done with both sides' memory
            room = self.session.room_of(x)
            if room is not None and room in self.spans:
                self.spans[room][1] = time.perf_counter()
            if st.state is TransferState.DONE:
                self._run(self.session.on_xfer_done(x))
            else:
                self._run(self.session.on_xfer_failed(x, st.reason))
        while self._done_now:
            self._run(self.session.on_xfer_done(self._done_now.pop(0)))
        if self.session.rooms:
            self._run(self.session.on_tick(time.monotonic()))
        return progressed

    def close(self) -> None:
        for h in self._handles.values():
            self.backend.release(h)
        self._handles.clear()
        self.sock.close(0)

    # ------------------------------------------------------------------ messages in

    def _send(self, conn: _Conn, msg: Any) -> None:
        frames = wire.encode(msg, conn.version)
        self.sock.send_multipart([conn.identity, *frames], copy=False)
        self.stats.messages_out += 1

    def _on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        conn = self._conns.setdefault(identity, _Conn(identity))
        try:
            msg = wire.decode(frames)
        except wire.WireError as exc:
            # An unreadable first message is answered with our Hello so the peer can name the skew.
            if conn.hello is None:
                self._send(conn, self.hello)
            self.stats.failures.append(f"undecodable message from a peer: {exc}")
            return
        if isinstance(msg, wire.Hello):
            self._on_hello(conn, msg)
        elif isinstance(msg, wire.RegisterInfo):
            self._on_register(conn, msg)
        elif isinstance(msg, wire.TransferRequest):
            self._on_request(conn, msg)
        elif isinstance(msg, wire.Abort):
            if conn.peer is not None:
                self._run(self.session.on_abort(int(msg.room), conn.peer))
        else:
            self.stats.failures.append(f"unexpected {type(msg).__name__} from a decode peer")

    def _on_hello(self, conn: _Conn, hello: wire.Hello) -> None:
        conn.hello = hello
        try:
            conn.version = check_hello(self.hello, hello)
            by_descriptor = bool(self.backend.local_metadata().region_descs)
            check_descriptors(conn.version, self.backend.name, by_descriptor, hello.engine_id)
            conn.peer = PeerRef(hello.engine_id, int(hello.geometry.tp_rank))
        except HandshakeError as exc:
            conn.refused = str(exc)
            conn.version = None
        self._send(conn, self.hello)  # always answer: the peer runs the same checks and names the cause

    def _on_register(self, conn: _Conn, info: wire.RegisterInfo) -> None:
        def refuse(failure: Failure) -> None:
            self._send(conn, self._register_answer(conn, failure))

        if conn.peer is None or conn.version is None:
            refuse(Failure(FailureKind.HANDSHAKE, conn.refused or "RegisterInfo before a Hello"))
            return
        try:
            remote = remote_memory(info, self.caches.memory)
            plan = prepare_peer(self.caches.memory, remote)
            old = self._by_peer.get(conn.peer)
            if old is not None and old is not conn:  # a restarted decode rank: forget the old one
                self._run(self.session.on_peer_lost(conn.peer))
            md = PeerMetadata(info.agent_name, bytes(info.agent_metadata), join_region_descs(info))
            backend_peer = self.backend.add_peer(md)
        except (HandshakeError, PlanError, BackendError) as exc:
            refuse(Failure(FailureKind.HANDSHAKE, f"{type(exc).__name__}: {exc}"))
            return
        conn.plan, conn.backend_peer = plan, backend_peer
        self._by_peer[conn.peer] = conn
        self._send(conn, self._register_answer(conn, None))

    def _register_answer(self, conn: _Conn, failure: Failure | None) -> wire.Message:
        """RegisterAck at 1.2 or newer; a TransferStatus for room 0 for older or unknown versions
        (a refused Hello leaves the version unknown, and every version reads TransferStatus)."""
        kind, reason = failure_to_wire(failure, conn.version)
        if conn.version is not None and conn.version >= REGISTER_ACK_SINCE:
            return wire.RegisterAck(
                accepted=failure is None, sender_rank=self.sender_rank, failure_kind=kind, reason=reason
            )
        status = wire.Status.SUCCESS if failure is None else wire.Status.FAILED
        return wire.TransferStatus(
            room=REGISTER_ROOM, status=status, sender_rank=self.sender_rank, failure_kind=kind, reason=reason
        )

    def _on_request(self, conn: _Conn, req: wire.TransferRequest) -> None:
        room = int(req.room)
        if conn.plan is None or conn.peer is None:
            reason = Failure(FailureKind.VALIDATION, "TransferRequest from a peer that is not registered")
            self._send(conn, self._status(conn, room, RoomStatus.FAILED, reason))
            return
        why = self._request_problem(conn.plan, req)
        if why is not None:  # the requester is told; its decode rank aborts the room everywhere
            self._send(
                conn, self._status(conn, room, RoomStatus.FAILED, Failure(FailureKind.VALIDATION, why))
            )
            return
        comps = tuple(i for i, idx in enumerate(req.state_indices) if idx is not None and len(idx) > 0)
        target = Target(conn.peer, conn.plan.is_dummy, comps, conn.plan.writes_aux and req.dst_aux_index >= 0)
        actions = self.session.on_request(room, target, int(req.required_dst_info_num), time.monotonic())
        if room in self.session.rooms and conn.peer in self.session.rooms[room].targets:
            self._requests.setdefault(room, {}).setdefault(conn.peer, req)
        self._run(actions)

    @staticmethod
    def _request_problem(plan: PeerPlan, req: wire.TransferRequest) -> str | None:
        """What makes a request unplannable as a whole, before any of it is posted."""
        if bool(req.is_dummy) != plan.is_dummy:
            return f"request says is_dummy={req.is_dummy}, the rank routing says {plan.is_dummy}"
        try:
            # chunks are planned one slice at a time: a page named twice across a chunk
            # boundary would be written twice, the later chunk silently winning
            check_unique_destinations(req.dst_kv_indices, component="kv")
        except PlanError as exc:
            return str(exc)
        return None

    # ------------------------------------------------------------------ actions out

    def _status(
        self, conn: _Conn, room: int, status: RoomStatus, failure: Failure | None
    ) -> wire.TransferStatus:
        # typed failure_kind from 1.2; a "<kind>: " reason prefix for older peers
        kind, reason = failure_to_wire(failure, conn.version)
        return wire.TransferStatus(
            room=room,
            status=wire.Status(int(status)),
            sender_rank=self.sender_rank,
            reason=reason,
            failure_kind=kind,
        )

    def _run(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, PostTransfer):
                self._post(a)
            elif isinstance(a, CancelTransfers):
                for x in a.xfer_ids:
                    h = self._handles.get(x)
                    if h is not None:  # the others complete without the engine or are not posted yet
                        self.backend.cancel(h)
            elif isinstance(a, SendStatus):
                conn = self._by_peer.get(a.peer)
                if conn is not None:
                    self._send(conn, self._status(conn, a.room, a.status, a.failure))
            elif isinstance(a, SendAbortAck):
                conn = self._by_peer.get(a.peer)
                if conn is not None:
                    self._send(conn, wire.AbortAck(room=a.room, sender_rank=self.sender_rank))
            elif isinstance(a, ReleaseRoom):
                self._release(a)

    def _plan(self, a: PostTransfer, conn: _Conn) -> tuple[PlanGroup, wire.Notification]:
        assert conn.plan is not None
        req = self._requests[a.room][a.peer]
        src = self._sources[a.room]
        part = a.part
        if isinstance(part, KvPart):
            dst = np.asarray(req.dst_kv_indices)
            if part.is_last and part.stop != len(dst):
                # The chunks slice the destination list; a longer list would leave its tail
                # unwritten while both sides report Success.
                raise IndexListMismatch(
                    f"prefill produced {part.stop} KV pages, {a.peer} asked for {len(dst)}", component="kv"
                )
            group = conn.plan.plan_kv_chunk(
                part.chunk_id, src.pages[part.start : part.stop], dst[part.start : part.stop]
            )
            kind, chunk, last, comp = wire.NotificationKind.KV, part.chunk_id, part.is_last, 0
        elif isinstance(part, StatePart):
            plans = self._state_plans.setdefault(a.room, {})
            if a.peer not in plans:
                dst_lists = [
                    np.asarray(i) if i is not None else np.zeros(0, np.int32) for i in req.state_indices
                ]
                dst_lists += [np.zeros(0, np.int32)] * (len(self.caches.memory.state) - len(dst_lists))
                src_lists = [
                    s if len(d) else np.zeros(0, np.int32)
                    for s, d in zip(src.state_indices(self.caches.spec), dst_lists, strict=True)
                ]
                plans[a.peer] = conn.plan.plan_state(src_lists, dst_lists)
            group = plans[a.peer][part.component]
            kind, chunk, last, comp = wire.NotificationKind.STATE, 0, False, part.component
        else:
            assert isinstance(part, AuxPart)
            group = conn.plan.plan_aux(src.aux, int(req.dst_aux_index))
            kind, chunk, last, comp = wire.NotificationKind.AUX, 0, False, 0
        note = wire.Notification(
            room=a.room, kind=kind, chunk_id=chunk, is_last=last, sender_rank=self.sender_rank, component=comp
        )
        return group, note

    def _not_posted(self, a: PostTransfer, failure: Failure) -> None:
        self._run(self.session.on_not_posted(a.xfer_id, failure))

    def _post(self, a: PostTransfer) -> None:
        if not self.session.accepts_posts(a.room):
            # an earlier action of the same batch failed the room: nothing more is posted for it
            self._not_posted(
                a, Failure(FailureKind.ABORTED, f"room {a.room} failed before {a.part} was posted")
            )
            return
        conn = self._by_peer.get(a.peer)
        if conn is None or conn.backend_peer is None:
            self._not_posted(a, Failure(FailureKind.PEER_GONE, f"{a.peer} is not connected"))
            return
        try:
            group, note = self._plan(a, conn)
        except (PlanError, KeyError, ValueError) as exc:
            self._not_posted(a, Failure(FailureKind.VALIDATION, f"planning {a.part}: {exc}"))
            return
        table: DescriptorTable = group.table
        now = time.perf_counter()
        self.spans.setdefault(a.room, [now, now])
        if len(table) == 0:
            self._send(conn, note)  # nothing to write: the completion rides on the control socket
            self.stats.control_notifications += 1
            self._done_now.append(a.xfer_id)
            return
        try:
            h = self.backend.post(conn.backend_peer, table, wire.encode_bytes(note, conn.version))
        except BackendError as exc:  # a refused post moved nothing
            self._not_posted(a, Failure(FailureKind.ENGINE_ERROR, f"{type(exc).__name__}: {exc}"))
            return
        self._handles[a.xfer_id] = h
        self.stats.posts += 1
        self.stats.bytes_posted += table.total_bytes
        self.stats.descriptors += len(table)

    def _release(self, a: ReleaseRoom) -> None:
        # Nothing of the room is in flight any more: its source slots may be reused.
        self._requests.pop(a.room, None)
        self._state_plans.pop(a.room, None)
        self._sources.pop(a.room, None)
        if a.status is RoomStatus.SUCCESS:
            self.stats.rooms_ok += 1
        else:
            self.stats.rooms_failed += 1
            if a.failure is not None:
                self.stats.failures.append(f"room {a.room}: {a.failure.reason}")
        if self.on_release is not None:
            self.on_release(a.room, a.status, a.failure)
