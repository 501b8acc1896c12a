"""A decode rank in its own process, for the restart and impersonation tests: engine ``dec``
rank 0 of SPEC on a local backend, connected to one prefill endpoint.

``python -m tests.e2e.registrant ENDPOINT [KEYDIR]`` (no KEYDIR: an unauthenticated control
plane) prints ``ready`` once registered, or ``refused <reason>``, then serves until its stdin
closes; ``room N`` on stdin asks for room N (24 tokens) and prints ``finished N STATUS reason``.
``REGISTRANT_ENGINE`` and ``REGISTRANT_AGENT`` in the environment change its engine id and its
backend's agent name; ``REGISTRANT_RETRY_S`` makes it connect again after a refusal for that
long, then print ``ready after S s, N refusals`` (a restart waiting for its old connection to go);
``REGISTRANT_GO=1`` makes it print ``waiting`` once started and connect on a ``go`` line;
``REGISTRANT_BACKEND`` names its backend (default ``local``).
"""

from __future__ import annotations

import os
import select
import sys
import time

from pdwire.runtime.backends import create_backend
from pdwire.runtime.control_auth import ControlAuth
from pdwire.runtime.engine import DecodeWorker, Failure, HandshakeError, Status
from tests.e2e.conftest import SPEC, decode_config, room_slots, worker_caches


def main(endpoint: str, keys: str | None) -> int:
    auth = {"control_auth": ControlAuth.from_directory(keys)} if keys else {"insecure_control": True}
    agent = os.environ.get("REGISTRANT_AGENT", f"registrant-{os.getpid()}")
    backend = create_backend(os.environ.get("REGISTRANT_BACKEND", "local"), agent_name=agent)
    caches = worker_caches(backend)

    def finished(room: int, status: Status, failure: Failure | None) -> None:
        print(f"finished {room} {status.name} {failure.reason if failure else ''}", flush=True)

    config = decode_config(os.environ.get("REGISTRANT_ENGINE", "dec"), **auth, room_timeout_s=120)
    retry_s = float(os.environ.get("REGISTRANT_RETRY_S", "0"))
    with DecodeWorker(config, caches.memory, backend=backend, on_finished=finished) as dec:
        if os.environ.get("REGISTRANT_GO"):
            print("waiting", flush=True)
            if sys.stdin.readline().strip() != "go":
                return 0
        start, refusals = time.monotonic(), 0
        while True:
            group = dec.connect([endpoint], timeout_s=20)  # returns at once, CONNECTING
            try:
                dec.wait_ready(group)  # the prefill rank's answer: registered, or refused
                break
            except HandshakeError as exc:
                refusals += 1
                if time.monotonic() - start >= retry_s:
                    print(f"refused {exc}", flush=True)
                    return 0
                time.sleep(0.2)
        took = time.monotonic() - start
        print(f"ready after {took:.2f} s, {refusals} refusals" if retry_s else "ready", flush=True)
        while True:
            dec.step(5)
            if select.select([sys.stdin], [], [], 0)[0]:
                line = sys.stdin.readline()
                if not line:
                    return 0
                if line.startswith("room "):
                    dec.start_room(int(line.split()[1]), room_slots(24).request(SPEC), group)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
