"""A rank process that only registers: ``python -m tests.discovery.registrant SPEC ENGINE TP_RANK``.

Prints ``registered <incarnation>`` once its own entry is visible in the registry, then
keeps its lease alive until it is killed (SIGKILL: the lease expires) or stopped (SIGTERM:
the lease is revoked).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from pdwire import wire
from pdwire.discovery import Geometry, RankEntry, open_discovery


def main() -> None:
    spec, engine, tp_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    incarnation = f"{os.getpid()}-{time.time_ns()}"
    entry = RankEntry(
        role=wire.Role.PREFILL,
        engine_id=engine,
        geometry=Geometry(tp_size=2, tp_rank=tp_rank),
        control=f"tcp://127.0.0.1:{17000 + tp_rank}",
        incarnation=incarnation,
        backend="nixl",
        protocol=("1.3",),
        pid=os.getpid(),
    )
    disc = open_discovery(spec, roles=(wire.Role.PREFILL,))
    signal.signal(signal.SIGTERM, lambda *_: (disc.close(), sys.exit(0)))
    disc.register(entry)
    announced = False
    while True:
        disc.poll(0.2)
        # Seen as a Joined, or as a Restarted when this process's watch read the previous
        # incarnation's entry (its lease not yet expired) before its own put: either way the
        # registry now holds this incarnation.
        mine = any(e.incarnation == incarnation for e in disc.membership.entries().values())
        if mine and not announced:
            print("registered", incarnation, flush=True)
            announced = True


if __name__ == "__main__":
    main()
