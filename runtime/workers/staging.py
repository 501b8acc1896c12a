"""A prefill rank's staging: the arena buffer, the host copies and the decision per part (the
edge that owns memory around :mod:`pdwire.runtime.staging`; docs/request-efficiency.md).

The buffer is allocated through the rank's backend and registered after the planner's regions
the first time a part is staged, so a rank whose parts never stage holds nothing. A range is
freed only when the engine reports its write final (DONE, or FAILED once confirmed stopped):
the room's fence covers the staging bytes too. A part that does not fit now waits for a range;
one that never could goes direct. Decode-side scatter (:meth:`Stager.scatter`) needs a decode
rank at 1.4 that reserved a range of its receive staging buffer for the room.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdwire.runtime.backends import Backend, BackendError, Peer
from pdwire.runtime.descriptors import DescriptorTable, MemoryKind
from pdwire.runtime.planner import PeerPlan
from pdwire.runtime.session.actions import KvPart, Part
from pdwire.runtime.staging import (
    Choice,
    Copier,
    CopyError,
    CostModel,
    HostCopier,
    Mode,
    StagingArena,
    gather,
    runs,
    scatter_write,
)
from pdwire.runtime.workers.setup import STAGING_BUFFER, own_buffer

# KV chunks are cut so that one staged chunk for one peer takes at most this share of the arena,
# so that several are in flight at once (the copy of one overlaps the engine's write of another)
PIECES_IN_FLIGHT = 4


@dataclass
class ScatteredPost:
    """One write of KV parts into a decode rank's receive staging range (and of the other parts
    of the same notification in place): the table, and the staged pages for the notification."""

    write: DescriptorTable
    first_page: int  # position in the room's page list
    pages: int
    kv_parts: int
    kv_bytes: int


@dataclass
class StagedPost:
    """One gathered part: the table the engine posts and the arena range it reads."""

    write: DescriptorTable
    offset: int
    rows: int  # the planner's rows, before staging


class Stager:
    def __init__(
        self, backend: Backend, nbytes: int, model: CostModel | None = None, copier: Copier | None = None
    ) -> None:
        self.backend = backend
        self.model = model if model is not None else CostModel.for_backend(backend.name)
        self.arena = StagingArena(nbytes)
        self._copier = copier
        self._base = 0
        self._region = -1
        self._disabled = nbytes <= 0
        self._ranges: dict[int, int] = {}  # xfer id -> arena offset
        # peer plan -> staged KV (bytes, rows) per page (None: its KV goes direct)
        self._kv_page: weakref.WeakKeyDictionary[PeerPlan, tuple[int, int] | None] = (
            weakref.WeakKeyDictionary()
        )
        self.failure = ""  # why staging turned itself off, if it did

    @property
    def enabled(self) -> bool:
        return not self._disabled

    def _host_only(self, table: DescriptorTable) -> bool:
        if self._copier is not None:
            return True
        kinds = {self.backend.regions[int(i)].kind for i in np.unique(table.src_region)}
        return kinds == {MemoryKind.DRAM}

    def choose(self, table: DescriptorTable) -> Choice:
        if len(table) < self.model.min_rows:  # never staged (the model's own rule), decided cheaply
            return self.model.choose(table)
        if self._disabled or not self.arena.fits_ever(table.total_bytes) or not self._host_only(table):
            return Choice(Mode.DIRECT)
        return self.model.choose(table, (Mode.GATHER,))

    def _ensure_buffer(self) -> bool:
        if self._region >= 0:
            return True
        try:
            nbytes = self.arena.nbytes
            self._region, self._base = own_buffer(self.backend, STAGING_BUFFER, nbytes, self._copier)
        except BackendError as exc:
            self._disabled, self.failure = True, f"staging off: {type(exc).__name__}: {exc}"
            return False
        if self._copier is None:
            self._copier = HostCopier(self.backend.regions)
        return True

    def stage(self, xfer_id: int, table: DescriptorTable) -> StagedPost | None:
        """Gather ``table`` into a free arena range; None when no range is free now (retry later)."""
        if not self._ensure_buffer():
            raise CopyError(self.failure)
        offset = self.arena.alloc(table.total_bytes)
        if offset is None:
            return None
        try:
            plan = gather(table, self._base + offset, self._region)
            assert self._copier is not None
            self._copier.copy(plan.gather)
        except BaseException:
            self.arena.free(offset)
            raise
        self._ranges[xfer_id] = offset
        return StagedPost(plan.write, offset, len(table))

    def release(self, xfer_id: int) -> None:
        """The engine is done with ``xfer_id`` (final): its arena range is free again."""
        offset = self._ranges.pop(xfer_id, None)
        if offset is not None:
            self.arena.free(offset)

    def kv_pages_per_part(self, plans: list[PeerPlan]) -> int | None:
        """How many KV pages one chunk may carry so that a staged chunk for any of ``plans`` fits
        its share of the arena; None when no peer's KV parts stage (chunks stay as given)."""
        if self._disabled:
            return None
        per_page = [x for x in (self._probe(p) for p in plans) if x]
        if not per_page:
            return None
        nbytes = max(b for b, _ in per_page)
        rows = min(r for _, r in per_page)
        pages = max(1, self.arena.nbytes // PIECES_IN_FLIGHT // nbytes)
        # but never so few pages that a chunk is too small to be worth staging at all
        pages = max(pages, -(-self.model.min_rows // rows))
        return pages if pages * nbytes <= self.arena.nbytes else None

    def _probe(self, plan: PeerPlan) -> tuple[int, int] | None:
        """Staged KV (bytes, rows) per page for one peer, from a plan of a few pages (None: direct)."""
        key = plan
        if key not in self._kv_page:
            self._kv_page[key] = None
            kv = plan.local.kv
            if kv is not None and plan.remote.kv is not None and not plan.is_dummy:
                n = 8
                try:
                    # destinations apart from one another: runs per page, as fragmented pages give
                    table = plan.plan_kv_chunk(0, np.arange(n), np.arange(0, 2 * n, 2)).table
                except Exception:
                    table = DescriptorTable.empty()
                if len(table) and self._host_only(table):
                    scale = max(1, self.model.min_rows // len(table) + 1)
                    rows, nbytes = len(table) * scale, table.total_bytes * scale
                    direct = self.model.estimate(Mode.DIRECT, rows, nbytes, rows)
                    staged = self.model.estimate(Mode.GATHER, rows, nbytes, runs(table, "dst") * scale)
                    if staged <= (1 - self.model.min_saving) * direct:
                        self._kv_page[key] = (table.total_bytes // n, max(1, len(table) // n))
        return self._kv_page[key]

    def scatter(
        self,
        peer: Peer,
        buffer: tuple[int, int],
        parts: Sequence[Part],
        tables: Sequence[DescriptorTable],
    ) -> ScatteredPost | None:
        """The write of ``parts`` (one notification's) with their KV rows into the decode rank's
        receive staging ``buffer`` (base, length), when the room reserved their pages and the
        cost model prefers it to direct and gather; None: post them the ordinary way."""
        base, length = buffer
        kv = [(p, t) for p, t in zip(parts, tables, strict=True) if isinstance(p, KvPart)]
        if not length or not kv or any(p.scatter_at[0] < 0 for p, _ in kv):
            return None
        first = kv[0][0]
        at, per_page = first.scatter_at
        pages = sum(len(p.dst) for p, _ in kv)
        kv_table = DescriptorTable.concat([t for _, t in kv]) if len(kv) > 1 else kv[0][1]
        if kv_table.total_bytes != pages * per_page or at + pages * per_page > length:
            return None  # the decode rank computed another page size: it could not place the bytes
        if self.model.choose(kv_table, (Mode.GATHER, Mode.SCATTER)).mode is not Mode.SCATTER:
            return None
        region = _region_holding(peer, base, length)
        if region is None:
            return None
        write = scatter_write(kv_table, base + at, region)
        others = [t for p, t in zip(parts, tables, strict=True) if not isinstance(p, KvPart) and len(t)]
        table = DescriptorTable.concat([write, *others]) if others else write
        return ScatteredPost(table, first.dst_first, pages, len(kv), kv_table.total_bytes)


def _region_holding(peer: Peer, base: int, length: int) -> int | None:
    """The index of the peer's region that is its receive staging buffer (registered last)."""
    for i in range(len(peer.regions) - 1, -1, -1):
        r = peer.regions[i]
        if r.base <= base and base + length <= r.base + r.length:
            return i
    return None
