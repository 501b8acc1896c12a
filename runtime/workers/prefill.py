"""The prefill rank an engine embeds: a ZMQ ROUTER, a transfer backend, a clock around the pure core
(one ``PrefillConnection`` per decode peer, the ``PrefillSession`` of rooms); docs/engine-api.md.

A part whose plan is empty (a replicated tensor another prefill rank writes) cannot ride on an
engine write, so its Notification travels on the control socket instead. A failed room's
transfers are cancelled with ``Backend.cancel`` and polled until the engine confirms each
stopped; its statuses, AbortAcks and ``on_released`` wait for that (:mod:`.session.prefill_room`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdwire import wire
from pdwire.runtime.backends import Backend, BackendError, Peer, PeerMetadata, TransferHandle, TransferState
from pdwire.runtime.config import ConfigError, PrefillConfig
from pdwire.runtime.descriptors import DescriptorTable
from pdwire.runtime.indices import (
    RESERVED_ROOM,
    IndicesError,
    as_aux_index,
    as_index_array,
    as_state_indices,
    check_room,
)
from pdwire.runtime.planner import PeerPlan, PlanError, PlanGroup, RankMemory
from pdwire.runtime.session.actions import (
    Action,
    AuxPart,
    CancelTransfers,
    KvPart,
    Part,
    PeerRef,
    PostTransfer,
    ReleaseRoom,
    SendAbortAck,
    SendStatus,
    StatePart,
)
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
from pdwire.runtime.session.failures import Failure, FailureKind
from pdwire.runtime.session.merging import group_posts, runs
from pdwire.runtime.session.prefill_connection import PrefillConnection, PrefillLocal
from pdwire.runtime.session.prefill_session import PrefillSession
from pdwire.runtime.session.status import Status
from pdwire.runtime.staging import Copier, CopyError, CostModel, Mode
from pdwire.runtime.workers.curve import (
    HANDSHAKE_EVENTS,
    ZapHandler,
    log_refusal,
    report_refusal,
    serve_curve,
)
from pdwire.runtime.workers.failure_log import FailureLog, log
from pdwire.runtime.workers.setup import RankEdge, register_memory
from pdwire.runtime.workers.staging import Stager

# Peers decide how many connections and how large a message a rank holds; these bound both.
CONTROL_MAX_MESSAGE = 32 << 20
"""ZMQ_MAXMSGSIZE of the control socket: a larger frame disconnects its sender before it is
buffered. The largest legal message is a TransferRequest naming every page of a pool (4 bytes
a page: 8M pages); RegisterInfo is a few KiB per layer."""
MAX_CONNECTIONS = 4096
"""Connections (ROUTER identities) kept at once. Past it a new identity evicts the oldest one
that never registered; when every one is registered, the new one's messages are dropped."""
SPANS_KEPT = 4096
"""Rooms whose data-movement span :attr:`PrefillWorker.spans` keeps (the newest)."""
HEARTBEAT_S = 5.0
"""ZMTP heartbeats of the control socket: a decode peer that answers none for
:data:`HEARTBEAT_TIMEOUT_S` (its host gone, the process stopped) has its connection closed, so a
restart of that rank is accepted (see :meth:`PrefillWorker._add_peer`)."""
HEARTBEAT_TIMEOUT_S = 30.0

OnReleased = Callable[[int, Status, Failure | None], None]


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
    planned_descriptors: int = 0  # the planner's rows of the posted parts (``descriptors``: engine rows)
    staged_parts: int = 0  # parts gathered into the staging buffer and written from it
    merged_parts: int = 0  # parts that rode on another part's engine write (one notification)
    staged_bytes: int = 0
    staging_waits: int = 0  # staged parts that waited for staging space
    scattered_parts: int = 0  # KV parts written to a decode rank's receive staging, scattered there
    scattered_bytes: int = 0
    copy_s: float = 0.0  # time in staging copies (gathers)
    failures: FailureLog = field(default_factory=FailureLog)  # bounded: the newest, and a total
    peers_failed: int = 0  # connections dropped because handling their message raised
    connections_evicted: int = 0  # unregistered connections forgotten at MAX_CONNECTIONS
    connections_refused: int = 0  # messages of new identities dropped: MAX_CONNECTIONS registered
    handshakes_refused: int = 0  # ZMTP handshakes refused at the socket (no CURVE, unknown key, garbage)
    restarts: int = 0  # registrations taken over from an older connection of the same decode rank
    takeovers_refused: int = 0  # registrations refused: the rank is registered on a live connection
    identities_refused: int = 0  # registrations refused: the identity is bound to another key
    aborts_refused: int = 0  # Aborts (and Leases) without authority: unregistered, or not the requester
    messages_too_large: int = 0  # messages past the largest legal one for their peer's registration
    leases: int = 0  # Lease messages: decode engines renewing rooms they still queue
    rooms_renewed: int = 0  # rooms those renewed (waiting for requests, held room_timeout_s longer)


