"""Trusted peers that misbehave, as their own processes, holding the deployment's keys.

Takeover: a process registering as a live decode rank (engine id and rank of the rank this test's
decode worker runs), with the very key that rank holds, is refused by name while the live rank's
in-flight room and its next room are served; a restart is accepted once the old process is gone
(killed: its socket closes at once; stopped: once its heartbeats are missed), timed. Aborts: a
socket that only said Hello declines no room and aborts none (claiming the victim's name or not),
each refusal is counted, and the victim's rooms are served. Per-rank keys: with the identities
file, the deployment's key cannot claim a bound rank and a rank's key can claim nothing else.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdwire.demo.content import fill, full_tensors
from pdwire.runtime.backends import Backend, available_backends, create_backend
from pdwire.runtime.control_auth import ControlAuth, bind_rank, generate_directory
from pdwire.runtime.engine import Status
from pdwire.runtime.workers import prefill
from tests.e2e.conftest import SPEC, WorkerPair, room_slots, send, worker_pair
from tests.e2e.test_control_auth import Registrant
from tests.e2e.test_hostile_peers import run_room

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["local", "nixl"]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_directory(tmp_path / "keys")
    return tmp_path / "keys"


def authed(prefill_keys: Path, decode_keys: Path | None = None, **kw: Any) -> dict[str, Any]:
    """The pair's configs: keys, and ``kw`` (e.g. a room timeout outliving attacker processes) for both."""
    dec = {"control_auth": ControlAuth.from_directory(decode_keys or prefill_keys), **kw}
    return {"prefill_kw": {"control_auth": ControlAuth.from_directory(prefill_keys), **kw}, "decode_kw": dec}


