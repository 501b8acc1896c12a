"""All rooms of one decode rank: room ids, routing of completions and statuses, timeouts.

A room id that is active, quarantined or finished recently raises :class:`DuplicateRoomError`
before anything is sent, so a repeated client-supplied id never reaches a prefill rank. A
failed room is buried (its late completions are stray) but stays *quarantined* until its slots
are released: statuses, AbortAcks, lost peers, revocations and ticks still reach it.

A lost peer, or one a quarantined room still waits for past its fence deadline, is asked to be
revoked (:class:`~.actions.RevokePeer`, once until answered); the edge answers
:meth:`on_peer_lost`, then :meth:`on_revoked`, or :meth:`on_unrevocable` (those rooms then stay
quarantined until a real fence arrives). See docs/fencing.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdwire.runtime.session.actions import Action, PeerRef, ReleaseRoom, ReleaseSlots, RevokePeer
from pdwire.runtime.session.decode_room import DecodeRoom, SenderPlan
from pdwire.runtime.session.failures import DuplicateRoomError, Failure
from pdwire.runtime.session.room_table import RoomTable
from pdwire.runtime.session.status import Status
from pdwire.wire import NotificationKind


class DecodeSession(RoomTable[DecodeRoom, Status]):
    """Live rooms by id; ``tombstones`` holds the final status of recently finished ones and
    ``quarantined`` the failed ones whose slots are not released yet.

    ``fence_timeout_s`` (default twice the room timeout: longer than any transfer may take)
    bounds how long past its deadline a failed room waits for a silent sender.
    ``status_completes``: a sender's Success status stands for its notifications (engines
    whose ``notifications_reliable`` is False).
    """

    def __init__(
        self,
        room_timeout_s: float = 30.0,
        tombstones: int = 65536,
        fence_timeout_s: float | None = None,
        status_completes: bool = False,
    ) -> None:
        super().__init__(room_timeout_s, tombstones)
        self.fence_timeout_s = 2 * room_timeout_s if fence_timeout_s is None else fence_timeout_s
        self.status_completes = status_completes  # see DecodeRoom: for engines that lose notifications
        self.quarantined: dict[int, DecodeRoom] = {}
        self.stray_completions = 0  # completions for rooms already over (late, harmless)
        self.revoking: set[PeerRef] = set()  # RevokePeer asked, not answered yet
        self.unrevocable: dict[PeerRef, str] = {}  # peers the edge cannot revoke, and why

    def start_room(
        self, room: int, senders: Sequence[SenderPlan], now: float, timeout_s: float | None = None
    ) -> DecodeRoom:
        self.check_free(room)
        deadline = now + (self.room_timeout_s if timeout_s is None else timeout_s)
        r = DecodeRoom(room, senders, deadline, self.fence_timeout_s, self.status_completes)
        self.rooms[room] = r
        return r

    def check_free(self, room: int) -> None:
        """Raise DuplicateRoomError if ``room`` is in flight, quarantined or finished recently."""
        if room in self.rooms:
            raise DuplicateRoomError(room, "still in flight on this decode rank")
        if room in self.quarantined:
            # its fences are routed by id: a new room of the same id would take the old room's
            # late AbortAck or Failed for its own and release its slots under live writes
            raise DuplicateRoomError(room, "failed and still waiting for its senders to stop writing")
        if room in self.tombstones:
            raise DuplicateRoomError(room, f"finished {self.tombstones[room].name} recently")

    def _settle(self, actions: list[Action]) -> list[Action]:
        out: list[Action] = []
        for a in actions:
            if isinstance(a, ReleaseRoom):
                r = self.rooms[a.room]
                self._bury(a.room, a.status)
                if not r.slots_released:
                    self.quarantined[a.room] = r
            elif isinstance(a, ReleaseSlots):
                self.quarantined.pop(a.room, None)
            elif isinstance(a, RevokePeer):
                if a.peer in self.revoking or a.peer in self.unrevocable:
                    continue  # asked already (rooms ask on every tick past their fence deadline)
                self.revoking.add(a.peer)
            out.append(a)
        return out

    def _fenced_room(self, room: int) -> DecodeRoom | None:
        """The room a fence event is for: live, or failed and still quarantined."""
        return self.rooms.get(room) or self.quarantined.get(room)

    def on_notification(
        self,
        room: int,
        sender: int,
        kind: NotificationKind,
        chunk_id: int = 0,
        is_last: bool = False,
        component: int = 0,
        chunk_count: int = 1,
        also_components: Sequence[int] = (),
        also_aux: bool = False,
    ) -> list[Action]:
        r = self.rooms.get(room)
        if r is None:
            self.stray_completions += 1
            return []
        return self._settle(
            r.on_notification(
                sender, kind, chunk_id, is_last, component, chunk_count, also_components, also_aux
            )
        )

    def on_status(self, room: int, sender: int, status: Status, failure: Failure | None) -> list[Action]:
        r = self._fenced_room(room)
        return [] if r is None else self._settle(r.on_status(sender, status, failure))

    def on_abort_ack(self, room: int, sender: int) -> list[Action]:
        r = self._fenced_room(room)
        return [] if r is None else self._settle(r.on_abort_ack(sender))

    def on_peer_lost(self, peer: PeerRef, detail: str | None = None) -> list[Action]:
        """``peer`` is gone, or the edge just cut it off: its live rooms fail. A peer that is
        gone fences nothing by that (a stopped process resumes, a closed connection's buffered
        bytes still land), so it is revoked unless this is the edge answering a revocation."""
        actions: list[Action] = []
        for r in list(self.rooms.values()):
            actions += self._settle(r.on_peer_lost(peer, detail))
        if peer not in self.revoking and any(peer in r.unfenced() for r in self.quarantined.values()):
            actions += self._settle([RevokePeer(peer)])
        return actions

    def on_revoked(self, peer: PeerRef) -> list[Action]:
        """The edge revoked ``peer`` and the revocation settled: nothing it writes lands here."""
        self.revoking.discard(peer)
        actions: list[Action] = []
        for r in [*self.rooms.values(), *self.quarantined.values()]:
            actions += self._settle(r.on_revoked(peer))
        return actions

    def on_unrevocable(self, peer: PeerRef, reason: str) -> list[Action]:
        """The edge cannot revoke ``peer`` (``reason``): rooms waiting for it stay quarantined."""
        self.revoking.discard(peer)
        self.unrevocable[peer] = reason
        return []

    def on_reclaimed(self, room: int) -> DecodeRoom | None:
        """The engine took the slots of quarantined ``room`` back on its own authority (it knows
        the writers it waited for are gone for good, or its own timeout freed them): the room is
        forgotten, its late fences and completions are stray. Returns the room (None: it was not
        quarantined). Its tombstone stays, so the id is not reused while late messages may come."""
        return self.quarantined.pop(room, None)

    def on_reregistered(self, peer: PeerRef) -> None:
        """``peer`` registered again (new windows): it may be asked to be revoked again."""
        self.unrevocable.pop(peer, None)

    def on_tick(self, now: float) -> list[Action]:
        actions = super().on_tick(now)
        for r in list(self.quarantined.values()):
            if now >= r.fence_deadline:
                actions += self._settle(r.on_tick(now))
        return actions

    def status(self, room: int) -> Status | None:
        """The room's status: live, quarantined (failed) or recently finished; None if unknown."""
        r = self.rooms.get(room) or self.quarantined.get(room)
        if r is not None:
            return r.status
        return self.tombstones.get(room)

    def abort(self, room: int, failure: Failure) -> list[Action]:
        r = self.rooms.get(room)
        return [] if r is None else self._settle(r.abort(failure))
