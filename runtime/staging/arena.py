"""A bounded staging buffer shared by the parts in flight: first-fit ranges, reused, never grown.

The worker allocates one registered buffer per rank (``staging_bytes``) and carves each staged
part's bytes out of it. A range is freed only when the engine reported the part's transfer
final (DONE, or FAILED after a confirmed stop), so a write still reading the range can never
see it reused: the arena is covered by the same fence as the room's own memory. A part that
does not fit now waits for a range to come free; one larger than the whole arena is not staged.
"""

from __future__ import annotations

import bisect

ALIGN = 4096  # ranges start on a page: engines and copies like aligned rows


class StagingArena:
    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"staging arena size must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []  # (start, stop), sorted
        self._used: dict[int, int] = {}  # start -> stop

    @property
    def in_use(self) -> int:
        return sum(stop - start for start, stop in self._used.items())

    def fits_ever(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.nbytes

    def largest_free(self) -> int:
        """The most bytes one :meth:`alloc` can take now (a multiple of ALIGN)."""
        return max(((stop - start) // ALIGN * ALIGN for start, stop in self._free), default=0)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free range of ``nbytes`` (rounded up to ALIGN), or None if none is free."""
        size = -(-nbytes // ALIGN) * ALIGN
        for i, (start, stop) in enumerate(self._free):
            if stop - start >= size:
                if stop - start == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, stop)
                self._used[start] = start + size
                return start
        return None

    def free(self, offset: int) -> None:
        stop = self._used.pop(offset)
        i = bisect.bisect_left(self._free, (offset, stop))
        self._free.insert(i, (offset, stop))
        # join with the neighbours
        if i + 1 < len(self._free) and self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (self._free[i][0], self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i][1])
            del self._free[i]
