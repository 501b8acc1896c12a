"""A decode rank's rooms: the requests it asked for, around the pure
:class:`~pdwire.runtime.session.decode_session.DecodeSession`.

A room starts on a ready group at once, is held while its group still connects, or waits while
a rank of a ready group registers again after its revocation. What the session decides
(release, revoke, send an abort) is carried out here, with the links
(:class:`~.decode_links.DecodeLinks`) for everything that touches a socket.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from pdwire import wire
from pdwire.runtime.backends import EngineNotification
from pdwire.runtime.config import ConfigError, DecodeConfig
from pdwire.runtime.indices import IndicesError, RequestIndices, check_room
from pdwire.runtime.planner import Indexing, PlanError, RankMemory
from pdwire.runtime.session.actions import (
    Action,
    ReleaseRoom,
    ReleaseSlots,
    RevokePeer,
    SendAbort,
    SendRequest,
)
from pdwire.runtime.session.decode_session import DecodeSession
from pdwire.runtime.session.events import (
    AbortAcked,
    Completed,
    DecodeEvent,
    Problem,
    StatusReceived,
    completion,
)
from pdwire.runtime.session.failures import DuplicateRoomError, Failure, FailureKind
from pdwire.runtime.session.leases import Leases, renewal_interval
from pdwire.runtime.session.states import GroupState
from pdwire.runtime.session.status import Status
from pdwire.runtime.staging import CopyError
from pdwire.runtime.workers.decode_links import Connecting, DecodeLinks, DecodeStats, Link, PrefillGroup
from pdwire.runtime.workers.failure_log import log
from pdwire.runtime.workers.scatter import ScatterGeometryError, ScatterReceiver, ScatterRefused

OnFinished = Callable[[int, Status, Failure | None], None]
OnSlotsReleased = Callable[[int], None]


class DecodeRooms:
    """Every room of one decode rank: live (the session's), held for a connecting group, waiting
    for a rank to register again, or refused and reported from the next step."""

    def __init__(
        self,
        config: DecodeConfig,
        memory: RankMemory,
        session: DecodeSession,
        scatter: ScatterReceiver,
        stats: DecodeStats,
        links: DecodeLinks,
    ) -> None:
        assert memory.kv is not None
        self.config = config
        self.memory = memory
        self.session = session
        self.scatter = scatter
        self.stats = stats
        self.links = links
        self.on_finished: OnFinished | None = None
        self.on_slots_released: OnSlotsReleased | None = None
        self._page_size = memory.kv.page_size
        self._refused: list[tuple[int, Failure]] = []  # rooms refused by start_room, reported by step()
        self._held: dict[int, Connecting] = {}  # rooms waiting for their group to be ready
        # rooms waiting for a rank of a ready group to register again after its revocation
        self._awaiting: dict[int, tuple[RequestIndices, PrefillGroup, float]] = {}
        self.leases: Leases[PrefillGroup] = Leases()  # rooms the engine queues, renewed on their group
        self._declines: dict[int, tuple[PrefillGroup, str]] = {}  # declined while their group connects

    # ------------------------------------------------------------------ starting

    def start_room(
        self, room: int, indices: RequestIndices, prefill: PrefillGroup, timeout_s: float | None
    ) -> None:
        """See :meth:`DecodeWorker.start_room`."""
        room = check_room(room)
        self.leases.drop(room)  # asked for now (its request holds it on prefill), or refused here
        self.check_free(room)
        if not isinstance(prefill, PrefillGroup):
            raise ConfigError(f"start_room takes the PrefillGroup connect() returned, got {prefill!r}")
        self._check_indices(indices)
        timeout = self.config.room_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        if prefill.ready:
            self._start_now(room, indices, prefill, deadline)
            return
        c = next((c for c in self.links.connects if c.group is prefill), None)
        if c is None and not prefill.failed:
            raise ConfigError(f"{prefill} was not connected by this worker; call connect() first")
        if c is None:
            self._refuse_room(room, Failure(FailureKind.HANDSHAKE, prefill.error or f"{prefill} failed"))
            return
        self._held[room] = c
        self.links.on_group(c, c.machine.hold(room, indices, deadline))

    def start_held(self, room: int, indices: RequestIndices, prefill: PrefillGroup, deadline: float) -> None:
        """A room held for its group: the group is ready now."""
        self._held.pop(room, None)
        self._start_now(room, indices, prefill, deadline)

    def fail_held(self, room: int, failure: Failure) -> None:
        """A room held for its group: the group failed, or the room's deadline passed."""
        self._held.pop(room, None)
        self._refuse_room(room, failure)

    def _start_now(self, room: int, indices: RequestIndices, prefill: PrefillGroup, deadline: float) -> None:
        plans, requests = self.links.route_of(prefill).plan(room, indices)
        unready = [req.peer for req in requests if not self.links.usable(req.peer)]
        if unready and all(peer in self.links.registered for peer in unready):
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
            link = self.links.registered[req.peer]
            scatter = self._reserve(room, senders[req.peer], req, link)
            self.links.send(link, link.conn.transfer_request(req, scatter), link.conn.version)
            self.stats.requests_sent += 1
        r.on_requests_sent()

    def _reserve(self, room: int, sender: int, req: SendRequest, link: Link) -> tuple[int, int, int] | None:
        """A receive staging range for the room's first pages from this prefill rank (offset,
        bytes per page, pages), if both sides scatter; None: it writes them in place."""
        conn = link.conn
        heads, position = conn.prefill_heads, conn.position
        if req.is_dummy or heads is None or position is None or not len(req.indices.kv_pages):
            return None
        planner = self.scatter.planner(link.key, position, heads, conn.prefill_kv_layers)
        if planner is None:
            return None
        r = self.scatter.reserve(room, sender, req.peer, planner, req.indices.kv_pages)
        return None if r is None else (r.offset, r.page_bytes, r.pages)

    def start_awaiting(self, now: float) -> None:
        """Rooms waiting for ranks to register again: sent once they are, failed at their
        deadline (``timeout``) or when a rank is lost meanwhile (``peer_gone``, from the retry)."""
        for room, (indices, group, deadline) in list(self._awaiting.items()):
            if now >= deadline:
                del self._awaiting[room]
                why = "a prefill rank of the room was registering again (revoked) until its deadline"
                self._refuse_room(room, Failure(FailureKind.TIMEOUT, why))
                continue
            known = self.links.groups.get((group.engine_id, group.dp_rank))
            peers = [] if known is None else [s.peer for s in known[1].senders]
            if all(self.links.usable(p) for p in peers) or any(p not in self.links.registered for p in peers):
                del self._awaiting[room]
                self._start_now(room, indices, group, deadline)

    def _refuse_room(self, room: int, failure: Failure) -> None:
        # reported from the next step(), like every other room's end: the caller records the
        # room only once start_room returned
        self._refused.append((room, failure))

    @property
    def has_refused(self) -> bool:
        return bool(self._refused)

    @property
    def has_awaiting(self) -> bool:
        return bool(self._awaiting)

    def report_refused(self) -> None:
        refused, self._refused = self._refused, []
        for room, failure in refused:
            self.stats.rooms_failed += 1
            self.stats.failures.append(f"room {room}: {failure.reason}")
            if self.on_finished is not None:
                self.on_finished(room, Status.FAILED, failure)
            if self.on_slots_released is not None:
                self.on_slots_released(room)

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

    # ------------------------------------------------------------------ the engine's other calls

    def check_free(self, room: int) -> None:
        """See :meth:`DecodeWorker.check_free`."""
        if check_room(room) in self._held or room in self._awaiting:
            raise DuplicateRoomError(room, "waiting for its prefill group on this decode rank")
        self.session.check_free(room)

    def _waiting(self, room: int) -> bool:
        return room in self._held or room in self._awaiting

    def abort(self, room: int, reason: str) -> None:
        """See :meth:`DecodeWorker.abort`."""
        if self._awaiting.pop(check_room(room), None) is not None:  # nothing was sent for it
            self._refuse_room(room, Failure(FailureKind.ABORTED, reason))
            return
        c = self._held.pop(room, None)
        if c is not None and c.machine.release(room):  # nothing was sent for it
            self._refuse_room(room, Failure(FailureKind.ABORTED, reason))
            return
        self.run(self.session.abort(check_room(room), Failure(FailureKind.ABORTED, reason)))

    def hold(self, room: int, prefill: PrefillGroup) -> None:
        """See :meth:`DecodeWorker.hold`."""
        room = check_room(room)
        if not isinstance(prefill, PrefillGroup):
            raise ConfigError(f"hold takes the PrefillGroup connect() returned, got {prefill!r}")
        if prefill.failed:
            return  # nothing to renew it on (a request for it reconnects)
        self.leases.hold(room, prefill)

    def renew(self, now: float) -> None:
        """Send the renewals due (:mod:`.session.leases`) and the declines whose group is ready."""
        for room, (group, reason) in list(self._declines.items()):
            if group.state is not GroupState.CONNECTING:
                del self._declines[room]
                if group.ready:
                    self._send_decline(room, group, reason)
        for group in [g for g in self.leases.groups if g.failed]:
            self.leases.forget(group)
        for r in self.leases.due(now, self._renewal_interval):
            for link in self._lease_links(r.group):
                self.links.send(link, link.conn.lease(r.rooms), link.conn.version)
                self.stats.leases_sent += 1

    def _lease_links(self, group: PrefillGroup) -> list[Link]:
        """The ready links to ``group``'s ranks that take leases (1.5)."""
        links = (self.links.registered.get(peer) for peer in self.links.route_of(group).peers)
        return [lk for lk in links if lk is not None and lk.conn.ready and lk.conn.lease_s > 0]

    def _renewal_interval(self, group: PrefillGroup) -> float | None:
        if not group.ready:
            return None
        return renewal_interval([lk.conn.lease_s for lk in self._lease_links(group)])

    @property
    def has_leases(self) -> bool:
        return bool(self.leases) or bool(self._declines)

    def decline(self, room: int, prefill: PrefillGroup, reason: str) -> None:
        """See :meth:`DecodeWorker.decline`."""
        room = check_room(room)
        self.leases.drop(room)
        if room in self.session.rooms or self._waiting(room):
            self.abort(room, reason)
            return
        if not isinstance(prefill, PrefillGroup):
            raise ConfigError(f"decline takes the PrefillGroup connect() returned, got {prefill!r}")
        if prefill.state is GroupState.CONNECTING:
            self._declines[room] = (prefill, reason)  # sent once it is ready (renew)
            return
        if prefill.ready:
            self._send_decline(room, prefill, reason)

    def _send_decline(self, room: int, prefill: PrefillGroup, reason: str) -> None:
        self.stats.declines_sent += 1
        failure = Failure(FailureKind.ABORTED, reason)
        for peer in self.links.route_of(prefill).peers:
            link = self.links.registered.get(peer)
            if link is not None and link.conn.ready:
                self.links.send(link, link.conn.abort(room, failure), link.conn.version)

    def status(self, room: int) -> Status | None:
        """See :meth:`DecodeWorker.status`."""
        if self._waiting(room):
            return Status.BOOTSTRAPPING
        return self.session.status(room)

    def reclaim(self, room: int) -> bool:
        """See :meth:`DecodeWorker.reclaim`."""
        if room in self.session.rooms or self._waiting(room):
            raise ConfigError(f"room {room} is still live on this rank: abort it before reclaiming its slots")
        r = self.session.on_reclaimed(room)
        if r is None:
            return False
        self.stats.reclaimed += 1
        self.scatter.release(room, keep=r.unfenced())  # a late write may still land in those
        waiting = ", ".join(str(p) for p in r.unfenced()) or "none"
        text = f"room {room}: reclaimed by the engine before its writers fenced (waiting for: {waiting})"
        self.stats.failures.append(text)
        log.warning("%s", text)
        return True

    # ------------------------------------------------------------------ completions and outcomes

    def on_notifications(self, notes: Iterable[EngineNotification]) -> None:
        """Engine notifications: each a completion of one room's part (or several)."""
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
                self.on_event(completion(msg))
            except Exception as exc:
                self.links.peer_error(f"engine notification from {n.peer_agent_name}", None, exc)

    def on_event(self, e: DecodeEvent) -> None:
        if isinstance(e, Completed):
            if e.scatter_pages and not self._scatter_in(e):
                return
            self.run(
                self.session.on_notification(
                    e.room, e.sender, e.kind, e.chunk_id, e.is_last, e.component,
                    e.chunk_count, e.also_components, e.also_aux,
                )
            )  # fmt: skip
        elif isinstance(e, StatusReceived):
            self.run(self.session.on_status(e.room, e.sender, e.status, e.failure))
        elif isinstance(e, AbortAcked):
            self.run(self.session.on_abort_ack(e.room, e.sender))
        elif isinstance(e, Problem):
            self.stats.failures.append(e.text)

    def _scatter_in(self, e: Completed) -> bool:
        """Copy the staged pages a notification names into place; False (the room failed) when
        they cannot be: the parts are then not counted, so no Success covers unplaced bytes."""
        if e.room not in self.session.rooms:
            return True  # a late notification of an ended room: the session ignores it
        t0 = time.perf_counter()
        try:
            nbytes = self.scatter.scatter(e.room, e.sender, e.scatter_first, e.scatter_pages)
        except (ScatterRefused, ScatterGeometryError, CopyError, PlanError) as exc:
            why = f"staged KV pages from prefill rank {e.sender} cannot be placed: {exc}"
            self.run(self.session.abort(e.room, Failure(FailureKind.VALIDATION, why)))
            return False
        self.stats.scatter_s += time.perf_counter() - t0
        self.stats.scattered_pages += e.scatter_pages
        self.stats.scattered_bytes += nbytes
        return True

    def run(self, actions: list[Action]) -> None:
        """Carry out what the session decided."""
        for a in actions:
            if isinstance(a, RevokePeer):
                self.links.revoke(a.peer)
            elif isinstance(a, SendAbort):
                link = self.links.registered.get(a.peer)
                if link is not None:
                    self.links.send(link, link.conn.abort(a.room, a.failure), link.conn.version)
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
                self.scatter.release(a.room)  # the room's writes stopped: its ranges are free too
                if self.on_slots_released is not None:
                    self.on_slots_released(a.room)
