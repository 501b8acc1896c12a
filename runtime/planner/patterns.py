"""Segment patterns: which bytes of one source item go where in one destination item.

An item is one page (KV, SWA, DSA) or one slot (Mamba) of one tensor-layer. For a given pair of
ranks every item pair of a tensor copies the same segments, so the pattern is computed once per
peer and the hot path only multiplies indices by item sizes. Patterns are kept sorted by
destination offset and coalesced (segments adjacent on both sides merged), which is what makes
the merged descriptor list minimal later.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdwire.runtime.descriptors import U64
from pdwire.runtime.planner.model import HeadGeometry


def coalesce(src: U64, dst: U64, length: U64) -> tuple[U64, U64, U64]:
    """Merge rows adjacent on both sides. Rows must be sorted by ``dst`` with disjoint ``dst`` ranges;
    then any row that could extend another is its immediate successor, so one pass is minimal."""
    if len(src) < 2:
        return src, dst, length
    continues = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    if not continues.any():
        return src, dst, length
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return src[starts], dst[starts], np.add.reduceat(length, starts).astype(np.uint64, copy=False)


@dataclass(frozen=True, slots=True)
class Pattern:
    """Segments ``(src_off, dst_off, length)`` inside one item pair, sorted by ``dst_off``, coalesced."""

    src_off: U64
    dst_off: U64
    length: U64
    src_item: int
    dst_item: int

    def __len__(self) -> int:
        return len(self.src_off)

    @classmethod
    def from_rows(
        cls, src: list[int], dst: list[int], length: list[int], src_item: int, dst_item: int
    ) -> Pattern:
        s = np.asarray(src, dtype=np.uint64)
        d = np.asarray(dst, dtype=np.uint64)
        n = np.asarray(length, dtype=np.uint64)
        order = np.argsort(d, kind="stable")
        s, d, n = coalesce(s[order], d[order], n[order])
        return cls(s, d, n, src_item, dst_item)


def whole_item(item: int) -> Pattern:
    return Pattern.from_rows([0], [0], [item], item, item)


def empty_pattern(src_item: int, dst_item: int) -> Pattern:
    return Pattern.from_rows([], [], [], src_item, dst_item)


def _head_offsets(geometry: HeadGeometry, tokens: U64, local_heads: U64) -> U64:
    return local_heads * np.uint64(geometry.head_step) + tokens * np.uint64(geometry.token_step)


def head_slice(
    src: HeadGeometry,
    dst: HeadGeometry,
    *,
    src_first_head: int,
    dst_first_head: int,
    heads: tuple[int, int],
) -> Pattern:
    """Copy global heads ``[heads[0], heads[1])`` of every token of a page, each side in its layout.

    Enumerates (token, head) units and coalesces, so packed NHD gives one segment per token (one
    per page when the heads cover whole tokens on both sides) and packed HND one per page (one per
    head where a side's heads are apart, one per unit where K and V sit side by side per token),
    without special cases.
    """
    src_item, dst_item = src.item_extent, dst.item_extent
    lo, hi = heads
    if hi <= lo:
        return empty_pattern(src_item, dst_item)
    head_count = hi - lo
    tokens = np.repeat(np.arange(src.page_size, dtype=np.uint64), head_count)
    global_heads = np.tile(np.arange(lo, hi, dtype=np.uint64), src.page_size)
    src_off = _head_offsets(src, tokens, global_heads - np.uint64(src_first_head))
    dst_off = _head_offsets(dst, tokens, global_heads - np.uint64(dst_first_head))
    length = np.full(len(tokens), src.bytes_per_head, dtype=np.uint64)
    order = np.argsort(dst_off, kind="stable")
    s, d, n = coalesce(src_off[order], dst_off[order], length[order])
    return Pattern(s, d, n, src_item, dst_item)


def axis_slice(
    *,
    src_item: int,
    dst_item: int,
    unit_bytes: int,
    block_sizes: tuple[int, ...],
    src_tp: int,
    src_rank: int,
    dst_tp: int,
    dst_rank: int,
    outer_rows: int = 1,
) -> Pattern:
    """Copy the overlap of two ranks' shards of an axis made of independently sharded sub-blocks.

    A slot is ``outer_rows`` rows, each one axis of ``unit_bytes`` elements. ``block_sizes`` are
    full (unsharded) sizes; each rank's row holds, per block in order, its contiguous
    ``size / tp`` share. Every overlapping block of every row gives one segment (segments that
    meet on both sides merge, e.g. consecutive rows when a rank's share is the whole row).
    """
    src_rows: list[int] = []
    dst_rows: list[int] = []
    lengths: list[int] = []
    src_row = sum(full // src_tp for full in block_sizes) * unit_bytes
    dst_row = sum(full // dst_tp for full in block_sizes) * unit_bytes
    for row in range(outer_rows):
        src_block_start = dst_block_start = 0
        for full in block_sizes:
            src_share, dst_share = full // src_tp, full // dst_tp
            src_lo, dst_lo = src_rank * src_share, dst_rank * dst_share
            lo, hi = max(src_lo, dst_lo), min(src_lo + src_share, dst_lo + dst_share)
            if hi > lo:
                src_rows.append(row * src_row + (src_block_start + lo - src_lo) * unit_bytes)
                dst_rows.append(row * dst_row + (dst_block_start + lo - dst_lo) * unit_bytes)
                lengths.append((hi - lo) * unit_bytes)
            src_block_start += src_share
            dst_block_start += dst_share
    return Pattern.from_rows(src_rows, dst_rows, lengths, src_item, dst_item)
