"""The workers' wait while transfers are in flight: short first, doubling while idle, capped,
short again on progress, and never sleeping through a control message already waiting."""

from __future__ import annotations

import time
from typing import Any

import zmq

from pdwire.runtime.workers import backoff
from pdwire.runtime.workers.backoff import PollBackoff


def test_waits_double_while_idle_up_to_the_cap_and_reset_on_progress() -> None:
    poller = zmq.Poller()  # nothing registered: every poll is idle
    b = PollBackoff(first_s=1e-5, longest_s=8e-5)
    waits = []
    for _ in range(6):
        waits.append(b.next_s)
        assert b.poll(poller) == {}
    assert waits == [1e-5, 2e-5, 4e-5, 8e-5, 8e-5, 8e-5]
    b.progress()
    assert b.next_s == 1e-5


def test_a_waiting_message_is_returned_without_sleeping_out_the_wait(monkeypatch: Any) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    a, z = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://backoff")
        z.connect("inproc://backoff")
        poller = zmq.Poller()
        poller.register(z, zmq.POLLIN)

        # a short wait looks before it sleeps: with a message waiting it must not sleep at all
        def no_sleep(seconds: float) -> None:
            raise AssertionError(f"slept {seconds} s with a message waiting")

        monkeypatch.setattr(backoff.time, "sleep", no_sleep)
        a.send(b"status")
        assert PollBackoff(first_s=5e-4).poll(poller).get(z) == zmq.POLLIN
        assert z.recv() == b"status"
        # a long wait goes through the poller, which returns as soon as a message arrives
        a.send(b"status")
        t = time.monotonic()
        assert PollBackoff(first_s=5.0, longest_s=5.0).poll(poller).get(z) == zmq.POLLIN
        assert time.monotonic() - t < 2.5  # far from the 5 s it would wait for nothing
        assert z.recv() == b"status"
    finally:
        a.close(0)
        z.close(0)
        ctx.term()


def test_the_first_wait_after_progress_grows_with_the_work_in_flight() -> None:
    b = PollBackoff(first_s=2e-5, longest_s=1e-3)
    b.progress(0)
    assert b.next_s == 2e-5
    b.progress(10)
    assert 2e-5 < b.next_s < 5e-4  # a few transfers: still well under the old fixed 1 ms
    b.progress(10_000)
    assert b.next_s == 1e-3  # never longer than the old fixed poll


class _RecordingPoller:
    """A poller with nothing to report that records every timeout it was given."""

    def __init__(self) -> None:
        self.timeouts: list[int] = []

    def poll(self, timeout: int) -> list[Any]:
        self.timeouts.append(timeout)
        return []


def test_a_callers_limit_caps_the_wait_so_step_zero_never_blocks(monkeypatch: Any) -> None:
    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"slept {seconds} s although the caller allowed no wait")

    monkeypatch.setattr(backoff.time, "sleep", no_sleep)
    poller = _RecordingPoller()
    b = PollBackoff(first_s=5e-4, longest_s=1e-3)
    assert b.poll(poller, limit_s=0.0) == {}  # type: ignore[arg-type]
    assert b.next_s == 1e-3  # the backoff still lengthens for a caller that does allow waiting
    assert b.poll(poller, limit_s=0.0) == {}  # type: ignore[arg-type]  # a 1 ms wait is not taken either
    assert poller.timeouts == [0, 0]
    b.poll(poller, limit_s=0.05)  # type: ignore[arg-type]
    assert poller.timeouts[-1] == 1  # allowed to wait: the 1 ms goes through the poller
