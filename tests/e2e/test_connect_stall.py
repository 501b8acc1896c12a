"""connect() never blocks the decode rank: it returns a group still connecting, step() runs
the handshake, and a prefill rank that never answers (stopped) stalls nothing but its own
group. Rooms asked of a group still connecting wait inside their deadline: they start once it
is ready, and fail typed (nothing sent, slots free at once) when it is not in time."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pdwire.demo.cluster import Cluster
from pdwire.demo.content import fill, full_tensors, verify
from pdwire.runtime.engine import FailureKind, GroupState, HandshakeError, Status
from tests.e2e.conftest import CAP, SPEC, assert_rooms_ok, room_slots, send, worker_pair

TOKENS = 40


@contextmanager
def silent_endpoint() -> Iterator[str]:
    """Accepts the TCP connection and answers nothing: a stopped prefill rank."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        yield f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    finally:
        silent.close()


def test_a_connect_to_a_silent_rank_returns_at_once_and_stalls_no_other_room() -> None:
    with worker_pair() as p, silent_endpoint() as silent:
        src, slots = room_slots(TOKENS), room_slots(TOKENS)
        fill(p.pc, src, full_tensors(SPEC, 1, 5, TOKENS))
        p.ask(5, slots)
        p.step_until(lambda: p.pre.status(5) is Status.WAITING_FOR_INPUT, "room 5's request")
        send(p.pre, 5, src)  # posted; decode completes it only while it steps

        connected: list[object] = []
        p.dec.on_connected = connected.append
        t0 = time.monotonic()
        stuck = p.dec.connect([silent], timeout_s=3.0)
        assert time.monotonic() - t0 < 1.0  # returned without waiting for an answer
        assert stuck.state is GroupState.CONNECTING and not connected
        # a room asked of the silent group is held (nothing sent) and fails at its own deadline
        p.dec.start_room(6, room_slots(TOKENS).request(SPEC), stuck, timeout_s=1.0)
        assert p.dec.status(6) is Status.BOOTSTRAPPING

        p.step_until(lambda: any(r == 5 for r, _, _ in p.finished), "room 5 while the other group connects")
        assert stuck.state is GroupState.CONNECTING  # room 5 finished while the handshake still waited
        assert verify(p.dc, slots, full_tensors(SPEC, 1, 5, TOKENS)) == []

        p.step_until(lambda: any(r == 6 for r, _, _ in p.finished), "room 6's deadline")
        (outcome,) = [o for o in p.finished if o[0] == 6]
        assert outcome[1] is Status.FAILED and outcome[2] is not None
        assert outcome[2].kind is FailureKind.TIMEOUT, outcome
        assert 6 in p.slots_released  # nothing was sent: its slots are free at once

        p.step_until(lambda: stuck.state is not GroupState.CONNECTING, "the handshake timeout")
        assert stuck.failed and connected == [stuck]
        assert stuck.error is not None and "within the handshake timeout" in stuck.error
        with pytest.raises(HandshakeError, match="within the handshake timeout"):
            p.dec.wait_ready(stuck)
        # a room on the failed group fails typed from the next step, its slots free
        p.dec.start_room(7, room_slots(TOKENS).request(SPEC), stuck)
        p.dec.step(0)
        (outcome,) = [o for o in p.finished if o[0] == 7]
        assert outcome[2] is not None and outcome[2].kind is FailureKind.HANDSHAKE, outcome
        assert 7 in p.slots_released
        assert p.dec.stats.requests_sent == 1  # room 5's request only


def test_a_room_asked_of_a_group_still_connecting_starts_once_it_is_ready() -> None:
    with worker_pair(connect=False) as p:
        src, slots = room_slots(TOKENS), room_slots(TOKENS)
        fill(p.pc, src, full_tensors(SPEC, 1, 9, TOKENS))
        group = p.dec.connect([p.pre.endpoint], timeout_s=10)
        p.dec.start_room(9, slots.request(SPEC), group)  # before any handshake message moved
        assert group.state is GroupState.CONNECTING and p.dec.stats.requests_sent == 0
        p.step_until(lambda: p.pre.status(9) is Status.WAITING_FOR_INPUT, "room 9's request")
        assert group.ready and group.engine_id == "pre"
        send(p.pre, 9, src)
        p.step_until(lambda: any(r == 9 for r, _, _ in p.finished), "room 9")
        assert p.finished == [(9, Status.SUCCESS, None)]
        assert verify(p.dc, slots, full_tensors(SPEC, 1, 9, TOKENS)) == []


