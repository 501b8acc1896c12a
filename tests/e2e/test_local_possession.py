"""A registered peer naming another live local backend of the host is refused at the handshake.

Three processes: the prefill rank (and its real decode peer) in this one, a *victim* (a live
local backend holding a decode rank's caches, ``tests/e2e/local_impostor.py victim``) and an
*impostor* (``... impostor``) that registers with the prefill rank naming the victim's pid,
inbox and allocated memory. Every ``/proc`` check passes for that metadata (it is a real local
backend's); only the proof of possession, which needs the victim's token, tells them apart. The
impostor runs as another uid when the tests run as root, so it provably cannot read the token.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import WorkerPair, worker_pair
from tests.e2e.test_hostile_peers import run_room

ROOT = Path(__file__).resolve().parents[2]


def _line(proc: subprocess.Popen[str], p: WorkerPair, timeout_s: float = 60) -> dict[str, Any]:
    """The next JSON line ``proc`` prints, stepping the pair meanwhile."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    while not select.select([proc.stdout], [], [], 0)[0]:
        assert time.monotonic() < end, "the process said nothing"
        assert proc.poll() is None, f"the process exited with {proc.returncode}"
        p.pre.step(5)
        p.dec.step(0)
    value = json.loads(proc.stdout.readline())
    assert isinstance(value, dict)
    return value


def _start(*args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "tests.e2e.local_impostor", *args]
    return subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _impostor(p: WorkerPair, target: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    proc = _start("impostor", p.pre.endpoint, mode)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({**target, "uid": os.getuid()}) + "\n")
    proc.stdin.flush()
    try:
        answers = [_line(proc, p)]
        if not answers[0]["accepted"]:
            answers.append(_line(proc, p))
    finally:
        proc.stdin.close()
        proc.wait(30)
    return answers


@pytest.mark.parametrize("mode", ["forged", "none"])
def test_a_peer_naming_another_live_local_backend_is_refused(mode: str) -> None:
    victim = _start("victim")
    assert victim.stdin is not None
    try:
        with worker_pair() as p:
            target = _line(victim, p)
            ack, status = _impostor(p, target, mode)
            if os.getuid() == 0:  # the impostor ran as nobody: the token was out of its reach
                assert ack["token"] == "unreadable", ack
            assert not ack["accepted"] and ack["kind"] == "HANDSHAKE", ack
            assert "NotPossessed" in ack["reason"] and f"pid {target['pid']}" in ack["reason"], ack
            needle = "does not match the token" if mode == "forged" else "carries no proof of possession"
            assert needle in ack["reason"], ack
            # not registered: its request is refused, nothing is planned or written
            assert status["room"] == 77 and status["status"] == "FAILED", status
            assert "not registered" in status["reason"], status
            victim.stdin.write("sha\n")
            victim.stdin.flush()
            assert _line(victim, p)["sha"] == target["sha"]  # the victim's memory is untouched
            assert run_room(p, 3)[1].name == "SUCCESS"  # the rank and its real peer go on
    finally:
        victim.stdin.close()
        victim.wait(30)


def test_the_victims_own_proof_is_accepted() -> None:
    """The control case: the same registration carrying the victim's real proof is accepted, so
    the refusals above are the proof's and nothing else's. (Only the writers a backend registers
    with see its metadata, and those may write its memory anyway.)"""
    victim = _start("victim")
    assert victim.stdin is not None
    try:
        with worker_pair() as p:
            target = _line(victim, p)
            (ack,) = _impostor(p, target, "replayed")
            assert ack["accepted"], ack
    finally:
        victim.stdin.close()
        victim.wait(30)
