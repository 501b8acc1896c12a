"""One room on one decode rank: completion accounting, a pure state machine (its moves:
``DECODE_ROOM`` in :mod:`.states`; fences and revocation: docs/fencing.md).

Completions are counted per (sender, component, chunk), never per sender alone (a per-sender
count declares multi-component state complete after its first component). Anything this side
cannot account for fails the room: the bytes in its slots cannot be trusted either.

A room's end (``ReleaseRoom``, at once) and the reuse of its slots (``ReleaseSlots``) are
separate: a failed room is quarantined until every real sender fenced (Success, or a Failed
status or AbortAck from a sender whose reports are fences, ``SenderPlan.fences``) or was
revoked. A sender that is gone fences nothing by that alone (a stopped process resumes, a
closed connection's buffered bytes still land); a timeout alone never releases slots.

``status_completes`` (engines that may lose a notification yet report the write done, as
Mooncake does while a link is down) lets a sender's Success stand for every part it owes. A
1.4 notification may complete several parts; it is accounted exactly as those parts one by one
(KV chunks ascending), so both forms lead to the same outcome.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pdwire.runtime.session.actions import Action, PeerRef, ReleaseRoom, ReleaseSlots, RevokePeer, SendAbort
from pdwire.runtime.session.failures import Failure, FailureKind
from pdwire.runtime.session.states import DECODE_ROOM, StateField
from pdwire.runtime.session.status import Status, is_terminal
from pdwire.wire import NotificationKind

MAX_CHUNKS_PER_NOTIFICATION = 1 << 16
"""A notification naming more KV chunks than this fails the room (a prefill rank merges the few
chunks ready at once; a hostile count must not make this side count billions)."""


@dataclass(frozen=True, slots=True)
class SenderPlan:
    """What one prefill sender owes this decode rank for one room."""

    sender: int  # unique sender rank, as it appears in notifications and statuses
    peer: PeerRef
    is_dummy: bool = False
    components: tuple[int, ...] = ()
    aux: bool = False
    # its Failed status and AbortAck certify that its writes stopped (peers at protocol 1.3 or
    # newer, on an engine whose reports mean that); any other sender may send them with writes
    # still in flight, so only its Success status or its revocation fences it
    fences: bool = True


class DecodeRoom:
    status = StateField(DECODE_ROOM)  # every move checked against its table (:mod:`.states`)

    def __init__(
        self,
        room: int,
        senders: Sequence[SenderPlan],
        deadline: float,
        fence_timeout_s: float = math.inf,
        status_completes: bool = False,
    ) -> None:
        if not any(not s.is_dummy for s in senders):
            raise ValueError(f"room {room}: no real (non-dummy) sender")
        if sum(s.aux for s in senders if not s.is_dummy) > 1:
            raise ValueError(f"room {room}: at most one real sender owns aux")
        self.room = room
        self.deadline = deadline
        self.fence_deadline = deadline + fence_timeout_s
        self.slots_released = False
        self.status = Status.BOOTSTRAPPING
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
        self._revoked: set[PeerRef] = set()  # peers fenced by revocation (for ReleaseSlots)
        self.status_completes = status_completes
        self._vouched: set[int] = set()  # real senders whose Success stands for all they owe

    @property
    def finished(self) -> bool:
        return is_terminal(self.status)

    def missing(self) -> list[str]:
        """Human-readable list of what has not arrived (for timeout reasons)."""
        out: list[str] = []
        for s, seen in self._kv_seen.items():
            n = self._kv_count[s]
            if s in self._vouched:
                continue
            if n is None:
                out.append(f"sender {s}: kv (last chunk not seen, {len(seen)} chunks so far)")
            elif len(seen) < n:
                out.append(f"sender {s}: kv chunks {sorted(set(range(n)) - seen)}")
        out += [
            f"sender {s}: state {sorted(c)}"
            for s, c in self._state_missing.items()
            if c and s not in self._vouched
        ]
        out += [f"sender {s}: aux" for s in sorted(self._aux_missing - self._vouched)]
        return out

    @property
    def complete(self) -> bool:
        """Nothing owed is missing (``missing()`` is empty), in time linear in the senders: it is
        asked after every part of a multi-part notification."""
        for s, seen in self._kv_seen.items():
            n = self._kv_count[s]
            # ``seen`` holds only chunks below the count (a later or repeated one fails the room)
            if s not in self._vouched and (n is None or len(seen) < n):
                return False
        if any(c and s not in self._vouched for s, c in self._state_missing.items()):
            return False
        return not self._aux_missing - self._vouched

    def unfenced(self) -> tuple[PeerRef, ...]:
        """Real senders that may still have a write of this room in flight."""
        return tuple(p.peer for s, p in self.plans.items() if not p.is_dummy and s not in self._fenced)

    # -- events ----------------------------------------------------------------------

    def on_requests_sent(self) -> None:
        if self.status is Status.BOOTSTRAPPING:  # not after a completion overtook it
            self.status = Status.WAITING_FOR_INPUT

    def on_notification(
        self,
        sender: int,
        kind: NotificationKind,
        chunk_id: int = 0,
        is_last: bool = False,
        component: int = 0,
        chunk_count: int = 1,
        also_components: Sequence[int] = (),
        also_aux: bool = False,
    ) -> list[Action]:
        """A completion: one part, or (protocol 1.4) several parts one engine write carried."""
        if self.finished:
            return []
        problem = self._check_count(sender, kind, chunk_count)
        if problem is None:
            for part in _parts(kind, chunk_id, is_last, component, chunk_count, also_components, also_aux):
                problem = self._account(sender, *part)
                # a part that completes the room ends it, as a single notification would: the
                # parts after it are ignored like completions arriving after a success
                if problem is not None or self.complete:
                    break
        if problem is not None:
            return self._fail(Failure(FailureKind.VALIDATION, f"room {self.room}: {problem}"))
        self.status = Status.TRANSFERRING
        return self._succeed_if_complete()

    def _succeed_if_complete(self) -> list[Action]:
        if not self.complete:
            return []
        self.status = Status.SUCCESS
        self.slots_released = True  # every write completed: nothing can land any more
        return [ReleaseRoom(self.room, Status.SUCCESS, None), ReleaseSlots(self.room)]

    def on_status(self, sender: int, status: Status, failure: Failure | None) -> list[Action]:
        """A status from a prefill sender. A final one fences that sender. Failed fails the
        room; Success completes it only under ``status_completes``: otherwise it is counted
        from completions (a status can overtake the engine's notifications)."""
        plan = self.plans.get(sender)
        if plan is not None and (status is Status.SUCCESS or (is_terminal(status) and plan.fences)):
            self._fenced.add(sender)  # a Success is sent after every write completed, at any version
        if self.finished:
            return self._maybe_release_slots()
        if status is Status.SUCCESS and self.status_completes and plan is not None and not plan.is_dummy:
            self._vouched.add(sender)
            self.status = Status.TRANSFERRING
            return self._succeed_if_complete()
        if status is not Status.FAILED:
            return []
        who = plan.peer if plan is not None else None
        return self._fail(failure or Failure(FailureKind.UNSPECIFIED, f"sender {sender} failed"), skip=who)

    def on_abort_ack(self, sender: int) -> list[Action]:
        """A prefill sender acknowledged our Abort: nothing of the room is in flight there."""
        plan = self.plans.get(sender)
        if plan is not None and plan.fences:
            self._fenced.add(sender)
        return self._maybe_release_slots() if self.finished else []

    def on_peer_lost(self, peer: PeerRef, detail: str | None = None) -> list[Action]:
        """``peer``'s process or connection is gone (or it was cut off): the room fails, but this
        fences nothing; the session revokes the peer."""
        if self.finished or not any(p.peer == peer for p in self.plans.values()):
            return []
        # ``peer`` is told too: a revoked rank is alive, and its Abort must reach it before it
        # registers again (a lost one has no link: the edge drops it)
        return self._fail(Failure(FailureKind.PEER_GONE, detail or f"{peer} went away"))

    def on_revoked(self, peer: PeerRef) -> list[Action]:
        """``peer``'s access to this rank's memory was cut off and settled: nothing it writes
        lands any more, so it is fenced (and a live room it feeds fails: its writes go nowhere)."""
        senders = [s for s, p in self.plans.items() if p.peer == peer and not p.is_dummy]
        if not senders:
            return []
        self._fenced.update(senders)
        self._revoked.add(peer)
        if not self.finished:
            failure = Failure(FailureKind.PEER_GONE, f"{peer}'s access to this rank's memory was revoked")
            return self._fail(failure)
        return self._maybe_release_slots()

    def on_tick(self, now: float) -> list[Action]:
        if self.finished:
            if self.slots_released or now < self.fence_deadline:
                return []
            # Senders still unfenced this long after the deadline are revoked; the slots stay
            # quarantined until they are (a timeout alone never releases them).
            return [RevokePeer(p) for p in dict.fromkeys(self.unfenced())]
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

    @staticmethod
    def _check_count(sender: int, kind: NotificationKind, chunk_count: int) -> str | None:
        if chunk_count == 1:
            return None
        if kind is not NotificationKind.KV:
            return f"sender {sender}: chunk_count {chunk_count} on a {kind.name.lower()} notification"
        if not 1 <= chunk_count <= MAX_CHUNKS_PER_NOTIFICATION:
            return f"sender {sender}: chunk_count {chunk_count} outside 1..{MAX_CHUNKS_PER_NOTIFICATION}"
        return None

    def _account(
        self, sender: int, kind: NotificationKind, chunk_id: int, is_last: bool, component: int
    ) -> str | None:
        plan = self.plans.get(sender)
        if plan is None:
            return f"completion from sender {sender}, which does not feed this rank"
        if plan.is_dummy:
            return f"completion from dummy sender {sender}"
        if kind is NotificationKind.KV:
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
        if kind is NotificationKind.STATE:
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
        self.status = Status.FAILED
        self.failure = failure
        # Tell every prefill sender to stop and free its side; the one that failed knows.
        peers = dict.fromkeys(p.peer for p in self.plans.values() if p.peer != skip)
        actions: list[Action] = [SendAbort(p, self.room, failure) for p in peers]
        actions.append(ReleaseRoom(self.room, Status.FAILED, failure))
        return actions + self._maybe_release_slots()

    def _maybe_release_slots(self) -> list[Action]:
        if self.slots_released or self.unfenced():
            return []
        self.slots_released = True
        return [ReleaseSlots(self.room, tuple(sorted(self._revoked, key=str)))]


def _parts(
    kind: NotificationKind,
    chunk_id: int,
    is_last: bool,
    component: int,
    chunk_count: int,
    also_components: Sequence[int],
    also_aux: bool,
) -> Iterator[tuple[NotificationKind, int, bool, int]]:
    """The single parts a notification stands for, in accounting order (lazily: the first
    problem stops the count)."""
    if kind is NotificationKind.KV:
        for c in range(chunk_id, chunk_id + chunk_count):
            yield kind, c, is_last and c == chunk_id + chunk_count - 1, 0
    else:
        yield kind, chunk_id, is_last, component
    for comp in also_components:
        yield NotificationKind.STATE, 0, False, int(comp)
    if also_aux:
        yield NotificationKind.AUX, 0, False, 0
