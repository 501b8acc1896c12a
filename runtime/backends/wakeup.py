"""File descriptors a worker's poller can wait on instead of polling an engine.

An engine whose completions happen on a thread of ours (the job workers of ``local`` and
``mooncake``) or whose notifications we deliver ourselves (``local``'s inbox) can say so at
once: :class:`Waker` is an eventfd the finishing thread sets; :class:`DatagramWaker` is a
Unix datagram socket a sending process pokes after it dropped a message into our inbox. A
worker registers :meth:`~.contract.Backend.wakeup_fds` in its ZMQ poller and blocks in it
(a control message wakes it as well) instead of waking up every few tens of microseconds.

A wake-up only says "look again": the worker still polls the engine, so a spurious one
costs one pass, and one that is lost (a full socket queue, a peer that could not reach the
socket) is covered by the workers' fallback wake-up period.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading


class Waker:
    """An eventfd that stays readable from :meth:`set` (any thread) until :meth:`drain`."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()  # set() from a thread never writes a closed (reused) fd
        self._closed = False

    def set(self) -> None:
        with self._lock:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):  # the counter is full: readable anyway
                    os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.fd)


WAKE_NAME = ".wake"
"""The datagram socket's name inside an inbox directory (dot names are never messages)."""


class DatagramWaker:
    """A Unix datagram socket bound at ``path``: readable once any process sent to it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind(path)
        self.fd = self._sock.fileno()

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while True:
                self._sock.recv(64)

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class _PokeSocket:
    """One thread's unbound datagram socket for :func:`poke`: made on the thread's first poke,
    closed when the thread ends and drops its thread-local values (not left to the collector,
    which would warn about an unclosed socket)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)

    def __del__(self) -> None:
        self.sock.close()


_poker = threading.local()


def poke(path: str) -> None:
    """Send one wake-up datagram to ``path``; nothing happens if nobody listens there (an
    older peer, a closed one) or its queue is full (it is awake already)."""
    own: _PokeSocket | None = getattr(_poker, "own", None)
    if own is None:
        own = _poker.own = _PokeSocket()
    with contextlib.suppress(OSError):
        own.sock.sendto(b"\0", path)
