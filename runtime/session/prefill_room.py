"""One room on one prefill rank: a pure state machine.

Bootstrapping (collecting ``required_dst_info_num`` transfer requests) -> WaitingForInput
(all requests in, waiting for chunked prefill to produce pages) -> Transferring (posts in
flight) -> Success | Failed (draining while transfers stop) -> ended.

Chunks the engine produces before every request has arrived are remembered and posted as
soon as the last request comes in. Every non-dummy target gets every KV chunk, in order;
after its last KV chunk it gets each of its state components and then its aux part (aux
is posted on the last chunk even for dense models: decode's accounting needs it). The room
succeeds when every request arrived, the engine produced its last chunk and every posted
transfer completed. Any failure fails the whole room and nothing is posted afterwards.

A failed room is *fenced*: while any transfer it posted may still write into a target's
slots, the room drains: it asks for those transfers to be cancelled and answers nobody.
Only once every one of them was reported done or failed (the engine confirmed it stopped)
does it tell every target that sent a request (except the one that failed it), acknowledge
every Abort it received meanwhile, and release. So a Failed status or an AbortAck from a
prefill rank means: nothing of this room is in flight here any more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdwire.runtime.session.actions import (
    Action,
    AuxPart,
    CancelTransfers,
    KvPart,
    Part,
    PeerRef,
    PostTransfer,
    ReleaseRoom,
    SendAbortAck,
    SendStatus,
    StatePart,
)
from pdwire.runtime.session.failures import Failure, FailureKind, ProtocolViolation
from pdwire.runtime.session.status import RoomStatus


@dataclass(frozen=True, slots=True)
class Target:
    """One decode rank that asked for this room, and what this prefill rank owes it."""

    peer: PeerRef
    is_dummy: bool
    components: tuple[int, ...] = ()  # state components to send (non-empty on both sides)
    sends_aux: bool = False  # this prefill rank is the aux owner for that decode rank


@dataclass(frozen=True, slots=True)
class Chunk:
    chunk_id: int
    start: int
    stop: int
    is_last: bool


class PrefillRoom:
    def __init__(self, room: int, deadline: float, next_xfer_id: Callable[[], int]) -> None:
        self.room = room
        self.deadline = deadline
        self.status = RoomStatus.BOOTSTRAPPING
        self.failure: Failure | None = None
        self.required: int | None = None
        self.targets: dict[PeerRef, Target] = {}
        self.chunks: list[Chunk] = []
        self.outstanding: dict[int, tuple[PeerRef, Part]] = {}
        self._next_xfer_id = next_xfer_id
        self._not_told: set[PeerRef] = set()  # gets no Failed status: it failed the room, or is gone
        self._acks_owed: list[PeerRef] = []  # Aborts answered once the room stopped draining

    # -- queries ---------------------------------------------------------------------

    @property
    def all_requests_in(self) -> bool:
        return self.required is not None and len(self.targets) == self.required

    @property
    def last_chunk_seen(self) -> bool:
        return bool(self.chunks) and self.chunks[-1].is_last

    @property
    def finished(self) -> bool:
        return self.status.terminal

    @property
    def draining(self) -> bool:
        """Failed, with transfers the engine has not confirmed stopped yet."""
        return self.status is RoomStatus.FAILED and bool(self.outstanding)

    # -- events ----------------------------------------------------------------------

    def on_request(self, target: Target, required: int) -> list[Action]:
        """A transfer request from ``target``; the session has already ruled out duplicates."""
        if self.finished:
            return []
        if required < 1:
            return self._fail(Failure(FailureKind.VALIDATION, f"required_dst_info_num={required} < 1"))
        if self.required is not None and required != self.required:
            return self._fail(
                Failure(
                    FailureKind.VALIDATION,
                    f"{target.peer} says required_dst_info_num={required}, earlier requests said "
                    f"{self.required}",
                )
            )
        self.required = required
        self.targets[target.peer] = target
        if not self.all_requests_in:
            return []
        self.status = RoomStatus.WAITING_FOR_INPUT
        actions: list[Action] = []
        for chunk in self.chunks:  # chunks produced before the last request arrived
            actions += self._post_chunk(chunk)
        return actions + self._maybe_succeed()

    def on_chunk(self, start: int, stop: int, is_last: bool) -> list[Action]:
        """Chunked prefill produced pages ``[start, stop)`` of the prompt."""
        if self.finished:
            return []
        if self.last_chunk_seen:
            raise ProtocolViolation(f"room {self.room}: chunk after the last chunk")
        expected_start = self.chunks[-1].stop if self.chunks else 0
        if stop < start or start != expected_start:
            raise ProtocolViolation(
                f"room {self.room}: chunk [{start}, {stop}) must start at page {expected_start}"
            )
        chunk = Chunk(len(self.chunks), start, stop, is_last)
        self.chunks.append(chunk)
        if not self.all_requests_in:
            return []
        return self._post_chunk(chunk) + self._maybe_succeed()

    def on_xfer_done(self, xfer_id: int) -> list[Action]:
        """A posted transfer completed (the engine is done with it)."""
        return self._xfer_ended(xfer_id, None)

    def on_xfer_failed(self, xfer_id: int, detail: str) -> list[Action]:
        """A posted transfer failed or was cancelled, and the engine confirmed it stopped."""
        return self._xfer_ended(
            xfer_id,
            lambda peer, part: Failure(
                FailureKind.ENGINE_ERROR, f"{type(part).__name__} to {peer}: {detail}"
            ),
        )

    def on_not_posted(self, xfer_id: int, failure: Failure) -> list[Action]:
        """The edge did not post a part it was asked to (planning failed, the engine refused,
        the peer is not connected, or the room failed meanwhile): nothing of it is in flight."""
        return self._xfer_ended(xfer_id, lambda _peer, _part: failure)

    def on_abort(self, peer: PeerRef) -> list[Action]:
        if peer not in self.targets or (self.finished and not self.draining):
            # Only a requester may abort the room: another engine that reused the room id
            # (and was refused as a duplicate) aborts *its* attempt, not this one. Nothing of
            # the room is in flight for that peer, so the answer needs no wait.
            return [SendAbortAck(peer, self.room)]
        if self.draining:
            self._acks_owed.append(peer)  # "nothing in flight" is true only after the drain
            return []
        return self._fail(Failure(FailureKind.ABORTED, f"aborted by {peer}"), skip=peer, ack=peer)

    def on_peer_lost(self, peer: PeerRef) -> list[Action]:
        if peer not in self.targets or (self.finished and not self.draining):
            return []
        if self.draining:
            # whoever answers on that peer's name later is someone else: tell it nothing
            self._not_told.add(peer)
            self._acks_owed = [p for p in self._acks_owed if p != peer]
            return []
        return self._fail(Failure(FailureKind.PEER_GONE, f"{peer} went away"), skip=peer)

    def on_tick(self, now: float) -> list[Action]:
        if self.finished or now < self.deadline:
            return []
        have = len(self.targets)
        want = "?" if self.required is None else str(self.required)
        return self._fail(
            Failure(
                FailureKind.TIMEOUT,
                f"room {self.room} not done by its deadline: status {self.status.name}, "
                f"{have}/{want} requests, last chunk {'seen' if self.last_chunk_seen else 'not seen'}, "
                f"{len(self.outstanding)} transfers in flight",
            )
        )

    def fail(self, failure: Failure) -> list[Action]:
        """Fail the room from outside (a planning or validation error at the edge)."""
        if self.finished:
            return []
        return self._fail(failure)

    # -- internals -------------------------------------------------------------------

    def _post(self, peer: PeerRef, part: Part) -> PostTransfer:
        xfer_id = self._next_xfer_id()
        self.outstanding[xfer_id] = (peer, part)
        self.status = RoomStatus.TRANSFERRING
        return PostTransfer(xfer_id, self.room, peer, part)

    def _post_chunk(self, chunk: Chunk) -> list[Action]:
        actions: list[Action] = []
        for target in self.targets.values():
            if target.is_dummy:
                continue
            kv = KvPart(chunk.chunk_id, chunk.start, chunk.stop, chunk.is_last)
            actions.append(self._post(target.peer, kv))
            if chunk.is_last:
                actions += [self._post(target.peer, StatePart(c)) for c in target.components]
                if target.sends_aux:
                    actions.append(self._post(target.peer, AuxPart()))
        return actions

    def _maybe_succeed(self) -> list[Action]:
        if not (self.all_requests_in and self.last_chunk_seen and not self.outstanding):
            return []
        self.status = RoomStatus.SUCCESS
        actions: list[Action] = [SendStatus(p, self.room, RoomStatus.SUCCESS) for p in self.targets]
        actions.append(ReleaseRoom(self.room, RoomStatus.SUCCESS, None))
        return actions

    def _xfer_ended(self, xfer_id: int, failure: Callable[[PeerRef, Part], Failure] | None) -> list[Action]:
        """One posted part is no longer in flight: completed (``failure`` None) or not."""
        entry = self.outstanding.pop(xfer_id, None)
        if entry is None:
            return []
        if self.finished:
            return [] if self.outstanding else self._end_failed()  # draining: maybe the last one
        if failure is None:
            return self._maybe_succeed()
        return self._fail(failure(*entry))

    def _fail(
        self, failure: Failure, skip: PeerRef | None = None, ack: PeerRef | None = None
    ) -> list[Action]:
        self.status = RoomStatus.FAILED
        self.failure = failure
        if skip is not None:
            self._not_told.add(skip)
        if ack is not None:
            self._acks_owed.append(ack)
        if self.outstanding:
            # The engine may still be writing into the targets' slots: answer nobody until
            # every posted transfer is confirmed stopped (see the module notes).
            return [CancelTransfers(self.room, tuple(self.outstanding))]
        return self._end_failed()

    def _end_failed(self) -> list[Action]:
        assert self.failure is not None and not self.outstanding
        failure = self.failure
        actions: list[Action] = [
            SendStatus(p, self.room, RoomStatus.FAILED, failure)
            for p in self.targets
            if p not in self._not_told
        ]
        actions += [SendAbortAck(p, self.room) for p in self._acks_owed]
        self._acks_owed = []
        actions.append(ReleaseRoom(self.room, RoomStatus.FAILED, failure))
        return actions
