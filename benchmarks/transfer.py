"""Data-movement throughput of each transfer backend against plain memcpy, same run.

    .venv/bin/python benchmarks/transfer.py [--repeats 5] [--backends local,nixl,mooncake]

Each case posts one DescriptorTable between two agents of one backend in this process
(initiator -> target, the target's memory pre-faulted), waits for DONE and for the
target's notification, and times post-to-notification. The baseline is one
``np.copyto`` of the same number of bytes between two pre-faulted buffers. Reported:
medians over ``--repeats`` runs, GB/s, ratio to memcpy, descriptors per second.

More rows: append a function to ``CASES`` returning a :class:`Row` (the control-plane
rows of the runtime go there too).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from pdwire.runtime.backends import available_backends, create_backend
from pdwire.runtime.descriptors import DescriptorTable

MiB = 1 << 20


@dataclass
class Row:
    backend: str
    case: str
    nbytes: int
    ndescs: int
    seconds: float  # median
    memcpy_seconds: float  # median baseline, same bytes, same run

    def cells(self) -> list[str]:
        gbs = self.nbytes / self.seconds / 1e9
        ratio = self.memcpy_seconds / self.seconds
        return [
            self.backend,
            self.case,
            f"{self.nbytes / MiB:.0f} MiB",
            str(self.ndescs),
            f"{self.seconds * 1e3:.2f}",
            f"{gbs:.2f}",
            f"{ratio:.2f}x",
            f"{self.ndescs / self.seconds:,.0f}",
        ]


HEADER = ["backend", "case", "bytes", "descs", "median ms", "GB/s", "vs memcpy", "descs/s"]


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.zeros(nbytes, dtype=np.uint8)  # zeros written = pages faulted in
    b.fill(1)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# Engine options per row name: "nixl-shm" is NIXL with UCX error handling off, which lets UCX
# use shared memory on one host (the default "peer" mode goes through tcp on loopback).
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "nixl-shm": ("nixl", {"ucx_params": {"ucx_error_handling_mode": "none"}}),
}


def backend_seconds(name: str, nbytes: int, desc: int, repeats: int, scatter: bool) -> float:
    engine, opts = VARIANTS.get(name, (name, {}))
    a = create_backend(engine, agent_name=f"bench-a-{name}", **opts)
    b = create_backend(engine, agent_name=f"bench-b-{name}", **opts)
    try:
        src, dst = a.allocate("src", nbytes), b.allocate("dst", nbytes)
        src.array[:] = 7
        a.register([src.region()])
        b.register([dst.region()])
        peer = a.add_peer(b.local_metadata())
        n = nbytes // desc
        offs = np.arange(n, dtype=np.uint64) * np.uint64(desc)
        dst_offs = np.random.default_rng(0).permutation(offs) if scatter else offs
        table = DescriptorTable(
            offs + np.uint64(src.address),
            dst_offs + np.uint64(dst.address),
            np.full(n, desc, dtype=np.uint64),
            np.zeros(n, dtype=np.uint32),
            np.zeros(n, dtype=np.uint32),
        )
        times = []
        for i in range(repeats + 1):  # the first run warms connections up and is dropped
            t0 = time.perf_counter()
            h = a.post(peer, table, f"r{i}".encode())
            st = a.wait(h, 120)
            assert st.state.value == "DONE", st
            while not b.receive_notifications():
                time.sleep(1e-5)
            times.append(time.perf_counter() - t0)
            a.release(h)
        assert np.array_equal(src.array[:desc], dst.array[int(dst_offs[0]) : int(dst_offs[0]) + desc])
        return statistics.median(times[1:])
    finally:
        a.close()
        b.close()


Case = Callable[[str, int], Row]


def large(name: str, repeats: int) -> Row:
    nbytes, desc = 64 * MiB, 2 * MiB
    return Row(
        name, "64 MiB in 2 MiB descs", nbytes, nbytes // desc,
        backend_seconds(name, nbytes, desc, repeats, False), memcpy_seconds(nbytes, repeats),
    )  # fmt: skip


def small(name: str, repeats: int) -> Row:
    nbytes, desc = 16 * MiB, 4096
    return Row(
        name, "4 KiB descs, scattered", nbytes, nbytes // desc,
        backend_seconds(name, nbytes, desc, repeats, True), memcpy_seconds(nbytes, repeats),
    )  # fmt: skip


CASES: list[Case] = [large, small]


def machine() -> str:
    model = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.release()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", default="local,nixl,nixl-shm,mooncake")
    args = ap.parse_args()
    names = [n for n in args.backends.split(",") if n]
    missing = [n for n in names if VARIANTS.get(n, (n,))[0] not in available_backends()]
    if missing:
        raise SystemExit(f"backends not available here: {missing}")
    print(f"machine: {machine()}")
    print(f"repeats: {args.repeats} (medians)\n")
    rows = [case(n, args.repeats) for n in names for case in CASES]
    table = [HEADER, *[r.cells() for r in rows]]
    print("| " + " | ".join(table[0]) + " |")
    print("|" + "|".join("---" for _ in HEADER) + "|")
    for cells in table[1:]:
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
