"""Descriptor tables: the one value the planner produces and every backend consumes.

A descriptor is one contiguous copy ``length`` bytes from ``src_addr`` (in the local,
prefill-side process) to ``dst_addr`` (in the peer, decode-side process). Addresses are
absolute virtual addresses as registered, always ``uint64``: offsets are never computed in
a narrower type. Each descriptor also names the registered region it lies in on each side
(an index into that side's region list), so engines that address memory as
"descriptor + offset" (MoRI) or need a device id per row (NIXL) can translate without
searching.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]


class MemoryKind(StrEnum):
    """Where a registered region lives."""

    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True, slots=True)
class Region:
    """One registered, contiguous memory region on one side of a transfer."""

    base: int
    length: int
    kind: MemoryKind = MemoryKind.DRAM
    device_id: int = 0
    name: str = ""

    @property
    def end(self) -> int:
        return self.base + self.length


@dataclass(frozen=True, slots=True)
class RegionColumns:
    """A region list as uint64 columns; build it once per list, since every post checks against it."""

    bases: U64
    lengths: U64

    @classmethod
    def of(cls, regions: Sequence[Region]) -> RegionColumns:
        n = len(regions)
        return cls(
            np.fromiter((r.base for r in regions), dtype=np.uint64, count=n),
            np.fromiter((r.length for r in regions), dtype=np.uint64, count=n),
        )

    def __len__(self) -> int:
        return len(self.bases)


def outside_regions(addr: U64, length: U64, region: U32, columns: RegionColumns) -> npt.NDArray[np.bool_]:
    """Per row: names a region that does not exist, has zero length, or does not lie inside it.

    All arithmetic stays in uint64 and never forms ``base + length`` (which may be 2**64) or
    ``addr + length``, so no row can pass by wrapping around.
    """
    if len(columns) == 0:
        return np.ones(len(addr), dtype=bool)
    exists = region < len(columns)
    ids = np.where(exists, region, 0)
    bases, lengths = columns.bases[ids], columns.lengths[ids]
    below = addr < bases
    offset = np.where(below, np.uint64(0), addr - np.where(below, addr, bases))
    past = (offset > lengths) | (length > lengths - np.minimum(offset, lengths))
    bad: npt.NDArray[np.bool_] = ~exists | below | past | (length == 0)
    return bad


@dataclass(frozen=True, slots=True)
class DescriptorTable:
    """Columns of equal length; row i copies ``length[i]`` bytes ``src_addr[i] -> dst_addr[i]``."""

    src_addr: U64
    dst_addr: U64
    length: U64
    src_region: U32
    dst_region: U32

    def __post_init__(self) -> None:
        n = len(self.src_addr)
        for name in ("src_addr", "dst_addr", "length"):
            col = getattr(self, name)
            if col.dtype != np.uint64 or col.ndim != 1 or len(col) != n:
                raise TypeError(f"DescriptorTable.{name} must be a 1-D uint64 column of length {n}")
        for name in ("src_region", "dst_region"):
            col = getattr(self, name)
            if col.dtype != np.uint32 or col.ndim != 1 or len(col) != n:
                raise TypeError(f"DescriptorTable.{name} must be a 1-D uint32 column of length {n}")

    def __len__(self) -> int:
        return len(self.src_addr)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum(dtype=np.uint64))

    @classmethod
    def empty(cls) -> DescriptorTable:
        z64 = np.zeros(0, dtype=np.uint64)
        z32 = np.zeros(0, dtype=np.uint32)
        return cls(z64, z64.copy(), z64.copy(), z32, z32.copy())

    @classmethod
    def concat(cls, tables: list[DescriptorTable]) -> DescriptorTable:
        if not tables:
            return cls.empty()
        return cls(
            np.concatenate([t.src_addr for t in tables]),
            np.concatenate([t.dst_addr for t in tables]),
            np.concatenate([t.length for t in tables]),
            np.concatenate([t.src_region for t in tables]),
            np.concatenate([t.dst_region for t in tables]),
        )

    def take(self, rows: npt.NDArray[np.intp]) -> DescriptorTable:
        """The rows at ``rows``, in that order."""
        return DescriptorTable(
            self.src_addr[rows],
            self.dst_addr[rows],
            self.length[rows],
            self.src_region[rows],
            self.dst_region[rows],
        )

    def merged(self) -> DescriptorTable:
        """Consecutive rows (in table order) that continue one another on both sides, in the same
        regions, merged into one; ``self`` when none do."""
        if len(self) < 2:
            return self
        s, d, n = self.src_addr, self.dst_addr, self.length
        sr, dr = self.src_region, self.dst_region
        cont = (
            (s[1:] == s[:-1] + n[:-1])
            & (d[1:] == d[:-1] + n[:-1])
            & (sr[1:] == sr[:-1])
            & (dr[1:] == dr[:-1])
        )
        if not cont.any():
            return self
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        lengths = np.add.reduceat(n, starts).astype(np.uint64, copy=False)
        return DescriptorTable(s[starts], d[starts], lengths, sr[starts], dr[starts])

    def mergeable_pairs(self) -> npt.NDArray[np.intp]:
        """Row pairs ``(i, j)`` that could be one descriptor: row j starts where row i ends on both
        sides, in the same regions. Empty for a minimal table. Vectorised: sort by destination and
        look up each row's destination end among destination starts."""
        n = len(self)
        if n < 2:
            return np.zeros((0, 2), dtype=np.intp)
        src_end = self.src_addr + self.length
        dst_end = self.dst_addr + self.length
        order = np.argsort(self.dst_addr, kind="stable")
        starts = self.dst_addr[order]
        lo = np.searchsorted(starts, dst_end, side="left")
        hi = np.searchsorted(starts, dst_end, side="right")
        pairs: list[npt.NDArray[np.intp]] = []
        single = np.flatnonzero(hi - lo == 1)
        if len(single):
            j = order[lo[single]]
            ok = (
                (self.src_addr[j] == src_end[single])
                & (self.src_region[j] == self.src_region[single])
                & (self.dst_region[j] == self.dst_region[single])
            )
            pairs.append(np.stack([single[ok], j[ok]], axis=1).astype(np.intp))
        for i in np.flatnonzero(hi - lo > 1):  # several rows start at one address: rare, check each
            for j in order[lo[i] : hi[i]]:
                if (
                    self.src_addr[j] == src_end[i]
                    and self.src_region[j] == self.src_region[i]
                    and self.dst_region[j] == self.dst_region[i]
                ):
                    pairs.append(np.asarray([[i, j]], dtype=np.intp))
        return np.concatenate(pairs) if pairs else np.zeros((0, 2), dtype=np.intp)

    def rows_outside(
        self, src_regions: Sequence[Region], dst_regions: Sequence[Region]
    ) -> npt.NDArray[np.intp]:
        """Rows that name a missing region, have zero length or leave their region, on either side."""
        bad = outside_regions(self.src_addr, self.length, self.src_region, RegionColumns.of(src_regions))
        bad |= outside_regions(self.dst_addr, self.length, self.dst_region, RegionColumns.of(dst_regions))
        return np.flatnonzero(bad)
