"""All rooms of one prefill rank: routing of events to rooms, duplicate ids, timeouts.

Pure: every method takes the current time as a value and returns actions. A failed room
stays while it drains (its transfers stopping); ended rooms leave a bounded tombstone, so
that a late or repeated request for the same id gets a typed answer (its original failure,
or ``duplicate_room``) instead of silently opening a room that would never complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdwire.runtime.session.actions import (
    I32,
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
from pdwire.runtime.session.status import Status


@dataclass(frozen=True, slots=True)
class Tombstone:
    status: Status
    failure: Failure | None
    peers: frozenset[PeerRef]
    declined: bool = False  # a decode rank declined the room before the engine produced any of it


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
            failed = dead.status is Status.FAILED and dead.failure is not None
            if failed and same_engine and peer not in dead.peers:
                assert dead.failure is not None
                return [SendStatus(peer, room, Status.FAILED, dead.failure)]
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
        return SendStatus(peer, room, Status.FAILED, Failure(FailureKind.DUPLICATE_ROOM, detail))

    def on_chunk(
        self,
        room: int,
        pages: I32,
        is_last: bool,
        now: float,
        state: Sequence[I32 | None] | None = None,
        aux_index: int | None = None,
    ) -> list[Action]:
        """The engine produced the next ``pages`` of ``room`` (see :meth:`PrefillRoom.on_chunk`)."""
        dead = self.tombstones.get(room) if room not in self.rooms else None
        if dead is not None:
            if dead.status is Status.SUCCESS:
                # the room was sent in full and released: these are pages of a new use of its
                # id, which nobody can be served (every request for it is refused as a
                # duplicate). They are released at once, or the engine would wait for them forever.
                failure = Failure(FailureKind.DUPLICATE_ROOM, f"room {room} already finished SUCCESS")
                return [ReleaseRoom(room, Status.FAILED, failure)]
            if dead.declined:
                # declined before the engine produced it: nobody will ask, give the pages back
                return [ReleaseRoom(room, Status.FAILED, dead.failure)]
            return []  # the room failed (or was aborted) while being sent; its pages were freed there
        return self._settle(self._room(room, now).on_chunk(pages, is_last, state, aux_index))

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
            if room not in self.tombstones:
                # declined before this engine produced any of it: its chunks, when they come,
                # are released at once and a request for it is refused
                failure = Failure(FailureKind.ABORTED, f"declined by {peer} before any request")
                self._bury(room, Tombstone(Status.FAILED, failure, frozenset(), declined=True))
            return [SendAbortAck(peer, room)]
        return self._settle(r.on_abort(peer))

    def abort_refusal(self, room: int, peer: PeerRef) -> str | None:
        """Why an Abort of ``room`` from the registered ``peer`` changes nothing: the room was
        asked for, and not by ``peer`` (only a requester may abort it; :meth:`on_abort` answers
        it without touching the room). None when the Abort acts, or there is nothing to act on."""
        r = self.rooms.get(room)
        if r is None or not r.targets or peer in r.targets:
            return None
        askers = ", ".join(sorted(str(p) for p in r.targets))
        return f"room {room} was asked for by {askers}; only a requester may abort it"

    def on_lease(self, rooms: Sequence[int], peer: PeerRef, now: float) -> int:
        """``peer``'s engine still holds a request for each of ``rooms``: each live room waiting
        for requests is held ``room_timeout_s`` from ``now`` (:meth:`PrefillRoom.renew`). A room
        not produced yet or already over is left alone (a new room gets its full timeout; an
        expired one stays failed). Returns how many rooms were renewed."""
        until = now + self.room_timeout_s
        return sum(1 for room in rooms if (r := self.rooms.get(room)) is not None and r.renew(peer, until))

    def fail_room(self, room: int, failure: Failure) -> list[Action]:
        r = self.rooms.get(room)
        return [] if r is None else self._settle(r.fail(failure))

    def abort(self, room: int, failure: Failure, now: float) -> list[Action]:
        """The prefill engine gives up on ``room``. A live room fails (and drains); a room no
        decode rank asked for yet is remembered as failed, so its requests get ``failure``."""
        if room in self.rooms:
            return self.fail_room(room, failure)
        if room not in self.tombstones:
            self._bury(room, Tombstone(Status.FAILED, failure, frozenset()))
        return []

    def status(self, room: int) -> Status | None:
        """The room's status: live, or its tombstone's; None for a room never seen (or forgotten)."""
        r = self.rooms.get(room)
        if r is not None:
            return r.status
        dead = self.tombstones.get(room)
        return None if dead is None else dead.status

    def room_of(self, xfer_id: int) -> int | None:
        """The room an in-flight transfer belongs to."""
        return self._xfer_room.get(xfer_id)

    def refuses_post(self, room: int, now: float) -> Failure | None:
        """Why a PostTransfer of ``room`` must not be posted at ``now``, or None if it may be.

        Asked at the moment of each post, not when the batch of actions was made: a room that
        failed meanwhile, or whose deadline passed (the rank may have stalled between two posts
        of one batch, e.g. stopped, and resumed past it), gets nothing more posted; the decode
        rank may already have given the room's slots to another request."""
        r = self.rooms.get(room)
        if r is None or r.finished:
            return Failure(FailureKind.ABORTED, f"room {room} failed before this part was posted")
        if now >= r.deadline:
            why = f"room {room} reached its deadline before this part was posted"
            return Failure(FailureKind.TIMEOUT, why)
        return None