def attack(p: WorkerPair, keys: Path | None, engine_id: str, rooms: list[int]) -> str:
    """``tests/e2e/aborter.py`` in its own process (stepping both workers meanwhile): its line."""
    argv = [sys.executable, "-m", "tests.e2e.aborter", p.pre.endpoint, str(keys or "-"), engine_id, "0"]
    proc = subprocess.Popen([*argv, *map(str, rooms)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    end = time.monotonic() + 60
    try:
        while not select.select([proc.stdout], [], [], 0)[0]:
            assert time.monotonic() < end and proc.poll() is None, "the attacker said nothing"
            p.pre.step(5)
            p.dec.step(0)
        return proc.stdout.readline().strip()
    finally:
        proc.wait(30)


def room_in_flight(p: WorkerPair, room: int) -> None:
    """The pair's decode rank asked for ``room``; the prefill engine has produced nothing yet."""
    fill(p.pc, room_slots(24), full_tensors(SPEC, 1, room, 24))
    p.ask(room, room_slots(24))
    p.step_until(lambda: p.pre.status(room) is Status.WAITING_FOR_INPUT, f"request of room {room}")


def finish(p: WorkerPair, room: int) -> Status:
    send(p.pre, room, room_slots(24))
    p.step_until(lambda: any(r == room for r, _, _ in p.finished), f"room {room} on decode")
    return next(s for r, s, _ in p.finished if r == room)


def backends(name: str) -> dict[str, Backend]:
    """The pair's backends on engine ``name``."""
    if name not in available_backends():
        pytest.fail(f"backend {name} does not import here: CI must install it (./dev setup)")
    return {"pb": create_backend(name, agent_name="pre"), "db": create_backend(name, agent_name="dec")}


@pytest.mark.parametrize("engine", BACKENDS)
def test_the_deployment_key_claiming_a_live_rank_is_refused_and_the_rank_keeps_its_rooms(
    keys: Path, engine: str
) -> None:
    with worker_pair(**backends(engine), **authed(keys, room_timeout_s=120)) as p:
        room_in_flight(p, 5)
        impostor = Registrant(p, keys, REGISTRANT_BACKEND=engine)  # "dec"/0, the pair's rank, its key
        try:
            answer = impostor.line()
        finally:
            impostor.close()
        assert answer.startswith("refused") and "dec/0 is registered on a live connection" in answer, answer
        assert finish(p, 5) is Status.SUCCESS, (p.finished, p.events)  # in flight: served, not failed
        assert run_room(p, 6)[1] is Status.SUCCESS  # and the next one goes to the live rank
        stats = p.pre.stats
        assert (stats.takeovers_refused, stats.restarts, stats.rooms_ok) == (1, 0, 2)
        assert p.dec.stats.reconnects == 0 and not p.dec.stats.failures.total, list(p.dec.stats.failures)


@pytest.fixture(params=BACKENDS)
def old_rank(keys: Path, request: pytest.FixtureRequest) -> Iterator[tuple[WorkerPair, Registrant]]:
    """A prefill rank (heartbeats every 0.5 s, silent past 6 s: closed) and a decode rank "dec"/0
    in its own process, registered with the deployment's key, on the engine of the param."""
    saved = prefill.HEARTBEAT_S, prefill.HEARTBEAT_TIMEOUT_S
    prefill.HEARTBEAT_S, prefill.HEARTBEAT_TIMEOUT_S = 0.5, 6.0
    engine = request.param
    try:
        with worker_pair(**backends(engine), **authed(keys), connect=False) as p:
            old = Registrant(p, keys, REGISTRANT_BACKEND=engine)
            try:
                assert old.line() == "ready"
                yield p, old
            finally:
                old.proc.kill()  # (a stopped one too: its graceful exit is not under test here)
                old.proc.wait(30)
    finally:
        prefill.HEARTBEAT_S, prefill.HEARTBEAT_TIMEOUT_S = saved


def engine_of(p: WorkerPair) -> str:
    return p.pb.name


def serve_restarted(p: WorkerPair, new: Registrant) -> tuple[float, str]:
    """``new`` registers and is served a room: when it was registered (``time.monotonic()``),
    and its line."""
    try:
        line = new.line()
        registered = time.monotonic()
        assert line.startswith("ready after"), line
        new.say("room 21")
        fill(p.pc, room_slots(24), full_tensors(SPEC, 1, 21, 24))
        end = time.monotonic() + 20
        while p.pre.status(21) is not Status.WAITING_FOR_INPUT:
            assert time.monotonic() < end, "the new incarnation's request did not arrive"
            p.pre.step(5)
        send(p.pre, 21, room_slots(24))
        assert new.line().startswith("finished 21 SUCCESS")  # the restarted rank is served
    finally:
        new.close()
    return registered, line


def test_a_killed_rank_restarts_at_once(old_rank: tuple[WorkerPair, Registrant], keys: Path) -> None:
    p, old = old_rank
    new = Registrant(p, keys, REGISTRANT_RETRY_S="30", REGISTRANT_GO="1", REGISTRANT_BACKEND=engine_of(p))
    assert new.line() == "waiting"  # started up: it registers on "go"
    os.kill(old.proc.pid, signal.SIGKILL)  # its socket closes with it
    old.proc.wait(10)
    killed = time.monotonic()
    new.say("go")
    registered, line = serve_restarted(p, new)
    print(f"restart after SIGKILL: registered {registered - killed:.2f} s after the kill ({line})")
    assert line.endswith(" 0 refusals"), line  # the first registration was accepted
    assert registered - killed < 5
    assert (p.pre.stats.restarts, p.pre.stats.takeovers_refused) == (1, 0)


def test_a_stopped_rank_is_replaced_once_its_heartbeats_are_missed(
    old_rank: tuple[WorkerPair, Registrant], keys: Path
) -> None:
    p, old = old_rank
    new = Registrant(p, keys, REGISTRANT_RETRY_S="30", REGISTRANT_GO="1", REGISTRANT_BACKEND=engine_of(p))
    assert new.line() == "waiting"  # started up: it registers on "go"
    os.kill(old.proc.pid, signal.SIGSTOP)  # alive, its connection open, answering nothing
    stopped = time.monotonic()
    new.say("go")
    registered, line = serve_restarted(p, new)
    after = registered - stopped
    print(f"restart after SIGSTOP: registered {after:.2f} s after the stop ({line})")
    # refused while the old connection counted as live (its heartbeats were not yet missed),
    # accepted once the prefill rank closed it: between the timeout and a few retries later
    assert prefill.HEARTBEAT_TIMEOUT_S <= after < prefill.HEARTBEAT_TIMEOUT_S + 5, after
    assert not line.endswith(" 0 refusals"), line
    assert p.pre.stats.restarts == 1 and p.pre.stats.takeovers_refused >= 1, p.pre.stats


def test_an_unregistered_socket_declines_and_aborts_nothing(keys: Path) -> None:
    with worker_pair(**authed(keys, room_timeout_s=120)) as p:
        room_in_flight(p, 8)  # asked for by the victim
        # room 7: nobody asked yet (a decline's target); room 8: the victim's, claimed in its name
        assert attack(p, keys, "evil", [7]) == "answered 0"
        assert attack(p, keys, "dec", [8]) == "answered 0"
        assert p.pre.stats.aborts_refused == 2, list(p.pre.stats.failures)
        assert any("not its registered one" in f for f in p.pre.stats.failures)
        assert finish(p, 8) is Status.SUCCESS, p.finished
        assert run_room(p, 7)[1] is Status.SUCCESS  # not "declined by evil/0 before any request"


def test_per_rank_keys_bind_each_identity_to_its_own_key(keys: Path, tmp_path: Path) -> None:
    rank_keys = tmp_path / "dec-0"
    bind_rank(keys, "dec", "0", rank_keys)
    with worker_pair(**authed(keys, rank_keys), connect=False) as p:
        # the deployment's own key cannot claim the bound rank, even with no live rank
        impostor = Registrant(p, keys)
        try:
            answer = impostor.line()
        finally:
            impostor.close()
        assert answer.startswith("refused") and "dec/0 is bound to its own key" in answer, answer
        # the rank's key cannot claim another identity
        other = Registrant(p, rank_keys, REGISTRANT_ENGINE="other", REGISTRANT_AGENT="other-agent")
        try:
            answer = other.line()
        finally:
            other.close()
        assert answer.startswith("refused") and "is bound to dec/0" in answer, answer
        assert p.pre.stats.identities_refused == 2
        p.group = p.dec.connect([p.pre.endpoint])
        p.step_until(lambda: p.group is not None and p.group.ready, "the bound rank's registration")
        assert run_room(p, 3)[1] is Status.SUCCESS  # the rank with its own key is served
