"""A decode peer in its own process that registers properly, then sends a TransferRequest far
larger than its registered pools allow (yet under the socket's 32 MiB), for
``test_message_bounds.py``.

``python -m tests.e2e.oversized_peer ENDPOINT PAGES``: registers engine "big" rank 0 of SPEC with
its own local backend's caches, prints the registration answer, sends room 78 naming ``PAGES``
destination pages, then a legal request for room 79, and prints the status each got (or
``null`` when none came within 5 s) as JSON lines.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import zmq

from pdwire import wire
from pdwire.demo.rank import model_fingerprint
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.config import ParallelRank
from pdwire.runtime.planner import regions
from pdwire.runtime.session.hello import Identity
from pdwire.runtime.session.registration import register_info
from tests.e2e.conftest import SPEC, worker_caches


def _answer(sock: zmq.Socket[Any], timeout_s: float = 5) -> wire.Message | None:
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return wire.decode(sock.recv_multipart())


def _status(msg: wire.Message | None) -> dict[str, Any] | None:
    if msg is None:
        return None
    assert isinstance(msg, wire.TransferStatus), msg
    return {"room": int(msg.room), "status": wire.Status(msg.status).name, "reason": str(msg.reason)}


def main(endpoint: str, pages: int) -> int:
    backend = LocalBackend(agent_name="big-agent")
    caches = worker_caches(backend)
    backend.register(regions(caches.memory))
    md = backend.local_metadata()
    hello = Identity(wire.Role.DECODE, "big", ParallelRank(1, 0), model_fingerprint(SPEC), ()).hello()
    info = register_info(
        caches.memory,
        endpoint="tcp://127.0.0.1:2",
        engine_id="big",
        agent_name=md.agent_name,
        agent_metadata=md.agent_metadata,
        geometry=hello.geometry,
    )
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(wire.encode(hello, wire.NEWEST))
    assert isinstance(_answer(sock, 20), wire.Hello)
    sock.send_multipart(wire.encode(info, wire.NEWEST))
    ack = _answer(sock, 20)
    assert isinstance(ack, wire.RegisterAck), ack
    print(json.dumps({"accepted": bool(ack.accepted), "reason": str(ack.reason)}), flush=True)
    big = wire.TransferRequest(
        room=78, sender="tcp://127.0.0.1:2", dst_kv_indices=np.arange(pages, dtype=np.int32)
    )
    frames = wire.encode(big, wire.NEWEST)
    size = sum(memoryview(f).nbytes for f in frames)
    sock.send_multipart(frames)
    print(json.dumps({"sent": size, "answer": _status(_answer(sock))}), flush=True)
    legal = wire.TransferRequest(
        room=79, sender="tcp://127.0.0.1:2", dst_kv_indices=np.arange(2, dtype=np.int32)
    )
    sock.send_multipart(wire.encode(legal, wire.NEWEST))
    print(json.dumps({"answer": _status(_answer(sock))}), flush=True)
    sock.close(0)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
