"""The decode rank an engine embeds: its links (:mod:`.decode_links`: one ZMQ DEALER per
prefill rank it reads from, each around a pure
:class:`~pdwire.runtime.session.decode_connection.DecodeConnection`) and its rooms
(:mod:`.decode_rooms`: around the pure
:class:`~pdwire.runtime.session.decode_session.DecodeSession`), a transfer backend for
completions and a clock. This module is the facade and the poll loop.

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

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
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

from pdwire import wire

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

        Raises :class:`DuplicateRoomError` if the room id is in use (live, quarantined, waiting
        for its group or just finished) and :class:`IndicesError` for indices that do not fit
        this rank's memory, both before anything is sent. ``timeout_s`` overrides the room
        timeout. A group still connecting holds the room inside its deadline: it starts once the
        group is ready, or fails (``on_finished`` Failed: ``handshake`` with the cause, or
        ``timeout`` at its deadline; nothing was sent, its slots come back at once). A failed
        group's rooms fail the same way from the next ``step()``.
        """
        self.rooms.start_room(room, indices, prefill, timeout_s)

    def check_free(self, room: int) -> None:
        """Raise :class:`DuplicateRoomError` if ``room`` is live, quarantined, waiting for its group or
        just finished here (call it before allocating a request's memory; :meth:`start_room`
        checks again)."""
        self.rooms.check_free(room)

    def abort(self, room: int, reason: str = "aborted by the decode engine") -> None:
        """Give up on ``room``: every prefill rank is told to stop; ``on_finished`` reports it
        Failed now and ``on_slots_released`` once every writer fenced (a room still waiting
        for its group fails at once: nothing was sent for it). A room this rank never started
        (or one already over) is left alone: nothing is reported, since no slot of it was ever
        handed to a writer; to tell prefill not to wait for it, :meth:`decline` it."""
        self.rooms.abort(room, reason)

    def decline(
        self, room: int, prefill: PrefillGroup, reason: str = "declined by the decode engine"
    ) -> None:
        """Tell ``prefill`` that this rank will never ask for ``room`` (the engine dropped the
        request while it waited, e.g. for memory): every prefill rank that would feed this rank
        fails its room now (``on_released`` there, with ``ABORTED``) instead of at the room
        timeout, and refuses a later request for it. No callback fires here: nothing was started.
        A room that is live on this rank is aborted instead (:meth:`abort`)."""
        self.rooms.decline(room, prefill, reason)

    def status(self, room: int) -> Status | None:
        """The room's status here (live, quarantined, waiting for its group or recently ended);
        None if never seen."""
        return self.rooms.status(room)

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
