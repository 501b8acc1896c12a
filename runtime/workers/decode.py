"""The decode rank an engine embeds: the facade and the poll loop around its links
(:mod:`.decode_links`: one DEALER per prefill rank, each around a pure ``DecodeConnection``) and
its rooms (:mod:`.decode_rooms`: around the pure ``DecodeSession``).

The engine-facing contract (connect, rooms, the ``on_finished`` / ``on_slots_released`` /
``on_connected`` callbacks, reclaim) is in ``docs/engine-api.md``; revocation of lost or
unfenced prefill ranks, and why a timeout never releases slots, in ``docs/fencing.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from pdwire import wire
from pdwire.runtime.backends import Backend
from pdwire.runtime.config import ConfigError, DecodeConfig
from pdwire.runtime.indices import RequestIndices
from pdwire.runtime.planner import RankMemory
from pdwire.runtime.session.actions import PeerRef
from pdwire.runtime.session.decode_session import DecodeSession
from pdwire.runtime.session.failures import HandshakeError
from pdwire.runtime.session.states import GroupState
from pdwire.runtime.session.status import Status
from pdwire.runtime.staging import Copier
from pdwire.runtime.workers.decode_links import PREFILL_MAX_MESSAGE, DecodeLinks, DecodeStats, PrefillGroup
from pdwire.runtime.workers.decode_rooms import DecodeRooms, OnFinished, OnSlotsReleased
from pdwire.runtime.workers.scatter import ScatterReceiver
from pdwire.runtime.workers.setup import RankEdge, register_memory

__all__ = ["PREFILL_MAX_MESSAGE", "DecodeStats", "DecodeWorker", "OnConnected", "PrefillGroup"]

OnConnected = Callable[[PrefillGroup], None]


class DecodeWorker(RankEdge):
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
        super().__init__(config, memory, wire.Role.DECODE, backend, context)
        self.config: DecodeConfig = config
        try:
            register_memory(self.backend, memory, config.rank)
            # after the planner's regions: every peer gets a revocable window onto it too
            scatter = ScatterReceiver(self.backend, memory, config.scatter_bytes, copier)
        except BaseException:
            self._close_edge()
            raise
        self.session = DecodeSession(
            config.room_timeout_s,
            fence_timeout_s=config.fence_timeout_s,
            status_completes=not self.backend.notifications_reliable,
        )
        self.stats = DecodeStats()
        self.links = DecodeLinks(
            config, memory, self.hello, self.backend, self._ctx, self.auth, self.session, scatter,
            self.stats, self.poller,
        )  # fmt: skip
        self.rooms = DecodeRooms(config, memory, self.session, scatter, self.stats, self.links)
        self.links.rooms = self.rooms
        self.endpoint = self.links.endpoint
        self.on_finished = on_finished
        self.on_slots_released = on_slots_released
        self.on_connected = on_connected
        self._wake_on(self.backend.wakes_on_notification)  # when a notification may have arrived

    # the engine's callbacks, kept by the part that calls them (settable at any time)
    @property
    def on_finished(self) -> OnFinished | None:
        return self.rooms.on_finished

    @on_finished.setter
    def on_finished(self, fn: OnFinished | None) -> None:
        self.rooms.on_finished = fn

    @property
    def on_slots_released(self) -> OnSlotsReleased | None:
        return self.rooms.on_slots_released

    @on_slots_released.setter
    def on_slots_released(self, fn: OnSlotsReleased | None) -> None:
        self.rooms.on_slots_released = fn

    @property
    def on_connected(self) -> OnConnected | None:
        return self.links.on_connected

    @on_connected.setter
    def on_connected(self, fn: OnConnected | None) -> None:
        self.links.on_connected = fn

    # ------------------------------------------------------------------ links

    def connect(
        self, endpoints: Sequence[str], *, prefill_pp: int = 1, timeout_s: float | None = None
    ) -> PrefillGroup:
        """Start the handshake with one prefill DP group's ranks; returns its :class:`PrefillGroup`
        at once, ``CONNECTING``. ``endpoints`` lists every rank of the group, PP stage major
        (``endpoints[pp_rank * tp_size + tp_rank]``). :meth:`step` runs the handshakes and calls
        ``on_connected(group)`` once it is ``READY`` or ``FAILED`` (``group.error``); rooms may be
        started on it at once. See docs/engine-api.md.
        """
        return self.links.connect(endpoints, prefill_pp, timeout_s)

    def wait_ready(self, group: PrefillGroup) -> PrefillGroup:
        """Step this worker until ``group`` is ready (returned) or failed (:class:`HandshakeError`
        with the cause); bounded by the handshake timeout given to :meth:`connect`. Only from the
        thread that steps the worker."""
        while group.state is GroupState.CONNECTING:
            self.step(20)
        if group.failed:
            raise HandshakeError(group.error or f"connecting to {group} failed")
        return group

    def peer_lost(self, engine_id: str, rank: int | None = None, reason: str = "") -> None:
        """Tell the worker that prefill ranks are gone (e.g. their discovery lease expired):
        ``rank`` of ``engine_id``, or every rank of it. Handled like a closed connection."""
        for peer, link in list(self.links.registered.items()):
            if peer.engine_id == engine_id and (rank is None or peer.rank == rank):
                # not reconnected: whoever said it is gone says when it is back (connect())
                self.links.lose(link, reason or f"{peer} left the registry", reconnect=False)

    @property
    def unready_peers(self) -> tuple[PeerRef, ...]:
        """Prefill ranks of connected groups that take no new room now: lost (reconnecting in
        the background), or revoked and not registered again yet."""
        peers = {s.peer for _, route in self.links.groups.values() for s in route.senders}
        return tuple(sorted((p for p in peers if not self.links.usable(p)), key=str))

    # ------------------------------------------------------------------ rooms

    def start_room(
        self, room: int, indices: RequestIndices, prefill: PrefillGroup, *, timeout_s: float | None = None
    ) -> None:
        """Ask ``prefill`` (a group :meth:`connect` returned) for ``room`` into ``indices``.

        Raises :class:`DuplicateRoomError` or :class:`IndicesError` before anything is sent.
        ``timeout_s`` overrides the room timeout. A group still connecting holds the room inside
        its deadline (docs/engine-api.md).
        """
        self.rooms.start_room(room, indices, prefill, timeout_s)

    def check_free(self, room: int) -> None:
        """Raise :class:`DuplicateRoomError` if ``room`` is live, quarantined, waiting for its group or
        just finished here (call it before allocating a request's memory; :meth:`start_room`
        checks again)."""
        self.rooms.check_free(room)

    def abort(self, room: int, reason: str = "aborted by the decode engine") -> None:
        """Give up on ``room``: every prefill rank is told to stop; ``on_finished`` reports it
        Failed now and ``on_slots_released`` once every writer fenced. A room this rank never
        started (or one already over) is left alone; :meth:`decline` tells prefill not to wait."""
        self.rooms.abort(room, reason)

    def hold(self, room: int, prefill: PrefillGroup) -> None:
        """The engine queues a request for ``room`` (its memory not allocated yet): renew
        ``prefill``'s lease on the room (protocol 1.5) until :meth:`start_room` or :meth:`decline`
        names it, so it outlives the prefill's room timeout while the request waits here. A
        group still connecting is renewed once it is ready; a failed one not at all."""
        self.rooms.hold(room, prefill)

    def decline(
        self, room: int, prefill: PrefillGroup, reason: str = "declined by the decode engine"
    ) -> None:
        """Tell ``prefill`` that this rank will never ask for ``room``: its prefill ranks fail the
        room now instead of at its timeout and refuse a later request for it; a group still
        connecting is told once it is ready (a failed one never: the room times out there). No
        callback fires here; a room live on this rank is aborted instead (:meth:`abort`)."""
        self.rooms.decline(room, prefill, reason)

    def status(self, room: int) -> Status | None:
        """The room's status here (live, quarantined, waiting for its group or recently ended);
        None if never seen."""
        return self.rooms.status(room)

    def reclaim(self, room: int) -> bool:
        """Forget quarantined ``room``: the engine takes its slots back on its own authority (for a
        writer that can never fence, ``stats.unrevocable``; docs/engine-api.md). A late write is
        then the engine's risk; ``on_slots_released`` is not called. Returns False when the room
        is not quarantined; raises :class:`ConfigError` for a live room (``abort`` it first).
        """
        return self.rooms.reclaim(room)

    @property
    def scatter_in_use(self) -> int:
        """Bytes of the receive staging buffer reserved by rooms whose slots are not released."""
        return self.rooms.scatter.arena.in_use

    @property
    def quarantined_rooms(self) -> tuple[int, ...]:
        """Failed rooms whose destination slots are not released yet (a writer has not fenced)."""
        return tuple(self.session.quarantined)

    @property
    def stray_completions(self) -> int:
        """Completions that arrived for rooms already over (late, harmless, counted)."""
        return self.session.stray_completions

    # ------------------------------------------------------------------ the loop

    def step(self, timeout_ms: int) -> dict[Any, int]:
        """Poll once: control messages, engine notifications, deadlines. Returns poll events.

        Waits at most ``timeout_ms`` (0: never blocks)."""
        if self.rooms.has_refused:
            self.rooms.report_refused()
            timeout_ms = 0
        # with rooms live, engine notifications may come at any time
        events = self._wait(timeout_ms, bool(self.session.rooms))
        self.links.on_poll(events)
        notes = self.backend.receive_notifications()
        if events or notes:
            self._backoff.progress()
        self.rooms.on_notifications(notes)
        now = time.monotonic()
        self.links.on_tick(now)
        if self.rooms.has_awaiting:
            self.rooms.start_awaiting(now)
        if self.rooms.has_leases:
            self.rooms.renew(now)
        if self.session.rooms or self.session.quarantined:
            self.rooms.run(self.session.on_tick(now))
        if self.rooms.has_refused:  # held rooms that failed in this step
            self.rooms.report_refused()
        return events

    def close(self) -> None:
        """Close every link (and the backend and context the worker made itself). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.links.close()
        self._close_edge()
