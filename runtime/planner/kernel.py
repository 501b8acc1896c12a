"""The hot path: index arrays in, one coalesced DescriptorTable out. Vectorised numpy, u64 only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pdwire.runtime.descriptors import U32, U64, DescriptorTable
from pdwire.runtime.planner.errors import DuplicateDestination, IndexListMismatch, IndexOutOfRange, PlanError
from pdwire.runtime.planner.patterns import Pattern, coalesce

IndexArray = npt.NDArray[np.integer] | Sequence[int]


@dataclass(frozen=True, slots=True)
class BufferSet:
    """Tensor-layers (entries) that share one pattern: every entry copies the same relative rows.

    Per entry: the address of item 0 (registration base plus the tensor's offset inside an item)
    and region index on each side, and how many items fit in its registration on each side
    (bounds), plus the names used in error messages: ``tensors``/``layers`` name each entry,
    ``src_limits``/``dst_limits`` the (tensor, layer) whose registration sets its capacity (an
    entry fused from several tensors of one item is as long as its shortest member). Item ``i``
    starts ``i * stride`` bytes after item 0 on each side.
    """

    component: str
    tensors: tuple[str, ...]
    layers: tuple[int, ...]
    pattern: Pattern
    src_bases: U64
    dst_bases: U64
    src_regions: U32
    dst_regions: U32
    src_capacity: U64
    dst_capacity: U64
    src_stride: int
    dst_stride: int
    src_limits: tuple[tuple[str, int], ...]
    dst_limits: tuple[tuple[str, int], ...]


def as_indices(values: IndexArray, *, component: str, side: str) -> U64:
    """Validate an index list (integers, >= 0) and widen it to u64 before any multiplication."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise PlanError(
            f"{side} indices must be one-dimensional, got shape {array.shape}", component=component
        )
    if array.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if array.dtype.kind not in "iu":
        raise PlanError(f"{side} indices must be integers, got dtype {array.dtype}", component=component)
    if array.dtype.kind == "i" and int(array.min()) < 0:
        position = int(np.argmax(array < 0))
        raise IndexOutOfRange(
            f"{side} index {int(array[position])} at position {position} is negative",
            component=component,
            index=int(array[position]),
        )
    return array.astype(np.uint64, copy=False)


def paired_indices(src: IndexArray, dst: IndexArray, *, component: str) -> tuple[U64, U64]:
    """Both lists, equal length, sorted by destination, no destination twice."""
    s = as_indices(src, component=component, side="source")
    d = as_indices(dst, component=component, side="destination")
    if len(s) != len(d):
        raise IndexListMismatch(
            f"{len(s)} source indices but {len(d)} destination indices (never truncated)", component=component
        )
    order = _destination_order(d, component)
    return (s, d) if order is None else (s[order], d[order])


def check_unique_destinations(dst: IndexArray, *, component: str) -> None:
    """Refuse a destination list that names an index twice, across the whole list.

    A request's KV list is planned chunk by chunk, and each chunk only sees its own slice:
    an index repeated across a chunk boundary must be refused here, once per request.
    """
    _destination_order(as_indices(dst, component=component, side="destination"), component)


def _destination_order(d: U64, component: str) -> npt.NDArray[np.intp] | None:
    """The stable order that sorts ``d`` (None when it already increases); no index twice."""
    if len(d) < 2:
        return None
    steps = np.diff(d.astype(np.int64, copy=False)) if int(d.max()) < 2**63 else None
    if steps is not None and bool((steps > 0).all()):
        return None
    order = np.argsort(d, kind="stable")
    ordered = d[order]
    repeated = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(repeated):
        raise DuplicateDestination(
            f"destination index {int(ordered[repeated[0]])} appears twice",
            component=component,
            index=int(ordered[repeated[0]]),
        )
    return order


def check_bounds(buffers: BufferSet, src: U64, dst: U64) -> None:
    """Every item addressed must lie inside its registered region on both sides."""
    if len(src):
        b, where = buffers, "outside the registered region"
        _check_side("source", src, b.src_capacity, b.src_limits, b.component, where)
        _check_side("destination", dst, b.dst_capacity, b.dst_limits, b.component, where)


def check_destination_bounds(buffers: BufferSet, dst: U64, component: str) -> None:
    """Every destination item must lie inside the peer's registered regions: checked once per
    request, before any of it is planned (a request past the pools is refused whole)."""
    if len(dst):
        where = "is past the registered pool"
        _check_side("destination", dst, buffers.dst_capacity, buffers.dst_limits, component, where)


def _check_side(
    side: str,
    indices: U64,
    capacity: U64,
    limits: tuple[tuple[str, int], ...],
    component: str,
    where: str,
) -> None:
    highest = int(indices.max())
    bad = np.flatnonzero(capacity <= np.uint64(highest))
    if len(bad):
        entry = int(bad[0])
        tensor, layer = limits[entry]
        raise IndexOutOfRange(
            f"{side} index {highest} {where} ({int(capacity[entry])} items fit)",
            component=component,
            tensor=tensor,
            layer=layer,
            index=highest,
        )


def coalesce_table(table: DescriptorTable) -> DescriptorTable:
    """Merge rows adjacent on both sides in the same regions, across entries: for a group whose
    entries share registrations in ways a fused pattern cannot express. Destinations must be
    disjoint (they are: ``PeerPlan.check_request``); sorted by destination, one pass is minimal."""
    if len(table) < 2:
        return table
    ordered = table.take(np.argsort(table.dst_addr, kind="stable"))
    merged = ordered.merged()
    return table if merged is ordered else merged


def expand(buffers: BufferSet, src: U64, dst: U64) -> DescriptorTable:
    """Descriptors of every entry for index pairs sorted by destination; coalesced, hence minimal."""
    pattern = buffers.pattern
    if len(src) == 0 or len(buffers.src_bases) == 0:
        return DescriptorTable.empty()
    # checked even where this rank writes nothing (a dummy or duplicate-head rank): every rank
    # of a room refuses the same out-of-range index instead of one failing and others passing
    check_bounds(buffers, src, dst)
    if len(pattern) == 0:
        return DescriptorTable.empty()
    rel_src = (src[:, None] * np.uint64(buffers.src_stride) + pattern.src_off[None, :]).ravel()
    rel_dst = (dst[:, None] * np.uint64(buffers.dst_stride) + pattern.dst_off[None, :]).ravel()
    rel_len = np.tile(pattern.length, len(src))
    rel_src, rel_dst, rel_len = coalesce(rel_src, rel_dst, rel_len)
    rows = len(rel_src)
    entries = len(buffers.src_bases)
    return DescriptorTable(
        (buffers.src_bases[:, None] + rel_src[None, :]).ravel(),
        (buffers.dst_bases[:, None] + rel_dst[None, :]).ravel(),
        np.tile(rel_len, entries),
        np.repeat(buffers.src_regions, rows),
        np.repeat(buffers.dst_regions, rows),
    )
