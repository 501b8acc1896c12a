"""A prefill engine in its own process, for the two-process test: SGLang's bootstrap server and
P prefill ranks (SGLang's pools, KVArgs and managers), driven like SGLang's prefill scheduler.

``python -m tests.sglang_backend.prefill_process P BOOTSTRAP_PORT HTTP_PORT ROOMS_JSON`` prints
``READY`` once every rank registered and ``DONE <json outcomes>`` when every room finished.
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    p, bootstrap_port, http_port = (int(x) for x in sys.argv[1:4])
    rooms = {int(k): int(v) for k, v in json.loads(sys.argv[4]).items()}
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from tests.sglang_backend import harness as h
    from tests.sglang_backend.test_transfer import _prefill_engine

    backend = TransferBackend("pdwire")
    server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=bootstrap_port)
    pair = type("PrefillOnly", (), {})()
    from sglang.srt.disaggregation.base.conn import KVPoll

    pair.sg = {"KVPoll": KVPoll, "sender": get_kv_class(backend, KVClassType.SENDER)}
    pair.addr = f"127.0.0.1:{bootstrap_port}"
    pair.prefill = [h.make_rank("prefill", p, r, bootstrap_port, http_port) for r in range(p)]
    print("READY", flush=True)
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
