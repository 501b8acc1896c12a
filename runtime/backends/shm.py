"""Named shared memory for same-host backends: segments, a notification inbox, a reaper.

Naming and unlink policy
------------------------
Everything lives in ``/dev/shm`` as ``pdwire-<pid>-<token>-...`` where ``<pid>`` is the
creating process. The creator unlinks its files on ``close()`` and, as a fallback, at
interpreter exit. A process killed outright (SIGKILL) cannot clean up, so every new
local backend first *reaps*: it removes any ``pdwire-<pid>-*`` entry whose pid no longer
exists. Peers map segments by name; an existing mapping stays valid after the name is
unlinked, so a writer never faults on memory of a peer that died — it only learns from
the liveness check that the data went nowhere.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import mmap
import os
import re
import shutil
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt
from pdwire.runtime.backends.base import pid_alive

SHM_DIR = "/dev/shm"
PREFIX = "pdwire-"
_NAME_OK = re.compile(r"[^A-Za-z0-9_.]")
_owned: set[str] = set()  # paths this process created and has not removed yet


def _cleanup_at_exit() -> None:
    for path in list(_owned):
        remove_path(path)


atexit.register(_cleanup_at_exit)


def remove_path(path: str) -> None:
    _owned.discard(path)
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def owned_paths() -> set[str]:
    return set(_owned)


def make_stem(token: str) -> str:
    return f"{SHM_DIR}/{PREFIX}{os.getpid()}-{token}"


def reap_dead(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove entries left by processes that no longer exist; returns what was removed."""
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_s = name[len(PREFIX) :].split("-", 1)[0]
        if pid_s.isdigit() and not pid_alive(int(pid_s)):
            remove_path(f"{shm_dir}/{name}")
            removed.append(name)
    return removed


def leftover_paths(pid: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Entries a given process still has in /dev/shm (tests use it to prove cleanup)."""
    tag = f"{PREFIX}{pid}-"
    return sorted(n for n in os.listdir(shm_dir) if n.startswith(tag))


class Mapping:
    """One mmap of a /dev/shm file with a uint8 numpy view and its address."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                _owned.add(path)
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise OSError(f"{path} is {os.fstat(fd).st_size} bytes, expected {nbytes}")
            # MAP_POPULATE pre-faults the pages so first-touch cost is paid here, not mid-transfer.
            self.mm: mmap.mmap | None = mmap.mmap(
                fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
        finally:
            os.close(fd)
        self.array: npt.NDArray[np.uint8] | None = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self.nbytes = nbytes
        self.peer_base = 0  # for a peer's segment: its address in the peer's process

    def close(self) -> None:
        """Unmap if nobody else holds a view; otherwise the mapping dies with the last view."""
        self.array = None
        if self.mm is not None:
            # With user views alive the mmap object is freed (unmapped) with the last of them.
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None


# --------------------------------------------------------------------------- inbox


class _Message(msgspec.Struct, array_like=True):
    sender: str
    payload: bytes


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Message)


@dataclass
class Inbox:
    """A per-agent directory of one-file messages.

    A sender writes ``.<name>.tmp`` then renames it to ``<name>``: rename is atomic, so the
    receiver never reads a partial message. Names sort by send time then sender pid and
    sequence, which keeps each sender's messages in order.
    """

    path: str

    @classmethod
    def create(cls, path: str) -> Inbox:
        os.mkdir(path, 0o700)
        _owned.add(path)
        return cls(path)

    def receive(self) -> list[tuple[str, bytes]]:
        try:
            names = sorted(n for n in os.listdir(self.path) if not n.startswith("."))
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            p = f"{self.path}/{n}"
            with open(p, "rb") as f:
                msg = _decoder.decode(f.read())
            os.unlink(p)
            out.append((msg.sender, msg.payload))
        return out


_seq = itertools.count(1)  # next() on a count is atomic under the GIL: safe from worker threads


def send(inbox_path: str, sender: str, payload: bytes) -> None:
    """Deliver one message; raises FileNotFoundError when the inbox is gone (peer closed/reaped)."""
    name = f"{time.time_ns():020d}-{os.getpid():08d}-{next(_seq):012d}"
    tmp = f"{inbox_path}/.{name}.tmp"
    with open(tmp, "wb") as f:
        f.write(_encoder.encode(_Message(sender, payload)))
    os.rename(tmp, f"{inbox_path}/{name}")


def safe_token(name: str) -> str:
    return _NAME_OK.sub("_", name)[:40]
