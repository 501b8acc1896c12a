"""One room on one prefill rank: a pure state machine (its moves: ``PREFILL_ROOM`` in :mod:`.states`;
what it posts and when: docs/runtime.md).

Every event carries its indices (a target's :class:`Destination`, each chunk's source pages), so
every ``PostTransfer`` is self-contained: the edge plans and posts it without looking anything
up. A target whose page list does not line up with what the engine produced fails the room,
never a partial Success; aux is posted on the last chunk even for dense models (decode's
accounting needs it).

A failed room is *fenced* (docs/fencing.md): while a transfer it posted may still write into a
target's slots it drains, asking for them to be cancelled and answering nobody; only once each
was reported done or failed does it tell its targets, acknowledge their Aborts and release. So
a Failed status or an AbortAck from a prefill rank means nothing of the room is in flight there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdwire.runtime.session.actions import (
    I32,
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
from pdwire.runtime.session.states import PREFILL_ROOM, StateField
from pdwire.runtime.session.status import Status, is_terminal


def _none() -> I32:
    return np.zeros(0, dtype=np.int32)


@dataclass(frozen=True, slots=True, eq=False)
class Destination:
    """What one decode rank asked for: its KV pages after the ``skip_pages`` it already holds,
    per state component its indices (empty: not sent), and its aux item (-1: none)."""

    kv_pages: I32 = field(default_factory=_none)
    state: tuple[I32, ...] = ()
    aux_index: int = -1
    skip_pages: int = 0
    # protocol 1.4: the decode rank's receive staging range for this room (offset, bytes per page,
    # pages): KV chunks inside its first pages may be written there for decode to scatter
    scatter: tuple[int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """One decode rank that asked for this room, and what this prefill rank owes it."""

    peer: PeerRef
    is_dummy: bool
    components: tuple[int, ...] = ()  # state components to send (non-empty on both sides)
    sends_aux: bool = False  # this prefill rank is the aux owner for that decode rank
    dst: Destination = field(default_factory=Destination, compare=False)

    @classmethod
    def of(cls, peer: PeerRef, is_dummy: bool, writes_aux: bool, dst: Destination) -> Target:
        """The target a request makes: the components it asks for, aux if this rank writes it."""
        if is_dummy:
            return cls(peer, True, (), False, Destination())
        comps = tuple(i for i, idx in enumerate(dst.state) if len(idx) > 0)
        return cls(peer, False, comps, writes_aux and dst.aux_index >= 0, dst)


@dataclass(frozen=True, slots=True)
class Chunk:
    chunk_id: int
    start: int
    stop: int
    is_last: bool
    pages: I32  # the source pages of positions [start, stop)


class PrefillRoom:
    status = StateField(PREFILL_ROOM)  # every move checked against its table (:mod:`.states`)

    def __init__(self, room: int, deadline: float, next_xfer_id: Callable[[], int]) -> None:
        self.room = room
        self.deadline = deadline
        self.status = Status.BOOTSTRAPPING
        self.failure: Failure | None = None
        self.required: int | None = None
        self.targets: dict[PeerRef, Target] = {}
        self.chunks: list[Chunk] = []
        self.source_state: tuple[I32 | None, ...] | None = None  # with the last chunk
        self.source_aux: int | None = None
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
        return is_terminal(self.status)

    @property
    def draining(self) -> bool:
        """Failed, with transfers the engine has not confirmed stopped yet."""
        return self.status is Status.FAILED and bool(self.outstanding)

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
        self.status = Status.WAITING_FOR_INPUT
        actions: list[Action] = []
        for chunk in self.chunks:  # chunks produced before the last request arrived
            actions += self._post_chunk(chunk)
            if self.finished:  # a request did not fit what was produced
                return actions
        return actions + self._maybe_succeed()

    def on_chunk(
        self,
        pages: I32,
        is_last: bool,
        state: Sequence[I32 | None] | None = None,
        aux_index: int | None = None,
    ) -> list[Action]:
        """Chunked prefill produced the next ``pages`` (source page ids) of the prompt; the last
        chunk brings the source ``state`` indices (per component, None: not given) and aux item."""
        if self.finished:
            return []
        if self.last_chunk_seen:
            raise ProtocolViolation(f"room {self.room}: chunk after the last chunk")
        start = self.chunks[-1].stop if self.chunks else 0
        chunk = Chunk(len(self.chunks), start, start + len(pages), is_last, pages)
        self.chunks.append(chunk)
        if is_last:
            self.source_state = None if state is None else tuple(state)
            self.source_aux = aux_index
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
        if not self.targets and not self.finished:
            # no decode rank asked yet: a decode rank declines the room (its engine will never
            # ask for it), so the source pages are released now instead of at the deadline
            return self._fail(
                Failure(FailureKind.ABORTED, f"declined by {peer} before any request"), ack=peer
            )
        if peer not in self.targets or (self.finished and not self.draining):
            # Only a requester may abort the room: another engine that reused the room id
            # (and was refused as a duplicate) aborts *its* attempt, not this one. Nothing of
            # the room is in flight for that peer, so the answer needs no wait.
            return [SendAbortAck(peer, self.room)]
        if self.draining:
            self._acks_owed.append(peer)  # "nothing in flight" is true only after the drain
            return []
        return self._fail(Failure(FailureKind.ABORTED, f"aborted by {peer}"), skip=peer, ack=peer)

    def renew(self, peer: PeerRef, until: float) -> bool:
        """A decode engine still holds the request for this room (a Lease): the room waits for
        its requests until ``until`` at least. Only a room still waiting for requests, and only
        for the engine its requests came from (if any); whether it was renewed."""
        if self.finished or self.all_requests_in:
            return False
        if self.targets and peer.engine_id not in {p.engine_id for p in self.targets}:
            return False
        self.deadline = max(self.deadline, until)
        return True

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
        self.status = Status.TRANSFERRING
        return PostTransfer(xfer_id, self.room, peer, part)

    def _parts(self, t: Target, chunk: Chunk) -> list[Part] | str:
        """What ``t`` gets of ``chunk``, or why its request does not fit what the engine produced."""
        dst, skip = t.dst, t.dst.skip_pages
        lo = max(chunk.start, skip)
        hi = max(chunk.stop, lo)
        if hi - skip > len(dst.kv_pages) or (chunk.is_last and chunk.stop - skip != len(dst.kv_pages)):
            # The chunks slice the destination list; a longer list would leave its tail
            # unwritten while both sides report Success, a shorter one has no room for the rest.
            produced = f"{chunk.stop}" if chunk.is_last else f"at least {chunk.stop}"
            return (
                f"prefill produced {produced} KV pages ({skip} of them already on decode), "
                f"{t.peer} asked for {len(dst.kv_pages)}"
            )
        parts: list[Part] = [
            KvPart(
                chunk.chunk_id, chunk.start, chunk.stop, chunk.is_last,
                chunk.pages[lo - chunk.start : hi - chunk.start], dst.kv_pages[lo - skip : hi - skip],
                lo - skip, _scatter_at(dst.scatter, lo - skip, hi - skip),
            )
        ]  # fmt: skip
        if not chunk.is_last:
            return parts
        given = self.source_state or ()
        for c in t.components:
            src = given[c] if c < len(given) else None
            if src is None:
                return f"{t.peer} asks for state component {c}; the engine gave no source index for it"
            parts.append(StatePart(c, src, dst.state[c]))
        if t.sends_aux:
            if self.source_aux is None:
                return f"{t.peer} asks for aux; the engine gave no source aux index"
            parts.append(AuxPart(self.source_aux, dst.aux_index))
        return parts

    def _post_chunk(self, chunk: Chunk) -> list[Action]:
        owed: list[tuple[PeerRef, list[Part]]] = []
        for target in self.targets.values():
            if target.is_dummy:
                continue
            parts = self._parts(target, chunk)
            if isinstance(parts, str):  # checked for every target before anything is posted
                return self._fail(Failure(FailureKind.VALIDATION, parts))
            owed.append((target.peer, parts))
        return [self._post(peer, part) for peer, parts in owed for part in parts]

    def _maybe_succeed(self) -> list[Action]:
        if self.finished or not (self.all_requests_in and self.last_chunk_seen and not self.outstanding):
            return []
        self.status = Status.SUCCESS
        actions: list[Action] = [SendStatus(p, self.room, Status.SUCCESS) for p in self.targets]
        actions.append(ReleaseRoom(self.room, Status.SUCCESS, None))
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
        self.status = Status.FAILED
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
            SendStatus(p, self.room, Status.FAILED, failure) for p in self.targets if p not in self._not_told
        ]
        actions += [SendAbortAck(p, self.room) for p in self._acks_owed]
        self._acks_owed = []
        actions.append(ReleaseRoom(self.room, Status.FAILED, failure))
        return actions


def _scatter_at(scatter: tuple[int, int, int] | None, first: int, stop: int) -> tuple[int, int]:
    """(offset in the decode rank's receive staging buffer, bytes per page) for destination pages
    ``[first, stop)``, or (-1, 0) when they are not all inside the room's staging range."""
    if scatter is None or stop <= first:
        return (-1, 0)
    offset, per_page, pages = scatter
    return (offset + first * per_page, per_page) if stop <= pages else (-1, 0)