@dataclass
class _Waiting:
    """A staged write waiting for a free range of the staging buffer (planned, not posted): one
    part, or several of one room for one peer with one notification (the first one leads)."""

    actions: list[PostTransfer]
    table: DescriptorTable
    notification: bytes


class PrefillWorker(RankEdge):
    """One prefill rank. Not thread-safe: call it from one thread (or use :class:`.WorkerThread`).

    ``backend``: a backend the engine created (and allocated its memory from); the worker
    registers ``memory``'s regions in it unless they are registered already, in that order.
    None: the worker creates one from ``config.backend`` / ``config.backend_options`` and
    closes it in :meth:`close`. ``context``: a ZMQ context to share (default: its own).
    ``cost_model``: staging's costs (default: the backend's measured defaults, see
    :mod:`pdwire.runtime.staging.cost`); ``copier``: a device copier for staging parts that
    read device memory (default: host memory only; device parts go direct).
    """

    def __init__(
        self,
        config: PrefillConfig,
        memory: RankMemory,
        *,
        backend: Backend | None = None,
        context: zmq.Context[Any] | None = None,
        on_released: OnReleased | None = None,
        cost_model: CostModel | None = None,
        copier: Copier | None = None,
    ) -> None:
        super().__init__(config, memory, wire.Role.PREFILL, backend, context)
        self.config: PrefillConfig = config
        self.sock = self._ctx.socket(zmq.ROUTER)
        self._zap: tuple[ZapHandler, str] | None = None
        try:
            register_memory(self.backend, memory, config.rank)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_MESSAGE)
            self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
            self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
            if self.auth is not None:
                self._zap = ZapHandler.attach(self._ctx, self.auth)
                serve_curve(self.sock, self.auth, self._zap[1])
            bind = config.bind_endpoint()
            if bind.is_ipv6:
                self.sock.setsockopt(zmq.IPV6, 1)
            try:
                if bind.port == 0:
                    port = self.sock.bind_to_random_port(str(bind).rsplit(":", 1)[0])
                else:
                    self.sock.bind(str(bind))
                    port = bind.port
            except zmq.ZMQError as exc:
                raise ConfigError(f"PrefillConfig.bind {config.bind!r}: {exc}") from exc
            by_descriptor = bool(self.backend.local_metadata().region_descs)
        except BaseException:
            self.sock.close(0)
            if self._zap is not None:
                self._zap[0].detach(self._zap[1])
            self._close_edge()
            raise
        self.bound = str(bind.with_port(port))
        self.endpoint = config.advertised(port)  # what decode ranks connect to
        self.poller.register(self.sock, zmq.POLLIN)
        self._wake_on(self.backend.wakes_on_completion)  # when a transfer may be final
        # handshakes libzmq refused (no CURVE, an unknown key, garbage): logged and counted here
        self._monitor = self.sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self.poller.register(self._monitor, zmq.POLLIN)
        self.session = PrefillSession(config.room_timeout_s)
        self.sender_rank = config.rank.sender_rank
        self.on_released = on_released
        self.stats = PrefillStats()
        self._local = PrefillLocal(
            self.hello, memory, self.sender_rank, self.backend.name, by_descriptor, config.room_timeout_s
        )
        self._conns: dict[bytes, PrefillConnection] = {}  # ROUTER identity -> its connection
        self._key_of: dict[bytes, bytes] = {}  # ROUTER identity -> the CURVE key it authenticated with
        # rooms of a restarted peer's old incarnation: told Failed on its old connection once released
        self._owed_to_old: dict[int, tuple[bytes, PrefillConnection, Failure]] = {}
        self._identity_of: dict[PeerRef, bytes] = {}  # registered decode rank -> its identity
        self._backend_peers: dict[PeerRef, Peer] = {}
        self._handles: dict[int, TransferHandle] = {}  # the leading part's xfer id -> its write
        self._riders: dict[int, list[int]] = {}  # leading xfer id -> the other parts of its write
        self._lead_of: dict[int, int] = {}  # a riding part's xfer id -> the leading one
        self._done_now: list[int] = []  # parts completed without an engine write
        self._stager = Stager(self.backend, config.staging_bytes, cost_model, copier)
        self._waiting: deque[_Waiting] = deque()  # staged parts waiting for staging space
        # room -> [first post, last completion] (perf_counter): the data-movement span, for
        # separating control-plane time from transfer time in benchmarks; the newest SPANS_KEPT
        # rooms only, so a long-running rank does not grow with every request it served
        self.spans: dict[int, list[float]] = {}

    # ------------------------------------------------------------------ engine side

    def send_chunk(
        self,
        room: int,
        kv_pages: Any,
        *,
        last: bool,
        state: Sequence[Any | None] | None = None,
        aux_index: int | None = None,
    ) -> None:
        """Chunked prefill produced the next ``kv_pages`` (source page ids, in prompt order) of
        ``room``; ``last`` marks the final chunk, which also carries the source ``state``
        indices (per component, in ``memory.state`` order; None for a component this rank does
        not send) and the source ``aux_index``. Pages decode already holds
        (``decode_prefix_len``) are skipped per decode rank. Chunks produced before decode
        asked are kept and posted once it does. Raises :class:`IndicesError` on bad indices
        (nothing is recorded then)."""
        room = check_room(room)
        pages = as_index_array(kv_pages, "send_chunk kv_pages")
        if not last and (state is not None or aux_index is not None):
            raise IndicesError("send_chunk: state and aux indices come with the last chunk")
        st = None if state is None else as_state_indices(state, "send_chunk state")
        if st is not None and len(st) != len(self.memory.state):
            raise IndicesError(
                f"send_chunk state: {len(st)} entries for {len(self.memory.state)} state components"
            )
        aux = as_aux_index(aux_index, "send_chunk aux_index")
        # staged KV chunks are cut to a share of the staging buffer, so that several are in
        # flight at once; decode learns the chunk count from the last one, as always
        step = self._stager.kv_pages_per_part([c.plan for c in self._conns.values() if c.plan is not None])
        cuts = list(range(0, len(pages), step)) if step and len(pages) > step else [0]
        for i, start in enumerate(cuts):
            end = cuts[i + 1] if i + 1 < len(cuts) else len(pages)
            final = last and end == len(pages)
            now = time.monotonic()
            self._run(
                self.session.on_chunk(
                    room, pages[start:end], final, now, st if final else None, aux if final else None
                )
            )

    def abort(self, room: int, reason: str = "aborted by the prefill engine") -> None:
        """Give up on ``room``: nothing more is posted; once the transfers in flight stopped,
        every decode rank that asked is told Failed (aborted) and ``on_released`` fires. A room
        no decode rank asked for yet is refused when one does."""
        room = check_room(room)
        self._run(self.session.abort(room, Failure(FailureKind.ABORTED, reason), time.monotonic()))

    def status(self, room: int) -> Status | None:
        """The room's status here (live, or recently ended); None for a room never seen."""
        return self.session.status(room)

    @property
    def transfers_in_flight(self) -> int:
        """Engine transfers posted and not yet final (a failed room's included while they stop)."""
        return len(self._handles)

    @property
    def staging_in_use(self) -> int:
        """Bytes of the staging buffer held by staged parts in flight (0 once every staged write
        is final: a range is reused only after the engine is done with it)."""
        return self._stager.arena.in_use

    @property
    def staged_parts_waiting(self) -> int:
        """Staged parts planned but not posted yet: they wait for staging space."""
        return len(self._waiting)

    @property
    def draining_rooms(self) -> tuple[int, ...]:
        """Failed rooms whose transfers the engine has not confirmed stopped yet: nobody is told,
        and their source pages stay in use, until they have."""
        return tuple(room for room, r in self.session.rooms.items() if r.draining)

    @property
    def registered_peers(self) -> tuple[PeerRef, ...]:
        """The decode ranks registered with this rank (engine id, engine-wide rank)."""
        return tuple(self._identity_of)

    # ------------------------------------------------------------------ the loop

    def step(self, timeout_ms: int) -> dict[Any, int]:
        """Poll once: control messages, transfer completions, deadlines. Returns poll events.

        Waits at most ``timeout_ms`` (0: never blocks)."""
        if self.session.rooms:
            # Deadlines first: after a stall (the process stopped or starved) rooms that expired
            # meanwhile fail before any message that arrived during it can make them post.
            self._run(self.session.on_tick(time.monotonic()))
        # with transfers in flight, completions may come at any time; parts done without the
        # engine are accounted at once
        events = self._wait(timeout_ms, bool(self._handles), at_once=bool(self._done_now))
        if events.get(self.sock):
            self._drain()
        if events.get(self._monitor):
            self._on_monitor()
        if self._service() or events:
            self._backoff.progress(len(self._handles))
        return events

    def _on_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats.handshakes_refused += 1  # a peer that hung up mid-handshake too
            endpoint = event["endpoint"].decode("utf-8", "replace")
            report_refusal(event, endpoint, self.auth is not None, self.stats.failures)

    def _drain(self) -> None:
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.stats.messages_in += 1
            frames = [f.bytes for f in parts]
            identity = frames[0]
            conn = self._conns.get(identity)
            if conn is None:
                if len(self._conns) >= MAX_CONNECTIONS and not self._evict_one():
                    self.stats.connections_refused += 1
                    continue
                conn = self._conns[identity] = PrefillConnection(self._local)
                if self.auth is not None:  # libzmq admitted only a key ZAP accepted
                    self._key_of[identity] = str(parts[-1].get("User-Id")).encode()
            try:
                too_large = conn.oversized(frames[1:])  # reads the header frame only
                if too_large is not None:
                    self.stats.messages_too_large += 1
                    self._fail_peer(identity, conn, too_large)
                    continue
                try:
                    msg = wire.decode(frames[1:])
                except wire.WireError as exc:
                    self._handle(identity, conn, conn.undecodable(str(exc)))
                    continue
                self._handle(identity, conn, conn.receive(msg))
            except Exception as exc:
                self._fail_peer(identity, conn, exc)

    def _evict_one(self) -> bool:
        """Forget the oldest connection that never registered (a half-open or hostile socket);
        False when every connection is a registered peer."""
        for identity, conn in self._conns.items():
            if conn.peer is None or self._identity_of.get(conn.peer) != identity:
                self._forget(identity)
                self.stats.connections_evicted += 1
                return True
        return False

    def _fail_peer(self, identity: bytes, conn: PrefillConnection, exc: Exception) -> None:
        """Handling a message of this peer raised: drop its connection (its rooms fail as for a
        lost peer), log and count it; every other peer and room keeps going."""
        self.stats.peers_failed += 1
        text = f"decode peer {conn.peer or identity.hex()} dropped: {type(exc).__name__}: {exc}"
        self.stats.failures.append(text)
        log.warning("%s", text, exc_info=exc)
        self._forget(identity)
        peer = conn.peer
        if peer is not None and self._identity_of.get(peer) == identity:
            self._lose_peer(peer, str(peer))

    def _forget(self, identity: bytes) -> None:
        self._conns.pop(identity, None)
        self._key_of.pop(identity, None)

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
            self._stager.release(x)  # and with its staging range
            room = self.session.room_of(x)
            if room is not None and room in self.spans:
                self.spans[room][1] = time.perf_counter()
            riders = self._riders.pop(x, [])
            for r in riders:
                del self._lead_of[r]
            for part in (x, *riders):  # every part the write carried ends with it
                if st.state is TransferState.DONE:
                    self._run(self.session.on_xfer_done(part))
                else:
                    self._run(self.session.on_xfer_failed(part, st.reason))
        while self._done_now:
            self._run(self.session.on_xfer_done(self._done_now.pop(0)))
        self._post_waiting()
        if self.session.rooms:
            self._run(self.session.on_tick(time.monotonic()))
        return progressed

    def close(self) -> None:
        """Release every transfer handle and the socket (and the backend and context the worker
        made itself). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles.values():
            self.backend.release(h)
        self._handles.clear()
        self._riders.clear()
        self._lead_of.clear()
        self._waiting.clear()
        self.sock.disable_monitor()
        self._monitor.close(0)
        self.sock.close(0)
        if self._zap is not None:
            self._zap[0].detach(self._zap[1])
        self._close_edge()

    # ------------------------------------------------------------------ connection events

    def _send(self, identity: bytes, msg: wire.Message, version: tuple[int, int] | None) -> None:
        # numpy declares ndarray a buffer (its side frames) only from Python 3.12 on
        self.sock.send_multipart([identity, *wire.encode(msg, version)], copy=False)  # type: ignore[list-item]
        self.stats.messages_out += 1

    def _handle(self, identity: bytes, conn: PrefillConnection, events: list[PrefillEvent]) -> None:
        for e in events:
            if isinstance(e, Send):
                self._send(identity, e.message, e.version)
            elif isinstance(e, Problem):
                self.stats.failures.append(e.text)
            elif isinstance(e, AddPeer):
                self._handle(identity, conn, self._add_peer(identity, conn, e))
            elif isinstance(e, Requested):
                self._run(self.session.on_request(e.room, e.target, e.required, time.monotonic()))
            elif isinstance(e, AbortRequested):
                if self._speaks_for(identity, e.peer, f"Abort of room {e.room}"):
                    refusal = self.session.abort_refusal(e.room, e.peer)
                    if refusal is not None:  # answered (nothing is in flight for it), no effect
                        self._refuse_abort(f"Abort of room {e.room} from {e.peer} refused: {refusal}")
                    self._run(self.session.on_abort(e.room, e.peer))
            elif isinstance(e, LeaseRenewed):
                self.stats.leases += 1
                if self._speaks_for(identity, e.peer, f"Lease of {len(e.rooms)} rooms"):
                    self.stats.rooms_renewed += self.session.on_lease(e.rooms, e.peer, time.monotonic())
            else:
                assert isinstance(e, Registered)

    def _speaks_for(self, identity: bytes, peer: PeerRef, what: str) -> bool:
        """Whether the connection ``identity`` is ``peer``'s registered one, the only one that may
        decline or abort rooms in its name (a registration is the proof: a Hello alone claims any
        name); otherwise the message is refused (no answer), logged and counted."""
        if self._identity_of.get(peer) == identity:
            return True
        self._refuse_abort(f"{what} refused: the connection claiming {peer} is not its registered one")
        return False

    def _refuse_abort(self, text: str) -> None:
        self.stats.aborts_refused += 1
        self.stats.failures.append(text)
        log_refusal(text)

    def _add_peer(self, identity: bytes, conn: PrefillConnection, e: AddPeer) -> list[PrefillEvent]:
        bound = self._identity_refusal(identity, e.peer)
        if bound is not None:
            self.stats.identities_refused += 1
            self.stats.failures.append(f"registration of {e.peer} refused: {bound}")
            log_refusal(f"registration of {e.peer} refused: {bound}")
            return conn.peer_refused(bound)
        old = self._identity_of.get(e.peer)
        if old is not None and old != identity:
            refusal = self._takeover_refusal(identity, old, e.peer)
            if refusal is not None:
                self.stats.takeovers_refused += 1
                self.stats.failures.append(f"registration of {e.peer} refused: {refusal}")
                log_refusal(f"registration of {e.peer} from a new connection refused: {refusal}")
                return conn.peer_refused(refusal)
            self._retire(e.peer, old)
        peers = self._backend_peers.items()
        holder = next((ref for ref, bp in peers if bp.agent_name == e.agent_name and ref != e.peer), None)
        if holder is not None:
            # the engine keys its peers by agent name: adding it again would replace (and cut
            # off) the live registration of another decode rank
            refusal = f"agent name {e.agent_name!r} is registered by {holder}, a live decode rank"
            self.stats.failures.append(f"registration of {e.peer} refused: {refusal}")
            log_refusal(f"registration of {e.peer} refused: {refusal}")
            return conn.peer_refused(refusal)
        try:
            peer = self.backend.add_peer(PeerMetadata(e.agent_name, e.agent_metadata, e.region_descs))
        except BackendError as exc:
            return conn.peer_refused(f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            return conn.peer_refused(f"malformed backend metadata ({type(exc).__name__}: {exc})")
        self._backend_peers[e.peer] = peer
        self._identity_of[e.peer] = identity
        return conn.peer_added()

    def _identity_refusal(self, identity: bytes, peer: PeerRef) -> str | None:
        """Why the connection ``identity`` may not register as ``peer`` under the key directory's
        per-rank keys (:meth:`.ControlAuth.identity_refusal`); None without bindings."""
        if self.auth is None:
            return None
        return self.auth.identity_refusal(peer.engine_id, peer.rank, self._key_of.get(identity))

    def _takeover_refusal(self, identity: bytes, old: bytes, peer: PeerRef) -> str | None:
        """Why a registration of ``peer`` from ``identity`` may not replace its registration on
        ``old``; None for a restart: the old connection is gone (its process exited and the
        socket closed, or it answered no heartbeat for HEARTBEAT_TIMEOUT_S), or the backend
        proves the old incarnation's process dead (:meth:`.Backend.peer_gone`). Whatever keys
        the two hold: a key is the deployment's (every rank may hold the same one), a live
        connection is the rank itself. So a process claiming the (engine, rank) of a live decode
        rank, or a second process started under the same engine id and rank, is refused."""
        if not self._reachable(old):
            return None
        backend_peer = self._backend_peers.get(peer)
        if backend_peer is not None and self.backend.peer_gone(backend_peer):
            return None
        return (
            f"{peer} is registered on a live connection (its heartbeats are answered); a "
            f"registration from another connection is taken as a restart only once that connection "
            f"is gone: closed, or silent for {HEARTBEAT_TIMEOUT_S:g} s (retry later)"
        )

    def _reachable(self, identity: bytes) -> bool:
        """Whether the ROUTER still has a connection for ``identity``: a repeated registration
        answer (every decode version ignores one) sent with ROUTER_MANDATORY, which raises
        EHOSTUNREACH for an identity whose connection closed."""
        conn = self._conns.get(identity)
        if conn is None:
            return False
        frames = wire.encode(conn.status(RESERVED_ROOM, Status.SUCCESS), conn.version)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.sock.send_multipart([identity, *frames], zmq.NOBLOCK)  # type: ignore[list-item]  # as in _send
        except zmq.ZMQError as exc:
            return exc.errno != zmq.EHOSTUNREACH  # EAGAIN: connected, its queue full
        finally:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        return True

    def _retire(self, peer: PeerRef, old: bytes) -> None:
        """``peer`` restarted (or registers again from a new connection): the rooms of its old
        incarnation fail, each told Failed on the old connection once its writes stopped, its
        backend peer is removed and the old connection forgotten."""
        conn = self._conns.get(old)
        why = Failure(FailureKind.PEER_GONE, f"{peer} registered again on another connection")
        if conn is not None:
            for room, r in self.session.rooms.items():
                if peer in r.targets and not r.finished:
                    self._owed_to_old[room] = (old, conn, why)
        self.stats.restarts += 1
        self._forget(old)
        self._lose_peer(peer, f"{peer}'s old incarnation")

    def _lose_peer(self, peer: PeerRef, what: str) -> None:
        """``peer``'s connection is over: its rooms fail (cancelling their transfers), then its
        backend peer is removed."""
        del self._identity_of[peer]
        backend_peer = self._backend_peers.pop(peer, None)
        self._run(self.session.on_peer_lost(peer))
        if backend_peer is not None:  # its transfers were cancelled with its rooms
            try:
                self.backend.remove_peer(backend_peer)
            except Exception as exc:
                self.stats.failures.append(f"removing {what}: {exc}")

    # ------------------------------------------------------------------ actions out

    def _conn_of(self, peer: PeerRef) -> tuple[bytes, PrefillConnection] | None:
        identity = self._identity_of.get(peer)
        conn = None if identity is None else self._conns.get(identity)
        return None if identity is None or conn is None else (identity, conn)

    def _run(self, actions: list[Action]) -> None:
        for a in group_posts(actions):
            if isinstance(a, list):
                self._post_group(a)
            elif isinstance(a, CancelTransfers):
                cancel = set(a.xfer_ids)
                for w in [w for w in self._waiting if any(p.xfer_id in cancel for p in w.actions)]:
                    if w in self._waiting:  # never posted: nothing of it is in flight
                        self._waiting.remove(w)
                        for p in w.actions:
                            why = f"room {a.room} failed before {p.part} was posted"
                            self._not_posted(p, Failure(FailureKind.ABORTED, why))
                for lead in dict.fromkeys(self._lead_of.get(x, x) for x in a.xfer_ids):
                    h = self._handles.get(lead)
                    if h is not None:  # the others complete without the engine or are not posted yet
                        self.backend.cancel(h)
            elif isinstance(a, SendStatus | SendAbortAck):
                found = self._conn_of(a.peer)
                if found is not None:
                    identity, conn = found
                    msg: wire.Message = (
                        conn.status(a.room, a.status, a.failure)
                        if isinstance(a, SendStatus)
                        else conn.abort_ack(a.room)
                    )
                    self._send(identity, msg, conn.version)
            elif isinstance(a, ReleaseRoom):
                self._release(a)

    @staticmethod
    def _plan(plan: PeerPlan, part: Part) -> PlanGroup:
        """The descriptors of one self-contained part."""
        if isinstance(part, KvPart):
            return plan.plan_kv_chunk(part.chunk_id, part.src, part.dst)
        if isinstance(part, StatePart):
            return plan.plan_component(part.component, part.src, part.dst)
        assert isinstance(part, AuxPart)
        return plan.plan_aux(part.src, part.dst)

    def _not_posted(self, a: PostTransfer, failure: Failure) -> None:
        self._run(self.session.on_not_posted(a.xfer_id, failure))

    def _post_group(self, posts: list[PostTransfer]) -> None:
        """Plan and post parts of one room for one peer (:func:`.merging.group_posts`): to a peer
        reading multi-part notifications (1.4), each run of them goes as one engine write."""
        a = posts[0]
        # Checked now, at this post: an earlier action of the same batch may have failed the
        # room, or the rank stalled (stopped, starved) past the room's deadline meanwhile.
        refused = self.session.refuses_post(a.room, time.monotonic())
        if refused is not None:
            for p in posts:
                self._not_posted(p, Failure(refused.kind, f"{refused.detail} ({p.part})"))
            return
        found = self._conn_of(a.peer)
        backend_peer = self._backend_peers.get(a.peer)
        if found is None or backend_peer is None or found[1].plan is None:
            for p in posts:
                self._not_posted(p, Failure(FailureKind.PEER_GONE, f"{p.peer} is not connected"))
            return
        identity, conn = found
        assert conn.plan is not None
        planned: list[tuple[PostTransfer, DescriptorTable]] = []
        for p in posts:
            try:
                planned.append((p, self._plan(conn.plan, p.part).table))
            except (PlanError, ValueError) as exc:
                self._not_posted(p, Failure(FailureKind.VALIDATION, f"planning {p.part}: {exc}"))
                return  # the room failed: the rest of its parts are refused with it
        writes = [(p, t) for p, t in planned if len(t)]
        for p, t in planned:
            if not len(t):
                self._post_parts(identity, conn, [p], [t])  # rides on the control socket
        if not conn.merges_parts:  # a 1.4 peer counts one part per notification
            for p, t in writes:
                self._post_parts(identity, conn, [p], [t])
            return
        for run in runs([p.part for p, _ in writes]):
            self._post_parts(identity, conn, [writes[i][0] for i in run], [writes[i][1] for i in run])

    def _post_parts(
        self,
        identity: bytes,
        conn: PrefillConnection,
        posts: list[PostTransfer],
        tables: list[DescriptorTable],
    ) -> None:
        """Post planned parts as one engine write with one notification (one part: its own)."""
        a = posts[0]
        if self.session.refuses_post(a.room, time.monotonic()) is not None:
            for p in posts:  # an earlier write of the batch failed the room
                self._post_group([p])
            return
        now = time.perf_counter()
        if a.room not in self.spans:
            self.spans[a.room] = [now, now]
            if len(self.spans) > SPANS_KEPT:
                del self.spans[next(iter(self.spans))]  # the oldest room's (insertion order)
        if len(posts) == 1:
            note = conn.notification(a.room, a.part)
            table = tables[0]
            if len(table) == 0:
                # nothing to write: the completion rides on the control socket
                self._send(identity, note, conn.version)
                self.stats.control_notifications += 1
                self._done_now.append(a.xfer_id)
                return
        else:
            note = conn.merged_notification(a.room, [p.part for p in posts])
            table = DescriptorTable.concat(tables)
        backend_peer = self._backend_peers.get(a.peer)
        if conn.scatter[1] and backend_peer is not None:
            sc = self._stager.scatter(backend_peer, conn.scatter, [p.part for p in posts], tables)
            if sc is not None:  # KV into decode's receive staging, decode copies it into place
                note.scatter_first_page, note.scatter_pages = sc.first_page, sc.pages
                payload = wire.encode_bytes(note, conn.version)
                if self._engine_post(posts, sc.write, payload, sum(len(t) for t in tables)):
                    self.stats.scattered_parts += sc.kv_parts
                    self.stats.scattered_bytes += sc.kv_bytes
                return
        mode = self._stager.choose(table).mode
        if (
            len(posts) > 1
            and mode is Mode.DIRECT
            and any(self._stager.choose(t).mode is Mode.GATHER for t in tables)
        ):
            # the joined write is too large for the staging buffer while its parts would stage:
            # staged parts of few large rows beat one write of many small ones
            for p, t in zip(posts, tables, strict=True):
                self._post_parts(identity, conn, [p], [t])
            return
        payload = wire.encode_bytes(note, conn.version)
        if mode is Mode.GATHER:
            if self._waiting or not self._post_staged(posts, table, payload):
                self._waiting.append(_Waiting(posts, table, payload))  # in order, once space frees
                self.stats.staging_waits += 1
            return
        self._engine_post(posts, table, payload, len(table))

    def _engine_post(
        self, posts: list[PostTransfer], table: DescriptorTable, payload: bytes, planned: int
    ) -> bool:
        """Post one engine write of ``posts``; False (the parts failed, nothing moved) if refused."""
        a = posts[0]
        backend_peer = self._backend_peers.get(a.peer)
        if backend_peer is None:
            for p in posts:
                self._not_posted(p, Failure(FailureKind.PEER_GONE, f"{p.peer} is not connected"))
            return False
        try:
            h = self.backend.post(backend_peer, table, payload)
        except BackendError as exc:  # a refused post moved nothing
            for p in posts:
                self._not_posted(p, Failure(FailureKind.ENGINE_ERROR, f"{type(exc).__name__}: {exc}"))
            return False
        self._handles[a.xfer_id] = h
        if len(posts) > 1:
            self._riders[a.xfer_id] = [p.xfer_id for p in posts[1:]]
            self._lead_of.update((p.xfer_id, a.xfer_id) for p in posts[1:])
        self.stats.posts += 1
        self.stats.merged_parts += len(posts) - 1
        self.stats.bytes_posted += table.total_bytes
        self.stats.descriptors += len(table)
        self.stats.planned_descriptors += planned
        return True

    def _post_staged(self, posts: list[PostTransfer], table: DescriptorTable, payload: bytes) -> bool:
        """Gather ``table`` into staging and post the staged write; False if no staging space is
        free now (nothing done). A gather that cannot run fails the parts."""
        a = posts[0]
        t0 = time.perf_counter()
        try:
            staged = self._stager.stage(a.xfer_id, table)
        except CopyError as exc:
            for p in posts:
                self._not_posted(p, Failure(FailureKind.ENGINE_ERROR, f"staging {p.part}: {exc}"))
            return True
        if staged is None:
            return False
        self.stats.copy_s += time.perf_counter() - t0
        if self._engine_post(posts, staged.write, payload, staged.rows):
            self.stats.staged_parts += len(posts)
            self.stats.staged_bytes += table.total_bytes
        else:
            self._stager.release(a.xfer_id)
        return True

    def _post_waiting(self) -> None:
        """Staged writes that waited for staging space, in order, as far as space allows."""
        while self._waiting:
            w = self._waiting.popleft()
            refused = self.session.refuses_post(w.actions[0].room, time.monotonic())
            if refused is not None:
                for p in w.actions:
                    self._not_posted(p, Failure(refused.kind, f"{refused.detail} ({p.part})"))
            elif not self._post_staged(w.actions, w.table, w.notification):
                self._waiting.appendleft(w)  # still no space: the next completion frees some
                return

    def _release(self, a: ReleaseRoom) -> None:
        # Nothing of the room is in flight any more: its source slots may be reused.
        owed = self._owed_to_old.pop(a.room, None)
        if owed is not None:  # the old incarnation of a restarted peer hears why, now its writes stopped
            identity, conn, why = owed
            self._send(identity, conn.status(a.room, Status.FAILED, why), conn.version)
        if a.status is Status.SUCCESS:
            self.stats.rooms_ok += 1
        else:
            self.stats.rooms_failed += 1
            if a.failure is not None:
                self.stats.failures.append(f"room {a.room}: {a.failure.reason}")
        if self.on_released is not None:
            self.on_released(a.room, a.status, a.failure)
