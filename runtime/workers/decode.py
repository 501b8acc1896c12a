"""The decode rank an engine embeds: one ZMQ DEALER per prefill rank it reads from, a transfer
backend for completions, a clock, around the pure core (one
:class:`~pdwire.runtime.session.decode_connection.DecodeConnection` per prefill rank, the
:class:`~pdwire.runtime.session.routing.GroupRoute` of each prefill group and the
:class:`~pdwire.runtime.session.decode_session.DecodeSession` of rooms).

An engine builds one per rank from a :class:`~pdwire.runtime.config.DecodeConfig` and the
rank's memory, :meth:`DecodeWorker.connect` s it to a prefill engine's ranks (returns a
:class:`PrefillGroup` at once; ``step()`` runs the handshakes, a pure
:class:`~pdwire.runtime.session.group_connect.GroupConnect` per group, while the worker keeps
serving its other links and rooms; ``on_connected(group)`` reports it ready or failed with the
cause, and :meth:`DecodeWorker.wait_ready` is the blocking form), and asks for each request with
:meth:`DecodeWorker.start_room` (one TransferRequest per prefill rank the routing names,
dummies explicitly marked; a room asked of a group still connecting waits inside its deadline);
completions arrive as engine notifications or, for parts with nothing to write, on the control
socket.

Two callbacks tell the engine about a room: ``on_finished(room, status, failure)`` as soon as
it ends (a failed request can be retried elsewhere at once), and ``on_slots_released(room)``
once its destination slots may be reused: at once after a success, and for a failed room
only when every writing prefill rank fenced (its Success status, or its Failed status or
AbortAck from a peer at protocol 1.3 or newer on an engine whose reports mean its writes
stopped) or was revoked.

Revocation (see ``docs/fencing.md``): every prefill rank is given its own windows onto this
rank's memory (``Backend.local_metadata(for_peer=...)``). A prefill rank that is lost (its
control connection closed, or silent past ``peer_timeout_s``: heartbeats run on every link),
or that a failed room still waits for ``fence_timeout_s`` past the room's deadline, is
revoked (``Backend.revoke``): its rooms fail at once, typed ``peer_gone``, and whatever it
still writes lands nowhere, so the slots come back once the revocation settled. A rank that
cannot be revoked (memory the engine did not allocate) leaves the rooms waiting for it
quarantined, counted in ``stats.unrevocable`` and named in ``stats.failures``: a timeout never
releases slots. A revoked rank registers again with new windows; a lost one is reconnected
in the background (a new handshake), while the other links and rooms go on. Until then a
room that needs it fails at once (``on_finished`` Failed, ``peer_gone``; nothing was sent); a
room that needs a live rank registering again after its revocation waits inside its deadline.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
from pdwire.runtime.backends import Backend
from pdwire.runtime.config import ConfigError, DecodeConfig
from pdwire.runtime.indices import IndicesError, RequestIndices, check_room
from pdwire.runtime.planner import (
    DecodeRoute,
    Indexing,
    PlanError,
    RankMemory,
    has_tp_sharded_state,
    route_decode_rank,
)
from pdwire.runtime.session.actions import (
    Action,
    PeerRef,
    ReleaseRoom,
    ReleaseSlots,
    RevokePeer,
    SendAbort,
    SendRequest,
)
from pdwire.runtime.session.decode_connection import DecodeConnection, DecodeConnState, DecodeLocal, Expected
from pdwire.runtime.session.decode_session import DecodeSession
from pdwire.runtime.session.events import (
    AbortAcked,
    Completed,
    DecodeEvent,
    Problem,
    Ready,
    Refused,
    Send,
    StatusReceived,
    completion,
)
from pdwire.runtime.session.failures import DuplicateRoomError, Failure, FailureKind, HandshakeError
from pdwire.runtime.session.group_connect import (
    FailHeld,
    GroupAction,
    GroupConnect,
    GroupConnected,
    GroupFailed,
    GroupIdentity,
    GroupState,
    LinkSpec,
    OpenLink,
    StartHeld,
)
from pdwire.runtime.session.hello import FENCE_SINCE, Identity
from pdwire.runtime.session.routing import GroupRoute
from pdwire.runtime.session.stage_layers import HeldLayers
from pdwire.runtime.session.status import Status
from pdwire.runtime.staging import Copier, CopyError
from pdwire.runtime.workers.backoff import WAKEUP_FALLBACK_MS, PollBackoff
from pdwire.runtime.workers.curve import HANDSHAKE_EVENTS, connect_curve, log_refusal, refusal_text, resolve
from pdwire.runtime.workers.failure_log import FailureLog, log
from pdwire.runtime.workers.scatter import ScatterGeometryError, ScatterReceiver, ScatterRefused
from pdwire.runtime.workers.setup import owned_backend, register_memory
from zmq.utils.monitor import recv_monitor_message

from pdwire import wire

OnFinished = Callable[[int, Status, Failure | None], None]
OnSlotsReleased = Callable[[int], None]
OnConnected = Callable[["PrefillGroup"], None]


class PrefillGroup:
    """One prefill engine's attention-DP group, as :meth:`DecodeWorker.connect` returns it at
    once: the handle :meth:`DecodeWorker.start_room` takes to say where a request comes from.

    ``state`` is ``CONNECTING`` until every rank's handshake passed (``READY``: ``engine_id``
    and ``dp_rank`` are what the ranks said) or one failed (``FAILED``: ``error`` names the
    cause). The worker updates it from ``step()`` and reports the change through its
    ``on_connected(group)`` callback; another thread may read it (attributes are set before
    ``state``). Handles compare by identity; two handles of the same engine and DP group
    address the same, newest, links.
    """

    __slots__ = ("dp_rank", "endpoints", "engine_id", "error", "pp_size", "state", "tp_size")

    def __init__(self, endpoints: Sequence[str], pp_size: int) -> None:
        self.endpoints = tuple(endpoints)
        self.pp_size = pp_size
        self.tp_size = len(self.endpoints) // pp_size
        self.engine_id = ""  # known once ready
        self.dp_rank = 0
        self.error: str | None = None
        self.state = GroupState.CONNECTING

    @property
    def ready(self) -> bool:
        return self.state is GroupState.READY

    @property
    def failed(self) -> bool:
        return self.state is GroupState.FAILED

    def __str__(self) -> str:
        if not self.engine_id:
            return f"prefill group at {', '.join(self.endpoints)}"
        return f"{self.engine_id}" + (f" (DP group {self.dp_rank})" if self.dp_rank else "")

    def __repr__(self) -> str:
        return f"<PrefillGroup {self} {self.state.value}>"


@dataclass(eq=False)
class _Connect:
    """One connect() under way: its handle, the pure machine, and the links it opened."""

    group: PrefillGroup
    machine: GroupConnect
    route: DecodeRoute
    links: dict[tuple[int, int], _Link] = field(default_factory=dict)


RETRY_FIRST_S = 0.2  # a refused re-registration or reconnect waits this long, doubling up to...
RETRY_MAX_S = 5.0
# connecting again to a rank this worker is registered with closes the old link first; the
# prefill rank refuses the new registration until it saw that connection go, so a refusal then
# is retried this often (waiting TAKEOVER_FIRST_S, doubling), inside the handshake deadline
TAKEOVER_TRIES = 6
TAKEOVER_FIRST_S = 0.05
PREFILL_MAX_MESSAGE = 1 << 20
"""ZMQ_MAXMSGSIZE of a link's socket: a prefill rank sends Hello, RegisterAck, TransferStatus
and AbortAck over it, each a few hundred bytes (a reason text at most a few KiB); a larger
frame disconnects the prefill rank (its rooms fail as for a lost peer) before it is buffered."""


@dataclass(eq=False)
class _Link:
    """The control socket to one prefill rank, its connection machine, and the name of the
    windows onto this rank's memory that this link's registration gave the prefill rank."""

    sock: zmq.Socket[Any]
    conn: DecodeConnection
    key: str
    monitor: zmq.Socket[Any] | None = None
    retry_at: float | None = None  # a refused (re)registration is tried again from then on
    backoff_s: float = RETRY_FIRST_S
    revoked: bool = False  # its windows were revoked: no new room until it registered again
    transport_up: bool = False  # its TCP connection was established at least once (the monitor)
    takeover_tries: int = 0  # its first registration, refused while the link it replaces closed
    register_again_at: float | None = None  # ... is sent again from then on


@dataclass
class DecodeStats:
    rooms_ok: int = 0
    rooms_failed: int = 0
    engine_notifications: int = 0
    control_notifications: int = 0
    messages_out: int = 0  # every message sent: Hello, RegisterInfo, TransferRequest, Abort
    requests_sent: int = 0  # TransferRequests among them
    revocations: int = 0  # prefill ranks cut off this rank's memory
    unrevocable: int = 0  # prefill ranks that could not be revoked (their rooms stay quarantined)
    reclaimed: int = 0  # quarantined rooms whose slots the engine took back itself (reclaim())
    peers_lost: int = 0  # control connections lost (closed, or silent past peer_timeout_s)
    reconnects: int = 0  # lost links handshaken again
    reconnect_error: str = ""  # why the last background reconnect failed (it is retried)
    versions: list[str] = field(default_factory=list)  # agreed protocol version per prefill link
    # failed rooms with their reason, and anything odd: bounded, the newest and a total
    failures: FailureLog = field(default_factory=FailureLog)
    peer_errors: int = 0  # messages of a peer whose handling raised: that peer's rooms failed
    scattered_pages: int = 0  # KV pages copied out of the receive staging buffer into place
    scattered_bytes: int = 0
    scatter_s: float = 0.0  # time in those copies


class DecodeWorker:
    """One decode rank. Not thread-safe: call it from one thread (or use :class:`.WorkerThread`).

    ``backend`` and ``context`` as for :class:`~.prefill.PrefillWorker`. ``copier``: copies staged
    KV pages out of the receive staging buffer (``DecodeConfig.scatter_bytes``) into place; the
    default copies host memory (a KV cache in device memory takes a device copier, or no
    decode-side scatter is offered).
    """

    def __init__(
        self,
        config: DecodeConfig,
        memory: RankMemory,
        *,
        backend: Backend | None = None,
        context: zmq.Context[Any] | None = None,
        on_finished: OnFinished | None = None,
        on_slots_released: OnSlotsReleased | None = None,
        on_connected: OnConnected | None = None,
        copier: Copier | None = None,
    ) -> None:
        if memory.kv is None:
            raise ConfigError("a decode rank's memory needs a KV pool (memory.kv is None)")
        self.config = config
        self.memory = memory
        self.auth = resolve(config)  # None: an unauthenticated control plane, as explicitly asked
        identity = Identity(wire.Role.DECODE, config.engine_id, config.rank, config.model, config.versions)
        self.hello = identity.hello()
        self.backend, self._owns_backend = owned_backend(config, "decode", backend)
        try:
            register_memory(self.backend, memory, config.rank)
            # after the planner's regions: every peer gets a revocable window onto it too
            self._scatter = ScatterReceiver(self.backend, memory, config.scatter_bytes, copier)
        except BaseException:
            if self._owns_backend:
                self.backend.close()
            raise
        self._ctx: zmq.Context[Any] = context if context is not None else zmq.Context()
        self._owns_ctx = context is None
        self.session = DecodeSession(
            config.room_timeout_s,
            fence_timeout_s=config.fence_timeout_s,
            status_completes=not self.backend.notifications_reliable,
        )
        self.on_finished = on_finished
        self.on_slots_released = on_slots_released
        self.stats = DecodeStats()
        self.endpoint = config.advertised()
        self._page_size = memory.kv.page_size
        self._links: dict[PeerRef, _Link] = {}  # registered links (ready, or registering again)
        self._connecting: list[_Link] = []  # links whose handshake runs (inside connect())
        self._reconnecting: list[_Link] = []  # lost links handshaking again in the background
        self._monitors: dict[zmq.Socket[Any], _Link] = {}
        self._window_keys: dict[PeerRef, list[str]] = {}  # every key whose windows a peer may hold
        self._settling: list[tuple[float, PeerRef]] = []  # revocations settling, by time
        self._lost_links: list[_Link] = []  # lost links waiting for their reconnect to be due
        self._refused: list[tuple[int, Failure]] = []  # rooms refused by start_room, reported by step()
        self._next_key = 0
        self._groups: dict[tuple[str, int], tuple[PrefillGroup, GroupRoute]] = {}
        self._connects: list[_Connect] = []  # connect()s under way
        self._connect_of: dict[_Link, tuple[_Connect, tuple[int, int]]] = {}  # their links
        # registered links a connect()'s link closed before registering with the same rank (a
        # prefill rank takes a registration under a live connection's rank only once it is gone):
        # peer -> (the old link, the link replacing it); its rooms fail once the new one is ready
        self._replaced: dict[PeerRef, tuple[_Link, _Link]] = {}
        self._held: dict[int, _Connect] = {}  # rooms waiting for their group to be ready
        # rooms waiting for a rank of a ready group to register again after its revocation
        self._awaiting: dict[int, tuple[RequestIndices, PrefillGroup, float]] = {}
        self.on_connected = on_connected
        self.poller = zmq.Poller()  # the driver may register its own sockets or fds here too
        self._wake_fds = self.backend.wakeup_fds() if self.backend.wakes_on_notification else ()
        for fd in self._wake_fds:  # the engine says when a notification may have arrived
            self.poller.register(fd, zmq.POLLIN)
        self._backoff = PollBackoff()
        self._closed = False

    # ------------------------------------------------------------------ handshake

    def connect(
        self, endpoints: Sequence[str], *, prefill_pp: int = 1, timeout_s: float | None = None
    ) -> PrefillGroup:
        """Start the handshake with the prefill ranks of one prefill engine's DP group this rank
        reads from; returns its :class:`PrefillGroup` at once, ``CONNECTING``.

        ``endpoints`` lists every rank of that group, PP stage major: ``endpoints[pp_rank *
        tp_size + tp_rank]`` (with one stage, simply by TP rank); ``prefill_pp`` is its number
        of PP stages. Only the ranks the routing names are contacted, one after another, by
        :meth:`step`, which keeps serving every other link and room meanwhile. The group becomes
        ``READY`` or ``FAILED`` (its ``error`` names the cause: a refusal, a rank that says it
        is another rank, of another engine or DP group, or the handshake timeout) in a later
        ``step()``, which calls ``on_connected(group)``. Rooms may be started on it at once
        (see :meth:`start_room`). Connecting again to a group replaces its links once ready.
        :meth:`wait_ready` blocks until the outcome, for simple callers.
        """
        if prefill_pp < 1 or not endpoints or len(endpoints) % prefill_pp:
            raise ConfigError(f"{len(endpoints)} endpoints do not split into {prefill_pp} PP stages")
        prefill_tp = len(endpoints) // prefill_pp
        route = self._route(prefill_tp, prefill_pp)
        timeout = self.config.handshake_timeout_s if timeout_s is None else timeout_s
        specs = [
            LinkSpec((p, st), endpoints[st * prefill_tp + p], Expected(prefill_tp, p, prefill_pp, st))
            for p in route.prefill_ranks
            for st in route.prefill_pp_stages
        ]
        machine = GroupConnect(specs, time.monotonic() + timeout, HeldLayers.of(self.memory))
        c = _Connect(PrefillGroup(endpoints, prefill_pp), machine, route)
        self._connects.append(c)
        try:
            self._on_group(c, c.machine.start())
        except BaseException:
            self._abandon(c)
            raise
        return c.group

    def wait_ready(self, group: PrefillGroup) -> PrefillGroup:
        """Step this worker until ``group`` is ready (returned) or failed (:class:`HandshakeError`
        with the cause); bounded by the handshake timeout given to :meth:`connect`. Only from the
        thread that steps the worker."""
        while group.state is GroupState.CONNECTING:
            self.step(20)
        if group.failed:
            raise HandshakeError(group.error or f"connecting to {group} failed")
        return group

    def _on_group(self, c: _Connect, actions: list[GroupAction]) -> None:
        """Carry out what a group's connect machine asks."""
        for a in actions:
            if isinstance(a, OpenLink):
                try:
                    link = self._open(a.spec.endpoint, c.machine.deadline, a.spec.expected)
                except HandshakeError as exc:
                    if not c.links:  # the first rank, inside connect(): raised to its caller
                        raise
                    self._on_group(c, c.machine.on_link_refused(a.spec.key, str(exc)))
                    continue
                c.links[a.spec.key] = link
                self._connect_of[link] = (c, a.spec.key)
            elif isinstance(a, GroupConnected):
                self._connected(c, a.identity)
            elif isinstance(a, GroupFailed):
                self._abandon(c)
                c.group.error = a.reason
                c.group.state = GroupState.FAILED
                if self.on_connected is not None:
                    self.on_connected(c.group)
            elif isinstance(a, StartHeld):
                self._held.pop(a.room, None)
                self._start_now(a.room, a.indices, c.group, a.deadline)
            else:
                assert isinstance(a, FailHeld)
                self._held.pop(a.room, None)
                self._refuse_room(a.room, a.failure)

    def _abandon(self, c: _Connect) -> None:
        """A connect that failed: close the links it opened."""
        if c in self._connects:
            self._connects.remove(c)
        for link in c.links.values():
            self._connect_of.pop(link, None)
            if link in self._connecting:
                self._drop(link)
            peer = link.conn.peer
            if peer is not None and peer in self._replaced and self._replaced[peer][1] is link:
                # the link it closed to register is gone too: its rooms fail, it reconnects
                old, _ = self._replaced.pop(peer)
                self.stats.peers_lost += 1
                why = f"{peer}: its link was closed for a new connection to it, which failed"
                self._run(self.session.on_peer_lost(peer, why))
                self._schedule_reconnect(old)

    def _connected(self, c: _Connect, identity: GroupIdentity) -> None:
        """Every rank of a connect registered: its links replace older ones to those ranks."""
        self._connects.remove(c)
        links: dict[tuple[int, int], tuple[PeerRef, int, bool]] = {}
        for key, link in c.links.items():
            self._connect_of.pop(link, None)
            conn = link.conn
            assert conn.peer is not None and conn.position is not None and conn.version is not None
            old = self._links.pop(conn.peer, None)
            replaced = self._replaced.pop(conn.peer, None)
            if old is None and replaced is not None:  # closed when this link registered
                old = replaced[0]
            for stale in [r for r in self._reconnecting if r.conn.endpoint == conn.endpoint]:
                self._drop(stale)  # this connect replaces a background reconnect of that rank
            self._lost_links = [r for r in self._lost_links if r.conn.endpoint != conn.endpoint]
            self._connecting.remove(link)
            self._links[conn.peer] = link
            self._window_keys.setdefault(conn.peer, []).append(link.key)
            if old is not None:  # connecting again (a restarted prefill engine): the old link is gone
                self._drop(old)
                self._run(self.session.on_peer_lost(conn.peer))
            self.stats.versions.append(f"{conn.peer}={conn.version[0]}.{conn.version[1]}")
            links[key] = (conn.peer, conn.position.sender_rank, self._fences(conn.version))
        g = c.group
        g.engine_id, g.dp_rank = identity.engine_id, identity.dp_rank
        self._groups[(g.engine_id, g.dp_rank)] = (g, GroupRoute.of(c.route, g.pp_size, links))
        g.state = GroupState.READY
        if self.on_connected is not None:
            self.on_connected(g)

    def _fences(self, version: tuple[int, int]) -> bool:
        """Whether a prefill rank's Failed status and AbortAck mean its writes stopped: from 1.3,
        on an engine whose reports are true (Mooncake's are not: its ranks are revoked instead)."""
        return version >= FENCE_SINCE and self.backend.final_states_fence

    def _local(self, key: str) -> DecodeLocal:
        """What this rank says and registers over one link: the engine's metadata with the windows
        named ``key`` (opened on first use, new ones after a revocation)."""
        md = self.backend.local_metadata(for_peer=key)
        return DecodeLocal(
            self.hello,
            self.memory,
            self.endpoint,
            self.backend.name,
            md.agent_name,
            md.agent_metadata,
            md.region_descs,
            self._scatter.advertised,
        )

    def _open(
        self, endpoint: str, deadline: float, expected: Expected | None, into: list[_Link] | None = None
    ) -> _Link:
        """A new socket and handshake to ``endpoint`` (for connect(), or a background reconnect
        into ``into``), with heartbeats and a monitor that reports the connection's loss."""
        self._next_key += 1
        key = f"{endpoint}#{self._next_key}"  # each link's windows are its own, revoked apart
        conn = DecodeConnection(self._local(key), endpoint, deadline, expected)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, PREFILL_MAX_MESSAGE)
        # ZMTP heartbeats: a peer that answers none within peer_timeout_s (stopped, cut off,
        # its host gone) has its connection closed, which the monitor reports as a loss
        timeout_ms = max(1, int(self.config.peer_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, timeout_ms // 4))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if self.auth is not None:
            connect_curve(sock, self.auth)
        link = _Link(sock, conn, key)
        (self._connecting if into is None else into).append(link)
        self.poller.register(sock, zmq.POLLIN)
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | HANDSHAKE_EVENTS
        link.monitor = sock.get_monitor_socket(events)
        self._monitors[link.monitor] = link
        self.poller.register(link.monitor, zmq.POLLIN)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise HandshakeError(f"cannot connect to {endpoint!r}: {exc}") from exc
        self._handle(link, conn.start())
        return link

    def _drop(self, link: _Link) -> None:
        if link.sock.closed:  # dropped already (a link closed for its replacement)
            return
        for pending in (self._connecting, self._reconnecting):
            if link in pending:
                pending.remove(link)
        if link.monitor is not None:
            self._monitors.pop(link.monitor, None)
            self.poller.unregister(link.monitor)
            link.sock.disable_monitor()
            link.monitor.close(0)
            link.monitor = None
        self.poller.unregister(link.sock)
        link.sock.close(0)
        self._scatter.forget(link.key)  # rooms that reserved through it keep their own planner

    def _route(self, prefill_tp: int, prefill_pp: int) -> DecodeRoute:
        kv = self.memory.kv
        assert kv is not None
        r = self.config.rank
        return route_decode_rank(
            prefill_tp, r.tp_size, r.tp_rank, is_mla=kv.is_mla,
            prefill_pp=prefill_pp, decode_pp=r.pp_size, decode_pp_rank=r.pp_rank,
            sharded_state=has_tp_sharded_state(self.memory),
        )  # fmt: skip

    # ------------------------------------------------------------------ rooms

    def start_room(
        self, room: int, indices: RequestIndices, prefill: PrefillGroup, *, timeout_s: float | None = None
    ) -> None:
        """Ask ``prefill`` (a group :meth:`connect` returned) for ``room`` into ``indices``.

        Raises :class:`DuplicateRoomError` if the room id is in use (live, quarantined, waiting
        for its group or just finished) and :class:`IndicesError` for indices that do not fit
        this rank's memory, both before anything is sent. ``timeout_s`` overrides the room
        timeout. A group still connecting holds the room inside its deadline: it starts once the
        group is ready, or fails (``on_finished`` Failed: ``handshake`` with the cause, or
        ``timeout`` at its deadline; nothing was sent, its slots come back at once). A failed
        group's rooms fail the same way from the next ``step()``.
        """
        room = check_room(room)
        self.check_free(room)
        if not isinstance(prefill, PrefillGroup):
            raise ConfigError(f"start_room takes the PrefillGroup connect() returned, got {prefill!r}")
        self._check_indices(indices)
        timeout = self.config.room_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        if prefill.ready:
            self._start_now(room, indices, prefill, deadline)
            return
        c = next((c for c in self._connects if c.group is prefill), None)
        if c is None and not prefill.failed:
            raise ConfigError(f"{prefill} was not connected by this worker; call connect() first")
        if c is None:
            self._refuse_room(room, Failure(FailureKind.HANDSHAKE, prefill.error or f"{prefill} failed"))
            return
        self._held[room] = c
        self._on_group(c, c.machine.hold(room, indices, deadline))

    def _start_now(self, room: int, indices: RequestIndices, prefill: PrefillGroup, deadline: float) -> None:
        known = self._groups.get((prefill.engine_id, prefill.dp_rank))
        if known is None:
            raise ConfigError(f"not connected to prefill {prefill}; call connect() first")
        plans, requests = known[1].plan(room, indices)
        unready = [req.peer for req in requests if not self._usable(req.peer)]
        if unready and all(peer in self._links for peer in unready):
            # alive, registering again with new windows after a revocation (milliseconds, or a
            # back-off while its old transfers stop): the room waits inside its deadline
            self._awaiting[room] = (indices, prefill, deadline)
            return
        if unready:
            # nothing is sent: no writer can touch the slots, which are the engine's again at once
            why = (
                f"prefill rank {unready[0]} is not registered with this rank "
                "(lost, or revoked and registering again)"
            )
            self._refuse_room(room, Failure(FailureKind.PEER_GONE, why))
            return
        now = time.monotonic()
        r = self.session.start_room(room, plans, now, deadline - now)
        senders = {p.peer: p.sender for p in plans}
        for req in requests:
            link = self._links[req.peer]
            scatter = self._reserve(room, senders[req.peer], req, link)
            self._send(link, link.conn.transfer_request(req, scatter), link.conn.version)
            self.stats.requests_sent += 1
        r.on_requests_sent()

    def _reserve(self, room: int, sender: int, req: SendRequest, link: _Link) -> tuple[int, int, int] | None:
        """A receive staging range for the room's first pages from this prefill rank (offset,
        bytes per page, pages), if both sides scatter; None: it writes them in place."""
        conn = link.conn
        heads, position = conn.prefill_heads, conn.position
        if req.is_dummy or heads is None or position is None or not len(req.indices.kv_pages):
            return None
        planner = self._scatter.planner(link.key, position, heads, conn.prefill_kv_layers)
        if planner is None:
            return None
        r = self._scatter.reserve(room, sender, req.peer, planner, req.indices.kv_pages)
        return None if r is None else (r.offset, r.page_bytes, r.pages)

    def _start_awaiting(self, now: float) -> None:
        """Rooms waiting for ranks to register again: sent once they are, failed at their
        deadline (``timeout``) or when a rank is lost meanwhile (``peer_gone``, from the retry)."""
        for room, (indices, group, deadline) in list(self._awaiting.items()):
            if now >= deadline:
                del self._awaiting[room]
                why = "a prefill rank of the room was registering again (revoked) until its deadline"
                self._refuse_room(room, Failure(FailureKind.TIMEOUT, why))
                continue
            known = self._groups.get((group.engine_id, group.dp_rank))
            peers = [] if known is None else [s.peer for s in known[1].senders]
            if all(self._usable(p) for p in peers) or any(p not in self._links for p in peers):
                del self._awaiting[room]
                self._start_now(room, indices, group, deadline)

    def _usable(self, peer: PeerRef) -> bool:
        link = self._links.get(peer)
        return link is not None and link.conn.ready and not link.revoked

    def _refuse_room(self, room: int, failure: Failure) -> None:
        # reported from the next step(), like every other room's end: the caller records the
        # room only once start_room returned
        self._refused.append((room, failure))

    def _report_refused(self) -> None:
        refused, self._refused = self._refused, []
        for room, failure in refused:
            self._refused_now(room, failure)

    def _refused_now(self, room: int, failure: Failure) -> None:
        self.stats.rooms_failed += 1
        self.stats.failures.append(f"room {room}: {failure.reason}")
        if self.on_finished is not None:
            self.on_finished(room, Status.FAILED, failure)
        if self.on_slots_released is not None:
            self.on_slots_released(room)

    def peer_lost(self, engine_id: str, rank: int | None = None, reason: str = "") -> None:
        """Tell the worker that prefill ranks are gone (e.g. their discovery lease expired):
        ``rank`` of ``engine_id``, or every rank of it. Handled like a closed connection."""
        for peer, link in list(self._links.items()):
            if peer.engine_id == engine_id and (rank is None or peer.rank == rank):
                # not reconnected: whoever said it is gone says when it is back (connect())
                self._lost(link, reason or f"{peer} left the registry", reconnect=False)

    def _check_indices(self, indices: RequestIndices) -> None:
        if not isinstance(indices, RequestIndices):
            raise IndicesError(f"start_room takes RequestIndices, got {type(indices).__name__}")
        n = len(self.memory.state)
        if indices.state and len(indices.state) != n:
            raise IndicesError(f"RequestIndices.state: {len(indices.state)} entries for {n} state components")
        for ci, idx in enumerate(indices.state):
            c = self.memory.state[ci]
            if idx is not None and c.indexing is Indexing.SLOT and len(idx) not in (0, 1):
                raise IndicesError(
                    f"RequestIndices.state[{ci}] ({c.kind.value}) is a slot component: "
                    f"one index, got {len(idx)}"
                )
        if indices.decode_prefix_len % self._page_size:
            raise IndicesError(
                f"RequestIndices.decode_prefix_len {indices.decode_prefix_len} is not a multiple of the "
                f"page size {self._page_size}"
            )

    def check_free(self, room: int) -> None:
        """Raise :class:`DuplicateRoomError` if ``room`` is live, quarantined, waiting for its group or
        just finished here (call it before allocating a request's memory; :meth:`start_room`
        checks again)."""
        if check_room(room) in self._held or room in self._awaiting:
            raise DuplicateRoomError(room, "waiting for its prefill group on this decode rank")
        self.session.check_free(room)

    def abort(self, room: int, reason: str = "aborted by the decode engine") -> None:
        """Give up on ``room``: every prefill rank is told to stop; ``on_finished`` reports it
        Failed now and ``on_slots_released`` once every writer fenced (a room still waiting
        for its group fails at once: nothing was sent for it). A room this rank never started
        (or one already over) is left alone: nothing is reported, since no slot of it was ever
        handed to a writer; to tell prefill not to wait for it, :meth:`decline` it."""
        if self._awaiting.pop(check_room(room), None) is not None:  # nothing was sent for it
            self._refuse_room(room, Failure(FailureKind.ABORTED, reason))
            return
        c = self._held.pop(room, None)
        if c is not None and c.machine.release(room):  # nothing was sent for it
            self._refuse_room(room, Failure(FailureKind.ABORTED, reason))
            return
        self._run(self.session.abort(check_room(room), Failure(FailureKind.ABORTED, reason)))

    def decline(
        self, room: int, prefill: PrefillGroup, reason: str = "declined by the decode engine"
    ) -> None:
        """Tell ``prefill`` that this rank will never ask for ``room`` (the engine dropped the
        request while it waited, e.g. for memory): every prefill rank that would feed this rank
        fails its room now (``on_released`` there, with ``ABORTED``) instead of at the room
        timeout, and refuses a later request for it. No callback fires here: nothing was started.
        A room that is live on this rank is aborted instead (:meth:`abort`)."""
        room = check_room(room)
        if room in self.session.rooms or room in self._held or room in self._awaiting:
            self.abort(room, reason)
            return
        if not isinstance(prefill, PrefillGroup):
            raise ConfigError(f"decline takes the PrefillGroup connect() returned, got {prefill!r}")
        if not prefill.ready:
            raise ConfigError(f"{prefill} is not connected (yet): prefill cannot have seen the room")
        known = self._groups.get((prefill.engine_id, prefill.dp_rank))
        if known is None:
            raise ConfigError(f"not connected to prefill {prefill}; call connect() first")
        failure = Failure(FailureKind.ABORTED, reason)
        for peer in known[1].peers:
            link = self._links.get(peer)
            if link is not None and link.conn.ready:
                self._send(link, link.conn.abort(room, failure), link.conn.version)

    def status(self, room: int) -> Status | None:
        """The room's status here (live, quarantined, waiting for its group or recently ended);
        None if never seen."""
        if room in self._held or room in self._awaiting:
            return Status.BOOTSTRAPPING
        return self.session.status(room)

    def reclaim(self, room: int) -> bool:
        """Forget quarantined ``room``: the engine takes its slots back on its own authority.

        For a writer that can never fence: a prefill rank that died while its memory could not be
        revoked (``stats.unrevocable``: engine-owned memory) keeps its rooms quarantined for good,
        because only the engine can know when the writer is gone for good (its host is down, its
        process is confirmed dead) or decide to free the slots at a timeout of its own, as
        SGLang's deferred release does. From this call on a late write of that writer is the
        engine's risk. ``on_slots_released`` is not called (the engine has the slots already);
        the room's id stays unusable while late messages for it may come. Returns False when the
        room is not quarantined (unknown, or its slots were released already); raises
        :class:`ConfigError` for a live room (``abort`` it first).
        """
        if room in self.session.rooms or room in self._held or room in self._awaiting:
            raise ConfigError(f"room {room} is still live on this rank: abort it before reclaiming its slots")
        r = self.session.on_reclaimed(room)
        if r is None:
            return False
        self.stats.reclaimed += 1
        self._scatter.release(room, keep=r.unfenced())  # a late write may still land in those
        waiting = ", ".join(str(p) for p in r.unfenced()) or "none"
        text = f"room {room}: reclaimed by the engine before its writers fenced (waiting for: {waiting})"
        self.stats.failures.append(text)
        log.warning("%s", text)
        return True

    @property
    def scatter_in_use(self) -> int:
        """Bytes of the receive staging buffer reserved by rooms whose slots are not released."""
        return self._scatter.arena.in_use

    @property
    def quarantined_rooms(self) -> tuple[int, ...]:
        """Failed rooms whose destination slots are not released yet (a writer has not fenced)."""
        return tuple(self.session.quarantined)

    @property
    def unready_peers(self) -> tuple[PeerRef, ...]:
        """Prefill ranks of connected groups that take no new room now: lost (reconnecting in
        the background), or revoked and not registered again yet."""
        peers = {s.peer for _, route in self._groups.values() for s in route.senders}
        return tuple(sorted((p for p in peers if not self._usable(p)), key=str))

    @property
    def stray_completions(self) -> int:
        """Completions that arrived for rooms already over (late, harmless, counted)."""
        return self.session.stray_completions

    # ------------------------------------------------------------------ the loop

    def step(self, timeout_ms: int) -> dict[Any, int]:
        """Poll once: control messages, engine notifications, deadlines. Returns poll events.

        Waits at most ``timeout_ms`` (0: never blocks)."""
        if self._refused:
            self._report_refused()
            timeout_ms = 0
        # with rooms live, engine notifications have nothing to wait on: look again soon
        if self.session.rooms and not self._wake_fds:
            events = self._backoff.poll(self.poller, timeout_ms / 1000)
        else:  # an engine with wake-ups is waited on (bounded: a lost wake-up costs that)
            events = dict(
                self.poller.poll(min(timeout_ms, WAKEUP_FALLBACK_MS) if self.session.rooms else timeout_ms)
            )
        if self._wake_fds and any(events.get(fd) for fd in self._wake_fds):
            self.backend.clear_wakeups()  # before receiving: a later notification wakes again
        for link in [*self._links.values(), *self._connecting, *self._reconnecting]:
            if events.get(link.sock):
                self._drain(link)
        for mon, link in list(self._monitors.items()):
            if events.get(mon):
                self._on_monitor(mon, link)
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
            try:
                self._on_event(completion(msg))
            except Exception as exc:
                self._peer_error(f"engine notification from {n.peer_agent_name}", None, exc)
        now = time.monotonic()
        for link in [*self._connecting, *self._reconnecting]:
            self._handle(link, link.conn.on_tick(now))
        for link in list(self._connecting):
            if link.register_again_at is not None and now >= link.register_again_at:
                link.register_again_at = None
                self._handle(link, link.conn.register_again())
        for c in list(self._connects):
            self._on_group(c, c.machine.on_tick(now))
        while self._settling and self._settling[0][0] <= now:
            _, peer = self._settling.pop(0)
            self._run(self.session.on_revoked(peer))
            again = self._links.get(peer)
            if again is not None:  # still connected: it registers again, with new windows (only
                # now, so that no room of the new registration can be taken for a revoked one)
                self._window_keys.setdefault(peer, []).append(again.key)
                self._handle(again, again.conn.reregister(self._local(again.key)))
        self._retry(now)
        if self._awaiting:
            self._start_awaiting(now)
        if self.session.rooms or self.session.quarantined:
            self._run(self.session.on_tick(now))
        if self._refused:  # held rooms that failed in this step
            self._report_refused()
        return events

    # ------------------------------------------------------------------ losses and revocations

    def _on_monitor(self, mon: zmq.Socket[Any], link: _Link) -> None:
        lost = False
        while link.monitor is mon:  # a refusal handled below may fail the connect and drop the link
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                break
            lost = lost or event["event"] == zmq.EVENT_DISCONNECTED
            link.transport_up = link.transport_up or event["event"] == zmq.EVENT_CONNECTED
            if event["event"] & HANDSHAKE_EVENTS:
                self._handshake_refused(link, event)
        if lost and link in self._links.values():
            self._lost(link, f"{link.conn.peer}: control connection lost (closed, or no heartbeat answered "
                             f"within {self.config.peer_timeout_s}s)")  # fmt: skip
        elif lost and link in self._reconnecting:
            self._drop(link)  # it dropped again mid-handshake: start over after a pause
            self._schedule_reconnect(link)

    def _handshake_refused(self, link: _Link, event: Mapping[str, Any]) -> None:
        """The socket refused the ZMTP handshake with a prefill rank (keys, one side without
        CURVE): logged; a registration handshake in progress is refused with it at once."""
        text = refusal_text(event["event"], event["value"], link.conn.endpoint, self.auth is not None)
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            log.debug("%s", text)  # the peer hung up mid-handshake (a reset, a restart): it retries
            return
        self.stats.failures.append(text)
        log_refusal(text)
        self._handle(link, link.conn.transport_refused(text))

    def _lost(self, link: _Link, reason: str, reconnect: bool = True) -> None:
        """A registered prefill rank is gone: its rooms fail now and it is revoked (a process that
        stopped resumes, a closed connection's buffered bytes still land); with ``reconnect`` its
        endpoint is handshaken again in the background."""
        peer = link.conn.peer
        assert peer is not None
        if self._links.get(peer) is link:
            del self._links[peer]
        self._drop(link)
        self.stats.peers_lost += 1  # its rooms' failures name it; a loss alone is no failure
        self._run(self.session.on_peer_lost(peer, reason))
        if reconnect:
            self._schedule_reconnect(link)

    def _schedule_reconnect(self, old: _Link) -> None:
        """Handshake with ``old``'s endpoint again once its back-off passed (see :meth:`_retry`)."""
        old.retry_at = time.monotonic() + old.backoff_s
        self._lost_links.append(old)

    def _retry(self, now: float) -> None:
        """Registrations refused after a revocation, and lost links, are tried again when due."""
        for link in list(self._links.values()):
            due = link.retry_at is not None and now >= link.retry_at
            if link.conn.state is DecodeConnState.RETRY and due:
                link.retry_at = None
                self._handle(link, link.conn.reregister(self._local(link.key)))
        for old in [o for o in self._lost_links if o.retry_at is not None and now >= o.retry_at]:
            self._lost_links.remove(old)
            deadline = now + self.config.handshake_timeout_s
            try:
                new = self._open(old.conn.endpoint, deadline, old.conn.expected, into=self._reconnecting)
            except HandshakeError as exc:
                self.stats.reconnect_error = f"{old.conn.endpoint}: {exc}"
                old.backoff_s = min(RETRY_MAX_S, old.backoff_s * 2)
                self._schedule_reconnect(old)
                continue
            new.backoff_s = old.backoff_s

    def _revoke(self, peer: PeerRef) -> None:
        """Cut ``peer`` off this rank's memory (every window any of its links was given)."""
        keys = self._window_keys.get(peer, [])
        blockers = [why for why in (self.backend.revocation_blocker(k) for k in keys) if why]
        if not keys or blockers:
            why = blockers[0] if blockers else "no windows were published to it"
            self.stats.unrevocable += 1
            self.stats.failures.append(f"{peer} cannot be revoked, its rooms stay quarantined: {why}")
            self._run(self.session.on_unrevocable(peer, why))
            return
        settles = time.monotonic()
        for key in keys:
            settles = max(settles, self.backend.revoke(key).settles_at)
        self._window_keys[peer] = []
        self.stats.revocations += 1
        self._settling.append((settles, peer))
        self._settling.sort(key=lambda t: t[0])
        link = self._links.get(peer)
        if link is not None:
            link.revoked = True
        # its live rooms fail now: what it writes from here on goes nowhere
        self._run(self.session.on_peer_lost(peer, f"{peer}'s access to this rank's memory was revoked"))

    def _drain(self, link: _Link) -> None:
        while not link.sock.closed:  # a refusal in the handshake closes it (a failed connect)
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                try:
                    msg = wire.decode(frames)
                except wire.WireError as exc:
                    self._handle(link, link.conn.undecodable(str(exc)))
                    continue
                self._handle(link, link.conn.receive(msg))
            except Exception as exc:
                self._peer_error(f"message from prefill {link.conn.peer}", link.conn.peer, exc)

    def _peer_error(self, what: str, peer: PeerRef | None, exc: Exception) -> None:
        """Handling ``what`` raised: the rooms of that peer fail as for a lost peer, the error
        is logged and counted, and every other link and room keeps going."""
        self.stats.peer_errors += 1
        text = f"{what} failed: {type(exc).__name__}: {exc}"
        self.stats.failures.append(text)
        log.warning("%s", text, exc_info=exc)
        if peer is not None:
            self._run(self.session.on_peer_lost(peer))

    def _send(self, link: _Link, msg: wire.Message, version: tuple[int, int] | None) -> None:
        # numpy declares ndarray a buffer (its side frames) only from Python 3.12 on
        link.sock.send_multipart(wire.encode(msg, version), copy=False)  # type: ignore[arg-type]
        self.stats.messages_out += 1

    def _handle(self, link: _Link, events: list[DecodeEvent]) -> None:
        for e in events:
            if isinstance(e, Send):
                if isinstance(e.message, wire.RegisterInfo) and link in self._connect_of:
                    self._close_replaced(link)
                self._send(link, e.message, e.version)
            elif isinstance(e, Completed):
                self.stats.control_notifications += 1
                self._on_event(e)
            elif isinstance(e, Ready):
                pending = self._connect_of.get(link)
                if pending is not None:  # a rank of a connect() under way
                    pos = e.position
                    identity = GroupIdentity(e.peer.engine_id, pos.dp_rank, pos.tp_size, pos.pp_size)
                    actions = pending[0].machine.on_link_ready(pending[1], identity, e.layers)
                    self._on_group(pending[0], actions)
                else:
                    self._on_ready(link, e)
            elif isinstance(e, Refused):
                pending = self._connect_of.get(link)
                if pending is not None and self._takeover_retry(link, pending[0]):
                    continue  # the prefill rank has not seen the replaced link go yet
                if pending is not None:
                    reason = e.reason
                    if not link.transport_up and link.monitor is not None:
                        self._on_monitor(link.monitor, link)  # events not polled yet
                    if not link.transport_up:
                        reason += (
                            " (no TCP connection to it was ever established: nothing listens there, "
                            "or it is not reachable from this host)"
                        )
                    self._on_group(pending[0], pending[0].machine.on_link_refused(pending[1], reason))
                elif link in self._reconnecting:
                    self.stats.reconnect_error = f"{link.conn.endpoint}: {e.reason}"
                    self._drop(link)
                    link.backoff_s = min(RETRY_MAX_S, link.backoff_s * 2)
                    self._schedule_reconnect(link)
            else:
                self._on_event(e)
                if link.conn.state is DecodeConnState.RETRY and link.retry_at is None:
                    link.retry_at = time.monotonic() + link.backoff_s
                    link.backoff_s = min(RETRY_MAX_S, link.backoff_s * 2)

    def _close_replaced(self, link: _Link) -> None:
        """A connect()'s ``link`` is about to register with a rank this worker is registered with
        on another link: that link closes first (the prefill rank takes the new registration only
        once the old connection is gone). Its rooms fail when the new link is ready (as for any
        replaced link), or when the connect fails (and the old link reconnects)."""
        peer = link.conn.peer
        old = self._links.get(peer) if peer is not None else None
        if peer is None or old is None or old is link:
            return
        del self._links[peer]
        self._drop(old)
        self._replaced[peer] = (old, link)

    def _takeover_retry(self, link: _Link, c: _Connect) -> bool:
        """Whether ``link``'s refused first registration is sent again shortly: it closed the link
        it replaces (:meth:`_close_replaced`) and the prefill rank may not have seen it go yet."""
        peer = link.conn.peer
        if peer is None or peer not in self._replaced or self._replaced[peer][1] is not link:
            return False
        due = time.monotonic() + TAKEOVER_FIRST_S * 2**link.takeover_tries
        if link.takeover_tries >= TAKEOVER_TRIES or due >= c.machine.deadline:
            return False
        link.takeover_tries += 1
        link.register_again_at = due
        return True

    def _on_ready(self, link: _Link, e: Ready) -> None:
        """A registration was accepted: a link registering again after a revocation, or a lost
        link that reconnected (connect() takes its own links when their handshake ends)."""
        if link in self._reconnecting:
            self._reconnecting.remove(link)
            old = self._links.pop(e.peer, None)
            if old is not None:
                self._drop(old)
            self._links[e.peer] = link
            self._window_keys.setdefault(e.peer, []).append(link.key)
            self.stats.reconnects += 1
            self._update_fences(e.peer, e.version)
        if self._links.get(e.peer) is link:
            link.backoff_s = RETRY_FIRST_S
            link.revoked = False
            self.session.on_reregistered(e.peer)

    def _update_fences(self, peer: PeerRef, version: tuple[int, int]) -> None:
        """A reconnected rank may speak another version: its fence promise follows it."""
        for key, (group, route) in self._groups.items():
            if any(s.peer == peer for s in route.senders):
                senders = tuple(
                    replace(s, fences=self._fences(version)) if s.peer == peer else s for s in route.senders
                )
                self._groups[key] = (group, replace(route, senders=senders))

    def _on_event(self, e: DecodeEvent) -> None:
        if isinstance(e, Completed):
            if e.scatter_pages and not self._scatter_in(e):
                return
            self._run(
                self.session.on_notification(
                    e.room, e.sender, e.kind, e.chunk_id, e.is_last, e.component,
                    e.chunk_count, e.also_components, e.also_aux,
                )
            )  # fmt: skip
        elif isinstance(e, StatusReceived):
            self._run(self.session.on_status(e.room, e.sender, e.status, e.failure))
        elif isinstance(e, AbortAcked):
            self._run(self.session.on_abort_ack(e.room, e.sender))
        elif isinstance(e, Problem):
            self.stats.failures.append(e.text)

    def _scatter_in(self, e: Completed) -> bool:
        """Copy the staged pages a notification names into place; False (the room failed) when
        they cannot be: the parts are then not counted, so no Success covers unplaced bytes."""
        if e.room not in self.session.rooms:
            return True  # a late notification of an ended room: the session ignores it
        t0 = time.perf_counter()
        try:
            nbytes = self._scatter.scatter(e.room, e.sender, e.scatter_first, e.scatter_pages)
        except (ScatterRefused, ScatterGeometryError, CopyError, PlanError) as exc:
            why = f"staged KV pages from prefill rank {e.sender} cannot be placed: {exc}"
            self._run(self.session.abort(e.room, Failure(FailureKind.VALIDATION, why)))
            return False
        self.stats.scatter_s += time.perf_counter() - t0
        self.stats.scattered_pages += e.scatter_pages
        self.stats.scattered_bytes += nbytes
        return True

    def _run(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, RevokePeer):
                self._revoke(a.peer)
            elif isinstance(a, SendAbort):
                link = self._links.get(a.peer)
                if link is not None:
                    self._send(link, link.conn.abort(a.room, a.failure), link.conn.version)
            elif isinstance(a, ReleaseRoom):
                if a.status is Status.SUCCESS:
                    self.stats.rooms_ok += 1
                else:
                    self.stats.rooms_failed += 1
                    reason = a.failure.reason if a.failure is not None else "no reason given"
                    self.stats.failures.append(f"room {a.room}: {reason}")
                if self.on_finished is not None:
                    self.on_finished(a.room, a.status, a.failure)
            elif isinstance(a, ReleaseSlots):
                self._scatter.release(a.room)  # the room's writes stopped: its ranges are free too
                if self.on_slots_released is not None:
                    self.on_slots_released(a.room)

    def close(self) -> None:
        """Close every link (and the backend and context the worker made itself). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for link in [*self._links.values(), *self._connecting, *self._reconnecting]:
            self._drop(link)
        self._links.clear()
        self._connects.clear()
        self._connect_of.clear()
        self._replaced.clear()
        self._lost_links.clear()
        for fd in self._wake_fds:
            with contextlib.suppress(KeyError):
                self.poller.unregister(fd)
        if self._owns_backend:
            self.backend.close()
        if self._owns_ctx:
            self._ctx.term()

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
