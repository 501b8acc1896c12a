"""Processes for the local backend's proof-of-possession test (``test_local_possession.py``).

``python -m tests.e2e.local_impostor victim``: a live local backend holding SPEC's decode rank 0
caches (allocated, registered, filled with a pattern), as a real decode rank would. It prints one
JSON line: its pid, agent name, metadata and the RegisterInfo its rank would send (base64), and
the sha256 of its caches; then one ``{"sha": ...}`` line for each line on stdin; it exits when
stdin closes.

``python -m tests.e2e.local_impostor impostor ENDPOINT MODE``: a registered-looking decode peer
"evil" that names the victim (read as one JSON line on stdin) as its memory: the victim's pid,
inbox and regions, and a proof made as well as it can without the victim's token (``MODE``
``forged``: an HMAC with a token of its own; ``none``: no proof, a 1.0 envelope's default;
``replayed``: the victim's own proof, the control case). Run as root, it first becomes
``nobody``, another uid, and reports whether it could read the victim's token. It prints the
registration answer and the status a request then gets as JSON lines.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import time
from typing import Any

import msgspec
import zmq

from pdwire import wire
from pdwire.demo.rank import model_fingerprint
from pdwire.runtime.backends import possession
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.config import ParallelRank
from pdwire.runtime.planner import regions
from pdwire.runtime.session.hello import Identity, geometry_of
from pdwire.runtime.session.registration import register_info
from pdwire.wire import backend_metadata as bm
from tests.e2e.conftest import SPEC, worker_caches

NOBODY = 65534


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def victim() -> int:
    backend = LocalBackend(agent_name=f"victim-{os.getpid()}")
    caches = worker_caches(backend)
    backend.register(regions(caches.memory))
    memory = backend._shared[0].array  # the allocated caches: what a write would change
    assert memory is not None
    memory[:] = 0x5A
    md = backend.local_metadata()
    info = register_info(
        caches.memory,
        endpoint="tcp://127.0.0.1:1",
        engine_id="victim",
        agent_name=md.agent_name,
        agent_metadata=md.agent_metadata,
        geometry=geometry_of(ParallelRank(1, 0)),
    )
    sha = lambda: hashlib.sha256(memory.tobytes()).hexdigest()  # noqa: E731
    out = {
        "pid": os.getpid(),
        "agent": md.agent_name,
        "metadata": b64(md.agent_metadata),
        "info": b64(wire.encode_bytes(info)),
        "sha": sha(),
    }
    print(json.dumps(out), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"sha": sha()}), flush=True)
    backend.close()
    return 0


def _as_nobody(inbox: str, uid: int) -> str:
    """Become another uid (when root) and try the victim's token: what the impostor could read."""
    if os.getuid() != 0:
        return "same uid (not root): the impostor simply does not read the token"
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        possession.read_token(inbox, uid)
    except PermissionError:
        return "unreadable"
    return "READABLE"


def _answer(sock: zmq.Socket[Any], frames: list[Any], timeout_s: float = 20) -> wire.Message:
    sock.send_multipart(frames)
    if not sock.poll(int(timeout_s * 1000)):
        raise SystemExit("the prefill rank did not answer")
    return wire.decode(sock.recv_multipart())


def impostor(endpoint: str, mode: str) -> int:
    target = json.loads(sys.stdin.readline())
    env = bm.decode_bytes(base64.b64decode(target["metadata"]))
    assert isinstance(env, bm.AgentMetadata)
    token_access = _as_nobody(env.inbox, target["uid"])
    if mode == "forged":  # the best it can do without the token: an HMAC with one of its own
        proof = possession.proof(os.urandom(possession.TOKEN_BYTES), env.agent_name, env.pid, env.inbox)
    elif mode == "none":
        proof = b""
    else:
        proof = env.proof
    forged = bm.encode_bytes(msgspec.structs.replace(env, proof=proof))
    hello = Identity(wire.Role.DECODE, "evil", ParallelRank(1, 0), model_fingerprint(SPEC), ()).hello()
    info = wire.decode_bytes(base64.b64decode(target["info"]))
    assert isinstance(info, wire.RegisterInfo)
    info = msgspec.structs.replace(info, engine_id="evil", agent_metadata=forged, geometry=hello.geometry)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    assert isinstance(_answer(sock, wire.encode(hello, wire.NEWEST)), wire.Hello)
    ack = _answer(sock, wire.encode(info, wire.NEWEST))
    assert isinstance(ack, wire.RegisterAck)
    print(
        json.dumps(
            {
                "token": token_access,
                "accepted": bool(ack.accepted),
                "kind": wire.FailureKind(ack.failure_kind).name,
                "reason": str(ack.reason),
            }
        ),
        flush=True,
    )
    if not ack.accepted:  # a request anyway: nothing of it may be served
        req = wire.TransferRequest(room=77, sender="tcp://127.0.0.1:1", dst_kv_indices=[0, 1, 2])
        status = _answer(sock, wire.encode(req, wire.NEWEST))
        assert isinstance(status, wire.TransferStatus)
        print(json.dumps({"room": int(status.room), "status": wire.Status(status.status).name,
                          "reason": str(status.reason)}), flush=True)  # fmt: skip
    time.sleep(0.1)
    sock.close(0)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "victim":
        sys.exit(victim())
    sys.exit(impostor(sys.argv[2], sys.argv[3]))
