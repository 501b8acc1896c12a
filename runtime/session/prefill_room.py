"""One room on one prefill rank: a pure state machine.

Bootstrapping (collecting ``required_dst_info_num`` transfer requests) -> WaitingForInput
(all requests in, waiting for chunked prefill to produce pages) -> Transferring (posts in
flight) -> Success | Failed.

Chunks the engine produces before every request has arrived are remembered and posted as
soon as the last request comes in. Every non-dummy target gets every KV chunk, in order;
after its last KV chunk it gets each of its state components and then its aux part (aux
is posted on the last chunk even for dense models: decode's accounting needs it). The room
succeeds when every request arrived, the engine produced its last chunk and every posted
transfer completed. Any failure fails the whole room: every target that sent a request is
told, in-flight handles are handed back for release, and nothing is posted afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdwire.runtime.session.actions import (
    Action,
    AuxPart,
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
        if self.outstanding.pop(xfer_id, None) is None or self.finished:
            return []
        return self._maybe_succeed()

    def on_xfer_failed(self, xfer_id: int, detail: str) -> list[Action]:
        entry = self.outstanding.pop(xfer_id, None)
        if entry is None or self.finished:
            return []
        peer, part = entry
        return self._fail(Failure(FailureKind.ENGINE_ERROR, f"{type(part).__name__} to {peer}: {detail}"))

    def on_abort(self, peer: PeerRef) -> list[Action]:
        acts: list[Action] = [SendAbortAck(peer, self.room)]
        if self.finished or peer not in self.targets:
            # Only a requester may abort the room: another engine that reused the room id
            # (and was refused as a duplicate) aborts *its* attempt, not this one.
            return acts
        return acts + self._fail(Failure(FailureKind.ABORTED, f"aborted by {peer}"), skip=peer)

    def on_peer_lost(self, peer: PeerRef) -> list[Action]:
        if self.finished or peer not in self.targets:
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

    def _fail(self, failure: Failure, skip: PeerRef | None = None) -> list[Action]:
        self.status = RoomStatus.FAILED
        self.failure = failure
        in_flight = tuple(self.outstanding)
        self.outstanding.clear()
        actions: list[Action] = [
            SendStatus(p, self.room, RoomStatus.FAILED, failure) for p in self.targets if p != skip
        ]
        actions.append(ReleaseRoom(self.room, RoomStatus.FAILED, failure, in_flight))
        return actions
