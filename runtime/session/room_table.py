"""What the prefill and the decode session do alike with their rooms.

Both keep their live rooms by id, fail every room of a peer that went away, run each room's
deadline check once it is due (a finished room kept for other reasons has none), and remember
finished rooms in a bounded tombstone list (oldest dropped first) so that a late or repeated id
is recognised. What a room is, and what a tombstone holds, is each session's own; so is
``_settle``, the book-keeping after a room returned actions.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from pdwire.runtime.session.actions import Action, PeerRef


class _Room(Protocol):
    @property
    def deadline(self) -> float: ...

    @property
    def finished(self) -> bool: ...

    def on_peer_lost(self, peer: PeerRef) -> list[Action]: ...

    def on_tick(self, now: float) -> list[Action]: ...


R = TypeVar("R", bound=_Room)
T = TypeVar("T")


class RoomTable(Generic[R, T]):
    def __init__(self, room_timeout_s: float, tombstones: int) -> None:
        self.room_timeout_s = room_timeout_s
        self.rooms: dict[int, R] = {}
        self.tombstones: OrderedDict[int, T] = OrderedDict()
        self._max_tombstones = tombstones

    def _settle(self, actions: list[Action]) -> list[Action]:
        raise NotImplementedError

    def _bury(self, room: int, tombstone: T) -> None:
        """Retire ``room``: forget the live room, keep its tombstone (within the bound)."""
        self.rooms.pop(room, None)
        self.tombstones[room] = tombstone
        while len(self.tombstones) > self._max_tombstones:
            self.tombstones.popitem(last=False)

    def on_peer_lost(self, peer: PeerRef) -> list[Action]:
        actions: list[Action] = []
        for r in list(self.rooms.values()):
            actions += self._settle(r.on_peer_lost(peer))
        return actions

    def on_tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for r in list(self.rooms.values()):
            if now >= r.deadline and not r.finished:
                actions += self._settle(r.on_tick(now))
        return actions