def test_connecting_again_fails_the_old_links_rooms_at_once_naming_them_and_serves_on() -> None:
    # a prefill rank fails the rooms of a decode rank's old connection when it registers again;
    # decode fails the same rooms itself, typed and at once (not at their deadline), the moment
    # the new links replace the old ones, and fences them by revoking every window the rank was
    # given; the rank then registers again with new windows, and a room asked meanwhile waits
    with worker_pair() as p:
        old = p.group
        assert old is not None
        src, slots = room_slots(TOKENS), room_slots(TOKENS)
        fill(p.pc, src, full_tensors(SPEC, 1, 5, TOKENS))
        p.ask(5, slots)
        p.step_until(lambda: p.pre.status(5) is Status.WAITING_FOR_INPUT, "room 5's request")
        t0 = time.monotonic()
        new = p.dec.connect([p.pre.endpoint], timeout_s=10)
        p.step_until(lambda: new.ready, "the second handshake")
        assert p.dec.status(5) is Status.FAILED  # at once, when the new links took over
        (outcome,) = [o for o in p.finished if o[0] == 5]
        assert outcome[2] is not None and outcome[2].kind is FailureKind.PEER_GONE, outcome
        # asked while the rank registers again (through the old handle: both address the new
        # links): it waits, nothing sent, then is sent and succeeds byte for byte
        assert p.dec.unready_peers
        src2, slots2 = room_slots(TOKENS), room_slots(TOKENS)
        fill(p.pc, src2, full_tensors(SPEC, 1, 6, TOKENS))
        sent = p.dec.stats.requests_sent
        p.dec.start_room(6, slots2.request(SPEC), old)
        assert p.dec.status(6) is Status.BOOTSTRAPPING and p.dec.stats.requests_sent == sent
        p.step_until(lambda: 5 in p.slots_released, "room 5's slots, fenced by the revocation")
        assert time.monotonic() - t0 < 10.0  # the room timeout: it was not its deadline
        assert p.dec.stats.revocations == 1 and p.dec.stats.unrevocable == 0
        p.step_until(lambda: p.pre.status(6) is Status.WAITING_FOR_INPUT, "room 6's request")
        send(p.pre, 6, src2)
        p.step_until(lambda: any(r == 6 for r, _, _ in p.finished), "room 6")
        assert (6, Status.SUCCESS, None) in p.finished
        assert verify(p.dc, slots2, full_tensors(SPEC, 1, 6, TOKENS)) == []
        assert any(r == 5 for r, _, _ in p.released)  # prefill failed room 5 on its side too


@pytest.mark.slow
def test_a_connect_to_a_stopped_prefill_process_stalls_no_room_of_another_engine() -> None:
    # real processes: the stopped rank's kernel still accepts the TCP connection, nothing answers
    with Cluster(SPEC, CAP, "local", room_timeout_s=30.0) as c:
        stopped = c.start("prefill", 1, "cs-stopped")
        spare = c.start("prefill", 1, "cs-spare")
        dec = c.start("decode", 1, "cs-dec")
        assert c.connect(dec, spare) == [""]
        pid = stopped.procs[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            c.start_connect(dec, stopped, timeout_s=20.0)
            assert_rooms_ok(c.wait_rooms([c.submit(dec, spare, 1, 40)], 60))
            assert not c.connected.get(("cs-dec", 0)), "the room finished while the handshake still waited"
            ((engine, error),) = c.wait_connected(dec, 60)
            assert engine == "" and "within the handshake timeout" in error, error
        finally:
            os.kill(pid, signal.SIGCONT)
        assert_rooms_ok(c.wait_rooms([c.submit(dec, spare, 2, 40)], 60))  # and serves on
        stats, problems = c.stop(dec)[0]
        assert problems == [] and stats["rooms_ok"] == 2 and stats["rooms_failed"] == 0
