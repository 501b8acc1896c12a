"""Destination items of one request must not overlap, also where registrations alias.

Distinct indices of one buffer are distinct items, and the tensors of one index space were
checked disjoint inside an item; what is left is memory addressed by several index spaces
(vLLM's Mamba and attention groups on the same blocks) or by buffers of one space at different
bases, where the bytes a request writes depend on its indices. The check is prepared once per
peer from the destination memory alone and costs nothing for memory without such registrations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdwire.runtime.descriptors import U64
from pdwire.runtime.planner.errors import OverlappingDestination
from pdwire.runtime.planner.model import RankMemory
from pdwire.runtime.planner.regions import RegionIndex

KV_SPACE = -1  # index space of the KV pages; state component i is space i, aux is AUX_SPACE
AUX_SPACE = -2


@dataclass(frozen=True, slots=True)
class _Writer:
    space: int
    name: str  # component/tensor/layer, for the error message
    origin: int  # registration base of the buffer
    start: int  # address of item 0
    stride: int
    item: int


@dataclass(frozen=True, slots=True)
class DestinationOverlaps:
    """The registrations whose writers could meet, each a tuple of writers; empty for most memory."""

    checked: tuple[tuple[_Writer, ...], ...] = ()

    def check(
        self,
        kv: U64 | None,
        state: Sequence[U64 | None],
        aux: int | None = None,
    ) -> None:
        """Raise :class:`OverlappingDestination` when two destination items of one request share a
        byte. ``kv``/``state``/``aux`` are the request's destination indices (None: not sent)."""
        for writers in self.checked:
            starts: list[U64] = []
            ends: list[U64] = []
            owners: list[np.ndarray] = []
            for wi, w in enumerate(writers):
                if w.space == KV_SPACE:
                    indices = kv
                elif w.space == AUX_SPACE:
                    indices = None if aux is None else np.asarray([aux], dtype=np.uint64)
                else:
                    indices = state[w.space] if w.space < len(state) else None
                if indices is None or len(indices) == 0:
                    continue
                first = np.uint64(w.start) + indices.astype(np.uint64) * np.uint64(w.stride)
                starts.append(first)
                ends.append(first + np.uint64(w.item))
                owners.append(np.full(len(indices), wi, dtype=np.int64))
            if len(starts) < 2:  # distinct items of one buffer never overlap
                continue
            s, e, o = np.concatenate(starts), np.concatenate(ends), np.concatenate(owners)
            order = np.argsort(s, kind="stable")
            s, e, o = s[order], e[order], o[order]
            clash = np.flatnonzero(s[1:] < e[:-1])
            if len(clash):
                k = int(clash[0])
                a, b = writers[int(o[k])], writers[int(o[k + 1])]
                raise OverlappingDestination(
                    f"destination items of {a.name} and {b.name} overlap at {int(s[k + 1]):#x}: "
                    "they alias one registration and this request names the same bytes for both"
                )


def destination_overlaps(memory: RankMemory, index: RegionIndex) -> DestinationOverlaps:
    """Prepare the per-request check for one destination rank's memory."""
    if not index.aliased:
        return DestinationOverlaps()
    by_region: dict[int, list[_Writer]] = {}
    kv = memory.kv
    if kv is not None:
        halves = [("k" if not kv.is_mla else "latent", kv.k_base_addrs, index.kv_k, kv.k_offset)]
        if not kv.is_mla:
            halves.append(("v", kv.v_base_addrs, index.kv_v, kv.v_offset))
        for name, bases, ids, offset in halves:
            for layer, (base, rid) in enumerate(zip(bases, ids, strict=True)):
                start, item = base + offset, kv.page_extent
                writer = _Writer(KV_SPACE, f"kv/{name}/L{layer}", base, start, kv.stride, item)
                by_region.setdefault(rid, []).append(writer)
    for ci, component in enumerate(memory.state):
        for ti, tensor in enumerate(component.tensors):
            for li, (base, rid) in enumerate(zip(tensor.base_addrs, index.state[ci][ti], strict=True)):
                name = f"state[{ci}]:{component.kind.value}/{tensor.name}/L{li}"
                writer = _Writer(ci, name, base, base + tensor.offset, tensor.stride, tensor.bytes_per_slot)
                by_region.setdefault(rid, []).append(writer)
    for ai, buffer in enumerate(memory.aux):
        item = buffer.bytes_per_item
        writer = _Writer(AUX_SPACE, f"aux/{buffer.name}", buffer.base_addr, buffer.base_addr, item, item)
        by_region.setdefault(index.aux[ai], []).append(writer)
    checked = []
    for writers in by_region.values():
        if len(writers) < 2:
            continue
        # one index space on one set of buffers at one stride: its items were validated disjoint
        if len({(w.space, w.origin, w.stride) for w in writers}) == 1:
            continue
        checked.append(_joined(writers))
    return DestinationOverlaps(tuple(checked))


def _joined(writers: list[_Writer]) -> tuple[_Writer, ...]:
    """Writers of one index space on one buffer at one stride (K and V of a layer) as one writer per
    index: their items were validated disjoint and may interleave (heads apart inside a page), so
    only the span they cover together is compared with the other spaces'."""
    groups: dict[tuple[int, int, int], list[_Writer]] = {}
    for w in writers:
        groups.setdefault((w.space, w.origin, w.stride), []).append(w)
    out = []
    for members in groups.values():
        start = min(w.start for w in members)
        end = max(w.start + w.item for w in members)
        name = "+".join(w.name for w in members)
        out.append(_Writer(members[0].space, name, members[0].origin, start, members[0].stride, end - start))
    return tuple(out)
