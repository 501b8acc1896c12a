"""The target of a late-write test across two hosts: memory given to one writer through windows.

``python -m tests.hosts.fence_target BACKEND NBYTES [k=v ...]`` allocates and registers NBYTES,
prints ``{"agent", "md"}`` (its metadata for the writer ``"w"``, base64), then answers lines on
stdin: ``revoke`` revokes the writer, waits until the revocation settled and fills the memory
with 0x5A (the reuse), printing ``{"revoked": effective, "reason"}``; ``check`` prints
``{"changed": <bytes that are not 0x5A>}``; ``exit`` (or end of input) closes. ``k=v`` pairs
are backend options (``hostname=10.251.0.2`` for Mooncake).
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time

import numpy as np

from pdwire.runtime.backends import create_backend

REUSED = 0x5A


def main() -> None:
    name, nbytes = sys.argv[1], int(sys.argv[2])
    options = dict(a.partition("=")[::2] for a in sys.argv[3:])
    b = create_backend(name, agent_name=f"target-{os.getpid()}", **options)
    buf = b.allocate("dst", nbytes)
    b.register([buf.region()])
    md = b.local_metadata(for_peer="w")
    hello = {"agent": md.agent_name, "md": base64.b64encode(md.agent_metadata).decode()}
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "revoke":
            r = b.revoke("w")
            time.sleep(max(0.0, r.settles_at - time.monotonic()))
            buf.array[:] = REUSED
            print(json.dumps({"revoked": r.effective, "reason": r.reason}), flush=True)
        elif cmd == "check":
            print(json.dumps({"changed": int(np.count_nonzero(buf.array != REUSED))}), flush=True)
        elif cmd == "exit":
            break
    b.close()


if __name__ == "__main__":
    main()
