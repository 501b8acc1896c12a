"""``pdwire demo``: a prefill group and a decode group as processes, N requests end to end.

Each rank holds a small hybrid model's caches (attention KV, Mamba conv with q|k|v
sub-blocks and temporal state, SWA; or MLA with SWA and DSA indexer) in memory allocated
through the chosen backend. Prefill ranks fill their TP shards of deterministic per-request
tensors; every request goes through the whole protocol (Hello, RegisterInfo, TransferRequest,
chunked KV writes, state and aux on the last chunk, completion accounting); every decode rank
then checks its destination slots byte for byte against shards derived independently from the
full tensors, and at the end that no byte outside a destination slot changed. Exit status 1
on any mismatch or failed request.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
from pdwire.runtime.demo_cluster import Cluster, ClusterError, RoomResult, busy_seconds
from pdwire.runtime.demo_content import pages_for
from pdwire.runtime.demo_model import Capacity, ModelSpec


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo", help="prefill and decode groups as processes; move and verify N requests"
    )
    p.add_argument("--prefill-tp", type=int, default=2)
    p.add_argument("--decode-tp", type=int, default=4)
    from pdwire.runtime.backends.registry import known_backends

    p.add_argument(
        "--backend",
        default=None,
        choices=known_backends(),
        help="transfer engine (default: nixl when it imports, else local)",
    )
    p.add_argument("--requests", type=int, default=24, help="number of concurrent requests")
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="KV heads (divisible by both TP sizes)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-pages", type=int, default=8, help="pages per chunked-prefill chunk")
    p.add_argument("--mla", action="store_true", help="MLA model (latent KV, SWA + DSA indexer state)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0, help="per-room timeout in seconds")
    p.set_defaults(func=run)


_last_bar: list[int] = [-1]


def _bar(done: int, total: int, t0: float) -> None:
    if done == _last_bar[0]:
        return  # redraw only on progress: stderr stays readable when captured
    _last_bar[0] = done
    width = 30
    filled = width * done // max(total, 1)
    bar = "#" * filled + "." * (width - filled)
    sys.stderr.write(f"\r  [{bar}] {done}/{total} requests  {time.perf_counter() - t0:5.1f}s")
    sys.stderr.flush()


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def run(args: argparse.Namespace) -> int:
    from pdwire.runtime.backends import default_backend

    backend = args.backend or default_backend()
    spec = ModelSpec(
        layers=args.layers,
        kv_heads=args.heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        mla=args.mla,
    )
    for tp in (args.prefill_tp, args.decode_tp):
        try:
            spec.check_tp(tp)
        except ValueError as exc:
            print(f"pdwire demo: {exc}", file=sys.stderr)
            return 2
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_tokens, args.max_tokens + 1, size=args.requests).tolist()
    pages = [pages_for(spec, n) for n in lengths]
    cap = Capacity(
        pages=sum(p for p, _ in pages) + 8, slots=args.requests + 2, swa_pages=sum(s for _, s in pages) + 8,
        aux_items=args.requests + 2,
    )  # fmt: skip
    kind = (
        "MLA (latent KV + SWA + DSA indexer)" if spec.mla else "GQA KV + Mamba (conv q|k|v, temporal) + SWA"
    )
    print(f"pdwire demo: prefill TP {args.prefill_tp} -> decode TP {args.decode_tp}, backend {backend}")
    heads = f"{spec.kv_heads} KV heads x {spec.head_dim}"
    print(f"  model: {kind}, {spec.layers} layers, {heads}, page {spec.page_size}")
    print(f"  machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    t_start = time.perf_counter()
    try:
        with Cluster(
            spec, cap, backend, seed=args.seed, room_timeout_s=args.timeout, chunk_pages=args.chunk_pages
        ) as c:
            pre = c.start("prefill", args.prefill_tp, "prefill-0")
            dec = c.start("decode", args.decode_tp, "decode-0")
            errors = [e for e in c.connect(dec, pre) if e]
            if errors:
                print(f"handshake refused: {errors[0]}", file=sys.stderr)
                return 1
            t_setup = time.perf_counter() - t_start
            print(f"  {args.prefill_tp + args.decode_tp} rank processes up and handshaken in {t_setup:.1f}s")
            t0 = time.perf_counter()
            rooms = [c.submit(dec, pre, room, n) for room, n in enumerate(lengths, start=1)]
            results = c.wait_rooms(rooms, args.timeout + 60, progress=lambda d: _bar(d, len(rooms), t0))
            wall = time.perf_counter() - t0
            sys.stderr.write("\n")
            spans = c.data_spans(pre, [r.room for r in results]) if all(r.ok for r in results) else []
            dec_final = c.stop(dec)
            pre_final = c.stop(pre)
    except ClusterError as exc:
        print(f"\npdwire demo: {exc}", file=sys.stderr)
        return 1
    return _report(args, results, dec_final, pre_final, wall, lengths, spans)


def _report(
    args: argparse.Namespace,
    results: list[RoomResult],
    dec_final: dict[int, tuple[dict[str, Any], list[str]]],
    pre_final: dict[int, tuple[dict[str, Any], list[str]]],
    wall: float,
    lengths: list[int],
    spans: list[tuple[float, float]],
) -> int:
    failed = [r for r in results if not r.ok]
    untouched = [p for _, (_, probs) in sorted(dec_final.items()) for p in probs]
    pstats = [s for s, _ in pre_final.values()]
    dstats = [s for s, _ in dec_final.values()]
    moved = sum(s["bytes_posted"] for s in pstats)
    descs = sum(s["descriptors"] for s in pstats)
    posts = sum(s["posts"] for s in pstats)
    ctl_msgs = sum(s["messages_in"] + s["messages_out"] for s in pstats)
    ctl_notes = sum(s["control_notifications"] for s in pstats)
    lat = [(r.finished - r.submitted) * 1e3 for r in results if r.ok]
    n = len(results)
    span = f"{min(lengths)}-{max(lengths)}"
    clean = "clean" if not untouched else f"{len(untouched)} problems"
    lines = [
        f"requests: {n} ({sum(lengths)} prompt tokens, {span} per request), all concurrent",
        f"verified: {n - len(failed)}/{n} requests byte for byte on every decode rank; "
        f"untouched-memory check: {clean}",
        f"moved:    {moved / 2**20:.1f} MiB in {descs} descriptors, {posts} engine writes "
        f"({ctl_notes} empty parts completed over the control socket)",
        f"throughput: {moved / wall / 2**20:.0f} MiB/s over {wall:.2f}s (fill, transfer and verify included)",
    ]
    if lat:
        p50, p99 = statistics.median(lat), _pct(lat, 99)
        lines.append(
            f"request latency (submit -> every decode rank verified): p50 {p50:.1f} ms, p99 {p99:.1f} ms"
        )
    requests_sent = sum(s["requests_sent"] for s in dstats)
    lines.append(
        f"control plane: {ctl_msgs} prefill-side messages ({ctl_msgs / max(n, 1):.1f} per request, "
        f"handshakes included), {requests_sent} TransferRequests"
    )
    if spans:
        # From the first request sent to the last room verified, the time during which no
        # transfer was in flight: control messages, but also chunked prefill's fill and decode's
        # verification, which this demo runs in the same processes. The protocol's own cost
        # per request, without them, is what benchmarks/control_plane.py measures.
        window = (min(r.submitted for r in results), max(r.finished for r in results))
        outside = (window[1] - window[0] - busy_seconds(spans, window)) / n
        lines.append(
            f"time outside data movement: {outside * 1e3:.2f} ms per request amortised "
            "(control plane plus fill and verify; the protocol alone: benchmarks/control_plane.py)"
        )
    for line in lines:
        print("  " + line)
    for r in failed[:10]:
        why = r.reason or "; ".join(r.problems[:3]) or "not finished"
        print(f"  FAILED room {r.room}: {why}", file=sys.stderr)
    for p in untouched[:10]:
        print(f"  STRAY WRITE {p}", file=sys.stderr)
    ok = not failed and not untouched
    print("  result: OK" if ok else "  result: FAILED")
    return 0 if ok else 1
