"""A writer (prefill-side) process that streams transfers into a target, for fence tests.

``python -m tests.backends.writer BACKEND``: reads one JSON line ``{"agent", "md", "size"}``
(the target's metadata, base64; optionally ``"options"``, backend constructor options such as
Mooncake's ``hostname``) from stdin, allocates a source of ``size`` bytes filled with
0xA5, adds the peer and then posts, back to back, transfers of ``size`` bytes in 4 KiB rows
to the start of the target's region 0, each polled to its final state. It prints
``{"ready": pid}`` once the peer is added, then one line per finished transfer
``{"t": time.monotonic(), "state", "reason"}`` (the monotonic clock is the host's, so the
test can compare), and stops at a line ``exit`` on stdin or when stdin closes.
"""

from __future__ import annotations

import base64
import json
import os
import select
import sys
import time

import numpy as np

from pdwire.runtime.backends import PeerMetadata, create_backend
from pdwire.runtime.descriptors import DescriptorTable

ROW = 4096


def main() -> None:
    name = sys.argv[1]
    hello = json.loads(sys.stdin.readline())
    size = int(hello["size"])
    options = hello.get("options", {})
    b = create_backend(name, agent_name=f"writer-{os.getpid()}", transfer_timeout_s=60, **options)
    src = b.allocate("src", size)
    src.array[:] = 0xA5
    b.register([src.region()])
    peer = b.add_peer(PeerMetadata(hello["agent"], base64.b64decode(hello["md"])))
    n = size // ROW
    off = np.arange(n, dtype=np.uint64) * np.uint64(ROW)
    table = DescriptorTable(
        np.uint64(src.address) + off,
        np.uint64(peer.regions[0].base) + off,
        np.full(n, ROW, dtype=np.uint64),
        np.zeros(n, dtype=np.uint32),
        np.zeros(n, dtype=np.uint32),
    )
    print(json.dumps({"ready": os.getpid()}), flush=True)
    try:
        while not select.select([sys.stdin], [], [], 0)[0]:
            h = b.post(peer, table, b"stream")
            st = b.wait(h, timeout_s=60)
            b.release(h)
            line = {"t": time.monotonic(), "state": st.state.value, "reason": st.reason}
            print(json.dumps(line), flush=True)
            if st.state.value == "FAILED":
                time.sleep(0.01)  # a revoked target refuses at once: do not spin
    finally:
        b.close()


if __name__ == "__main__":
    main()
