"""A reference memcpy executor over numpy byte buffers: the ground truth tests execute plans with.

An ``AddressSpace`` maps absolute addresses onto numpy ``uint8`` buffers (one per simulated
allocation, placed anywhere in the 64-bit space, e.g. above 4 GiB). ``execute`` copies every
descriptor row byte for byte, refusing rows that leave a backing buffer or that disagree with the
region column they claim. It is deliberately simple and slow; it also serves the runtime's local
fake transfer engine.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pdwire.runtime.descriptors import DescriptorTable, Region

Bytes = npt.NDArray[np.uint8]


class AddressFault(RuntimeError):
    """A descriptor touched memory that no buffer backs, or lies outside the region it names."""


class AddressSpace:
    """Non-overlapping numpy buffers at absolute addresses."""

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._buffers: list[Bytes] = []

    def map(self, base: int, buffer: Bytes) -> Bytes:
        """Back ``[base, base + len(buffer))`` with ``buffer`` (uint8, 1-D); returns it."""
        if buffer.dtype != np.uint8 or buffer.ndim != 1:
            raise TypeError("buffers are 1-D uint8 arrays")
        position = bisect.bisect_right(self._bases, base)
        if position and self._bases[position - 1] + len(self._buffers[position - 1]) > base:
            raise ValueError(f"buffer at {base:#x} overlaps the previous one")
        if position < len(self._bases) and base + len(buffer) > self._bases[position]:
            raise ValueError(f"buffer at {base:#x} overlaps the next one")
        self._bases.insert(position, base)
        self._buffers.insert(position, buffer)
        return buffer

    def allocate(self, base: int, length: int, rng: np.random.Generator | None = None) -> Bytes:
        """Map a fresh buffer, filled with random bytes so that missed or stray writes show."""
        generator = rng if rng is not None else np.random.default_rng(base % (2**32))
        return self.map(base, generator.integers(0, 256, size=length, dtype=np.uint8))

    def view(self, address: int, length: int) -> Bytes:
        """The bytes ``[address, address + length)``; they must lie in one buffer."""
        position = bisect.bisect_right(self._bases, address) - 1
        if position < 0:
            raise AddressFault(f"no buffer backs {address:#x}")
        offset = address - self._bases[position]
        buffer = self._buffers[position]
        if offset + length > len(buffer):
            start = self._bases[position]
            raise AddressFault(f"[{address:#x}, +{length}) runs past the buffer at {start:#x}")
        return buffer[offset : offset + length]

    def snapshot(self) -> list[tuple[int, Bytes]]:
        return [(base, buffer.copy()) for base, buffer in zip(self._bases, self._buffers, strict=True)]


def _check_region(address: int, length: int, region_id: int, regions: Sequence[Region], side: str) -> None:
    if region_id >= len(regions):
        raise AddressFault(f"{side} region {region_id} does not exist")
    region = regions[region_id]
    if address < region.base or address + length > region.end:
        raise AddressFault(f"{side} [{address:#x}, +{length}) is outside region {region_id} ({region.name})")


def execute(
    table: DescriptorTable,
    src: AddressSpace,
    dst: AddressSpace,
    src_regions: Sequence[Region] | None = None,
    dst_regions: Sequence[Region] | None = None,
) -> None:
    """Copy every row ``src -> dst``. With region lists, also check each row against its regions."""
    for row in range(len(table)):
        s, d, n = int(table.src_addr[row]), int(table.dst_addr[row]), int(table.length[row])
        if src_regions is not None:
            _check_region(s, n, int(table.src_region[row]), src_regions, "source")
        if dst_regions is not None:
            _check_region(d, n, int(table.dst_region[row]), dst_regions, "destination")
        dst.view(d, n)[:] = src.view(s, n)
