"""A decode rank's links: one ZMQ DEALER per prefill rank it reads from, around the pure
:class:`~pdwire.runtime.session.decode_connection.DecodeConnection` of each and the
:class:`~pdwire.runtime.session.group_connect.GroupConnect` of each :meth:`DecodeLinks.connect`.

Everything about a link's life lives here: the handshake and registration, the monitor that
reports its loss, heartbeats, revocation of its windows and registering again with new ones,
the background reconnect of a lost link, and a connect() that replaces the links of a
restarted prefill engine. What a link says about rooms (completions, statuses, losses) is
handed to the rooms (:class:`~.decode_rooms.DecodeRooms`), which own the session.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdwire import wire
from pdwire.runtime.backends import Backend
from pdwire.runtime.config import ConfigError, DecodeConfig
from pdwire.runtime.control_auth import ControlAuth
from pdwire.runtime.planner import DecodeRoute, RankMemory, has_tp_sharded_state, route_decode_rank
from pdwire.runtime.session.actions import PeerRef
from pdwire.runtime.session.decode_connection import DecodeConnection, DecodeLocal, Expected
from pdwire.runtime.session.decode_session import DecodeSession
from pdwire.runtime.session.events import Completed, DecodeEvent, Ready, Refused, Send
from pdwire.runtime.session.failures import HandshakeError
from pdwire.runtime.session.group_connect import (
    FailHeld,
    GroupAction,
    GroupConnect,
    GroupConnected,
    GroupFailed,
    GroupIdentity,
    LinkSpec,
    OpenLink,
    StartHeld,
)
from pdwire.runtime.session.group_route import GroupRoute
from pdwire.runtime.session.hello import FENCE_SINCE
from pdwire.runtime.session.stage_layers import HeldLayers
from pdwire.runtime.session.states import DecodeConnState, GroupState
from pdwire.runtime.workers.curve import HANDSHAKE_EVENTS, connect_curve, report_refusal
from pdwire.runtime.workers.failure_log import FailureLog, log
from pdwire.runtime.workers.scatter import ScatterReceiver

if TYPE_CHECKING:
    from collections.abc import Callable

    from pdwire.runtime.workers.decode_rooms import DecodeRooms

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
    versions: list[str] = field(default_factory=list)  # agreed protocol version per prefill rank (newest)
    # failed rooms with their reason, and anything odd: bounded, the newest and a total
    failures: FailureLog = field(default_factory=FailureLog)
    peer_errors: int = 0  # messages of a peer whose handling raised: that peer's rooms failed
    scattered_pages: int = 0  # KV pages copied out of the receive staging buffer into place
    scattered_bytes: int = 0
    scatter_s: float = 0.0  # time in those copies
    leases_sent: int = 0  # Lease messages: rooms the engine still queues, renewed on a prefill rank
    declines_sent: int = 0  # rooms declined (never to be asked for), each told to its prefill group


@dataclass(eq=False)
class Connecting:
    """One connect() under way: its handle, the pure machine, and the links it opened."""

    group: PrefillGroup
    machine: GroupConnect
    route: DecodeRoute
    links: dict[tuple[int, int], Link] = field(default_factory=dict)


@dataclass(eq=False)
class Link:
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
    registered_at: float = 0.0  # when its newest RegisterInfo was sent (monotonic)


class DecodeLinks:
    """Every link of one decode rank, the connect()s under way and the groups they made.

    ``rooms`` is set by the worker right after both are built (each side calls the other)."""

    rooms: DecodeRooms

    def __init__(
        self,
        config: DecodeConfig,
        memory: RankMemory,
        hello: wire.Hello,
        backend: Backend,
        ctx: zmq.Context[Any],
        auth: ControlAuth | None,
        session: DecodeSession,
        scatter: ScatterReceiver,
        stats: DecodeStats,
        poller: zmq.Poller,
    ) -> None:
        self.config = config
        self.memory = memory
        self.hello = hello
        self.backend = backend
        self.auth = auth
        self.session = session
        self.stats = stats
        self.poller = poller
        self.endpoint = config.advertised()
        self.on_connected: Callable[[PrefillGroup], None] | None = None
        self._ctx = ctx
        self._scatter = scatter
        self.registered: dict[PeerRef, Link] = {}  # registered links (ready, or registering again)
        self._connecting: list[Link] = []  # links whose handshake runs (inside connect())
        self._reconnecting: list[Link] = []  # lost links handshaking again in the background
        self._monitors: dict[zmq.Socket[Any], Link] = {}
        self._window_keys: dict[PeerRef, list[str]] = {}  # every key whose windows a peer may hold
        self._settling: list[tuple[float, PeerRef]] = []  # revocations settling, by time
        self._lost_links: list[Link] = []  # lost links waiting for their reconnect to be due
        # keys of closed links whose windows are still live: unmapped once the peer has no
        # unfenced room (nothing can write through them), else revoked with the peer
        self._retired: dict[str, PeerRef] = {}
        # revoked keys, their windows junk until a proof that no write through them can come:
        # peer -> key -> (when it was revoked, the endpoint of its link) (see _free_junk)
        self._junk: dict[PeerRef, dict[str, tuple[float, str]]] = {}
        self.groups: dict[tuple[str, int], tuple[PrefillGroup, GroupRoute]] = {}
        self.connects: list[Connecting] = []  # connect()s under way
        self._connect_of: dict[Link, tuple[Connecting, tuple[int, int]]] = {}  # their links
        # registered links a connect()'s link closed before registering with the same rank (a
        # prefill rank takes a registration under a live connection's rank only once it is gone):
        # peer -> (the old link, the link replacing it); its rooms fail once the new one is ready
        self._replaced: dict[PeerRef, tuple[Link, Link]] = {}

    # ------------------------------------------------------------------ groups

    def connect(self, endpoints: Sequence[str], prefill_pp: int, timeout_s: float | None) -> PrefillGroup:
        """See :meth:`DecodeWorker.connect`."""
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
        c = Connecting(PrefillGroup(endpoints, prefill_pp), machine, route)
        self.connects.append(c)
        try:
            self.on_group(c, c.machine.start())
        except BaseException:
            self._abandon(c)
            raise
        return c.group

    def route_of(self, group: PrefillGroup) -> GroupRoute:
        known = self.groups.get((group.engine_id, group.dp_rank))
        if known is None:
            raise ConfigError(f"not connected to prefill {group}; call connect() first")
        return known[1]

    def on_group(self, c: Connecting, actions: list[GroupAction]) -> None:
        """Carry out what a group's connect machine asks."""
        for a in actions:
            if isinstance(a, OpenLink):
                try:
                    link = self._open(a.spec.endpoint, c.machine.deadline, a.spec.expected)
                except HandshakeError as exc:
                    if not c.links:  # the first rank, inside connect(): raised to its caller
                        raise
                    self.on_group(c, c.machine.on_link_refused(a.spec.key, str(exc)))
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
                self.rooms.start_held(a.room, a.indices, c.group, a.deadline)
            else:
                assert isinstance(a, FailHeld)
                self.rooms.fail_held(a.room, a.failure)

    def _abandon(self, c: Connecting) -> None:
        """A connect that failed: close the links it opened."""
        if c in self.connects:
            self.connects.remove(c)
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
                self.rooms.run(self.session.on_peer_lost(peer, why))
                self._release_idle(peer)
                self._schedule_reconnect(old)

    def _connected(self, c: Connecting, identity: GroupIdentity) -> None:
        """Every rank of a connect registered: its links replace older ones to those ranks."""
        self.connects.remove(c)
        links: dict[tuple[int, int], tuple[PeerRef, int, bool]] = {}
        for key, link in c.links.items():
            self._connect_of.pop(link, None)
            conn = link.conn
            assert conn.peer is not None and conn.position is not None and conn.version is not None
            old = self.registered.pop(conn.peer, None)
            replaced = self._replaced.pop(conn.peer, None)
            if old is None and replaced is not None:  # closed when this link registered
                old = replaced[0]
            for stale in [r for r in self._reconnecting if r.conn.endpoint == conn.endpoint]:
                self._drop(stale)  # this connect replaces a background reconnect of that rank
            self._lost_links = [r for r in self._lost_links if r.conn.endpoint != conn.endpoint]
            self._connecting.remove(link)
            self.registered[conn.peer] = link
            self._window_keys.setdefault(conn.peer, []).append(link.key)
            if old is not None:  # connecting again (a restarted prefill engine): the old link is gone
                self._drop(old)
                self.rooms.run(self.session.on_peer_lost(conn.peer))
                self._release_idle(conn.peer)
            self._free_junk(conn.peer, link)
            # one entry per rank, the newest (a rank connected again a thousand times is one rank)
            mine = f"{conn.peer}="
            self.stats.versions[:] = [v for v in self.stats.versions if not v.startswith(mine)]
            self.stats.versions.append(f"{mine}{conn.version[0]}.{conn.version[1]}")
            links[key] = (conn.peer, conn.position.sender_rank, self._fences(conn.version))
        g = c.group
        g.engine_id, g.dp_rank = identity.engine_id, identity.dp_rank
        self.groups[(g.engine_id, g.dp_rank)] = (g, GroupRoute.of(c.route, g.pp_size, links))
        g.state = GroupState.READY
        if self.on_connected is not None:
            self.on_connected(g)

    def _fences(self, version: tuple[int, int]) -> bool:
        """Whether a prefill rank's Failed status and AbortAck mean its writes stopped: from 1.3,
        on an engine whose reports are true (Mooncake's are not: its ranks are revoked instead)."""
        return version >= FENCE_SINCE and self.backend.final_states_fence

    def _route(self, prefill_tp: int, prefill_pp: int) -> DecodeRoute:
        kv = self.memory.kv
        assert kv is not None
        r = self.config.rank
        return route_decode_rank(
            prefill_tp, r.tp_size, r.tp_rank, is_mla=kv.is_mla,
            prefill_pp=prefill_pp, decode_pp=r.pp_size, decode_pp_rank=r.pp_rank,
            sharded_state=has_tp_sharded_state(self.memory),
        )  # fmt: skip

    # ------------------------------------------------------------------ one link

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
        self, endpoint: str, deadline: float, expected: Expected | None, into: list[Link] | None = None
    ) -> Link:
        """A new socket and handshake to ``endpoint`` (for connect(), or a background reconnect
        into ``into``), with heartbeats and a monitor that reports the connection's loss."""
        # each link's windows are its own, revoked apart; numbered per backend, so two workers
        # sharing one backend never name each other's windows
        key = self.backend.new_window_key(endpoint)  # "<endpoint>#<n>"
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
        link = Link(sock, conn, key)
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

    def _drop(self, link: Link) -> None:
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
        self._retire(link)

    # ------------------------------------------------------------------ windows of closed links

    def _retire(self, link: Link) -> None:
        """A closed link's windows: never registered, they go at once (no room was asked through
        them); registered, they wait until the peer has no unfenced room (:meth:`_release_idle`)."""
        peer = link.conn.peer
        if peer is not None and link.key in self._window_keys.get(peer, []):
            self._retired[link.key] = peer
            return
        self.backend.release_windows(link.key, junk=False)  # (its revoked ones wait for _free_junk)

    def _release_idle(self, peer: PeerRef) -> None:
        """Unmap the live windows of ``peer``'s closed links once nothing can write through them:
        none of its rooms waits for a fence (each sender that wrote fenced, by Success or a fencing
        Failed/AbortAck) and no revocation of it is under way. A room still unfenced makes the
        session revoke the peer instead, and the windows become junk (:meth:`revoke`)."""
        keys = [k for k, p in self._retired.items() if p == peer]
        if not keys or peer in self.session.revoking:
            return
        rooms = [*self.session.rooms.values(), *self.session.quarantined.values()]
        if any(peer in r.unfenced() for r in rooms):
            return
        live = self._window_keys.get(peer, [])
        for key in keys:
            del self._retired[key]
            if key in live:
                live.remove(key)
            self.backend.release_windows(key, junk=False)

    def _free_junk(self, peer: PeerRef, link: Link) -> None:
        """``peer`` accepted ``link``'s registration. On an engine whose writers accept a new
        registration only once every transfer to an older one is final
        (``Backend.registration_fences_older``), nothing revoked before it was sent through a link
        to the same endpoint can be written any more: the process listening there is the one that
        was revoked, or took the port after it exited. Those junk windows are unmapped. Elsewhere
        (another endpoint: the revoked process may still live; Mooncake) they stay mapped (junk,
        no memory) until the backend closes: a late write must never land in a reused address."""
        junk = self._junk.get(peer)
        if not junk or not self.backend.registration_fences_older:
            return
        here = link.conn.endpoint
        for key in [k for k, (at, where) in junk.items() if at <= link.registered_at and where == here]:
            del junk[key]
            self.backend.release_windows(key, live=False)

    def send(self, link: Link, msg: wire.Message, version: tuple[int, int] | None) -> None:
        # numpy declares ndarray a buffer (its side frames) only from Python 3.12 on
        link.sock.send_multipart(wire.encode(msg, version), copy=False)  # type: ignore[arg-type]
        self.stats.messages_out += 1

    def usable(self, peer: PeerRef) -> bool:
        link = self.registered.get(peer)
        return link is not None and link.conn.ready and not link.revoked

    def _drain(self, link: Link) -> None:
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
                self.peer_error(f"message from prefill {link.conn.peer}", link.conn.peer, exc)

    def peer_error(self, what: str, peer: PeerRef | None, exc: Exception) -> None:
        """Handling ``what`` raised: the rooms of that peer fail as for a lost peer, the error
        is logged and counted, and every other link and room keeps going."""
        self.stats.peer_errors += 1
        text = f"{what} failed: {type(exc).__name__}: {exc}"
        self.stats.failures.append(text)
        log.warning("%s", text, exc_info=exc)
        if peer is not None:
            self.rooms.run(self.session.on_peer_lost(peer))

    def _handle(self, link: Link, events: list[DecodeEvent]) -> None:
        for e in events:
            if isinstance(e, Send):
                if isinstance(e.message, wire.RegisterInfo) and link in self._connect_of:
                    self._close_replaced(link)
                if isinstance(e.message, wire.RegisterInfo):
                    link.registered_at = time.monotonic()
                self.send(link, e.message, e.version)
            elif isinstance(e, Completed):
                self.stats.control_notifications += 1
                self.rooms.on_event(e)
            elif isinstance(e, Ready):
                pending = self._connect_of.get(link)
                if pending is not None:  # a rank of a connect() under way
                    pos = e.position
                    identity = GroupIdentity(e.peer.engine_id, pos.dp_rank, pos.tp_size, pos.pp_size)
                    actions = pending[0].machine.on_link_ready(pending[1], identity, e.layers)
                    self.on_group(pending[0], actions)
                else:
                    self._on_ready(link, e)
            elif isinstance(e, Refused):
                self._on_refused(link, e)
            else:
                self.rooms.on_event(e)
                if link.conn.state is DecodeConnState.RETRY and link.retry_at is None:
                    link.retry_at = time.monotonic() + link.backoff_s
                    link.backoff_s = min(RETRY_MAX_S, link.backoff_s * 2)

    def _on_refused(self, link: Link, e: Refused) -> None:
        pending = self._connect_of.get(link)
        if pending is not None and self._takeover_retry(link, pending[0]):
            return  # the prefill rank has not seen the replaced link go yet
        if pending is not None:
            reason = e.reason
            if not link.transport_up and link.monitor is not None:
                self._on_monitor(link.monitor, link)  # events not polled yet
            if not link.transport_up:
                reason += (
                    " (no TCP connection to it was ever established: nothing listens there, "
                    "or it is not reachable from this host)"
                )
            self.on_group(pending[0], pending[0].machine.on_link_refused(pending[1], reason))
        elif link in self._reconnecting:
            self.stats.reconnect_error = f"{link.conn.endpoint}: {e.reason}"
            self._drop(link)
            link.backoff_s = min(RETRY_MAX_S, link.backoff_s * 2)
            self._schedule_reconnect(link)

    def _close_replaced(self, link: Link) -> None:
        """A connect()'s ``link`` is about to register with a rank this worker is registered with
        on another link: that link closes first (the prefill rank takes the new registration only
        once the old connection is gone). Its rooms fail when the new link is ready (as for any
        replaced link), or when the connect fails (and the old link reconnects)."""
        peer = link.conn.peer
        old = self.registered.get(peer) if peer is not None else None
        if peer is None or old is None or old is link:
            return
        del self.registered[peer]
        self._drop(old)
        self._replaced[peer] = (old, link)

    def _takeover_retry(self, link: Link, c: Connecting) -> bool:
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

    def _on_ready(self, link: Link, e: Ready) -> None:
        """A registration was accepted: a link registering again after a revocation, or a lost
        link that reconnected (connect() takes its own links when their handshake ends)."""
        if link in self._reconnecting:
            self._reconnecting.remove(link)
            old = self.registered.pop(e.peer, None)
            if old is not None:
                self._drop(old)
            self.registered[e.peer] = link
            self._window_keys.setdefault(e.peer, []).append(link.key)
            self.stats.reconnects += 1
            self._update_fences(e.peer, e.version)
            self._release_idle(e.peer)
        if self.registered.get(e.peer) is link:
            link.backoff_s = RETRY_FIRST_S
            link.revoked = False
            self.session.on_reregistered(e.peer)
            self._free_junk(e.peer, link)

    def _update_fences(self, peer: PeerRef, version: tuple[int, int]) -> None:
        """A reconnected rank may speak another version: its fence promise follows it."""
        for key, (group, route) in self.groups.items():
            if any(s.peer == peer for s in route.senders):
                senders = tuple(
                    replace(s, fences=self._fences(version)) if s.peer == peer else s for s in route.senders
                )
                self.groups[key] = (group, replace(route, senders=senders))

    # ------------------------------------------------------------------ the loop

    def on_poll(self, events: Mapping[Any, int]) -> None:
        """Read every link and monitor that ``events`` (of the poller) names."""
        for link in [*self.registered.values(), *self._connecting, *self._reconnecting]:
            if events.get(link.sock):
                self._drain(link)
        for mon, link in list(self._monitors.items()):
            if events.get(mon):
                self._on_monitor(mon, link)

    def on_tick(self, now: float) -> None:
        """Handshake deadlines, registrations sent again, settled revocations, reconnects."""
        for link in [*self._connecting, *self._reconnecting]:
            self._handle(link, link.conn.on_tick(now))
        for link in list(self._connecting):
            if link.register_again_at is not None and now >= link.register_again_at:
                link.register_again_at = None
                self._handle(link, link.conn.register_again())
        for c in list(self.connects):
            self.on_group(c, c.machine.on_tick(now))
        while self._settling and self._settling[0][0] <= now:
            _, peer = self._settling.pop(0)
            self.rooms.run(self.session.on_revoked(peer))
            again = self.registered.get(peer)
            if again is not None:  # still connected: it registers again, with new windows (only
                # now, so that no room of the new registration can be taken for a revoked one)
                self._window_keys.setdefault(peer, []).append(again.key)
                self._handle(again, again.conn.reregister(self._local(again.key)))
        for peer in set(self._retired.values()):
            self._release_idle(peer)  # their rooms settled since the links closed
        self._retry(now)

    # ------------------------------------------------------------------ losses and revocations

    def _on_monitor(self, mon: zmq.Socket[Any], link: Link) -> None:
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
        if lost and link in self.registered.values():
            self.lose(link, f"{link.conn.peer}: control connection lost (closed, or no heartbeat answered "
                            f"within {self.config.peer_timeout_s}s)")  # fmt: skip
        elif lost and link in self._reconnecting:
            self._drop(link)  # it dropped again mid-handshake: start over after a pause
            self._schedule_reconnect(link)

    def _handshake_refused(self, link: Link, event: Mapping[str, Any]) -> None:
        """The socket refused the ZMTP handshake with a prefill rank (keys, one side without
        CURVE): logged; a registration handshake in progress is refused with it at once."""
        text = report_refusal(event, link.conn.endpoint, self.auth is not None, self.stats.failures)
        if text is not None:
            self._handle(link, link.conn.transport_refused(text))

    def lose(self, link: Link, reason: str, reconnect: bool = True) -> None:
        """A registered prefill rank is gone: its rooms fail now and it is revoked (a process that
        stopped resumes, a closed connection's buffered bytes still land); with ``reconnect`` its
        endpoint is handshaken again in the background."""
        peer = link.conn.peer
        assert peer is not None
        if self.registered.get(peer) is link:
            del self.registered[peer]
        self._drop(link)
        self.stats.peers_lost += 1  # its rooms' failures name it; a loss alone is no failure
        self.rooms.run(self.session.on_peer_lost(peer, reason))
        self._release_idle(peer)
        if reconnect:
            self._schedule_reconnect(link)

    def _schedule_reconnect(self, old: Link) -> None:
        """Handshake with ``old``'s endpoint again once its back-off passed (see :meth:`_retry`)."""
        old.retry_at = time.monotonic() + old.backoff_s
        self._lost_links.append(old)

    def _retry(self, now: float) -> None:
        """Registrations refused after a revocation, and lost links, are tried again when due."""
        for link in list(self.registered.values()):
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

    def revoke(self, peer: PeerRef) -> None:
        """Cut ``peer`` off this rank's memory (every window any of its links was given)."""
        keys = self._window_keys.get(peer, [])
        blockers = [why for why in (self.backend.revocation_blocker(k) for k in keys) if why]
        if not keys or blockers:
            why = blockers[0] if blockers else "no windows were published to it"
            self.stats.unrevocable += 1
            self.stats.failures.append(f"{peer} cannot be revoked, its rooms stay quarantined: {why}")
            self.rooms.run(self.session.on_unrevocable(peer, why))
            return
        now = settles = time.monotonic()
        junk = self._junk.setdefault(peer, {})
        for key in keys:
            settles = max(settles, self.backend.revoke(key).settles_at)
            junk[key] = (now, key.rpartition("#")[0])  # the endpoint of its link (_open)
            self._retired.pop(key, None)  # junk now: it waits for _free_junk's proof
        self._window_keys[peer] = []
        self.stats.revocations += 1
        self._settling.append((settles, peer))
        self._settling.sort(key=lambda t: t[0])
        link = self.registered.get(peer)
        if link is not None:
            link.revoked = True
        # its live rooms fail now: what it writes from here on goes nowhere
        self.rooms.run(self.session.on_peer_lost(peer, f"{peer}'s access to this rank's memory was revoked"))

    def close(self) -> None:
        for link in [*self.registered.values(), *self._connecting, *self._reconnecting]:
            self._drop(link)
        self.registered.clear()
        self.connects.clear()
        self._connect_of.clear()
        self._replaced.clear()
        self._lost_links.clear()
