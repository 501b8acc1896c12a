"""All rooms of one prefill rank: routing of events to rooms, duplicate ids, timeouts.

Pure: every method takes the current time as a value and returns actions. A failed room
stays while it drains (its transfers stopping); ended rooms leave a bounded tombstone, so
that a late or repeated request for the same id gets a typed answer (its original failure,
or ``duplicate_room``) instead of silently opening a room that would never complete.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdwire.runtime.session.actions import (
    Action,
    PeerRef,
    PostTransfer,
    ReleaseRoom,
    SendAbortAck,
    SendStatus,
)
from pdwire.runtime.session.failures import Failure, FailureKind
from pdwire.runtime.session.prefill_room import PrefillRoom, Target
from pdwire.runtime.session.room_table import RoomTable
from pdwire.runtime.session.status import RoomStatus


@dataclass(frozen=True, slots=True)
class Tombstone:
    status: RoomStatus
    failure: Failure | None
    peers: frozenset[PeerRef]


class PrefillSession(RoomTable[PrefillRoom, Tombstone]):
    def __init__(self, room_timeout_s: float = 30.0, tombstones: int = 65536) -> None:
        super().__init__(room_timeout_s, tombstones)
        self._xfer_room: dict[int, int] = {}
        self._xfer_counter = 0

    def _next_xfer_id(self) -> int:
        self._xfer_counter += 1
        return self._xfer_counter

    def _room(self, room: int, now: float) -> PrefillRoom:
        r = self.rooms.get(room)
        if r is None:
            r = PrefillRoom(room, now + self.room_timeout_s, self._next_xfer_id)
            self.rooms[room] = r
        return r

    def _settle(self, actions: list[Action]) -> list[Action]:
        """Book-keeping after a room returned actions: track transfers, retire finished rooms."""
        for a in actions:
            if isinstance(a, PostTransfer):
                self._xfer_room[a.xfer_id] = a.room
            elif isinstance(a, ReleaseRoom):
                targets = frozenset(self.rooms[a.room].targets)
                self._bury(a.room, Tombstone(a.status, a.failure, targets))
        return actions

    # -- events ----------------------------------------------------------------------

    def on_request(self, room: int, target: Target, required: int, now: float) -> list[Action]:
        peer = target.peer
        r = self.rooms.get(room)
        if r is None:
            dead = self.tombstones.get(room)
        elif r.draining:  # failed already: answered like an ended room (nothing is posted for it)
            dead = Tombstone(r.status, r.failure, frozenset(r.targets))
        else:
            dead = None
        if dead is not None:
            # A late request from the same engine for a room that failed learns why it failed;
            # anything else reusing a finished id is a duplicate. Nothing was ever posted to
            # this peer for the room, so its answer needs no drain.
            same_engine = not dead.peers or peer.engine_id in {p.engine_id for p in dead.peers}
            failed = dead.status is RoomStatus.FAILED and dead.failure is not None
            if failed and same_engine and peer not in dead.peers:
                assert dead.failure is not None
                return [SendStatus(peer, room, RoomStatus.FAILED, dead.failure)]
            return [self._duplicate(peer, room, f"room {room} already finished {dead.status.name}")]
        if r is not None:
            engines = {p.engine_id for p in r.targets}
            if peer in r.targets:
                return [self._duplicate(peer, room, f"{peer} already asked for room {room}")]
            if engines and peer.engine_id not in engines:
                return [self._duplicate(peer, room, f"room {room} belongs to engine {sorted(engines)[0]}")]
            if r.all_requests_in:
                return [self._duplicate(peer, room, f"room {room} already has all {r.required} requests")]
        return self._settle(self._room(room, now).on_request(target, required))

    def _duplicate(self, peer: PeerRef, room: int, detail: str) -> SendStatus:
        return SendStatus(peer, room, RoomStatus.FAILED, Failure(FailureKind.DUPLICATE_ROOM, detail))

    def on_chunk(self, room: int, start: int, stop: int, is_last: bool, now: float) -> list[Action]:
        if room in self.tombstones and room not in self.rooms:
            return []  # the room already failed (or was aborted); the engine's pages are freed there
        return self._settle(self._room(room, now).on_chunk(start, stop, is_last))

    def on_xfer_done(self, xfer_id: int) -> list[Action]:
        room = self._xfer_room.pop(xfer_id, None)
        if room is None:
            return []
        return self._settle(self.rooms[room].on_xfer_done(xfer_id))

    def on_xfer_failed(self, xfer_id: int, detail: str) -> list[Action]:
        room = self._xfer_room.pop(xfer_id, None)
        if room is None:
            return []
        return self._settle(self.rooms[room].on_xfer_failed(xfer_id, detail))

    def on_not_posted(self, xfer_id: int, failure: Failure) -> list[Action]:
        """A PostTransfer the edge did not post (see :meth:`PrefillRoom.on_not_posted`)."""
        room = self._xfer_room.pop(xfer_id, None)
        if room is None:
            return []
        return self._settle(self.rooms[room].on_not_posted(xfer_id, failure))

    def on_abort(self, room: int, peer: PeerRef) -> list[Action]:
        r = self.rooms.get(room)
        if r is None:
            return [SendAbortAck(peer, room)]
        return self._settle(r.on_abort(peer))

    def fail_room(self, room: int, failure: Failure) -> list[Action]:
        r = self.rooms.get(room)
        return [] if r is None else self._settle(r.fail(failure))

    def room_of(self, xfer_id: int) -> int | None:
        """The room an in-flight transfer belongs to."""
        return self._xfer_room.get(xfer_id)

    def accepts_posts(self, room: int) -> bool:
        """Whether ``room`` is live: a PostTransfer of a room that failed meanwhile is not posted."""
        r = self.rooms.get(room)
        return r is not None and not r.finished
