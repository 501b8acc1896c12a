"""A decode rank in its own process, for the restart and impersonation tests: engine ``dec``
rank 0 of SPEC on a local backend, connected to one prefill endpoint.

``python -m tests.e2e.registrant ENDPOINT [KEYDIR]`` (no KEYDIR: an unauthenticated control
plane) prints ``ready`` once registered, or ``refused <reason>``, then serves until its stdin
closes; ``room N`` on stdin asks for room N (24 tokens) and prints ``finished N STATUS reason``.
``REGISTRANT_ENGINE`` and ``REGISTRANT_AGENT`` in the environment change its engine id and its
backend's agent name.
"""

from __future__ import annotations

import os
import select
import sys

from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.control_auth import ControlAuth
from pdwire.runtime.engine import DecodeWorker, Failure, HandshakeError, Status
from tests.e2e.conftest import SPEC, decode_config, room_slots, worker_caches


def main(endpoint: str, keys: str | None) -> int:
    auth = {"control_auth": ControlAuth.from_directory(keys)} if keys else {"insecure_control": True}
    backend = LocalBackend(agent_name=os.environ.get("REGISTRANT_AGENT", f"registrant-{os.getpid()}"))
    caches = worker_caches(backend)

    def finished(room: int, status: Status, failure: Failure | None) -> None:
        print(f"finished {room} {status.name} {failure.reason if failure else ''}", flush=True)

    config = decode_config(os.environ.get("REGISTRANT_ENGINE", "dec"), **auth, room_timeout_s=120)
    with DecodeWorker(config, caches.memory, backend=backend, on_finished=finished) as dec:
        group = dec.connect([endpoint], timeout_s=20)  # returns at once, CONNECTING
        try:
            dec.wait_ready(group)  # the prefill rank's answer: registered, or refused
        except HandshakeError as exc:
            print(f"refused {exc}", flush=True)
            return 0
        print("ready", flush=True)
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
