"""One SGLang engine of one rank on a host of ``tests.support.netns.TwoHosts``, for
``test_across_hosts.py``: SGLang's pools, ``KVArgs`` and manager (``harness.make_rank``) under
the given ``--host`` and ``--disaggregation-ib-device``, driven like SGLang's scheduler.

``python -m tests.sglang.backend.netns_engine ROLE BOOTSTRAP_HOST BOOTSTRAP_PORT HTTP_PORT ROOMS_JSON
HOST [IB_DEVICE]``. Prefill also runs SGLang's bootstrap server on ``BOOTSTRAP_HOST``. Prints
``RANK <json>`` (the backend options the manager derived, its endpoint and what its backend
advertises) once the manager is up, ``BYTES <n>`` (decode: the bytes the rooms fill in its
pools) and ``DONE <json outcomes>`` when every room finished; decode compares every room's
pages, SWA window, Mamba slot and aux item byte for byte with what prefill wrote
(``_decode_engine``) and exits non-zero on any difference.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from types import SimpleNamespace
from typing import Any

warnings.filterwarnings("ignore")


def _rank_line(rank: Any) -> str:
    mgr = rank.manager
    backend = mgr.worker.backend
    return "RANK " + json.dumps({
        "options": mgr.backend_options,
        "host": mgr.local_ip,
        "endpoint": getattr(mgr.worker, "endpoint", None),
        "backend": backend.name,
        "session": getattr(backend, "session_name", None),
        "net_devices": getattr(backend, "net_devices", None),
    })  # fmt: skip


def main() -> None:
    role, bootstrap_host, bport, http_port, rooms_json, host = sys.argv[1:7]
    ib_device = sys.argv[7] if len(sys.argv) > 7 else None
    rooms = {int(k): int(v) for k, v in json.loads(rooms_json).items()}
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from tests.sglang.backend import harness as h
    from tests.sglang.backend.test_transfer import _decode_engine, _prefill_engine

    backend = TransferBackend("pdwire")
    server = None
    if role == "prefill":
        server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host=bootstrap_host, port=int(bport))
    flags: dict[str, Any] = {"host": host}
    if ib_device:
        flags["disaggregation_ib_device"] = ib_device
    rank = h.make_rank(role, 1, 0, int(bport), int(http_port), **flags)
    print(_rank_line(rank), flush=True)
    pair = SimpleNamespace(
        sg={"KVPoll": KVPoll, "sender": get_kv_class(backend, KVClassType.SENDER),
            "receiver": get_kv_class(backend, KVClassType.RECEIVER)},
        addr=f"{bootstrap_host}:{bport}", prefill=[rank], decode=[rank],
    )  # fmt: skip
    outcome: dict[int, int] = {}
    try:
        if role == "prefill":
            _prefill_engine(pair, rooms, outcome, chunk_pages=2)()  # type: ignore[arg-type]
        else:
            probe = dataclasses.replace(rank, rooms={})  # the same pools, its own allocation cursor
            nbytes = sum(
                want.nbytes for r, n in rooms.items() for _, _, want in h.Request(probe, r, n).regions()
            )
            print(f"BYTES {nbytes}", flush=True)
            _decode_engine(pair, rooms, outcome)()  # type: ignore[arg-type]
    finally:
        print("DONE " + json.dumps({str(k): v for k, v in outcome.items()}, default=str), flush=True)
        rank.manager.teardown()
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
