"""The decode rank's I/O edge: one ZMQ DEALER per prefill rank it reads from, a transfer
backend for completions, and the pure decode session.

``connect`` runs the handshake with every prefill rank of one prefill engine (Hello both
ways, then RegisterInfo, answered by a RegisterAck at 1.2 or newer, by a TransferStatus for
the reserved room 0 for 1.1 and 1.0 peers) and raises
:class:`HandshakeError` with the peer's reason on refusal. ``start_room`` sends one
TransferRequest per prefill rank the routing names (dummies explicitly marked) and opens
the room in the session; completions arrive as engine notifications or, for parts with
nothing to write, on the control socket.

Two callbacks tell the engine about a room: ``on_finished(room, status, failure)`` as soon as
it ends (a failed request can be retried elsewhere at once), and ``on_slots_released(room)``
once its destination slots may be reused: at once after a success, and for a failed room
only when every writing prefill rank fenced (its Failed status, Success status or AbortAck;
Failed and AbortAck count only from peers at protocol 1.3 or newer, which promise that their
writes stopped) or the fence timeout gave up on it (counted in ``stats.unfenced_releases`` and
named in ``stats.failures``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from pdwire.runtime.backends import Backend
from pdwire.runtime.demo_content import RoomSlots
from pdwire.runtime.demo_model import RankCaches
from pdwire.runtime.planner import route_decode_rank
from pdwire.runtime.session.actions import Action, PeerRef, ReleaseRoom, ReleaseSlots, SendAbort
from pdwire.runtime.session.decode_room import PartKind, SenderPlan
from pdwire.runtime.session.decode_session import DecodeSession
from pdwire.runtime.session.failures import (
    Failure,
    FailureKind,
    HandshakeError,
    SessionError,
    failure_from_wire,
)
from pdwire.runtime.session.handshake import (
    FENCE_SINCE,
    REGISTER_ACK_SINCE,
    REGISTER_ROOM,
    Identity,
    check_descriptors,
    check_hello,
    register_info,
)
from pdwire.runtime.session.poll_backoff import PollBackoff
from pdwire.runtime.session.status import RoomStatus

from pdwire import wire

_KIND = {
    wire.NotificationKind.KV: PartKind.KV,
    wire.NotificationKind.STATE: PartKind.STATE,
    wire.NotificationKind.AUX: PartKind.AUX,
}


@dataclass
class _Link:
    """The control connection to one prefill rank."""

    sock: zmq.Socket[Any]
    peer: PeerRef
    version: tuple[int, int]


@dataclass
class DecodeStats:
    rooms_ok: int = 0
    rooms_failed: int = 0
    engine_notifications: int = 0
    control_notifications: int = 0
    messages_out: int = 0  # every message sent: Hello, RegisterInfo, TransferRequest, Abort
    requests_sent: int = 0  # TransferRequests among them
    unfenced_releases: int = 0  # failed rooms whose slots the fence timeout released
    versions: list[str] = field(default_factory=list)  # agreed protocol version per prefill link
    failures: list[str] = field(default_factory=list)  # failed rooms with their reason, and anything odd


class DecodeWorker:
    def __init__(
        self,
        identity: Identity,
        caches: RankCaches,
        backend: Backend,
        ctx: zmq.Context[Any],
        *,
        room_timeout_s: float = 30.0,
        fence_timeout_s: float | None = None,
        on_finished: Callable[[int, RoomStatus, Failure | None], None] | None = None,
        on_slots_released: Callable[[int], None] | None = None,
    ) -> None:
        self.identity = identity
        self.hello = identity.hello()
        self.caches = caches
        self.backend = backend
        self.ctx = ctx
        self.session = DecodeSession(room_timeout_s, fence_timeout_s=fence_timeout_s)
        self.on_finished = on_finished
        self.on_slots_released = on_slots_released
        self.stats = DecodeStats()
        self.endpoint = f"decode:{identity.engine_id}/{identity.tp_rank}"
        self._links: dict[PeerRef, _Link] = {}
        self._engines: dict[str, int] = {}  # prefill engine id -> its TP size
        self.poller = zmq.Poller()  # the driver may register its own sockets or fds here too
        self._backoff = PollBackoff()

    # ------------------------------------------------------------------ handshake

    def connect(self, endpoints: list[str], timeout_s: float = 30.0) -> str:
        """Handshake with the prefill ranks this rank reads from; ``endpoints[r]`` is prefill TP rank r.

        Returns the prefill engine id. Raises HandshakeError naming the cause on refusal.
        """
        prefill_tp = len(endpoints)
        route = route_decode_rank(
            prefill_tp, self.identity.tp_size, self.identity.tp_rank, is_mla=self.caches.spec.mla
        )
        engine_id = ""
        for p in route.prefill_ranks:
            link = self._handshake(endpoints[p], timeout_s)
            if link.peer.rank != p:
                raise HandshakeError(
                    f"{endpoints[p]} says it is prefill TP rank {link.peer.rank}, expected {p}"
                )
            engine_id = link.peer.engine_id
            self._links[link.peer] = link
            self.stats.versions.append(f"{link.peer}={link.version[0]}.{link.version[1]}")
            self.poller.register(link.sock, zmq.POLLIN)
        self._engines[engine_id] = prefill_tp
        return engine_id

    def _send(self, sock: zmq.Socket[Any], frames: list[Any]) -> None:
        sock.send_multipart(frames, copy=False)
        self.stats.messages_out += 1

    def _recv(self, sock: zmq.Socket[Any], deadline: float, what: str, endpoint: str) -> wire.Message:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000)):
            raise HandshakeError(f"no {what} from {endpoint} within the handshake timeout")
        return wire.decode(sock.recv_multipart())

    def _handshake(self, endpoint: str, timeout_s: float) -> _Link:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        deadline = time.monotonic() + timeout_s
        try:
            self._send(sock, wire.encode(self.hello))
            theirs = self._recv(sock, deadline, "Hello", endpoint)
            if not isinstance(theirs, wire.Hello):
                raise HandshakeError(f"{endpoint} answered a Hello with {type(theirs).__name__}")
            version = check_hello(self.hello, theirs)
            md = self.backend.local_metadata()
            check_descriptors(version, self.backend.name, bool(md.region_descs), theirs.engine_id)
            info = register_info(
                self.caches.memory,
                endpoint=self.endpoint,
                engine_id=self.identity.engine_id,
                agent_name=md.agent_name,
                agent_metadata=md.agent_metadata,
                region_descs=md.region_descs,
                version=version,
            )
            try:
                frames = wire.encode(info, version)
            except wire.WireError as exc:  # e.g. DowngradeError: this memory does not fit an older version
                raise HandshakeError(
                    f"RegisterInfo cannot be sent to {theirs.engine_id!r} at version "
                    f"{version[0]}.{version[1]}: {exc}"
                ) from exc
            self._send(sock, frames)
            ack = self._recv(sock, deadline, "registration answer", endpoint)
            if version >= REGISTER_ACK_SINCE:
                if not isinstance(ack, wire.RegisterAck):
                    raise HandshakeError(f"{endpoint} answered RegisterInfo with {type(ack).__name__}")
                accepted = bool(ack.accepted)
            else:  # 1.1 and 1.0 peers answer with a TransferStatus for the reserved room 0
                if not (isinstance(ack, wire.TransferStatus) and int(ack.room) == REGISTER_ROOM):
                    raise HandshakeError(f"{endpoint} answered RegisterInfo with {type(ack).__name__}")
                accepted = ack.status == wire.Status.SUCCESS
            if not accepted:
                why = failure_from_wire(wire.FailureKind(ack.failure_kind), ack.reason)
                raise HandshakeError(f"prefill {theirs.engine_id!r} refused the registration: {why.reason}")
        except BaseException:
            sock.close(0)
            raise
        return _Link(sock, PeerRef(theirs.engine_id, int(theirs.geometry.tp_rank)), version)

    # ------------------------------------------------------------------ rooms

    def start_room(
        self, room: int, slots: RoomSlots, prefill_engine: str, *, timeout_s: float | None = None
    ) -> None:
        """Ask the prefill engine for ``room`` into ``slots``; raises DuplicateRoomError first if in use."""
        if room == REGISTER_ROOM:
            # its TransferStatus would be taken for a registration answer and dropped
            raise SessionError(f"room {REGISTER_ROOM} is reserved for registration answers; rooms start at 1")
        spec = self.caches.spec
        route = route_decode_rank(
            self._engines[prefill_engine], self.identity.tp_size, self.identity.tp_rank, is_mla=spec.mla
        )
        state_idx = slots.state_indices(spec)
        comps = tuple(i for i, idx in enumerate(state_idx) if len(idx))
        plans = [
            SenderPlan(
                p,
                PeerRef(prefill_engine, p),
                p in route.dummy_prefill_ranks,
                () if p in route.dummy_prefill_ranks else comps,
                p == route.prefill_ranks[0],
                fences=self._links[PeerRef(prefill_engine, p)].version >= FENCE_SINCE,
            )
            for p in route.prefill_ranks
        ]
        r = self.session.start_room(room, plans, time.monotonic(), timeout_s)
        empty = np.zeros(0, dtype=np.int32)
        for plan in plans:
            link = self._links[plan.peer]
            req = wire.TransferRequest(
                room=room,
                sender=self.endpoint,
                dst_kv_indices=empty if plan.is_dummy else slots.pages,
                dst_aux_index=-1 if plan.is_dummy else slots.aux,
                required_dst_info_num=route.required_dst_info_num,
                is_dummy=plan.is_dummy,
                state_indices=[] if plan.is_dummy else list(state_idx),
            )
            self._send(link.sock, wire.encode(req, link.version))
            self.stats.requests_sent += 1
        r.on_requests_sent()

    def abort(self, room: int, reason: str) -> None:
        self._run(self.session.abort(room, Failure(FailureKind.ABORTED, reason)))

    # ------------------------------------------------------------------ the loop

    def step(self, timeout_ms: int) -> dict[Any, int]:
        """Poll once: control messages, engine notifications, deadlines. Returns poll events."""
        # with rooms live, engine notifications have nothing to wait on: look again soon
        if self.session.rooms:
            events = self._backoff.poll(self.poller, timeout_ms / 1000)
        else:
            events = dict(self.poller.poll(timeout_ms))
        for link in self._links.values():
            if events.get(link.sock):
                self._drain(link)
        notes = self.backend.receive_notifications()
        if events or notes:
            self._backoff.progress()
        for n in notes:
            self.stats.engine_notifications += 1
            try:
                msg = wire.decode_bytes(n.payload)
            except wire.WireError as exc:
                # a peer's bad payload must not stop this loop (every room on the rank would
                # hang); the room it belonged to, if any, still fails at its deadline
                self.stats.failures.append(f"undecodable engine notification from {n.peer_agent_name}: {exc}")
                continue
            self._on_notification(msg)
        if self.session.rooms or self.session.quarantined:
            self._run(self.session.on_tick(time.monotonic()))
        return events

    def _drain(self, link: _Link) -> None:
        while True:
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = wire.decode(frames)
            except wire.WireError as exc:
                self.stats.failures.append(f"undecodable message from {link.peer}: {exc}")
                continue
            if isinstance(msg, wire.TransferStatus):
                if int(msg.room) == REGISTER_ROOM:
                    continue
                failed = msg.status == wire.Status.FAILED
                failure = (
                    failure_from_wire(wire.FailureKind(msg.failure_kind), msg.reason) if failed else None
                )
                self._run(
                    self.session.on_status(
                        int(msg.room), int(msg.sender_rank), RoomStatus(int(msg.status)), failure
                    )
                )
            elif isinstance(msg, wire.Notification):
                self.stats.control_notifications += 1
                self._on_notification(msg)
            elif isinstance(msg, wire.AbortAck):
                self._run(self.session.on_abort_ack(int(msg.room), int(msg.sender_rank)))
            elif isinstance(msg, wire.RegisterAck):
                pass  # a repeated registration answer: nothing is waiting for it
            else:
                self.stats.failures.append(f"unexpected {type(msg).__name__} from {link.peer}")

    def _on_notification(self, msg: wire.Message) -> None:
        if not isinstance(msg, wire.Notification):
            self.stats.failures.append(f"engine notification carried a {type(msg).__name__}")
            return
        kind = _KIND[wire.NotificationKind(msg.kind)]
        self._run(
            self.session.on_notification(
                int(msg.room),
                int(msg.sender_rank),
                kind,
                int(msg.chunk_id),
                bool(msg.is_last),
                int(msg.component),
            )
        )

    def _run(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, SendAbort):
                link = self._links.get(a.peer)
                if link is not None:
                    abort = wire.Abort(room=a.room, sender=self.endpoint, reason=a.failure.reason)
                    self._send(link.sock, wire.encode(abort, link.version))
            elif isinstance(a, ReleaseRoom):
                if a.status is RoomStatus.SUCCESS:
                    self.stats.rooms_ok += 1
                else:
                    self.stats.rooms_failed += 1
                    reason = a.failure.reason if a.failure is not None else "no reason given"
                    self.stats.failures.append(f"room {a.room}: {reason}")
                if self.on_finished is not None:
                    self.on_finished(a.room, a.status, a.failure)
            elif isinstance(a, ReleaseSlots):
                if a.unfenced:
                    # Never silent: a late write from these senders may still land in the slots.
                    self.stats.unfenced_releases += 1
                    self.stats.failures.append(
                        f"room {a.room}: destination slots released after the fence timeout, unfenced by "
                        + ", ".join(map(str, a.unfenced))
                    )
                if self.on_slots_released is not None:
                    self.on_slots_released(a.room)

    def close(self) -> None:
        for link in self._links.values():
            link.sock.close(0)
        self._links.clear()
