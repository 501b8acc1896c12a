"""One side of a raw engine transfer between two hosts (no pdwire control plane).

``python -m tests.hosts.engine_peer target BACKEND NBYTES [k=v ...]`` allocates and registers
NBYTES, prints ``{"md": <base64 metadata>, "agent": name}``, then prints ``{"sha": ...}`` of
its buffer when a notification arrives and exits.

``python -m tests.hosts.engine_peer source BACKEND NBYTES SEED [k=v ...]`` reads the target's
line on stdin, fills NBYTES with a pattern from SEED, writes all of it as 1 MiB descriptors
(in a scattered order), waits for the engine's DONE, prints ``{"sha": ..., "state": ...}``.

``k=v`` pairs are backend constructor options (``hostname=10.251.0.1`` for Mooncake).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import time

import numpy as np

from pdwire.runtime.backends import PeerError, PeerMetadata, create_backend
from pdwire.runtime.descriptors import DescriptorTable

MiB = 1 << 20


def _options(args: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for a in args:
        k, _, v = a.partition("=")
        out[k] = v
    return out


def main() -> None:
    role, name, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "target":
        b = create_backend(name, agent_name=f"target-{os.getpid()}", **_options(sys.argv[4:]))
        buf = b.allocate("dst", nbytes)
        b.register([buf.region()])
        md = b.local_metadata()
        print(
            json.dumps({"agent": md.agent_name, "md": base64.b64encode(md.agent_metadata).decode()}),
            flush=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if b.receive_notifications():
                print(json.dumps({"sha": hashlib.sha256(buf.array.tobytes()).hexdigest()}), flush=True)
                break
            time.sleep(0.001)
        b.close()
        return
    seed = int(sys.argv[4])
    b = create_backend(
        name, agent_name=f"source-{os.getpid()}", transfer_timeout_s=90, **_options(sys.argv[5:])
    )
    src = b.allocate("src", nbytes)
    src.array[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    b.register([src.region()])
    line = json.loads(sys.stdin.readline())
    try:
        peer = b.add_peer(PeerMetadata(line["agent"], base64.b64decode(line["md"])))
    except PeerError as exc:  # refused at the handshake: say why, move nothing
        print(json.dumps({"state": "PEER_REFUSED", "reason": str(exc)}), flush=True)
        b.close()
        return
    order = np.random.default_rng(seed + 1).permutation(nbytes // MiB).astype(np.uint64) * MiB
    n = len(order)
    table = DescriptorTable(
        np.uint64(src.address) + order,
        np.uint64(peer.regions[0].base) + order,
        np.full(n, MiB, dtype=np.uint64),
        np.zeros(n, dtype=np.uint32),
        np.zeros(n, dtype=np.uint32),
    )
    t0 = time.monotonic()
    h = b.post(peer, table, b"done")
    status = b.wait(h, 120)
    elapsed = time.monotonic() - t0
    print(
        json.dumps(
            {
                "sha": hashlib.sha256(src.array.tobytes()).hexdigest(),
                "state": status.state.name,
                "reason": status.reason,
                "seconds": elapsed,
            }
        ),
        flush=True,
    )
    b.release(h)
    b.close()


if __name__ == "__main__":
    main()
