"""A staging copier for caches held as torch tensors, on the caches' own device.

On a GPU a KV cache cut per token (an NHD block across TP sizes) is thousands of small rows; a
transfer engine posting them one by one is what staging avoids. :class:`TorchCopier` executes a
staged gather or scatter table with index ops on the tensors' device (one ``index_copy_`` per run
of rows of one length on one grid, on its own CUDA stream, synchronised before the engine reads
the staging buffer) and allocates the staging buffers there (:meth:`TorchCopier.buffer`), so
nothing crosses to the host. The same code runs on CPU tensors, which is how it is tested here.

Rows are resolved by address against the storages of the tensors it was given and the buffers
it allocated; a row outside all of them is refused before anything is copied (:class:`CopyError`).
torch is imported only when a copier is built.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pdwire.runtime.descriptors import DescriptorTable, MemoryKind, Region
from pdwire.runtime.staging.copy import CopyError

U64 = npt.NDArray[np.uint64]


class _Storage:
    """One tensor storage as flat bytes: ``[base, base + length)`` of this process."""

    def __init__(self, flat: Any) -> None:
        self.flat = flat
        self.base = int(flat.data_ptr())
        self.end = self.base + int(flat.numel())


class TorchCopier:
    """Copies between the memory of ``tensors`` (and the buffers it allocates), all on ``device``."""

    def __init__(self, tensors: Sequence[Any], device: Any | None = None) -> None:
        import torch

        self._torch = torch
        devices = {t.device for t in tensors}
        if device is None and len(devices) != 1:
            on = sorted(map(str, devices))
            raise CopyError(f"a torch copier copies on one device, the tensors are on {on}")
        self.device = torch.device(device) if device is not None else devices.pop()
        cuda = self.device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]
        self._storages: list[_Storage] = []
        for t in tensors:
            if t.device != self.device:
                raise CopyError(f"tensor on {t.device}, the copier copies on {self.device}")
            self._add(torch.empty(0, dtype=torch.uint8, device=self.device).set_(t.untyped_storage()))
        self._buffers: list[Any] = []  # allocated staging buffers, kept alive

    def _add(self, flat: Any) -> None:
        storage = _Storage(flat)
        if any(s.base == storage.base for s in self._storages):
            return  # views of one storage (the layers of one vLLM allocation)
        self._storages.append(storage)
        self._storages.sort(key=lambda s: s.base)

    def buffer(self, name: str, nbytes: int) -> Region:
        """A staging buffer of ``nbytes`` on the copier's device, as a region to register."""
        flat = self._torch.zeros(nbytes, dtype=self._torch.uint8, device=self.device)
        self._buffers.append(flat)
        self._add(flat)
        kind = MemoryKind.DRAM if self.device.type == "cpu" else MemoryKind.VRAM
        return Region(int(flat.data_ptr()), nbytes, kind, self.device.index or 0, name)

    def _storage_of(self, addr: U64, length: U64, side: str) -> list[tuple[_Storage, npt.NDArray[np.intp]]]:
        """Rows grouped by the storage holding them; CopyError for a row no storage holds whole."""
        if not self._storages:
            raise CopyError("a torch copier without tensors copies nothing")
        bases = [s.base for s in self._storages]
        where = np.searchsorted(np.asarray(bases, dtype=np.uint64), addr, side="right").astype(np.intp) - 1
        out = []
        for i in np.unique(where).tolist():
            rows = np.flatnonzero(where == i)
            storage = self._storages[max(i, 0)]
            beyond = (addr[rows] + length[rows] > storage.end) | (i < 0)
            if beyond.any():
                bad = int(rows[int(np.argmax(beyond))])
                raise CopyError(
                    f"copy row {bad}: {side} [{int(addr[bad]):#x}, +{int(length[bad])}) is in no tensor "
                    "this copier was given"
                )
            out.append((storage, rows))
        return out

    def copy(self, table: DescriptorTable) -> None:
        """Copy every row (rows must not overlap one another's destination)."""
        if len(table) == 0:
            return
        groups = []
        for src, s_rows in self._storage_of(table.src_addr, table.length, "src"):
            for dst, d_rows in self._storage_of(table.dst_addr, table.length, "dst"):
                rows = np.intersect1d(s_rows, d_rows, assume_unique=True)
                if len(rows):
                    groups.append((src, dst, rows))
        torch = self._torch
        if self._stream is None:
            self._copy_groups(table, groups)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the cache's writes first
        with torch.cuda.stream(self._stream):
            self._copy_groups(table, groups)
        self._stream.synchronize()  # the engine reads the staging buffer next

    def _copy_groups(self, table: DescriptorTable, groups: list[tuple[_Storage, _Storage, Any]]) -> None:
        for src, dst, rows in groups:
            s_off = table.src_addr[rows] - np.uint64(src.base)
            d_off = table.dst_addr[rows] - np.uint64(dst.base)
            n = table.length[rows]
            order = np.argsort(n, kind="stable")
            s_off, d_off, n = s_off[order], d_off[order], n[order]
            cut = np.flatnonzero(n[1:] != n[:-1]) + 1
            for a, b in itertools.pairwise([0, *cut.tolist(), len(n)]):
                self._segment(src.flat, dst.flat, s_off[a:b], d_off[a:b], int(n[a]))

    def _segment(self, src: Any, dst: Any, s_off: U64, d_off: U64, length: int) -> None:
        """Rows of one ``length``: one indexed copy where both sides' rows lie on a grid of that
        length, else row by row."""
        s_grid, d_grid = _grid(s_off, length), _grid(d_off, length)
        if s_grid is not None and d_grid is not None and len(s_off) > 1:
            (s0, s_rows, s_idx), (d0, d_rows, d_idx) = s_grid, d_grid
            torch = self._torch
            src_rows = src[s0 : s0 + s_rows * length].view(s_rows, length)
            dst_rows = dst[d0 : d0 + d_rows * length].view(d_rows, length)
            si = torch.from_numpy(s_idx).to(self.device, non_blocking=True)
            di = torch.from_numpy(d_idx).to(self.device, non_blocking=True)
            dst_rows.index_copy_(0, di, src_rows.index_select(0, si))
            return
        for s, d in zip(s_off.tolist(), d_off.tolist(), strict=True):
            dst[d : d + length].copy_(src[s : s + length])


def _grid(offsets: U64, length: int) -> tuple[int, int, npt.NDArray[np.int64]] | None:
    """(first offset, rows spanned, each offset's row) when every offset lies on one grid of
    ``length`` from the first; None otherwise."""
    first = int(offsets.min())
    rel = offsets - np.uint64(first)
    if bool((rel % np.uint64(length)).any()):
        return None
    idx = (rel // np.uint64(length)).astype(np.int64)
    return first, int(idx.max()) + 1, idx
