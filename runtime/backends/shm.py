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
import stat
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from pdwire.runtime.backends.metadata import pid_alive

SHM_DIR = "/dev/shm"
PREFIX = "pdwire-"
_NAME_OK = re.compile(r"[^A-Za-z0-9_.]")
_owned: set[str] = set()  # paths this process created and has not removed yet


def remove_owned() -> None:
    """Remove every path this process created and still has (for a process that leaves with
    ``os._exit``, which skips the interpreter-exit hook below)."""
    for path in list(_owned):
        remove_path(path)


atexit.register(remove_owned)


def remove_path(path: str) -> None:
    _owned.discard(path)
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


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
    skipped: int = 0  # entries that were no message of ours (not a file, unreadable, garbage)
    # The directory held open for the inbox's lifetime: a writer checks that the process a peer
    # names holds its inbox open (``/proc/<pid>/fd``), which no other process can fake for it.
    fd: int = -1

    @classmethod
    def create(cls, path: str) -> Inbox:
        os.mkdir(path, 0o700)
        _owned.add(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            remove_path(path)
            raise
        return cls(path, fd=fd)

    def close(self) -> None:
        """Remove the directory and let go of it; idempotent."""
        remove_path(self.path)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def receive(self) -> list[tuple[str, bytes]]:
        try:
            names = sorted(n for n in os.listdir(self.path) if not n.startswith("."))
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            p = f"{self.path}/{n}"
            try:
                msg = _decoder.decode(_read_message_file(p))
            except (OSError, ValueError, msgspec.DecodeError):
                # anyone who can write the directory can drop anything in it: a directory, a
                # symlink, a FIFO, random bytes. None of it is a message; it is removed and
                # counted, and the rank keeps receiving.
                self.skipped += 1
                _discard(p)
                continue
            _discard(p)
            out.append((msg.sender, msg.payload))
        return out


MESSAGE_FILE_LIMIT = 1 << 20  # a notification is a few hundred bytes; a bigger file is no message


def _read_message_file(path: str) -> bytes:
    """The bytes of one regular file of the inbox, never following a link or blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size > MESSAGE_FILE_LIMIT:
            raise ValueError(f"{path} is {st.st_size} bytes, more than any message")
        return os.read(fd, MESSAGE_FILE_LIMIT + 1)
    finally:
        os.close(fd)


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
    except (FileNotFoundError, PermissionError):
        pass


_INBOX_NAME = re.compile(r"pdwire-([0-9]+)-[0-9a-f]{8}\.inbox")


def inbox_problem(path: object, pid: int) -> str | None:
    """Why ``path`` is not the inbox process ``pid`` created (None: it is).

    A notification is written into the inbox the peer names, so a peer may only name its own:
    ``/dev/shm/pdwire-<its pid>-<token>.inbox`` as :meth:`Inbox.create` makes it, a real
    directory (no symlink), owned by the user the process runs as. Anything else (another
    directory, a path with ``..``, another process's inbox) would let it steer our writes.
    """
    if not isinstance(path, str):
        return "not a path"
    head, _, name = path.rpartition("/")
    m = _INBOX_NAME.fullmatch(name)
    if head != SHM_DIR or m is None:
        return f"not an inbox of {SHM_DIR}"
    if int(m.group(1)) != pid:
        return f"made by pid {m.group(1)}, the peer is pid {pid}"
    try:
        st = os.lstat(path)
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError as exc:
        return f"cannot be checked: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != owner:
        return f"owned by uid {st.st_uid}, the peer runs as uid {owner}"
    return None


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
