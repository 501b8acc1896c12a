"""Helpers engine adapters share: pre-faulted aligned host memory, bounded row batches."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def aligned_zeros(nbytes: int, align: int = 4096) -> npt.NDArray[np.uint8]:
    """Zeroed, page-aligned, pre-faulted host memory (writing the zeros faults every page in)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    arr = raw[off : off + nbytes]
    arr.fill(0)
    return arr


def batches(n: int, max_rows: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of at most ``max_rows`` rows covering ``n`` rows."""
    return [(s, min(s + max_rows, n)) for s in range(0, n, max_rows)]
