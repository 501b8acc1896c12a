"""A decode rank's receive staging: the buffer, the reservations per room and the scatter copies
(the edge of :mod:`pdwire.runtime.staging.receive`; docs/request-efficiency.md).

The buffer is registered after the planner's regions, so every prefill rank gets its own
revocable window onto it and the fence covers it. A room's ranges are freed with its slots: at
Success at once, after a failure only once its fence completed, because a late write into a
reused range would corrupt another room's copy source. Host memory by default (``HostCopier``);
a device copier (``TorchCopier``) plugs in as ``copier`` and allocates the buffer on its device.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pdwire.runtime.backends import Backend, BackendError
from pdwire.runtime.config import ParallelRank
from pdwire.runtime.descriptors import MemoryKind
from pdwire.runtime.planner import HeadGeometry, PlanError, RankMemory
from pdwire.runtime.session.actions import PeerRef
from pdwire.runtime.staging import Copier, CopyError, HostCopier, StagingArena, runs
from pdwire.runtime.staging.receive import ScatterGeometryError, ScatterPlanner, stand_in_source
from pdwire.runtime.workers.setup import SCATTER_BUFFER, own_buffer

SCATTER_MIN_ROWS_PER_LAYER = 4  # destination runs per page, layer and K/V from which scatter is offered


class ScatterRefused(ValueError):
    """A notification names staged pages this rank did not reserve for that room and sender."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """One room's range for one prefill rank: ``pages`` of ``page_bytes`` from ``offset``."""

    peer: PeerRef  # a range is kept while its writer has not fenced
    offset: int
    page_bytes: int
    pages: int
    dst_pages: npt.NDArray[np.int32]  # the room's first ``pages`` destination pages
    planner: ScatterPlanner


class ScatterReceiver:
    def __init__(
        self, backend: Backend, memory: RankMemory, nbytes: int, copier: Copier | None = None
    ) -> None:
        self.backend = backend
        self.memory = memory
        self.arena = StagingArena(0)
        self.base = 0
        self.region = -1
        self._copier = copier
        self._planners: dict[str, ScatterPlanner | None] = {}  # per link key
        self._rooms: dict[int, dict[int, Reservation]] = {}  # room -> sender rank -> range
        self.failure = ""  # why the rank offers no receive staging, if it offers none
        kv = memory.kv
        if nbytes <= 0:
            self.failure = "scatter_bytes is 0"
        elif kv is None or kv.is_mla:
            self.failure = "MLA latents are written whole: nothing to scatter"
        elif copier is None and kv.memory_kind is not MemoryKind.DRAM:
            self.failure = "the KV cache is device memory and no device copier was given"
        else:
            try:
                self.region, self.base = own_buffer(backend, SCATTER_BUFFER, nbytes, copier)
            except BackendError as exc:
                self.failure = f"no receive staging buffer: {type(exc).__name__}: {exc}"
            else:
                self.arena = StagingArena(nbytes)

    @property
    def enabled(self) -> bool:
        return self.region >= 0

    @property
    def advertised(self) -> tuple[int, int]:
        """(base, length) of the buffer for RegisterInfo; (0, 0) when there is none."""
        return (self.base, self.arena.nbytes) if self.enabled else (0, 0)

    def planner(
        self, key: str, position: ParallelRank, heads: HeadGeometry, kv_layers: tuple[int, ...]
    ) -> ScatterPlanner | None:
        """The scatter planner for the prefill rank registered under ``key`` (its position, head
        geometry and KV layers); None when its geometry does not plan against this rank's memory
        or its layers are not one run (its rooms are then written directly)."""
        if key not in self._planners:
            self._planners[key] = self._new_planner(position, heads, kv_layers)
        return self._planners[key]

    def _new_planner(
        self, position: ParallelRank, heads: HeadGeometry, kv_layers: tuple[int, ...]
    ) -> ScatterPlanner | None:
        kv = self.memory.kv
        if not self.enabled or kv is None or not kv_layers:
            return None
        first = kv_layers[0]
        if list(kv_layers) != list(range(first, first + len(kv_layers))):
            return None
        pages = kv.region_lens[0] // kv.stride if kv.region_lens else 0
        try:
            planner = ScatterPlanner(
                self.memory, stand_in_source(position, heads, len(kv_layers), pages, kv, first)
            )
            dst_runs = runs(planner.rows(np.zeros(1, np.int32)), "dst")  # the destination's cuts alone
        except (PlanError, ValueError):
            return None
        # A page whose destination is a few runs per layer (whole pages, or a head block each) is
        # written as well in place or gathered by the prefill rank: reserving for it would only
        # take buffer space from rooms whose destinations are cut per token.
        if planner.page_bytes <= 0 or dst_runs <= 2 * SCATTER_MIN_ROWS_PER_LAYER * len(kv_layers):
            return None
        return planner

    def forget(self, key: str) -> None:
        self._planners.pop(key, None)

    def reserve(
        self, room: int, sender: int, peer: PeerRef, planner: ScatterPlanner, dst_pages: npt.NDArray[np.int32]
    ) -> Reservation | None:
        """A range for the room's first pages from ``sender`` (as many as fit now; None: none)."""
        rooms = self._rooms.setdefault(room, {})
        if sender in rooms:
            return rooms[sender]
        p = planner.page_bytes
        pages = min(len(dst_pages), self.arena.largest_free() // p)
        offset = self.arena.alloc(pages * p) if pages > 0 else None
        if offset is None:
            if not rooms:
                del self._rooms[room]
            return None
        r = Reservation(peer, offset, p, pages, np.asarray(dst_pages[:pages], np.int32), planner)
        rooms[sender] = r
        return r

    def scatter(self, room: int, sender: int, first: int, count: int) -> int:
        """Copy staged pages ``[first, first + count)`` of ``room`` from ``sender`` into place;
        returns the bytes copied. Raises :class:`ScatterRefused` for a range not reserved,
        :class:`CopyError` / :class:`ScatterGeometryError` when the copy cannot be made."""
        r = self._rooms.get(room, {}).get(sender)
        if r is None:
            raise ScatterRefused(f"room {room}: no staging range was reserved for prefill rank {sender}")
        if count <= 0 or first < 0 or first + count > r.pages:
            raise ScatterRefused(
                f"room {room}: prefill rank {sender} names staged pages [{first}, {first + count}), "
                f"its range holds pages [0, {r.pages})"
            )
        table = r.planner.copy_table(
            r.dst_pages[first : first + count], self.base + r.offset + first * r.page_bytes, self.region
        )
        if self._copier is None:
            self._copier = HostCopier(self.backend.regions)
        self._copier.copy(table)
        return table.total_bytes

    def release(self, room: int, keep: Collection[PeerRef] = ()) -> None:
        """The room's slots are free again (its writes stopped): so are its ranges, except those
        of the writers in ``keep`` (not fenced: a late write may still land there, so the range
        is never reused; it stays counted in ``arena.in_use``)."""
        for r in self._rooms.pop(room, {}).values():
            if r.peer not in keep:
                self.arena.free(r.offset)


__all__ = ["CopyError", "Reservation", "ScatterGeometryError", "ScatterReceiver", "ScatterRefused"]
