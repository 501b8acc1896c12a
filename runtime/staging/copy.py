"""Executing a local copy table (a staged gather or scatter) on this process's memory.

:class:`HostCopier` checks every row against this process's host regions, then copies: a
segment of rows of one length on a grid of that length is one numpy ``take`` (gather) or
fancy-index store (scatter), C loops without the GIL; anything else goes row by row. Device
memory needs a device copier with the same methods (:class:`Copier`; caches held as torch
tensors: :class:`~pdwire.runtime.staging.torch_copy.TorchCopier`); the transform and the cost
model do not change.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from pdwire.runtime.descriptors import DescriptorTable, MemoryKind, Region, RegionColumns, outside_regions

U8 = npt.NDArray[np.uint8]
_ROW_BY_ROW = 64 << 10  # rows this long are copied one memmove each (the call is cheap next to them)


class CopyError(ValueError):
    """A copy table row outside the regions it names, or in device memory (nothing was copied)."""


class Copier(Protocol):
    """Executes local copy tables; ``buffer`` allocates a staging buffer where it copies (None:
    the transfer engine allocates host memory)."""

    def copy(self, table: DescriptorTable) -> None: ...

    def buffer(self, name: str, nbytes: int) -> Region | None: ...


def _span_view(lo: int, hi: int) -> U8:
    """Bytes ``[lo, hi)`` of this process as one array. Only rows inside registered regions are
    ever read or written through it (every row is checked first), so gaps between regions, which
    may be unmapped, are never touched."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * (hi - lo)).from_address(lo))


class HostCopier:
    """Copies between host regions of this process (``regions``: the backend's region list).

    All regions are seen through one array spanning them, so rows of one length are one numpy
    call however many regions (layers) they come from: a staged part of one KV chunk (every layer,
    K and V, hundreds of rows each) is one ``take``."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self.regions = list(regions)
        self._columns = RegionColumns.of(self.regions)
        self._dram = np.fromiter((r.kind is MemoryKind.DRAM for r in self.regions), bool, len(self.regions))
        host = [r for r in self.regions if r.kind is MemoryKind.DRAM]
        self._lo = min((r.base for r in host), default=0)
        self._hi = max((r.end for r in host), default=0)
        self._span: U8 | None = None

    def _view(self) -> U8:
        if self._span is None:
            self._span = _span_view(self._lo, self._hi)
        return self._span

    def _inside(
        self, addr: npt.NDArray[np.uint64], length: npt.NDArray[np.uint64], reg: npt.NDArray[np.uint32]
    ) -> bool:
        """Every row inside the host region it names, checked per run of rows naming one region
        (a staged part's rows come in long runs: a layer, then the next): a few reductions
        instead of a dozen passes over every row."""
        starts = np.flatnonzero(np.concatenate(([True], reg[1:] != reg[:-1])))
        regions = reg[starts]
        if int(regions.max()) >= len(self.regions) or bool((length == 0).any()):
            return False
        if not bool(self._dram[regions].all()):
            return False
        bases, sizes = self._columns.bases[regions], self._columns.lengths[regions]
        if bool((np.minimum.reduceat(addr, starts) < bases).any()):
            return False
        if bool((np.maximum.reduceat(length, starts) > sizes).any()):
            return False
        # lengths bounded by their region's size: addr + length of a row inside it cannot wrap
        return bool((np.maximum.reduceat(addr + length, starts) - bases <= sizes).all())

    def check(self, table: DescriptorTable) -> None:
        """Raise :class:`CopyError` naming the first row outside its region or in device memory."""
        for side, addr, reg in (
            ("src", table.src_addr, table.src_region),
            ("dst", table.dst_addr, table.dst_region),
        ):
            if self._inside(addr, table.length, reg):
                continue
            known = reg < len(self.regions)
            device = known & ~self._dram[np.where(known, reg, 0)]
            if device.any():
                i = int(np.argmax(device))
                raise CopyError(
                    f"copy row {i}: {side} region {int(reg[i])} is device memory; a host copier copies DRAM"
                )
            bad = outside_regions(addr, table.length, reg, self._columns)
            i = int(np.argmax(bad))
            raise CopyError(
                f"copy row {i}: {side} [{int(addr[i]):#x}, +{int(table.length[i])}) is not inside "
                f"region {int(reg[i])}"
            )

    def buffer(self, name: str, nbytes: int) -> Region | None:
        return None  # host memory: the transfer engine allocates it

    def copy(self, table: DescriptorTable) -> None:
        """Copy every row (rows must not overlap one another's destination)."""
        if len(table) == 0:
            return
        self.check(table)
        n = table.length
        cut = np.flatnonzero(n[1:] != n[:-1]) + 1
        bounds = [0, *cut.tolist(), len(table)]
        span = self._view()
        lo = np.uint64(self._lo)
        s_off, d_off = table.src_addr - lo, table.dst_addr - lo
        for a, b in itertools.pairwise(bounds):
            _segment(span, s_off[a:b], d_off[a:b], int(n[a]))


def _segment(span: U8, s_off: npt.NDArray[np.uint64], d_off: npt.NDArray[np.uint64], length: int) -> None:
    """Rows of one ``length`` at offsets into ``span``."""
    count = len(s_off)
    if count > 1 and length < _ROW_BY_ROW:
        step = np.uint64(length)
        if bool((np.diff(d_off) == step).all()):  # into one contiguous range: gather
            grid = _grid(span, s_off, length)
            if grid is not None:
                rows, idx = grid
                d0 = int(d_off[0])
                np.take(
                    rows, idx, axis=0, out=span[d0 : d0 + count * length].reshape(count, length), mode="clip"
                )
                return
        if bool((np.diff(s_off) == step).all()):  # out of one contiguous range: scatter
            grid = _grid(span, d_off, length)
            if grid is not None:
                rows, idx = grid
                s0 = int(s_off[0])
                rows[idx] = span[s0 : s0 + count * length].reshape(count, length)
                return
    for s, d in zip(s_off.tolist(), d_off.tolist(), strict=True):
        span[d : d + length] = span[s : s + length]


def _grid(buf: U8, offsets: npt.NDArray[np.uint64], length: int) -> tuple[U8, npt.NDArray[np.intp]] | None:
    """The part of ``buf`` the rows at ``offsets`` cover, as rows of ``length`` bytes on their grid,
    and each offset's row; None when the offsets are not all on one grid. The view is cut tight
    around the rows: numpy copies through a temporary when an output may overlap an input, and
    judges that by the arrays' extents."""
    first = int(offsets.min())
    rel = offsets - np.uint64(first)
    if bool((rel % np.uint64(length)).any()):
        return None
    idx = (rel // np.uint64(length)).astype(np.intp)
    rows = int(idx.max()) + 1
    return buf[first : first + rows * length].reshape(rows, length), idx
