"""All rooms of one decode rank: room ids, routing of completions and statuses, timeouts.

Pure like the prefill session. Starting a room whose id is active, or finished recently,
raises :class:`DuplicateRoomError` before anything is sent, so a repeated client-supplied id
never reaches (or confuses) a prefill rank.

A failed room is buried (tombstone: its late completions are stray, not failures) but stays
*quarantined* until its slots are released (see :mod:`.decode_room`): statuses, AbortAcks,
lost peers and ticks still reach it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdwire.runtime.session.actions import Action, PeerRef, ReleaseRoom, ReleaseSlots
from pdwire.runtime.session.decode_room import DecodeRoom, PartKind, SenderPlan
from pdwire.runtime.session.failures import DuplicateRoomError, Failure
from pdwire.runtime.session.room_table import RoomTable
from pdwire.runtime.session.status import RoomStatus


class DecodeSession(RoomTable[DecodeRoom, RoomStatus]):
    """Live rooms by id; ``tombstones`` holds the final status of recently finished ones and
    ``quarantined`` the failed ones whose slots are not released yet.

    ``fence_timeout_s`` (default twice the room timeout: longer than any transfer may take)
    bounds how long past its deadline a failed room waits for a silent sender.
    """

    def __init__(
        self, room_timeout_s: float = 30.0, tombstones: int = 65536, fence_timeout_s: float | None = None
    ) -> None:
        super().__init__(room_timeout_s, tombstones)
        self.fence_timeout_s = 2 * room_timeout_s if fence_timeout_s is None else fence_timeout_s
        self.quarantined: dict[int, DecodeRoom] = {}
        self.stray_completions = 0  # completions for rooms already over (late, harmless)

    def start_room(
        self, room: int, senders: Sequence[SenderPlan], now: float, timeout_s: float | None = None
    ) -> DecodeRoom:
        self.check_free(room)
        deadline = now + (self.room_timeout_s if timeout_s is None else timeout_s)
        r = DecodeRoom(room, senders, deadline, self.fence_timeout_s)
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
        for a in actions:
            if isinstance(a, ReleaseRoom):
                r = self.rooms[a.room]
                self._bury(a.room, a.status)
                if not r.slots_released:
                    self.quarantined[a.room] = r
            elif isinstance(a, ReleaseSlots):
                self.quarantined.pop(a.room, None)
        return actions

    def _fenced_room(self, room: int) -> DecodeRoom | None:
        """The room a fence event is for: live, or failed and still quarantined."""
        return self.rooms.get(room) or self.quarantined.get(room)

    def on_notification(
        self,
        room: int,
        sender: int,
        kind: PartKind,
        chunk_id: int = 0,
        is_last: bool = False,
        component: int = 0,
    ) -> list[Action]:
        r = self.rooms.get(room)
        if r is None:
            self.stray_completions += 1
            return []
        return self._settle(r.on_notification(sender, kind, chunk_id, is_last, component))

    def on_status(self, room: int, sender: int, status: RoomStatus, failure: Failure | None) -> list[Action]:
        r = self._fenced_room(room)
        return [] if r is None else self._settle(r.on_status(sender, status, failure))

    def on_abort_ack(self, room: int, sender: int) -> list[Action]:
        r = self._fenced_room(room)
        return [] if r is None else self._settle(r.on_abort_ack(sender))

    def on_peer_lost(self, peer: PeerRef) -> list[Action]:
        actions = super().on_peer_lost(peer)
        for r in list(self.quarantined.values()):
            actions += self._settle(r.on_peer_lost(peer))
        return actions

    def on_tick(self, now: float) -> list[Action]:
        actions = super().on_tick(now)
        for r in list(self.quarantined.values()):
            if now >= r.fence_deadline:
                actions += self._settle(r.on_tick(now))
        return actions

    def abort(self, room: int, failure: Failure) -> list[Action]:
        r = self.rooms.get(room)
        return [] if r is None else self._settle(r.abort(failure))
