"""One room on one decode rank: completion accounting, a pure state machine.

Decode knows, from the rank routing, which prefill senders feed it and what each owes:
every KV chunk (their number is learned from the chunk flagged last), each state component
it asked for, and aux from the one aux owner. Completions are counted per
(sender, component, chunk), never per sender alone (a per-sender count declares
multi-component state complete after its first component). The room succeeds only when
every expected completion arrived; anything unexpected (unknown sender, dummy sender,
repeated or out-of-range chunk, unexpected component) fails it, because a completion this
side cannot account for means the bytes in its slots cannot be trusted either.

A room's end and the reuse of its destination slots are separate. ``ReleaseRoom`` reports
the outcome at once (the engine can retry a failed request elsewhere); ``ReleaseSlots``
hands the slots back to the engine. After a success that is immediate: every write
completed. A failed room is quarantined until every real (non-dummy) sender has *fenced*,
i.e. said that nothing of the room is in flight there any more: a Failed or Success
status (a prefill rank sends either only once its transfers stopped), an AbortAck (sent
only after its drain), or the sender is gone. Failed and AbortAck carry that promise from
protocol 1.3 (``SenderPlan.fences``); an older peer fences only by Success or by leaving.
Dummy senders write nothing and need no fence. A sender that stays silent is given up on
``fence_timeout_s`` after the room's own deadline; that release names it in
``ReleaseSlots.unfenced`` so the edge can make it loud.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from pdwire.runtime.session.actions import Action, PeerRef, ReleaseRoom, ReleaseSlots, SendAbort
from pdwire.runtime.session.failures import Failure, FailureKind
from pdwire.runtime.session.status import RoomStatus


class PartKind(IntEnum):
    KV = 0
    STATE = 1
    AUX = 2


@dataclass(frozen=True, slots=True)
class SenderPlan:
    """What one prefill sender owes this decode rank for one room."""

    sender: int  # unique sender rank, as it appears in notifications and statuses
    peer: PeerRef
    is_dummy: bool = False
    components: tuple[int, ...] = ()
    aux: bool = False
    # its Failed status and AbortAck certify that its writes stopped (peers at protocol 1.3 or
    # newer); an older peer may send them with writes still in flight, so only its Success
    # status, its loss or the fence timeout fence it
    fences: bool = True


class DecodeRoom:
    def __init__(
        self, room: int, senders: Sequence[SenderPlan], deadline: float, fence_timeout_s: float = math.inf
    ) -> None:
        if not any(not s.is_dummy for s in senders):
            raise ValueError(f"room {room}: no real (non-dummy) sender")
        if sum(s.aux for s in senders if not s.is_dummy) != 1:
            raise ValueError(f"room {room}: exactly one real sender must own aux")
        self.room = room
        self.deadline = deadline
        self.fence_deadline = deadline + fence_timeout_s
        self.slots_released = False
        self.status = RoomStatus.BOOTSTRAPPING
        self.failure: Failure | None = None
        self.plans = {s.sender: s for s in senders}
        if len(self.plans) != len(senders):
            raise ValueError(f"room {room}: sender ranks repeat")
        real = [s for s in senders if not s.is_dummy]
        self._kv_seen: dict[int, set[int]] = {s.sender: set() for s in real}
        self._kv_count: dict[int, int | None] = {s.sender: None for s in real}
        self._state_missing: dict[int, set[int]] = {s.sender: set(s.components) for s in real}
        self._aux_missing: set[int] = {s.sender for s in real if s.aux}
        self._fenced: set[int] = set()  # real senders with nothing of the room in flight any more

    @property
    def finished(self) -> bool:
        return self.status.terminal

    def missing(self) -> list[str]:
        """Human-readable list of what has not arrived (for timeout reasons)."""
        out: list[str] = []
        for s, seen in self._kv_seen.items():
            n = self._kv_count[s]
            if n is None:
                out.append(f"sender {s}: kv (last chunk not seen, {len(seen)} chunks so far)")
            elif len(seen) < n:
                out.append(f"sender {s}: kv chunks {sorted(set(range(n)) - seen)}")
        out += [f"sender {s}: state {sorted(c)}" for s, c in self._state_missing.items() if c]
        out += [f"sender {s}: aux" for s in sorted(self._aux_missing)]
        return out

    @property
    def complete(self) -> bool:
        return not self.missing()

    def unfenced(self) -> tuple[PeerRef, ...]:
        """Real senders that may still have a write of this room in flight."""
        return tuple(p.peer for s, p in self.plans.items() if not p.is_dummy and s not in self._fenced)

    # -- events ----------------------------------------------------------------------

    def on_requests_sent(self) -> None:
        if not self.finished:
            self.status = RoomStatus.WAITING_FOR_INPUT

    def on_notification(
        self, sender: int, kind: PartKind, chunk_id: int = 0, is_last: bool = False, component: int = 0
    ) -> list[Action]:
        if self.finished:
            return []
        problem = self._account(sender, kind, chunk_id, is_last, component)
        if problem is not None:
            return self._fail(Failure(FailureKind.VALIDATION, f"room {self.room}: {problem}"))
        self.status = RoomStatus.TRANSFERRING
        if self.complete:
            self.status = RoomStatus.SUCCESS
            self.slots_released = True  # every write completed: nothing can land any more
            return [ReleaseRoom(self.room, RoomStatus.SUCCESS, None), ReleaseSlots(self.room)]
        return []

    def on_status(self, sender: int, status: RoomStatus, failure: Failure | None) -> list[Action]:
        """A status from a prefill sender. A final one fences that sender. Only Failed changes
        the room: Success is counted from completions (a status can overtake the engine's
        notifications)."""
        plan = self.plans.get(sender)
        if plan is not None and (status is RoomStatus.SUCCESS or (status.terminal and plan.fences)):
            self._fenced.add(sender)  # a Success is sent after every write completed, at any version
        if self.finished:
            return self._maybe_release_slots()
        if status is not RoomStatus.FAILED:
            return []
        who = plan.peer if plan is not None else None
        return self._fail(failure or Failure(FailureKind.REMOTE, f"sender {sender} failed"), skip=who)

    def on_abort_ack(self, sender: int) -> list[Action]:
        """A prefill sender acknowledged our Abort: nothing of the room is in flight there."""
        plan = self.plans.get(sender)
        if plan is not None and plan.fences:
            self._fenced.add(sender)
        return self._maybe_release_slots() if self.finished else []

    def on_peer_lost(self, peer: PeerRef) -> list[Action]:
        senders = [s for s, p in self.plans.items() if p.peer == peer]
        if not senders:
            return []
        self._fenced.update(senders)  # a process that is gone writes nothing more
        if self.finished:
            return self._maybe_release_slots()
        return self._fail(Failure(FailureKind.PEER_GONE, f"{peer} went away"), skip=peer)

    def on_tick(self, now: float) -> list[Action]:
        if self.finished:
            if self.slots_released or now < self.fence_deadline:
                return []
            # A sender never fenced: hand the slots back anyway, naming it (never silently).
            self.slots_released = True
            return [ReleaseSlots(self.room, self.unfenced())]
        if now < self.deadline:
            return []
        return self._fail(
            Failure(
                FailureKind.TIMEOUT, f"room {self.room} incomplete at deadline: {'; '.join(self.missing())}"
            )
        )

    def abort(self, failure: Failure) -> list[Action]:
        """Fail the room locally (the owner gave up, or the edge found a problem)."""
        if self.finished:
            return []
        return self._fail(failure)

    # -- internals -------------------------------------------------------------------

    def _account(
        self, sender: int, kind: PartKind, chunk_id: int, is_last: bool, component: int
    ) -> str | None:
        plan = self.plans.get(sender)
        if plan is None:
            return f"completion from sender {sender}, which does not feed this rank"
        if plan.is_dummy:
            return f"completion from dummy sender {sender}"
        if kind is PartKind.KV:
            seen, count = self._kv_seen[sender], self._kv_count[sender]
            if chunk_id < 0 or chunk_id in seen:
                return f"sender {sender}: kv chunk {chunk_id} repeated or negative"
            if count is not None and chunk_id >= count:
                return f"sender {sender}: kv chunk {chunk_id} after last chunk {count - 1}"
            if is_last:
                if seen and max(seen) > chunk_id:
                    return f"sender {sender}: last kv chunk {chunk_id} but chunk {max(seen)} arrived"
                self._kv_count[sender] = chunk_id + 1
            seen.add(chunk_id)
            return None
        if kind is PartKind.STATE:
            missing = self._state_missing[sender]
            if component not in missing:
                return f"sender {sender}: state component {component} unexpected or repeated"
            missing.remove(component)
            return None
        if sender not in self._aux_missing:
            return f"sender {sender}: aux unexpected or repeated"
        self._aux_missing.remove(sender)
        return None

    def _fail(self, failure: Failure, skip: PeerRef | None = None) -> list[Action]:
        self.status = RoomStatus.FAILED
        self.failure = failure
        # Tell every prefill sender to stop and free its side; the one that failed knows.
        peers = dict.fromkeys(p.peer for p in self.plans.values() if p.peer != skip)
        actions: list[Action] = [SendAbort(p, self.room, failure) for p in peers]
        actions.append(ReleaseRoom(self.room, RoomStatus.FAILED, failure))
        return actions + self._maybe_release_slots()

    def _maybe_release_slots(self) -> list[Action]:
        if self.slots_released or self.unfenced():
            return []
        self.slots_released = True
        return [ReleaseSlots(self.room)]
