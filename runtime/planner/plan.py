"""Per-request planning against one prepared peer: KV chunk by chunk, then state, then aux."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from pdwire.runtime.descriptors import DescriptorTable
from pdwire.runtime.planner.errors import IndexListMismatch
from pdwire.runtime.planner.kernel import (
    IndexArray,
    as_indices,
    check_destination_bounds,
    check_unique_destinations,
    coalesce_table,
    expand,
    paired_indices,
)
from pdwire.runtime.planner.model import Indexing, RankMemory
from pdwire.runtime.planner.peer import PeerSetup, SetGroup, prepare_peer_setup
from pdwire.runtime.planner.routing import DecodeRoute


class GroupKind(StrEnum):
    """What completes a group: one KV chunk, one state component, or the aux write."""

    KV = "kv"
    STATE = "state"
    AUX = "aux"


@dataclass(frozen=True, slots=True)
class PlanGroup:
    """Descriptors posted (and notified) together. ``chunk_id`` is set for KV, ``component_index``
    for state; an empty table means there is nothing to write but the group still completes."""

    kind: GroupKind
    chunk_id: int | None
    component_index: int | None
    table: DescriptorTable

    @property
    def descriptor_count(self) -> int:
        return len(self.table)


@dataclass(frozen=True, slots=True)
class Plan:
    """All groups of one request (or one chunk) for one peer."""

    groups: tuple[PlanGroup, ...]

    @property
    def descriptor_count(self) -> int:
        return sum(group.descriptor_count for group in self.groups)

    def counts(self) -> dict[str, int]:
        """Descriptor count per group kind, for metrics."""
        out = {kind.value: 0 for kind in GroupKind}
        for group in self.groups:
            out[group.kind.value] += group.descriptor_count
        return out

    def table(self) -> DescriptorTable:
        return DescriptorTable.concat([group.table for group in self.groups])


def _expand_all(group: SetGroup, src: IndexArray, dst: IndexArray, component: str) -> DescriptorTable:
    s, d = paired_indices(src, dst, component=component)
    tables = [expand(buffers, s, d) for buffers in group.sets]
    table = tables[0] if len(tables) == 1 else DescriptorTable.concat(tables)
    return coalesce_table(table) if group.coalesce else table


class PeerPlan:
    """One prefill rank's plan for one decode rank; built once per registration by ``prepare_peer``.

    Methods are pure: indices in, descriptor groups out. They raise a PlanError (and produce
    nothing) on bad input.
    """

    def __init__(self, local: RankMemory, remote: RankMemory, setup: PeerSetup) -> None:
        self.local = local
        self.remote = remote
        self._setup = setup

    @property
    def route(self) -> DecodeRoute:
        return self._setup.route

    @property
    def is_dummy(self) -> bool:
        """Contacted by decode but writes nothing (MLA, prefill TP > decode TP, not first of group)."""
        return self._setup.is_dummy

    @property
    def writes_aux(self) -> bool:
        return self._setup.writes_aux

    def plan_kv_chunk(self, chunk_id: int, src_pages: IndexArray, dst_pages: IndexArray) -> PlanGroup:
        """Pages ``src_pages[i] -> dst_pages[i]`` of every held layer, K then V."""
        kv = self._setup.kv
        if kv is None:
            paired_indices(src_pages, dst_pages, component="kv")
            return PlanGroup(GroupKind.KV, chunk_id, None, DescriptorTable.empty())
        return PlanGroup(GroupKind.KV, chunk_id, None, _expand_all(kv, src_pages, dst_pages, "kv"))

    def plan_state(
        self, src_indices: Sequence[IndexArray], dst_indices: Sequence[IndexArray]
    ) -> tuple[PlanGroup, ...]:
        """One group per state component; lists in component order on both sides.

        A slot component takes exactly one index per side; a paged one equal-length page lists.
        Both lists empty means the component is not sent for this request.
        """
        components = self.local.state
        if len(src_indices) != len(components) or len(dst_indices) != len(components):
            raise IndexListMismatch(
                f"{len(components)} state components but {len(src_indices)} source and "
                f"{len(dst_indices)} destination index lists"
            )
        pairs = enumerate(zip(src_indices, dst_indices, strict=True))
        return tuple(self.plan_component(ci, src, dst) for ci, (src, dst) in pairs)

    def plan_component(self, ci: int, src_indices: IndexArray, dst_indices: IndexArray) -> PlanGroup:
        """State component ``ci`` alone (what :meth:`plan_state` plans for each): a prefill rank
        posting one component's part plans only that one."""
        component = self.local.state[ci]
        name = f"state[{ci}]:{component.kind.value}"
        src = as_indices(src_indices, component=name, side="source")
        dst = as_indices(dst_indices, component=name, side="destination")
        if component.indexing is Indexing.SLOT and (len(src), len(dst)) not in ((0, 0), (1, 1)):
            raise IndexListMismatch(
                f"a slot component takes exactly one index per side, got {len(src)} and {len(dst)}",
                component=name,
            )
        sets = self._setup.state[ci]
        if sets is not None:
            table = _expand_all(sets, src, dst, name)
        else:
            paired_indices(src, dst, component=name)
            table = DescriptorTable.empty()
        return PlanGroup(GroupKind.STATE, None, ci, table)

    def plan_aux(self, src_index: int, dst_index: int) -> PlanGroup:
        """One item of every aux buffer; empty unless this rank is the aux writer for the decode rank."""
        if self._setup.aux is None:
            as_indices([src_index], component="aux", side="source")
            as_indices([dst_index], component="aux", side="destination")
            return PlanGroup(GroupKind.AUX, None, None, DescriptorTable.empty())
        return PlanGroup(
            GroupKind.AUX, None, None, _expand_all(self._setup.aux, [src_index], [dst_index], "aux")
        )

    def check_request(
        self,
        dst_pages: IndexArray,
        dst_state: Sequence[IndexArray | None] = (),
        dst_aux: int | None = None,
    ) -> None:
        """Refuse a request's destinations as a whole, before any of it is planned or posted.

        KV pages are planned chunk by chunk, state on the last chunk, so what only shows across
        them is checked here, once per request: a KV page named twice (also across chunks), a
        state list that names an item twice or breaks its indexing (a slot component takes one
        index, or none), and destination items that share bytes through aliased registrations
        (:class:`OverlappingDestination`), and destinations past the registered pools
        (:class:`IndexOutOfRange`). ``dst_state`` follows the wire: one entry per
        component, None for an absent component (an empty list means the same here). Every
        prefill rank of a room refuses the same request, dummies included.
        """
        kv = as_indices(dst_pages, component="kv", side="destination")
        check_unique_destinations(kv, component="kv")
        components = self.remote.state
        if dst_state and len(dst_state) != len(components):
            raise IndexListMismatch(f"{len(components)} state components but {len(dst_state)} index lists")
        state: list[np.ndarray | None] = []
        for ci, component in enumerate(components):
            name = f"state[{ci}]:{component.kind.value}"
            given = dst_state[ci] if dst_state else None
            if given is None:
                state.append(None)
                continue
            indices = as_indices(given, component=name, side="destination")
            if component.indexing is Indexing.SLOT and len(indices) > 1:
                raise IndexListMismatch(
                    f"a slot component takes exactly one index per side, got {len(indices)}", component=name
                )
            check_unique_destinations(indices, component=name)
            state.append(indices)
        aux = None if dst_aux is None or dst_aux < 0 else dst_aux
        self._check_bounds(self._setup.kv, kv, "kv")
        for ci, (sets, listed) in enumerate(zip(self._setup.state, state, strict=True)):
            if listed is not None:
                self._check_bounds(sets, listed, f"state[{ci}]:{components[ci].kind.value}")
        if aux is not None:
            self._check_bounds(self._setup.aux, np.asarray([aux], dtype=np.uint64), "aux")
        self._setup.overlaps.check(kv, state, aux)

    @staticmethod
    def _check_bounds(group: SetGroup | None, dst: np.ndarray, component: str) -> None:
        """Destinations past the registered pools (a group this rank writes nothing of is
        checked by the rank that writes it)."""
        for buffers in () if group is None else group.sets:
            check_destination_bounds(buffers, dst, component)

    def plan_request(
        self,
        src_pages: IndexArray,
        dst_pages: IndexArray,
        src_state: Sequence[IndexArray] = (),
        dst_state: Sequence[IndexArray] = (),
        aux: tuple[int, int] | None = None,
        *,
        chunk_id: int = 0,
    ) -> Plan:
        """A whole request in one go (a single last chunk): KV, every state component, then aux.
        Runs :meth:`check_request` first."""
        self.check_request(dst_pages, dst_state, None if aux is None else aux[1])
        groups = [self.plan_kv_chunk(chunk_id, src_pages, dst_pages)]
        if self.local.state or src_state or dst_state:
            groups.extend(self.plan_state(src_state, dst_state))
        if aux is not None:
            groups.append(self.plan_aux(*aux))
        return Plan(tuple(groups))


def prepare_peer(local: RankMemory, remote: RankMemory) -> PeerPlan:
    """Validate ``local`` (this prefill rank) against ``remote`` (one decode rank's registration)."""
    return PeerPlan(local, remote, prepare_peer_setup(local, remote))
