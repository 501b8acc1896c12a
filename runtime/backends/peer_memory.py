"""Where the ``local`` backend may write a peer: proof, from ``/proc``, that a named process is a
pdwire local backend and that the addresses it published are memory that backend allocated.

``process_vm_writev`` writes any address of a process the writer may ptrace, and a peer's pid,
inbox and regions are only its word: :func:`inbox_holder_problem` checks that the process holds
its inbox directory open (:class:`~.shm.Inbox` keeps it open; no outsider can make a process
open a file), :func:`destination_problem` that every destination lies inside its read-write
shared ``/memfd:pdwire-*`` mappings (:class:`~.window.SharedMemory` and its windows). Both are
read at the handshake; the checks and their refusals in full: docs/hostile-peers.md (2 and 4).
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Iterable, Sequence

MEMFD_PREFIX = "/memfd:pdwire-"  # how /proc/<pid>/maps names a SharedMemory's memfd


def inbox_holder_problem(path: str, pid: int) -> str | None:
    """Why process ``pid`` does not hold the directory ``path`` open (None: it does)."""
    try:
        want = os.lstat(path)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError as exc:
        return f"cannot be checked: {exc.strerror}"
    for n in fds:
        link = f"/proc/{pid}/fd/{n}"
        try:
            if os.readlink(link) != path:  # a deleted directory reads "<path> (deleted)"
                continue
            st = os.stat(link)
        except OSError:
            continue  # closed meanwhile
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return None
    return (
        f"process {pid} does not hold it open: it is no pdwire local backend, "
        "or not the one that created that inbox"
    )


@functools.cache
def _memfd_device() -> tuple[int, int]:
    """(major, minor) of the device every memfd of this kernel lives on (internal shmem)."""
    fd = os.memfd_create("pdwire-probe", os.MFD_CLOEXEC)
    try:
        dev = os.fstat(fd).st_dev
    finally:
        os.close(fd)
    return os.major(dev), os.minor(dev)


def pdwire_spans(pid: int) -> list[tuple[int, int]]:
    """[start, end) of the mappings of ``pid`` a peer may be written through (see the module),
    sorted, adjacent ones joined. Raises OSError when the maps cannot be read."""
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        text = f.read()
    memfd_dev = _memfd_device()
    spans: list[tuple[int, int]] = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(MEMFD_PREFIX):
            continue
        addr, perms, _offset, dev = fields[:4]
        if not (perms.startswith("rw") and perms[3:4] == "s"):
            continue
        major, _, minor = dev.partition(":")
        try:
            if (int(major, 16), int(minor, 16)) != memfd_dev:
                continue
            lo, _, hi = addr.partition("-")
            start, end = int(lo, 16), int(hi, 16)
        except ValueError:
            continue
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def inside(spans: Sequence[tuple[int, int]], start: int, length: int) -> bool:
    """Whether [start, start + length) lies inside one of ``spans`` (sorted, disjoint)."""
    i = bisect.bisect_right(spans, (start, 1 << 65)) - 1
    return i >= 0 and spans[i][0] <= start and start + max(length, 1) <= spans[i][1]


def destination_problem(
    ranges: Iterable[tuple[int, str, int, int]], spans: Sequence[tuple[int, int]]
) -> str | None:
    """The first of ``ranges`` ((region index, name, start, length) as the writer would write
    them) that is not inside ``spans``, described; None when all are."""
    for i, name, start, length in ranges:
        if not inside(spans, start, length):
            return (
                f"region {i} {name!r} [{start:#x}, +{length}) is not inside shared memory its backend "
                f"allocated (a read-write shared {MEMFD_PREFIX}* mapping, from Backend.allocate)"
            )
    return None
