"""Running ``pdwire demo`` once its arguments passed :func:`.cli.validate`.

The report is text on stdout (or one JSON object with ``--json``), failures on stderr; the
progress bar is drawn only when stderr is a terminal. Ctrl-C (SIGINT) stops the demo cleanly: the
rank processes ignore SIGINT, and the parent asks each to stop (closing its worker and backend,
which removes its shared-memory files), waits for them, kills any that do not answer, and removes
what a killed rank left in /dev/shm; exit status 130. A second Ctrl-C skips the wait.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np

from pdwire.demo.cli import EXIT_INTERRUPTED, EXIT_NOT_RUN, EXIT_OK, EXIT_VERIFY_FAILED
from pdwire.demo.cluster import Cluster, ClusterError, RoomResult, busy_seconds
from pdwire.demo.spec import ModelSpec, capacity_for


class _Progress:
    """``[####....] done/total`` on stderr, redrawn on progress, only on a terminal."""

    def __init__(self, total: int, t0: float) -> None:
        self.total, self.t0, self.last = total, t0, -1
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        if not self.enabled or done == self.last:
            return
        self.last = done
        width = 30
        filled = width * done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r  [{bar}] {done}/{self.total} requests  {time.perf_counter() - self.t0:5.1f}s")
        sys.stderr.flush()

    def end(self) -> None:
        if self.enabled and self.last >= 0:
            sys.stderr.write("\n")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def _say(args: argparse.Namespace, line: str) -> None:
    if not args.json:
        print(line, flush=True)


def _model_line(spec: ModelSpec) -> str:
    if spec.mla:
        # MLA has one latent per token: --heads and --head-dim do not shape it
        return (
            f"MLA (latent KV {spec.latent_dim} + SWA + DSA indexer), {spec.layers} layers, "
            f"page {spec.page_size}"
        )
    return (
        f"GQA KV + Mamba (conv q|k|v, temporal) + SWA, {spec.layers} layers, "
        f"{spec.kv_heads} KV heads x {spec.head_dim}, page {spec.page_size}"
    )


def run_demo(args: argparse.Namespace, backend: str, spec: ModelSpec) -> int:
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_tokens, args.max_tokens + 1, size=args.requests).tolist()
    cap = capacity_for(spec, lengths)
    _say(args, f"pdwire demo: prefill TP {args.prefill_tp} -> decode TP {args.decode_tp}, backend {backend}")
    _say(args, f"  model: {_model_line(spec)}")
    _say(args, f"  machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    t_start = time.perf_counter()
    # closed in `finally`; on Ctrl-C its ranks are first stopped cleanly
    c = Cluster(spec, cap, backend, seed=args.seed, room_timeout_s=args.timeout, chunk_pages=args.chunk_pages)
    progress = _Progress(args.requests, t_start)
    try:
        pre = c.start("prefill", args.prefill_tp, "prefill-0")
        dec = c.start("decode", args.decode_tp, "decode-0")
        errors = [e for e in c.connect(dec, pre) if e]
        if errors:
            print(f"pdwire demo: handshake refused: {errors[0]}", file=sys.stderr)
            return EXIT_NOT_RUN
        t_setup = time.perf_counter() - t_start
        _say(args, f"  {args.prefill_tp + args.decode_tp} rank processes up and handshaken in {t_setup:.1f}s")
        t0 = time.perf_counter()
        progress.t0 = t0
        rooms = [c.submit(dec, pre, room, n) for room, n in enumerate(lengths, start=1)]
        results = c.wait_rooms(rooms, args.timeout + 60, progress=progress)
        wall = time.perf_counter() - t0
        progress.end()
        spans = c.data_spans(pre, [r.room for r in results]) if all(r.ok for r in results) else []
        dec_final = c.stop(dec)
        pre_final = c.stop(pre)
    except KeyboardInterrupt:
        progress.end()
        return _interrupted(c)
    except ClusterError as exc:
        progress.end()
        print(f"pdwire demo: {exc}", file=sys.stderr)
        return EXIT_NOT_RUN
    finally:
        c.close()
    report = _report(args, backend, spec, results, dec_final, pre_final, wall, lengths, spans)
    if args.json:
        print(json.dumps(report, indent=2))
    return EXIT_OK if report["result"] == "OK" else EXIT_VERIFY_FAILED


def _interrupted(cluster: Cluster) -> int:
    """Ctrl-C: stop every rank (a second Ctrl-C: kill them), remove what they left in /dev/shm."""
    print("\npdwire demo: interrupted; stopping every rank (Ctrl-C again: at once)", file=sys.stderr)
    try:
        ranks = cluster.shutdown(timeout_s=20.0)
    except KeyboardInterrupt:
        ranks = cluster.shutdown(timeout_s=0.0)
    left = cluster.leftover_shm()
    tail = f"; {len(left)} shared-memory files could not be removed: {left[:3]}" if left else ""
    print(f"pdwire demo: stopped {ranks} rank processes, their shared memory removed{tail}", file=sys.stderr)
    return EXIT_INTERRUPTED


def _report(
    args: argparse.Namespace,
    backend: str,
    spec: ModelSpec,
    results: list[RoomResult],
    dec_final: dict[int, tuple[dict[str, Any], list[str]]],
    pre_final: dict[int, tuple[dict[str, Any], list[str]]],
    wall: float,
    lengths: list[int],
    spans: list[tuple[float, float]],
) -> dict[str, Any]:
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
    requests_sent = sum(s["requests_sent"] for s in dstats)
    outside = None
    if spans:
        # From the first request sent to the last room verified, the time during which no
        # transfer was in flight: control messages, but also chunked prefill's fill and decode's
        # verification, which this demo runs in the same processes. The protocol's own cost
        # per request, without them, is what benchmarks/control_plane.py measures.
        window = (min(r.submitted for r in results), max(r.finished for r in results))
        outside = (window[1] - window[0] - busy_seconds(spans, window)) / n
    ok = not failed and not untouched
    report: dict[str, Any] = {
        "result": "OK" if ok else "FAILED",
        "backend": backend,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "model": {
            "mla": spec.mla,
            "layers": spec.layers,
            "page_size": spec.page_size,
            **(
                {"latent_dim": spec.latent_dim}
                if spec.mla
                else {"kv_heads": spec.kv_heads, "head_dim": spec.head_dim}
            ),
        },
        "requests": n,
        "prompt_tokens": sum(lengths),
        "tokens_per_request": [min(lengths), max(lengths)],
        "verified": n - len(failed),
        "failed": [
            {"room": r.room, "reason": r.reason or "; ".join(r.problems[:3]) or "not finished"}
            for r in failed
        ],
        "stray_writes": untouched,
        "bytes_moved": moved,
        "descriptors": descs,
        "engine_writes": posts,
        "control_completions": ctl_notes,
        "seconds": round(wall, 3),
        "mib_per_s": round(moved / wall / 2**20, 1) if wall > 0 else None,
        "latency_ms": {"p50": round(statistics.median(lat), 2), "p99": round(_pct(lat, 99), 2)}
        if lat
        else None,
        "control_messages": ctl_msgs,
        "transfer_requests": requests_sent,
        "ms_outside_data_movement": round(outside * 1e3, 3) if outside is not None else None,
    }
    if args.json:
        return report
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
    lines.append(
        f"control plane: {ctl_msgs} prefill-side messages ({ctl_msgs / max(n, 1):.1f} per request, "
        f"handshakes included), {requests_sent} TransferRequests"
    )
    if outside is not None:
        lines.append(
            f"time outside data movement: {outside * 1e3:.2f} ms per request amortised "
            "(control plane plus fill and verify; the protocol alone: benchmarks/control_plane.py)"
        )
    for line in lines:
        print("  " + line)
    for f in report["failed"][:10]:
        print(f"  FAILED room {f['room']}: {f['reason']}", file=sys.stderr)
    for p in untouched[:10]:
        print(f"  STRAY WRITE {p}", file=sys.stderr)
    print("  result: OK" if ok else "  result: FAILED")
    return report
