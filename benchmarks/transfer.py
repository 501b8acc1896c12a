"""Data-movement throughput of each transfer backend against plain memcpy, same run.

    .venv/bin/python benchmarks/transfer.py [--repeats 5] [--backends local,nixl,mooncake]

Each case posts one DescriptorTable between two agents of one backend (initiator ->
target, the target's memory pre-faulted), waits for DONE and for the target's
notification, and times post-to-notification; after each transfer one ``np.copyto`` of
the same number of bytes between two pre-faulted buffers is timed too (the baseline,
interleaved so both see the same load). Both agents live in this process; the
backends named by ``--two-process`` are measured a second time with the target in a
spawned process (rows "(2 procs)"), which is how the runtime uses them; there the
target reports each notification back over a pipe. Every case checks all bytes.
Reported: medians over ``--repeats`` runs, GB/s, ratio to memcpy, descriptors per second.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any

import numpy as np
import numpy.typing as npt
from _common import arguments, head, load, machine, rows_table, single_host, table_row

from pdwire.runtime.backends import Backend, available_backends, create_backend
from pdwire.runtime.descriptors import DescriptorTable

MiB = 1 << 20


HEADER = ("backend", "case", "bytes", "descs", "median ms", "GB/s", "vs memcpy", "descs/s")
# each case: its name, bytes, descriptor size, destinations scattered
CASES = (
    ("64 MiB in 2 MiB descs", 64 * MiB, 2 * MiB, False),
    ("4 KiB descs, scattered", 16 * MiB, 4096, True),
)


# Engine options per row name: "nixl-shm" is NIXL with UCX error handling off, which lets UCX
# use shared memory on one host (the default "peer" mode goes through tcp on loopback).
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "nixl-shm": ("nixl", {"ucx_params": {"ucx_error_handling_mode": "none"}}),
}


def _fill(arr: npt.NDArray[np.uint8]) -> None:
    arr[:] = (np.arange(arr.size, dtype=np.uint32) % 251).astype(np.uint8)


def _verify(src: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8], table: DescriptorTable) -> None:
    desc = int(table.length[0])
    s = (table.src_addr - table.src_addr.min()) // np.uint64(desc)
    d = (table.dst_addr - table.dst_addr.min()) // np.uint64(desc)
    rows_src, rows_dst = src.reshape(-1, desc), dst.reshape(-1, desc)
    assert np.array_equal(rows_src[s.astype(np.int64)], rows_dst[d.astype(np.int64)]), "bytes differ"


def _open_target(engine: str, opts: dict[str, object], name: str, nbytes: int) -> tuple[Backend, Any]:
    """The target agent and its registered destination buffer."""
    b = create_backend(engine, agent_name=f"bench-b-{name}", **opts)
    dst = b.allocate("dst", nbytes)
    b.register([dst.region()])
    return b, dst


def _target(conn: Connection, engine: str, opts: dict[str, object], name: str, nbytes: int) -> None:
    """The target agent in its own process: registers, then reports every notification."""
    b, dst = _open_target(engine, opts, name, nbytes)
    try:
        conn.send((b.local_metadata(), dst.address))
        while True:
            got = b.receive_notifications()
            if got:
                conn.send([n.payload for n in got])
            elif conn.poll(0):
                if conn.recv() == "stop":
                    conn.send(bytes(dst.array))
                    return
            else:
                time.sleep(1e-5)
    finally:
        b.close()


def _recv(conn: Connection, child: SpawnProcess, timeout_s: float = 120.0) -> Any:
    if not conn.poll(timeout_s):
        raise SystemExit(f"target process silent for {timeout_s}s (exit code {child.exitcode})")
    return conn.recv()


def backend_seconds(
    name: str, nbytes: int, desc: int, repeats: int, scatter: bool, procs: int
) -> tuple[float, float]:
    """Median post-to-notification seconds and median memcpy seconds of the same bytes, the
    two timed alternately (one copy right after each transfer) so that both see the same
    load on a shared machine. ``procs`` 2 puts the target agent in its own process."""
    engine, opts = VARIANTS.get(name, (name, {}))
    a = create_backend(engine, agent_name=f"bench-a-{name}", **opts)
    b: Backend | None = None
    child: SpawnProcess | None = None
    conn: Connection | None = None
    try:
        if procs == 1:
            b, dst = _open_target(engine, opts, name, nbytes)
            md, dst_base = b.local_metadata(), dst.address
        else:
            ctx = mp.get_context("spawn")
            conn, theirs = ctx.Pipe()
            child = ctx.Process(target=_target, args=(theirs, engine, opts, name, nbytes), daemon=True)
            child.start()
            md, dst_base = _recv(conn, child)
        src = a.allocate("src", nbytes)
        _fill(src.array)
        a.register([src.region()])
        peer = a.add_peer(md)
        table = rows_table(src.address, dst_base, nbytes // desc, desc, (desc, desc), scatter)
        times, copies = [], []
        one, other = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)  # pre-faulted: ones written
        for i in range(repeats + 1):  # the first run warms connections up and is dropped
            t0 = time.perf_counter()
            h = a.post(peer, table, f"r{i}".encode())
            st = a.wait(h, 120)
            assert st.state.value == "DONE", st
            if b is not None:
                while not b.receive_notifications():
                    time.sleep(1e-5)
            else:
                assert conn is not None and child is not None
                assert _recv(conn, child) == [f"r{i}".encode()]
            times.append(time.perf_counter() - t0)
            a.release(h)
            t0 = time.perf_counter()  # the baseline: np.copyto of the same bytes
            np.copyto(other, one)
            copies.append(time.perf_counter() - t0)
        if b is not None:
            _verify(src.array, dst.array, table)
        else:
            assert conn is not None and child is not None
            conn.send("stop")
            _verify(src.array, np.frombuffer(_recv(conn, child), dtype=np.uint8), table)
        return statistics.median(times[1:]), statistics.median(copies[1:])
    finally:
        a.close()
        if b is not None:
            b.close()
        if child is not None:
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()


def main() -> None:
    ap = arguments(__doc__, backends="local,nixl,nixl-shm,mooncake")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--two-process",
        default="nixl,nixl-shm",
        help="backends also measured with the target agent in a second process ('' for none)",
    )
    args = ap.parse_args()
    single_host()
    names = [n for n in args.backends.split(",") if n]
    two = [n for n in args.two_process.split(",") if n in names]
    missing = [n for n in names if VARIANTS.get(n, (n,))[0] not in available_backends()]
    if missing:
        raise SystemExit(f"backends not available here: {missing}")
    print(machine(load()))
    print(f"repeats: {args.repeats} (medians)\n")
    print(head(*HEADER))
    for name in names:
        for procs, (case, nbytes, desc, scatter) in itertools.product((1, 2) if name in two else (1,), CASES):
            seconds, memcpy = backend_seconds(name, nbytes, desc, args.repeats, scatter, procs)
            label, n = (name if procs == 1 else f"{name} (2 procs)"), nbytes // desc
            gbs, per_s = f"{nbytes / seconds / 1e9:.2f}", f"{n / seconds:,.0f}"
            mib, ms, ratio = f"{nbytes / MiB:.0f} MiB", f"{seconds * 1e3:.2f}", f"{memcpy / seconds:.2f}x"
            print(table_row([label, case, mib, n, ms, gbs, ratio, per_s]), flush=True)


if __name__ == "__main__":
    main()
