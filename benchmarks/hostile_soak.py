"""Soak a real prefill rank with hostile connections and messages; report its RSS over time.

    .venv/bin/python benchmarks/hostile_soak.py [--connections 10000] [--messages 100000]

The prefill rank (a PrefillWorker on the local backend with the demo model's caches) runs in its
own process; this one opens ``--connections`` sockets to it, ``--batch`` at a time, sends
``--messages`` hostile messages over them in all and closes them, reading the rank's RSS from
``/proc/PID/status`` every ``--sample`` connections. Run ``auth``: the default CURVE control plane
(half the attackers plaintext, half an unknown key: every handshake refused); run ``insecure``:
every message reaches the connection machines, whose connection table (``MAX_CONNECTIONS``) and
failure log (``FAILURE_LOG_LIMIT``) fill, then evict (docs/hostile-peers.md has the whole attack).

Flat means: RSS at the end within ``--tolerance-mib`` of RSS at the first sample after the
table filled (the first half of the run for ``auth``). Exit status 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

from _common import arguments, load, machine

from pdwire.demo.model import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ModelSpec(layers=2, kv_heads=4, head_dim=16, page_size=4, conv_blocks=(8, 8, 16), ssm_heads=4)


def demo_caches(backend: Any, pages: int, slots: int, swa_pages: int, aux_items: int) -> Any:
    """The demo model's caches of a TP-1 rank, in memory from ``backend``."""
    from pdwire.demo.model import Capacity, build_caches, bytes_needed

    cap = Capacity(pages=pages, slots=slots, swa_pages=swa_pages, aux_items=aux_items)
    return build_caches(SPEC, 1, 0, cap, backend.allocate("caches", bytes_needed(SPEC, 1, 0, cap)).array)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


# --------------------------------------------------------------------------- the prefill rank


def serve(mode: str) -> int:
    """The child: one prefill rank; prints its endpoint (and public key), steps until stdin closes;
    a line on stdin asks for its stats (printed as JSON)."""
    import select

    from pdwire.demo.rank import model_fingerprint
    from pdwire.runtime.backends.local import LocalBackend
    from pdwire.runtime.control_auth import ControlAuth
    from pdwire.runtime.engine import ParallelRank, PrefillConfig, PrefillWorker

    backend = LocalBackend(agent_name=f"soak-prefill-{os.getpid()}")
    caches = demo_caches(backend, pages=64, slots=8, swa_pages=16, aux_items=8)
    auth = ControlAuth.generate() if mode == "auth" else None
    kw: dict[str, Any] = {"control_auth": auth} if auth else {"insecure_control": True}
    cfg = PrefillConfig(engine_id="soak", rank=ParallelRank(1, 0), model=model_fingerprint(SPEC), **kw)
    with PrefillWorker(cfg, caches.memory, backend=backend) as pre:
        key = auth.public_key.decode() if auth else ""
        print(json.dumps({"endpoint": pre.endpoint, "key": key}), flush=True)
        while True:
            pre.step(10)
            if select.select([sys.stdin], [], [], 0)[0]:
                if not sys.stdin.readline():
                    break
                s = pre.stats
                stats = {
                    k: getattr(s, k) for k in ("messages_in", "handshakes_refused", "connections_evicted")
                }
                stats |= {"connections": len(pre._conns), "failures_kept": len(s.failures)}
                print(json.dumps(stats | {"failures_total": s.failures.total}), flush=True)
    backend.close()
    return 0


# --------------------------------------------------------------------------- the attack


def hostile_messages(
    rng: random.Random, hello: list[bytes], register: list[bytes], request: list[bytes]
) -> list[list[bytes]]:
    """A mix of what a hostile peer sends (each a list of frames), in the order one connection
    sends them: a Hello first, so the registration and the request reach the connection machine."""
    envelope = hello[0]
    return [
        hello,
        [rng.randbytes(rng.randrange(1, 512))],
        [envelope, rng.randbytes(rng.randrange(1, 2048))],
        register,
        request,
        [rng.randbytes(8), rng.randbytes(8), rng.randbytes(rng.randrange(1, 64))],
    ]


def bad_registration(agent_name: str) -> Any:
    """A well-formed RegisterInfo of a TP-1 decode rank of ``spec`` whose backend metadata is
    garbage: the rank must refuse it (a typed peer failure) and keep serving."""
    from pdwire.runtime.backends.local import LocalBackend
    from pdwire.runtime.session.registration import register_info

    backend = LocalBackend(agent_name=agent_name)
    try:
        caches = demo_caches(backend, pages=8, slots=2, swa_pages=4, aux_items=2)
        return register_info(
            caches.memory, endpoint="tcp://127.0.0.1:1", engine_id="evil", agent_name=agent_name,
            agent_metadata=random.Random(3).randbytes(200),
        )  # fmt: skip
    finally:
        backend.close()


