"""Waiting on transfer engines that offer nothing to wait on (NIXL's Python API, the worker-thread
backends' jobs); engines with ``Backend.wakeup_fds`` are waited on in the ZMQ poller instead.

A fixed 1 ms poll made every small request pay about a millisecond per hop; this waits 20 us
first and doubles while nothing happens, up to 1 ms, and starts short again whenever something
happened (longer with many transfers in flight). Waits of a millisecond or more go through the
ZMQ poller (a control message still wakes it at once); shorter ones sleep, then poll.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

FIRST_WAIT_S = 20e-6
LONGEST_WAIT_S = 1e-3
# A pass polls every transfer in flight (a few us each on NIXL): with hundreds in flight, 20 us
# waits would spend the core on polling that the transfers and the peer process need, so the
# first wait after progress grows with the work in flight (1 ms from about 60 transfers, where
# the old fixed 1 ms poll measured best; a single request's few transfers wait about 0.1 ms).
PER_ITEM_WAIT_S = 16e-6
# An engine that offers wake-ups (``Backend.wakeup_fds``) is waited on instead; a wake-up that
# never comes (a peer that could not poke us) costs at most this long.
WAKEUP_FALLBACK_MS = 20


class PollBackoff:
    def __init__(self, first_s: float = FIRST_WAIT_S, longest_s: float = LONGEST_WAIT_S) -> None:
        self.first_s = first_s
        self.longest_s = longest_s
        self.next_s = first_s

    def progress(self, in_flight: int = 0) -> None:
        """Something happened: the next wait is short again (longer with ``in_flight`` to poll)."""
        self.next_s = min(self.longest_s, self.first_s + PER_ITEM_WAIT_S * in_flight)

    def poll(self, poller: zmq.Poller, limit_s: float = LONGEST_WAIT_S) -> dict[Any, int]:
        """Poll ``poller`` after the current wait (never longer than ``limit_s``: a caller's
        ``step(0)`` must not block), then lengthen the wait for next time."""
        wait_s = min(self.next_s, limit_s)
        self.next_s = min(2 * self.next_s, self.longest_s)
        if wait_s >= 1e-3:
            return dict(poller.poll(int(wait_s * 1000)))
        events = dict(poller.poll(0))
        if events or wait_s <= 0:
            return events
        time.sleep(wait_s)
        return dict(poller.poll(0))

    def wait(self, poller: zmq.Poller, timeout_ms: int, busy: bool, wakes: bool) -> dict[Any, int]:
        """One poll of a worker's loop, ``timeout_ms`` at most: while ``busy`` (work in flight the
        engine reports on) after the current wait, or, on an engine that ``wakes`` the poller,
        at most :data:`WAKEUP_FALLBACK_MS` (a lost wake-up costs that); idle, until a message."""
        if busy and not wakes:
            return self.poll(poller, timeout_ms / 1000)
        return dict(poller.poll(min(timeout_ms, WAKEUP_FALLBACK_MS) if busy else timeout_ms))
