"""Whether the PP stages of a prefill group hold each of a decode rank's layers exactly once.

Every prefill rank writes its own layers into the decode layers of the same global id; the
decode rank cannot see those ids in the bytes. A stage that reports a wrong start layer (or
state layer ids) writes another stage's layers twice and leaves some of decode's layers
unwritten, and every room still succeeds. So from 1.4 each prefill rank names the layers it
holds in its RegisterAck, and the decode rank checks the whole group once every rank of it
registered (:func:`coverage_problem`); a group that fails the check is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdwire.runtime.planner.model import RankMemory


@dataclass(frozen=True, slots=True)
class HeldLayers:
    """The global layer ids a rank holds: its KV pool's and each state component's, in order."""

    kv: tuple[int, ...]
    state: tuple[tuple[int, ...], ...]

    @property
    def pools(self) -> tuple[tuple[int, ...], ...]:
        """The KV pool's layers, then each state component's."""
        return (self.kv, *self.state)

    @classmethod
    def of(cls, memory: RankMemory) -> HeldLayers:
        kv = memory.kv
        first = memory.first_layer
        return cls(
            tuple(range(first, first + kv.num_layers)) if kv is not None else (),
            tuple(c.global_layer_ids() for c in memory.state),
        )


def coverage_problem(own: HeldLayers, stages: Mapping[int, Sequence[HeldLayers]]) -> str | None:
    """Why the ranks of a prefill group (by PP stage) do not hold each of ``own``'s layers
    exactly once; None when they do.

    A stage's ranks (TP ranks: other heads of the same layers) may hold the same layers; two
    stages may not, and every layer of ``own`` must be held by some stage.
    """
    if not stages:
        return "the group has no ranks"
    for stage, ranks in stages.items():
        for held in ranks:
            if len(held.state) != len(own.state):
                return (
                    f"PP stage {stage} names layers for {len(held.state)} state components, "
                    f"this decode rank has {len(own.state)}"
                )
    names = ["KV", *(f"state component {ci}" for ci in range(len(own.state)))]
    for i, name in enumerate(names):
        by_stage = {stage: {x for h in ranks for x in h.pools[i]} for stage, ranks in stages.items()}
        problem = _pool_problem(name, set(own.pools[i]), by_stage)
        if problem is not None:
            return problem
    return None


def _pool_problem(name: str, own: set[int], by_stage: Mapping[int, set[int]]) -> str | None:
    holder: dict[int, int] = {}
    for stage in sorted(by_stage):
        for layer in sorted(by_stage[stage]):
            other = holder.setdefault(layer, stage)
            if other != stage:
                return f"{name} layer {layer} is held by PP stages {other} and {stage}"
    missing = sorted(own - holder.keys())
    if missing:
        return f"{name} layers {_ids(missing)} of this decode rank are held by no PP stage of the group"
    foreign = sorted(holder.keys() - own)
    if foreign:
        return f"{name} layers {_ids(foreign)} of the group are not layers of this decode rank"
    return None


def _ids(layers: list[int]) -> str:
    shown = ", ".join(map(str, layers[:8]))
    return f"[{shown}{', ...' if len(layers) > 8 else ''}]"