def attack(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    import zmq

    from pdwire import wire
    from pdwire.demo.rank import model_fingerprint
    from pdwire.runtime.config import ParallelRank
    from pdwire.runtime.session.hello import Identity

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", mode], stdin=PIPE, stdout=PIPE, text=True, env=env
    )
    assert child.stdout is not None and child.stdin is not None
    info = json.loads(child.stdout.readline())
    endpoint = info["endpoint"]
    hello_msg = Identity(wire.Role.DECODE, "evil", ParallelRank(1, 0), model_fingerprint(SPEC), ()).hello()

    def frames(msg: Any) -> list[bytes]:
        return [bytes(f) for f in wire.encode(msg, wire.NEWEST)]

    bad_request = wire.TransferRequest(
        room=5, sender="evil", dst_kv_indices=[1, 2, 3], dst_aux_index=0, required_dst_info_num=1,
        decode_prefix_len=0, is_dummy=False, state_indices=[],
    )  # fmt: skip
    hello, request, register = frames(hello_msg), frames(bad_request), frames(bad_registration("evil"))
    rng = random.Random(7)
    ctx = zmq.Context()
    per_conn = max(1, args.messages // args.connections)
    samples: list[tuple[int, int, int]] = []  # (connections, messages, rss KiB)
    sent = opened = 0
    t0 = time.perf_counter()
    while opened < args.connections:
        socks = []
        for _ in range(min(args.batch, args.connections - opened)):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            if mode == "auth" and opened % 2:  # a key the rank does not know (ZAP refuses it)
                pub, sec = zmq.curve_keypair()
                s.setsockopt(zmq.CURVE_SERVERKEY, info["key"].encode())
                s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
                s.setsockopt(zmq.CURVE_SECRETKEY, sec)
            s.connect(endpoint)
            socks.append(s)
            opened += 1
        msgs = hostile_messages(rng, hello, register, request)
        for s in socks:
            for i in range(per_conn):
                # a socket whose handshake was refused already has no pipe to queue on
                with contextlib.suppress(zmq.Again):
                    s.send_multipart(msgs[i % len(msgs)], zmq.NOBLOCK, copy=False)
                sent += 1
        # paced: the rank reads every message (or refuses every handshake) before the next batch,
        # so what is measured is what it keeps, not a backlog queued in libzmq
        # (a refused CURVE client may be refused before the server saw a second one: refusals
        # are waited for briefly)
        end = time.monotonic() + (60 if mode == "insecure" else 2)
        while time.monotonic() < end:
            st = ask(child)
            if st["messages_in"] >= sent if mode == "insecure" else st["handshakes_refused"] >= opened:
                break
            time.sleep(0.01)
        for s in socks:
            s.close(0)
        if opened % args.sample == 0 or opened == args.connections:
            samples.append((opened, sent, rss_kib(child.pid)))
            rss = samples[-1][2] / 1024
            print(f"  {mode}: {opened:6d} connections, {sent:7d} messages, rank RSS {rss:.1f} MiB")
    elapsed = time.perf_counter() - t0
    time.sleep(1.0)
    final_rss = rss_kib(child.pid)
    stats = ask(child)
    child.stdin.close()
    child.wait(30)
    ctx.term()
    return {"samples": samples, "final_rss_kib": final_rss, "stats": stats, "elapsed_s": elapsed}


def ask(child: subprocess.Popen[str]) -> dict[str, Any]:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("stats\n")
    child.stdin.flush()
    return dict(json.loads(child.stdout.readline()))


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=100, help="sockets open at once")
    ap.add_argument(
        "--sample", type=int, default=1000, help="read the rank's RSS every this many connections"
    )
    ap.add_argument("--tolerance-mib", dest="tolerance_mib", type=float, default=8.0)
    ap.add_argument("--modes", default="auth,insecure")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    print(machine(load()))
    ok = True
    from pdwire.runtime.workers.failure_log import FAILURE_LOG_LIMIT
    from pdwire.runtime.workers.prefill import MAX_CONNECTIONS

    for mode in args.modes.split(","):
        r = attack(args, mode)
        samples = r["samples"]
        # the baseline: the first sample after the connection table can be full (insecure), or
        # the first sample at all (auth: nothing reaches the table)
        full_at = MAX_CONNECTIONS + args.batch if mode == "insecure" else 0
        base = next((s for s in samples if s[0] >= full_at), samples[-1])
        growth = (r["final_rss_kib"] - base[2]) / 1024
        flat = growth <= args.tolerance_mib
        ok = ok and flat
        print(
            f"{mode}: {samples[-1][0]} connections, {samples[-1][1]} messages in {r['elapsed_s']:.0f}s; "
            f"RSS {samples[0][2] / 1024:.1f} MiB at {samples[0][0]} connections, {base[2] / 1024:.1f} MiB at "
            f"{base[0]}, {r['final_rss_kib'] / 1024:.1f} MiB at the end: {growth:+.1f} MiB "
            f"({'flat' if flat else 'GROWING'}, tolerance {args.tolerance_mib} MiB)"
        )
        limits = f"{MAX_CONNECTIONS} connections, {FAILURE_LOG_LIMIT} failures"
        print(f"  rank stats: {r['stats']} (limits: {limits})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
