"""Decode-side scatter, the pure part: where a prefill rank's staged KV bytes go.

The prefill rank writes a chunk into the decode rank's receive staging in the order of
:func:`.transform.scatter_write`. The decode rank computes the same destination rows itself, by
planning (that prefill rank -> itself) with a *stand-in* of the prefill rank's memory built from
the head geometry it sent (``RegisterAck.kv_heads``) on made-up addresses: only the destination
side, this rank's own memory, is used (:func:`.transform.scatter_copy`), so whatever a peer
claims, the copy lands only in the pages of the room it names, as a direct write could.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import numpy.typing as npt

from pdwire.runtime.descriptors import DescriptorTable
from pdwire.runtime.planner import (
    HeadGeometry,
    KvPool,
    ParallelRank,
    PeerPlan,
    RankMemory,
    prepare_peer,
    region_index,
)
from pdwire.runtime.staging.transform import scatter_copy

_STAND_IN_BASE = 1 << 44  # made-up addresses of the stand-in's buffers (never dereferenced)
_ALIGN = 1 << 12


class ScatterGeometryError(ValueError):
    """A prefill rank's staged bytes cannot be placed: its geometry does not plan against this
    rank's memory, or the chunk's bytes are not the reserved page size times its pages."""


def stand_in_source(
    position: ParallelRank,
    heads: HeadGeometry,
    num_layers: int,
    pages: int,
    like: KvPool,
    first_layer: int = 0,
) -> RankMemory:
    """A prefill rank's KV pool as the decode rank knows it: its position (TP and PP), its head
    geometry, ``num_layers`` layers from ``first_layer``, room for ``pages`` pages, on made-up
    addresses. Kind and device follow ``like`` (this rank's pool)."""
    bytes_per_page = heads.kv_heads_per_rank * heads.page_size * heads.bytes_per_head
    region_len = max(1, pages) * bytes_per_page
    span = -(-region_len // _ALIGN) * _ALIGN
    bases = [_STAND_IN_BASE + i * span for i in range(2 * num_layers)]
    kv = KvPool(
        k_base_addrs=tuple(bases[:num_layers]),
        v_base_addrs=tuple(bases[num_layers:]),
        region_lens=(region_len,) * num_layers,
        bytes_per_page=bytes_per_page,
        page_size=heads.page_size,
        layout=heads.layout,
        kv_heads_per_rank=heads.kv_heads_per_rank,
        total_kv_heads=heads.total_kv_heads,
        bytes_per_head=heads.bytes_per_head,
        memory_kind=like.memory_kind,
        device_id=like.device_id,
    )
    return RankMemory(position, kv, first_layer=first_layer)


def kv_only(memory: RankMemory) -> RankMemory:
    """``memory`` without its state and aux: what a KV chunk is planned against."""
    return replace(memory, state=(), aux=())


def kv_region_map(memory: RankMemory) -> npt.NDArray[np.uint32]:
    """Region ids of :func:`kv_only` (``memory``) -> the same buffers' region ids in ``memory``
    (they differ where a KV buffer shares a registration with a state buffer)."""
    own, full = region_index(kv_only(memory)), region_index(memory)
    out = np.zeros(own.count, dtype=np.uint32)
    for mine, theirs in ((own.kv_k, full.kv_k), (own.kv_v, full.kv_v)):
        out[list(mine)] = theirs
    return out


class ScatterPlanner:
    """Where the staged bytes of one prefill rank go in this decode rank's memory.

    ``memory`` is this rank's; ``plan`` plans (stand-in prefill rank -> this rank). Built once
    per prefill rank, used for every room it scatters."""

    def __init__(self, memory: RankMemory, source: RankMemory) -> None:
        self.plan: PeerPlan = prepare_peer(source, kv_only(memory))
        self._regions = kv_region_map(memory)
        self.page_bytes = self.rows(np.zeros(1, np.int32)).total_bytes

    def rows(self, dst_pages: npt.NDArray[np.int32]) -> DescriptorTable:
        """The destination rows of ``dst_pages`` (source side: the stand-in's made-up addresses),
        with region ids of this rank's full memory."""
        t = self.plan.plan_kv_chunk(0, np.arange(len(dst_pages), dtype=np.int32), dst_pages).table
        return DescriptorTable(t.src_addr, t.dst_addr, t.length, t.src_region, self._regions[t.dst_region])

    def copy_table(
        self, dst_pages: npt.NDArray[np.int32], staging: int, staging_region: int
    ) -> DescriptorTable:
        """Staging ``[staging, + len(dst_pages) x page_bytes)`` -> the rows of ``dst_pages``."""
        rows = self.rows(dst_pages)
        if rows.total_bytes != len(dst_pages) * self.page_bytes:
            raise ScatterGeometryError(
                f"{len(dst_pages)} pages plan {rows.total_bytes} bytes, not {self.page_bytes} per page"
            )
        return scatter_copy(rows, staging, staging_region)
