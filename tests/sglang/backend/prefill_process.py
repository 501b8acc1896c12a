"""A prefill engine in its own process, for the multi-process tests: SGLang's bootstrap server and
P prefill ranks (SGLang's pools, KVArgs and managers), driven like SGLang's prefill scheduler.

``python -m tests.sglang.backend.prefill_process P BOOTSTRAP_PORT HTTP_PORT ROOMS_JSON [stall]``
prints ``READY`` once every rank registered and ``DONE <json outcomes>`` when every room finished.
With ``stall`` it sends each room's first chunk only, prints ``SENT <room>`` once the room is
Transferring on every rank, and then waits (up to 10 minutes) for the test to kill it: a
prefill engine that dies mid-transfer.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore")


def _stall(pair: Any, rooms: dict[int, int]) -> None:
    """SGLang's prefill scheduler up to the first chunk of each room, then nothing more."""
    from tests.sglang.backend import harness as h

    KVPoll = pair.sg["KVPoll"]
    for room, seq_len in rooms.items():
        send = [
            pair.sg["sender"](mgr=r.manager, bootstrap_addr=pair.addr, bootstrap_room=room)
            for r in pair.prefill
        ]
        reqs = [h.Request(rank, room, seq_len) for rank in pair.prefill]
        for req in reqs:
            req.fill()
        deadline = time.monotonic() + 120
        while h.min_poll([s.poll() for s in send]) != KVPoll.WaitingForInput:
            assert time.monotonic() < deadline, f"room {room}: no decode rank asked"
            time.sleep(0.002)
        for s, req in zip(send, reqs, strict=True):
            s.init(len(req.pages), req.aux)
            s.send(req.pages[:1])  # the first chunk; the last (with the state) never comes
        while h.min_poll([s.poll() for s in send]) != KVPoll.Transferring:
            assert time.monotonic() < deadline, f"room {room}: the first chunk is not transferring"
            time.sleep(0.002)
        print(f"SENT {room}", flush=True)
    time.sleep(600)


def main() -> None:
    p, bootstrap_port, http_port = (int(x) for x in sys.argv[1:4])
    rooms = {int(k): int(v) for k, v in json.loads(sys.argv[4]).items()}
    stall = sys.argv[5:6] == ["stall"]
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from tests.sglang.backend import harness as h
    from tests.sglang.backend.test_transfer import _prefill_engine

    backend = TransferBackend("pdwire")
    server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=bootstrap_port)
    pair = type("PrefillOnly", (), {})()
    from sglang.srt.disaggregation.base.conn import KVPoll

    pair.sg = {"KVPoll": KVPoll, "sender": get_kv_class(backend, KVClassType.SENDER)}
    pair.addr = f"127.0.0.1:{bootstrap_port}"
    pair.prefill = [h.make_rank("prefill", p, r, bootstrap_port, http_port) for r in range(p)]
    print("READY", flush=True)
    if stall:
        _stall(pair, rooms)
        return
    outcome: dict[int, int] = {}
    try:
        _prefill_engine(pair, rooms, outcome, chunk_pages=2)()  # type: ignore[arg-type]
    finally:
        print("DONE " + json.dumps({str(k): int(v) for k, v in outcome.items()}), flush=True)
        for rank in pair.prefill:
            rank.manager.teardown()
        server.close()


if __name__ == "__main__":
    main()
