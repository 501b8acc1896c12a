"""Per-request control-plane overhead over real sockets and processes.

    .venv/bin/python benchmarks/control_plane.py [--backends nixl,local] [--rounds 3]

One prefill rank and one decode rank (separate processes, TP 1 -> 1) of a tiny hybrid model
(one page of KV per request plus Mamba, SWA and aux: a few KiB), so that the data moved is
small and the time is dominated by the protocol. Prefill runs its chunks first, so each
measured request starts with a room that only waits for its TransferRequest.

Per request (decode's clock; prefill and decode share CLOCK_MONOTONIC on one host):

* latency: TransferRequest sent -> room Success on decode (every kv/state/aux completion counted);
* data:    prefill's first post -> last transfer completion for that room (engine time);
* overhead = latency - data: control messages, planning, posting, notification delivery.

At 64 concurrent requests the amortised figure is (batch wall - union of data spans) / 64,
where batch wall runs from the first TransferRequest to the last Success; wall/request is the
batch wall / 64 itself (no split into data and control, so it compares builds whose posts differ).

Baselines measured in the same run: a raw pyzmq DEALER/ROUTER round trip between two
processes carrying the same encoded TransferRequest and TransferStatus frames (the floor of
any socket protocol here), and the in-process encode+decode time of those messages.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from _common import (
    arguments,
    head,
    interleaved_us,
    load,
    machine,
    median_s,
    reference_loop,
    reference_text,
    single_host,
    table_row,
)


def _echo(conn: Connection) -> None:
    """ROUTER that answers every TransferRequest with a TransferStatus (the raw-socket baseline)."""
    import zmq

    from pdwire import wire

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    reply = wire.encode(wire.TransferStatus(room=1, status=wire.Status.SUCCESS, sender_rank=0))
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"stop":
            break
        wire.decode(frames[1:])
        sock.send_multipart([frames[0], *reply])
    sock.close(0)
    ctx.term()


def _request() -> Any:
    from pdwire import wire

    return wire.TransferRequest(
        room=1, sender="decode:bench/0", dst_kv_indices=np.arange(1, dtype=np.int32), dst_aux_index=0,
        state_indices=[np.asarray([1], np.int32), np.asarray([2], np.int32)],
    )  # fmt: skip


def zmq_baseline(n: int = 2000) -> float:
    """Median round trip (us) of an encoded TransferRequest -> TransferStatus between two processes."""
    import zmq

    from pdwire import wire

    ctx_mp = mp.get_context("spawn")
    parent, child = ctx_mp.Pipe()
    proc = ctx_mp.Process(target=_echo, args=(child,), daemon=True)
    proc.start()
    port = parent.recv()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    req = _request()

    def round_trip() -> None:
        sock.send_multipart(wire.encode(req))
        wire.decode(sock.recv_multipart())

    rtt = median_s(round_trip, n, warmup=200)
    sock.send(b"stop")
    proc.join(10)
    sock.close(0)
    ctx.term()
    return rtt * 1e6


def codec_baseline(n: int = 20000) -> float:
    """Median per-request encode+decode time (us) of TransferRequest, TransferStatus and a Notification."""
    from pdwire import wire

    msgs = [
        _request(),
        wire.TransferStatus(room=1, status=wire.Status.SUCCESS, sender_rank=0),
    ]
    note = wire.Notification(room=1, kind=wire.NotificationKind.KV, chunk_id=0, is_last=True)
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            for m in msgs:
                wire.decode([bytes(f) for f in wire.encode(m)])
            wire.decode_bytes(wire.encode_bytes(note))
        samples.append((time.perf_counter() - t) / n)
    return statistics.median(samples) * 1e6


def measure(backend: str, rounds: int) -> dict[int, list[Any]]:
    try:
        from pdwire.demo.cluster import Cluster, busy_seconds
        from pdwire.demo.model import Capacity, ModelSpec
    except ImportError:  # the release build control_plane_ab.py runs: the demo inside the runtime
        from pdwire.runtime.demo_cluster import Cluster, busy_seconds  # type: ignore[no-redef]
        from pdwire.runtime.demo_model import Capacity, ModelSpec  # type: ignore[no-redef]

    spec = ModelSpec(layers=1, kv_heads=2, head_dim=16, page_size=16, mamba_layers=1, conv_blocks=(4, 4, 8),
                     ssm_heads=2, ssm_head_dim=4, ssm_state=4, swa_layers=1, swa_window_pages=1)  # fmt: skip
    cap = Capacity(pages=256, slots=140, swa_pages=256, aux_items=140)
    out: dict[int, list[Any]] = {}  # per concurrency: requests, then the table's columns in seconds
    with Cluster(spec, cap, backend, room_timeout_s=60.0, chunk_pages=1) as c:
        pre = c.start("prefill", 1, "bench-pre")
        dec = c.start("decode", 1, "bench-dec")
        assert c.connect(dec, pre) == [""]
        room = 1
        for conc in (1, 64):
            per_req, data, overhead, amortised, wall_per_request = [], [], [], [], []  # seconds
            for _ in range(rounds):
                batch = 30 if conc == 1 else conc
                rooms = list(range(room, room + batch))
                room += batch
                for r in rooms:
                    c.prefill(pre, r, 16)
                time.sleep(0.5 + 0.01 * batch)  # let prefill fill and buffer its chunks
                results = []
                if conc == 1:
                    for r in rooms:
                        results += c.wait_rooms([c.submit(dec, pre, r, 16, prefill_too=False)], 60)
                else:
                    results = c.wait_rooms([c.submit(dec, pre, r, 16, prefill_too=False) for r in rooms], 120)
                c.data_spans(pre, rooms)
                spans = c.spans[("bench-pre", 0)]
                for res in results:
                    assert res.ok, (res.room, res.reason, res.problems[:2])
                    lat = res.latencies[0]
                    a, b = spans[res.room]
                    per_req.append(lat)
                    data.append(b - a)
                    overhead.append(lat - (b - a))
                if conc > 1:
                    starts = [r.started[0] for r in results]
                    ends = [r.started[0] + r.latencies[0] for r in results]
                    window = (min(starts), max(ends))
                    wall = window[1] - window[0]
                    busy = busy_seconds([spans[r.room] for r in results], window)
                    amortised.append((wall - busy) / len(results))
                    wall_per_request.append(wall / len(results))
            p50, p99 = statistics.median, float(np.percentile(per_req, 99))
            batch_figures = [p50(amortised), p50(wall_per_request)] if amortised else [None, None]
            out[conc] = [len(per_req), p50(per_req), p99, p50(data), p50(overhead), *batch_figures]
        c.stop(dec)
        c.stop(pre)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, backends="nixl,local")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    single_host()
    print(machine(load()))
    ref_start = reference_us()
    zmq_rtt = zmq_baseline()
    codec = codec_baseline()
    rtt = f"p50 {zmq_rtt:.0f} us"
    print(f"baseline: raw pyzmq round trip (TransferRequest -> TransferStatus, 2 processes) {rtt}")
    print(f"baseline: encode+decode of TransferRequest + TransferStatus + Notification: {codec:.1f} us")
    print()
    cols = ("latency p50", "latency p99", "data p50", "overhead p50", "amortised/request", "wall/request")
    print(head("backend", "concurrent", "requests", *cols))
    for backend in args.backends.split(","):
        for conc, (requests, *seconds) in measure(backend, args.rounds).items():
            ms = ["-" if x is None else f"{x * 1e3:.3f} ms" for x in seconds]
            print(table_row([backend, conc, requests, *ms]))
        sys.stdout.flush()
    print()
    print(f"machine speed at start: {ref_start}; at end: {reference_us()}")
    return 0


def reference_us() -> str:
    """The fixed pure-Python loop every benchmark times (``_common.reference_loop``)."""
    return reference_text(interleaved_us({0: reference_loop}, 9, quick=False)[0])


if __name__ == "__main__":
    sys.exit(main())
