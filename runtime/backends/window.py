"""Revocable host memory: one shared object, a view for its owner, one alias per writer.

Every engine here writes a target's memory through the virtual addresses it published, and
deregistering the memory stops none of them (measured: ``docs/fencing.md``); making those
addresses no longer reach the live memory does. So memory from :meth:`Backend.allocate` is a
memfd mapped once for its owner (:class:`SharedMemory`; this mapping never moves) and once more
per peer (:class:`Window`), whose addresses the peer is told. Revoking a window maps fresh
anonymous pages over it in one ``mmap(MAP_FIXED)``: a late write lands in those junk pages and
never faults; the owner's view and other peers' windows are untouched. On RDMA the engine's
deregistration of the window (done first) invalidates the peer's key. A copy already inside the
kernel (``process_vm_writev`` pins up to 16 pages, then copies) can still finish into the pages
it pinned: ``settles_at`` of :class:`~.values.Revocation` gives it a grace period.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os

import numpy as np
import numpy.typing as npt

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MADV_DONTNEED = 4

_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _mmap(addr: int | None, nbytes: int, flags: int, fd: int) -> int:
    got = _libc.mmap(addr, nbytes, _PROT_RW, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
    return int(got)


class SharedMemory:
    """Zeroed, pre-faulted host memory backed by a memfd, so it can be mapped again."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = nbytes
        self._fd = os.memfd_create(f"pdwire-{name}"[:240], os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            # The owner's mapping is a Python mmap so numpy views keep it alive: it is unmapped
            # when the last view dies, never under a live array.
            self._mm: mmap.mmap | None = mmap.mmap(
                self._fd, nbytes, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=_PROT_RW
            )
        except BaseException:
            os.close(self._fd)
            raise
        self.array: npt.NDArray[np.uint8] | None = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self.windows: list[Window] = []

    def contains(self, base: int, length: int) -> bool:
        return self.address <= base and base + length <= self.address + self.nbytes

    def open_window(self) -> Window:
        """A second mapping of the same pages at another address, for one writer."""
        if self._fd < 0:
            raise OSError(f"shared memory {self.name!r} is closed")
        w = Window(self, _mmap(None, self.nbytes, mmap.MAP_SHARED | _MAP_POPULATE, self._fd))
        self.windows.append(w)
        return w

    def close(self) -> None:
        """Revoke every window and drop the owner's view: the memfd's pages are freed once the
        last view dies. Windows are never unmapped: an engine thread that outlived its
        backend's close would fault; their junk pages are dropped instead (address space only)."""
        for w in list(self.windows):
            w.revoke()
            w.drop_junk()
        self.windows.clear()
        self.array = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a caller's view: unmapped with the last one
                self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Window:
    """One alias of a :class:`SharedMemory`; ``delta`` translates owner addresses into it."""

    def __init__(self, memory: SharedMemory, base: int) -> None:
        self.memory = memory
        self.base = base
        self.revoked = False
        self.unmapped = False

    @property
    def delta(self) -> int:
        """window address - owner address, modulo 2**64 (u64 arithmetic wraps the same way)."""
        return (self.base - self.memory.address) % (1 << 64)

    def revoke(self) -> None:
        """Point the window's addresses at junk pages: late writes land there, not in the memory."""
        if self.revoked or self.unmapped:
            return
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
        got = _mmap(self.base, self.memory.nbytes, flags, -1)
        if got != self.base:  # MAP_FIXED never moves; anything else would leave the alias live
            raise OSError(f"revoking window at {self.base:#x}: mmap returned {got:#x}")
        self.revoked = True

    def drop_junk(self) -> None:
        """Free the junk pages late writes touched (they are zero pages again on next touch)."""
        if self.revoked and not self.unmapped:
            _libc.madvise(self.base, self.memory.nbytes, _MADV_DONTNEED)

    def unmap(self) -> None:
        """Give the window's addresses back (live or junk). Only once no write through them can
        come any more: the kernel hands freed addresses to the next mapping, very likely the next
        window of the same memory, so a late write would land in live memory."""
        if self.unmapped:
            return
        if _libc.munmap(self.base, self.memory.nbytes) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap of window at {self.base:#x} failed: {os.strerror(err)}")
        self.unmapped = True
        if self in self.memory.windows:
            self.memory.windows.remove(self)
