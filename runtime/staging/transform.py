"""Staged transfers: a planner's descriptor table rewritten through contiguous staging buffers.

Many small rows (NHD pages between TP sizes: a head slice per token, layer and K/V) cost the
engine per row; staging moves them with host (or device) copies so the engine sees few large
rows (why and when: docs/request-efficiency.md):

* **gather** (prefill side): copy every row's source into local staging in destination order,
  then write staging -> destination, one engine row per destination run.
* **scatter** (decode side): write source -> the peer's staging in destination order, one row
  per run that continues on the source side too; the peer copies every row into place.
  Destination order is what the peer can compute alone: the staged byte at offset ``o`` is the
  ``o``-th byte of the destination rows sorted by (region, address), whatever the row cuts.
* **both**: gather locally, write staging in a handful of rows, scatter remotely.

Each step is a :class:`DescriptorTable` (``gather``: local -> local staging; ``write``: what the
engine posts; ``scatter``: remote staging -> destination, run by the peer), so the reference
executor runs it and the oracle tests prove the steps write exactly what the direct table does.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from pdwire.runtime.descriptors import DescriptorTable

U64 = np.uint64
MAX_WRITE_ROW = 64 << 20  # rows of a staged write are cut at this size (the engine splits work by row)


class Mode(StrEnum):
    DIRECT = "direct"
    GATHER = "gather"
    SCATTER = "scatter"
    BOTH = "both"


@dataclass(frozen=True, slots=True)
class StagedPlan:
    """The steps of one staged part. ``gather`` runs here before the post, ``write`` is posted,
    ``scatter`` runs on the peer after the write landed; an unused step is an empty table.
    ``local_bytes`` / ``remote_bytes``: staging space the part needs on each side."""

    mode: Mode
    gather: DescriptorTable
    write: DescriptorTable
    scatter: DescriptorTable
    local_bytes: int
    remote_bytes: int

    @property
    def engine_rows(self) -> int:
        return len(self.write)


def direct(table: DescriptorTable) -> StagedPlan:
    e = DescriptorTable.empty()
    return StagedPlan(Mode.DIRECT, e, table, e, 0, 0)


def merge_runs(table: DescriptorTable) -> DescriptorTable:
    """Merge consecutive rows (in table order) that continue one another on both sides."""
    return table.merged()


def _order(addr: np.ndarray, region: np.ndarray) -> np.ndarray | None:
    """Row order by (region, address); None when the rows are in that order already (the
    planner's tables are: sorted by destination within each layer, layers in region order)."""
    if len(addr) < 2:
        return None
    same = region[1:] == region[:-1]
    if bool(((region[1:] > region[:-1]) | (same & (addr[1:] >= addr[:-1]))).all()):
        return None
    return np.lexsort((addr, region))


def _take(column: np.ndarray, order: np.ndarray | None) -> np.ndarray:
    return column if order is None else column[order]


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums: where each row starts in a staging buffer."""
    out = np.zeros(len(lengths), dtype=np.uint64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], out=out[1:])
    return out


def _cut(base: int, total: int, region: int, dst: int, dst_region: int) -> DescriptorTable:
    """One contiguous range ``[base, base + total) -> [dst, ...)`` as rows of at most MAX_WRITE_ROW."""
    starts = np.arange(0, total, MAX_WRITE_ROW, dtype=np.uint64)
    lengths = np.minimum(np.uint64(MAX_WRITE_ROW), np.uint64(total) - starts)
    return DescriptorTable(
        np.uint64(base) + starts,
        np.uint64(dst) + starts,
        lengths,
        np.full(len(starts), region, np.uint32),
        np.full(len(starts), dst_region, np.uint32),
    )


Staged = tuple[np.ndarray | None, np.ndarray, np.ndarray]  # row order, lengths, staging offsets


def _staged(table: DescriptorTable) -> Staged:
    """The staged order of ``table``'s rows (by destination region and address), their lengths in
    that order, and where each starts in the staging range."""
    order = _order(table.dst_addr, table.dst_region)
    n = _take(table.length, order)
    return order, n, _offsets(n)


def _into(table: DescriptorTable, st: Staged, staging: int, region: int) -> DescriptorTable:
    """Source rows -> ``[staging, + total)`` (``region``), in the staged order, merged."""
    order, n, off = st
    reg = np.full(len(n), region, np.uint32)
    at = np.uint64(staging) + off
    return merge_runs(
        DescriptorTable(_take(table.src_addr, order), at, n, _take(table.src_region, order), reg)
    )


def _out_of(table: DescriptorTable, st: Staged, staging: int, region: int) -> DescriptorTable:
    """``[staging, + total)`` (``region``) -> the destination rows, in the staged order, merged."""
    order, n, off = st
    reg = np.full(len(n), region, np.uint32)
    at = np.uint64(staging) + off
    return merge_runs(
        DescriptorTable(at, _take(table.dst_addr, order), n, reg, _take(table.dst_region, order))
    )


def gather(table: DescriptorTable, staging: int, staging_region: int) -> StagedPlan:
    """Gather locally into ``[staging, staging + total)`` (region ``staging_region`` of this side),
    in destination order, and write staging -> destination by destination runs."""
    st = _staged(table)
    g = _into(table, st, staging, staging_region)
    w = _out_of(table, st, staging, staging_region)
    return StagedPlan(Mode.GATHER, g, w, DescriptorTable.empty(), table.total_bytes, 0)


def scatter_write(table: DescriptorTable, remote_staging: int, remote_region: int) -> DescriptorTable:
    """What the writer posts for a scattered part: source -> the peer's ``[remote_staging, +
    total)`` in destination order, rows continuing on both sides merged."""
    return _into(table, _staged(table), remote_staging, remote_region)


def scatter_copy(table: DescriptorTable, staging: int, staging_region: int) -> DescriptorTable:
    """What the receiver copies for a scattered part: its staging range -> the destination rows,
    in the order :func:`scatter_write` filled it. Reads only ``table``'s destination columns, so
    the receiver computes it from its own memory (the source side may be any stand-in)."""
    return _out_of(table, _staged(table), staging, staging_region)


def scatter(table: DescriptorTable, remote_staging: int, remote_region: int) -> StagedPlan:
    """Write source -> the peer's ``[remote_staging, + total)`` in destination order; the peer
    then scatters staging -> destination."""
    st = _staged(table)
    w = _into(table, st, remote_staging, remote_region)
    sc = _out_of(table, st, remote_staging, remote_region)
    return StagedPlan(Mode.SCATTER, DescriptorTable.empty(), w, sc, 0, table.total_bytes)


def both(
    table: DescriptorTable, staging: int, staging_region: int, remote_staging: int, remote_region: int
) -> StagedPlan:
    """Gather here in destination order, write the whole staging buffer, scatter on the peer."""
    st = _staged(table)
    total = table.total_bytes
    g = _into(table, st, staging, staging_region)
    w = _cut(staging, total, staging_region, remote_staging, remote_region)
    sc = _out_of(table, st, remote_staging, remote_region)
    return StagedPlan(Mode.BOTH, g, w, sc, total, total)


def runs(table: DescriptorTable, side: str) -> int:
    """Engine rows a one-sided staging of ``table`` would post: for a gather ("dst") the runs of
    adjacent destinations, for a scatter ("src") the runs of adjacent sources, both in destination
    order (the staged order). Cheap: no table is built."""
    if len(table) < 2:
        return len(table)
    order = _order(table.dst_addr, table.dst_region)
    addr, region = (table.dst_addr, table.dst_region) if side == "dst" else (table.src_addr, table.src_region)
    a, r, n = _take(addr, order), _take(region, order), _take(table.length, order)
    breaks = (a[1:] != a[:-1] + n[:-1]) | (r[1:] != r[:-1])
    return int(breaks.sum()) + 1
