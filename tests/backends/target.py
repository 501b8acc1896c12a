"""A target (decode-side) process for the conformance suite.

``python -m tests.backends.target BACKEND NBYTES``: allocates and registers one region of
NBYTES, prints one JSON line ``{"pid", "agent", "md", "regions"}``, then polls for
notifications. For each one it prints ``{"sender", "payload", "sha"}`` where ``sha`` is the
sha256 of the byte range the payload names (``"<tag>:<offset>:<nbytes>"``), computed the
moment the notification is seen: this is how the suite proves data is visible on arrival.
It exits (closing the backend) on a line ``exit`` on stdin or when stdin closes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import select
import sys
import time

from pdwire.demo import register_mori_fake
from pdwire.runtime.backends import create_backend


def main() -> None:
    name, nbytes = sys.argv[1], int(sys.argv[2])
    register_mori_fake()
    b = create_backend(name, agent_name=f"target-{os.getpid()}")
    buf = b.allocate("dst", nbytes)
    b.register([buf.region()])
    md = b.local_metadata()
    print(
        json.dumps(
            {
                "pid": os.getpid(),
                "agent": md.agent_name,
                "md": base64.b64encode(md.agent_metadata).decode(),
                "descs": [base64.b64encode(d).decode() for d in md.region_descs],
            }
        ),
        flush=True,
    )
    try:
        while True:
            for n in b.receive_notifications():
                _tag, off, size = n.payload.decode().split(":")
                o, s = int(off), int(size)
                sha = hashlib.sha256(buf.array[o : o + s].tobytes()).hexdigest()
                out = {"sender": n.peer_agent_name, "payload": n.payload.decode(), "sha": sha}
                print(json.dumps(out), flush=True)
            ready, _, _ = select.select([sys.stdin], [], [], 0.001)
            if ready:
                line = sys.stdin.readline()
                if not line or line.strip() == "exit":
                    break
            time.sleep(0.0005)
    finally:
        b.close()
        print(json.dumps({"closed": True}), flush=True)


if __name__ == "__main__":
    main()
