"""The authenticated control plane on real sockets, and restarts versus impersonation on real
processes.

CURVE: a decode rank holding the deployment's key is served; a socket with an unknown key or
none at all is refused by libzmq during the handshake (before any frame reaches a connection
machine), logged and counted. A registration under the (engine id, rank) of a live decode rank
is refused whatever key it holds (the deployment's own included); a restart after the old process
is gone is accepted and the old incarnation's backend peer removed.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zmq

from pdwire import wire
from pdwire.demo.content import fill, full_tensors
from pdwire.demo.rank import model_fingerprint
from pdwire.runtime.config import ConfigError, ParallelRank
from pdwire.runtime.control_auth import ENV_INSECURE, ENV_KEYS, ControlAuth, generate_directory
from pdwire.runtime.engine import DecodeWorker, GroupState, HandshakeError, PrefillGroup, Status
from pdwire.runtime.session.hello import Identity
from pdwire.runtime.workers.curve import resolve
from tests.e2e.conftest import (
    SPEC,
    WorkerPair,
    decode_config,
    prefill_config,
    room_slots,
    send,
    serving,
    worker_pair,
)
from tests.e2e.test_hostile_peers import run_room

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_directory(tmp_path / "keys")
    return tmp_path / "keys"


def authed(keys: Path) -> dict[str, Any]:
    auth = ControlAuth.from_directory(keys)
    return {"prefill_kw": {"control_auth": auth}, "decode_kw": {"control_auth": auth}}


def silent(p: WorkerPair, sock: zmq.Socket[Any], until: Any, what: str) -> None:
    """Step the prefill rank until ``until()``; ``sock`` must get no answer meanwhile."""
    end = time.monotonic() + 10
    while not until():
        assert time.monotonic() < end, f"timed out waiting for {what}: {list(p.pre.stats.failures)}"
        p.pre.step(5)
        assert not sock.poll(0), "a refused socket got an answer"


def test_an_authorised_peer_is_served_and_unknown_or_plain_peers_are_refused_at_the_socket(
    keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pdwire.auth")
    server_key = ControlAuth.from_directory(keys).public_key
    with worker_pair(**authed(keys)) as p:
        assert run_room(p, 3)[1] is Status.SUCCESS  # the deployment's own decode rank
        assert p.pre.auth is not None and p.dec.auth is not None
        # a well-formed Hello: only the socket's credentials differ
        hello = Identity(wire.Role.DECODE, "evil", ParallelRank(1, 0), model_fingerprint(SPEC), ()).hello()
        stranger = ControlAuth.generate()
        messages_in = p.pre.stats.messages_in
        refused_before = p.pre.stats.handshakes_refused
        # The plaintext peer's refusal is named when libzmq sees the mechanism mismatch first;
        # when the peer hangs up first it is only counted (a handshake failed without detail).
        for done, setup in (
            (lambda: any("key was refused (ZAP status 400)" in f for f in p.pre.stats.failures),
             lambda s: _client(s, stranger, server_key)),
            (lambda: p.pre.stats.handshakes_refused >= refused_before + 2, lambda s: None),
        ):  # fmt: skip
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            setup(sock)
            sock.connect(p.pre.endpoint)
            sock.send_multipart(wire.encode(hello, wire.NEWEST))
            try:
                silent(p, sock, done, "the refusal")
            finally:
                sock.close(0)
        assert p.pre.stats.messages_in == messages_in  # not one frame of theirs reached the worker
        texts = [r.getMessage() for r in caplog.records if r.name == "pdwire.auth"]
        assert any("is not authorized" in t for t in texts), texts  # the unknown key, by ZAP
        plain = [t for t in texts if "CURVE" in t and "not authorized" not in t]
        assert all("does not speak CURVE" in t for t in plain), plain  # when named, named right
        assert run_room(p, 4)[1] is Status.SUCCESS  # and the rank serves on


def _client(sock: zmq.Socket[Any], auth: ControlAuth, server_key: bytes) -> None:
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, auth.secret_key)


def test_a_decode_rank_with_the_wrong_key_or_none_is_refused_by_name(keys: Path) -> None:
    auth = ControlAuth.from_directory(keys)
    with worker_pair(prefill_kw={"control_auth": auth}, decode_kw={"control_auth": auth}, connect=False) as p:
        for kw, needle in (
            (
                {"control_auth": replace(ControlAuth.generate(), server_key=auth.public_key)},
                "key was refused",
            ),
            ({"insecure_control": True}, "mechanism_mismatch"),
        ):
            told: list[GroupState] = []

            def connected(g: PrefillGroup, told: list[GroupState] = told) -> None:
                told.append(g.state)

            dec = DecodeWorker(decode_config(**kw), p.dc.memory, backend=p.db, on_connected=connected)
            try:
                with serving(p.pre):
                    group = dec.connect([p.pre.endpoint], timeout_s=30)  # non-blocking: CONNECTING
                    assert group.state is GroupState.CONNECTING
                    start = time.monotonic()
                    with pytest.raises(HandshakeError, match=needle):
                        dec.wait_ready(group)
                    # the socket's refusal fails the group by name, not the handshake timeout
                    assert time.monotonic() - start < 10, "the refusal waited for the handshake timeout"
                assert group.failed and group.error is not None and needle in group.error, group.error
                assert told == [GroupState.FAILED]  # on_connected reported it once, failed
            finally:
                dec.close()


def test_without_keys_a_worker_refuses_to_start_unless_told_to_run_unauthenticated(
    keys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_INSECURE, raising=False)
    monkeypatch.delenv(ENV_KEYS, raising=False)
    with pytest.raises(ConfigError, match="no keys were given"):
        resolve(prefill_config())
    assert resolve(prefill_config(insecure_control=True)) is None
    monkeypatch.setenv(ENV_KEYS, str(keys))
    assert resolve(decode_config()) == ControlAuth.from_directory(keys)
    os.chmod(keys / "control.key_secret", 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        resolve(decode_config())


# --------------------------------------------------------------------------- restarts


class Registrant:
    """``tests/e2e/registrant.py`` in its own process: decode engine "dec" rank 0."""

    def __init__(self, p: WorkerPair, keys: Path | None, **env: str) -> None:
        self.p = p
        argv = [sys.executable, "-m", "tests.e2e.registrant", p.pre.endpoint, *([str(keys)] if keys else [])]
        pipe, env = subprocess.PIPE, {**os.environ, **env}
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=pipe, stdout=pipe, text=True, env=env)

    def line(self, timeout_s: float = 60) -> str:
        """The next line it prints, stepping both workers of the pair meanwhile."""
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout_s
        while not select.select([self.proc.stdout], [], [], 0)[0]:
            assert time.monotonic() < end, "the registrant said nothing"
            assert self.proc.poll() is None, f"the registrant exited with {self.proc.returncode}"
            self.p.pre.step(5)
            self.p.dec.step(0)
        return self.proc.stdout.readline().strip()

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


@pytest.mark.parametrize("secure", [False, True], ids=["insecure", "curve"])
def test_a_process_claiming_a_live_decode_rank_is_refused(secure: bool, tmp_path: Path) -> None:
    # secure: the impersonator holds a key the prefill rank admits, but not the real rank's
    keys, other = tmp_path / "keys", tmp_path / "other"
    generate_directory(keys)
    generate_directory(other)
    (other / "server.key").write_bytes((keys / "control.key").read_bytes())
    (keys / "other.key").write_bytes((other / "control.key").read_bytes())  # admitted, not the same
    with worker_pair(**(authed(keys) if secure else {})) as p:
        impostor = Registrant(p, other if secure else None)
        try:
            answer = impostor.line()
        finally:
            impostor.close()
        assert answer.startswith("refused") and "registered on a live connection" in answer, answer
        assert p.pre.stats.takeovers_refused == 1 and p.pre.stats.restarts == 0
        assert run_room(p, 5)[1] is Status.SUCCESS  # the real rank's connection is untouched


def test_another_rank_registering_a_live_ranks_agent_name_is_refused_and_the_live_rank_served() -> None:
    # the engine keys peers by agent name: accepting it would replace the live rank's entry
    with worker_pair() as p:
        thief = Registrant(p, None, REGISTRANT_ENGINE="dec-other", REGISTRANT_AGENT=p.db.agent_name)
        try:
            answer = thief.line()
        finally:
            thief.close()
        assert answer.startswith("refused") and f"agent name {p.db.agent_name!r} is registered by" in answer
        assert run_room(p, 5)[1] is Status.SUCCESS  # the live rank's peer entry is untouched


@pytest.mark.parametrize("secure", [False, True], ids=["insecure", "curve"])
def test_a_restart_after_the_old_process_is_gone_is_accepted(secure: bool, keys: Path) -> None:
    with worker_pair(**(authed(keys) if secure else {}), connect=False) as p:
        first = Registrant(p, keys if secure else None)
        try:
            assert first.line() == "ready"
        finally:
            first.close()  # the process exits: its connection closes
        old_agents = set(p.pb.peers)
        second = Registrant(p, keys if secure else None)
        try:
            assert second.line() == "ready"
        finally:
            second.close()
        assert p.pre.stats.restarts == 1 and p.pre.stats.takeovers_refused == 0
        gone = old_agents - set(p.pb.peers)
        assert gone, f"the old incarnation's backend peer is still there: {old_agents}, {set(p.pb.peers)}"


def test_the_same_key_from_another_live_process_is_refused_and_the_old_incarnations_room_served(
    keys: Path,
) -> None:
    kw = authed(keys)
    kw["prefill_kw"]["room_timeout_s"] = 120  # the room outlives starting the second process
    with worker_pair(**kw, connect=False) as p:
        old = Registrant(p, keys)
        try:
            assert old.line() == "ready"
            old.say("room 11")
            end = time.monotonic() + 20
            while p.pre.status(11) is not Status.WAITING_FOR_INPUT:
                assert time.monotonic() < end, "the old incarnation's request did not arrive"
                p.pre.step(5)
            new = Registrant(p, keys)  # the deployment's key, old connection alive: a duplicate
            try:
                answer = new.line()
            finally:
                new.close()
            assert answer.startswith("refused") and "registered on a live connection" in answer, answer
            fill(p.pc, room_slots(24), full_tensors(SPEC, 1, 11, 24))
            send(p.pre, 11, room_slots(24))
            told = old.line()
        finally:
            old.close()
        assert told.startswith("finished 11 SUCCESS"), told
        assert (p.pre.stats.restarts, p.pre.stats.takeovers_refused) == (0, 1)
        assert any(r == 11 and s is Status.SUCCESS for r, s, _ in p.released)
