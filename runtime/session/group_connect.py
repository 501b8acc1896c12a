"""Connecting to one prefill group without blocking: a pure state machine (h11 style; its moves:
``GROUP_CONNECT`` in :mod:`.states`).

A *group* is the prefill ranks of one engine's attention-DP group that a decode rank's routing
names; each rank's handshake is its own :class:`~.decode_connection.DecodeConnection`. This
machine runs them one after another (with NIXL 1.5.1, two prefill processes adding the same
decode agent at the same moment left one's writes pending until their timeout), checks that the
ranks are one group whose PP stages hold each of this rank's layers once (:mod:`.stage_layers`),
and holds the rooms asked of the group before it is ready. Nothing was sent for a held room, so
when it fails its slots are the engine's again at once.

The edge opens the link each :class:`OpenLink` names and reports its outcome with
:meth:`GroupConnect.on_link_ready` / :meth:`GroupConnect.on_link_refused`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdwire.runtime.indices import RequestIndices
from pdwire.runtime.session.decode_connection import Expected
from pdwire.runtime.session.failures import Failure, FailureKind
from pdwire.runtime.session.stage_layers import HeldLayers, coverage_problem
from pdwire.runtime.session.states import GROUP_CONNECT, GroupState, StateField


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One prefill rank of the group: its (TP rank, PP stage), endpoint and expected position."""

    key: tuple[int, int]
    endpoint: str
    expected: Expected


@dataclass(frozen=True, slots=True)
class GroupIdentity:
    """What a registered rank says it belongs to; every rank of a group says the same."""

    engine_id: str
    dp_rank: int
    tp_size: int
    pp_size: int

    def __str__(self) -> str:
        return self.engine_id + (f" (DP group {self.dp_rank})" if self.dp_rank else "")


# --- what the machine asks of the edge ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenLink:
    """Open a control socket to this rank and start its handshake."""

    spec: LinkSpec


@dataclass(frozen=True, slots=True)
class GroupConnected:
    """Every rank registered: the group takes rooms (its links replace any older ones)."""

    identity: GroupIdentity


@dataclass(frozen=True, slots=True)
class GroupFailed:
    """The group cannot be used: close its links. ``reason`` names the cause."""

    reason: str


@dataclass(frozen=True, slots=True)
class StartHeld:
    """A held room may start now, with its original deadline."""

    room: int
    indices: RequestIndices
    deadline: float


@dataclass(frozen=True, slots=True)
class FailHeld:
    """A held room fails before anything was sent for it: its slots are free at once."""

    room: int
    failure: Failure


GroupAction = OpenLink | GroupConnected | GroupFailed | StartHeld | FailHeld


class GroupConnect:
    """One group's connect; see the module notes. ``deadline``: the handshake deadline;
    ``own_layers``: the layers this decode rank holds (None: not checked)."""

    state = StateField(GROUP_CONNECT)

    def __init__(
        self, specs: Sequence[LinkSpec], deadline: float, own_layers: HeldLayers | None = None
    ) -> None:
        if not specs:
            raise ValueError("a prefill group needs at least one rank")
        self.specs = tuple(specs)
        self.deadline = deadline
        self.own_layers = own_layers
        self.layers_checked = False  # every rank named its layers and the check passed
        self._layers: dict[tuple[int, int], HeldLayers | None] = {}
        self.state = GroupState.CONNECTING
        self.identity: GroupIdentity | None = None
        self.reason: str | None = None
        self._next = 0  # index of the next spec to open
        self._open: tuple[int, int] | None = None  # the rank whose handshake runs
        self._ready: set[tuple[int, int]] = set()
        self.held: dict[int, tuple[RequestIndices, float]] = {}  # room -> (indices, deadline)

    def start(self) -> list[GroupAction]:
        return self._open_next()

    def _open_next(self) -> list[GroupAction]:
        spec = self.specs[self._next]
        self._next += 1
        self._open = spec.key
        return [OpenLink(spec)]

    def on_link_ready(
        self, key: tuple[int, int], identity: GroupIdentity, layers: HeldLayers | None = None
    ) -> list[GroupAction]:
        """Rank ``key`` registered; ``layers``: the layers it holds (None: a peer before 1.4)."""
        if self.state is not GroupState.CONNECTING or key != self._open:
            return []
        if self.identity is not None and identity != self.identity:
            spec = next(s for s in self.specs if s.key == key)
            others = self.identity
            return self._fail(f"{spec.endpoint} belongs to {identity}, the other endpoints to {others}")
        self.identity = identity
        self._ready.add(key)
        self._layers[key] = layers
        if self._next < len(self.specs):
            return self._open_next()
        problem = self._layer_problem()
        if problem is not None:
            return self._fail(f"prefill {identity}: {problem}")
        self.state, self._open = GroupState.READY, None
        out: list[GroupAction] = [GroupConnected(identity)]
        held, self.held = self.held, {}
        out += [StartHeld(room, indices, deadline) for room, (indices, deadline) in held.items()]
        return out

    def _layer_problem(self) -> str | None:
        """Whether the group's stages hold this rank's layers exactly once; checked only when
        every rank named its layers (a group with an older rank is taken as before 1.4)."""
        held = self._layers.values()
        if self.own_layers is None or any(h is None for h in held):
            return None
        stages: dict[int, list[HeldLayers]] = {}
        for (_, stage), h in self._layers.items():
            assert h is not None
            stages.setdefault(stage, []).append(h)
        problem = coverage_problem(self.own_layers, stages)
        self.layers_checked = problem is None
        return problem

    def on_link_refused(self, key: tuple[int, int], reason: str) -> list[GroupAction]:
        if self.state is not GroupState.CONNECTING or key != self._open:
            return []
        return self._fail(reason)

    def _fail(self, reason: str) -> list[GroupAction]:
        self.state, self.reason, self._open = GroupState.FAILED, reason, None
        out: list[GroupAction] = [GroupFailed(reason)]
        failure = Failure(FailureKind.HANDSHAKE, reason)
        held, self.held = self.held, {}
        out += [FailHeld(room, failure) for room in held]
        return out

    def hold(self, room: int, indices: RequestIndices, deadline: float) -> list[GroupAction]:
        """A room asked of this group: held while connecting, started once ready, failed once
        the group failed."""
        if self.state is GroupState.READY:
            return [StartHeld(room, indices, deadline)]
        if self.state is GroupState.FAILED:
            assert self.reason is not None
            return [FailHeld(room, Failure(FailureKind.HANDSHAKE, self.reason))]
        self.held[room] = (indices, deadline)
        return []

    def release(self, room: int) -> bool:
        """Forget a held room (the engine aborted it); whether it was held."""
        return self.held.pop(room, None) is not None

    def on_tick(self, now: float) -> list[GroupAction]:
        out: list[GroupAction] = []
        if self.state is GroupState.CONNECTING and now >= self.deadline:
            out += self._fail("the prefill group did not finish its handshake within the handshake timeout")
        for room, (_, deadline) in list(self.held.items()):
            if now >= deadline:
                del self.held[room]
                why = "the room's deadline passed while its prefill group was still connecting"
                out.append(FailHeld(room, Failure(FailureKind.TIMEOUT, why)))
        return out
