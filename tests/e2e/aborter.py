"""An attacker in its own process that says Hello and then sends Aborts, never registering:
``python -m tests.e2e.aborter ENDPOINT KEYDIR|- ENGINE_ID RANK ROOM...`` (``-``: no CURVE).

It claims decode (``ENGINE_ID``, ``RANK``) of SPEC's geometry (TP 1), waits for the prefill
rank's Hello, sends one Abort per room, then prints ``answered N`` with the count of answers it
got to them within a second (0: every Abort went unanswered) and exits.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import zmq

from pdwire import wire
from pdwire.demo.rank import model_fingerprint
from pdwire.runtime.config import ParallelRank
from pdwire.runtime.control_auth import ControlAuth
from pdwire.runtime.session.hello import Identity
from pdwire.runtime.workers.curve import connect_curve
from tests.e2e.conftest import SPEC


def answers(sock: zmq.Socket[Any], within_s: float) -> list[wire.Message]:
    got, end = [], time.monotonic() + within_s
    while (left := end - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            got.append(wire.decode(sock.recv_multipart()))
    return got


def main(endpoint: str, keys: str, engine_id: str, rank: int, rooms: list[int]) -> int:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys != "-":
        connect_curve(sock, ControlAuth.from_directory(keys))
    sock.connect(endpoint)
    geometry = ParallelRank(1, 0) if rank == 0 else ParallelRank(rank + 1, rank)
    hello = Identity(wire.Role.DECODE, engine_id, geometry, model_fingerprint(SPEC), ()).hello()
    sock.send_multipart(wire.encode(hello, wire.NEWEST))
    if not sock.poll(20_000):
        print("no hello", flush=True)
        return 1
    theirs = wire.decode(sock.recv_multipart())
    assert isinstance(theirs, wire.Hello), theirs
    version = wire.agree(hello, theirs)
    for room in rooms:
        sock.send_multipart(wire.encode(wire.Abort(room=room, sender="tcp://evil:1", reason="evil"), version))
    print(f"answered {len(answers(sock, 1.0))}", flush=True)
    sock.close(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), [int(r) for r in sys.argv[5:]]))
