"""``pdwire demo --serve``: the demo's scenario in the deployment's shape.

Instead of one parent driving rank processes over pipes, this starts an etcd server on
127.0.0.1, then ``pdwire serve prefill`` and ``pdwire serve decode`` as two independent
processes (the two commands an operator runs, printed as they are run), which find each
other through etcd, run the handshake, and move the requests; the demo only asks the decode
server for a wave over its admin socket, prints the outcome, and stops both with SIGTERM as
a service manager would. Both processes' logs are kept in a temporary directory and shown
when something fails.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdwire.demo.cli import EXIT_NOT_RUN
from pdwire.demo.local_etcd import LocalEtcd
from pdwire.demo.spec import ModelSpec, capacity_for
from pdwire.runtime.control_auth import generate_directory
from pdwire.serve.admin import admin_call


def _show_logs(logs: list[Path], n: int = 30) -> None:
    """The last ``n`` lines of each serve process's log, on stderr."""
    for log in logs:
        try:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            tail = ""
        print(f"--- {log.name}\n{tail}", file=sys.stderr)


def _wait_routable(admin: str, engine: str, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a serve process exited during start-up")
        if os.path.exists(admin):
            try:
                status = admin_call(admin, {"cmd": "status"}, 10)
                if status["groups"].get(engine, {}).get("routable"):
                    return
            except TimeoutError:
                pass
        time.sleep(0.2)
    raise RuntimeError(f"prefill {engine} not connected within {timeout_s}s")


def run_serve_demo(args: argparse.Namespace, backend: str, spec: ModelSpec) -> int:
    cap = capacity_for(spec, [args.max_tokens] * args.requests)
    model = [
        "--layers", str(spec.layers), "--heads", str(spec.kv_heads), "--head-dim", str(spec.head_dim),
        "--page-size", str(spec.page_size), "--pages", str(cap.pages), "--swa-pages", str(cap.swa_pages),
        "--slots", str(cap.slots), "--aux-items", str(cap.aux_items), "--seed", str(args.seed),
        *(["--mla"] if spec.mla else []),
    ]  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="pdwire-demo-serve-"))
    shape = f"prefill TP {args.prefill_tp} -> decode TP {args.decode_tp}, backend {backend}"
    print(f"pdwire demo --serve: {shape}, through pdwire serve processes and etcd")
    try:
        etcd = LocalEtcd(work)
    except FileNotFoundError as exc:
        print(f"pdwire demo --serve: {exc}; ./dev setup installs it", file=sys.stderr)
        return 2
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        etcd.wait_healthy()
        discovery = f"etcd://{etcd.endpoint}/pdwire-demo?ttl=5"
        print(f"  etcd: {etcd.endpoint} (started for this demo; logs in {work})")
        admin = str(work / "decode.sock")
        generate_directory(work / "keys")  # the deployment's CURVE key, as an operator would make it
        print(f"  $ pdwire keys generate {work / 'keys'}")
        common = [
            "--backend", backend, "--discovery", discovery, "--room-timeout", str(args.timeout),
            "--control-keys", str(work / "keys"), *model,
        ]  # fmt: skip
        commands = {
            "prefill": ["pdwire", "serve", "prefill", "--engine-id", "prefill-0",
                        "--tp", str(args.prefill_tp), "--chunk-pages", str(args.chunk_pages), *common],
            "decode": ["pdwire", "serve", "decode", "--engine-id", "decode-0",
                       "--tp", str(args.decode_tp), "--admin", admin, *common],
        }  # fmt: skip
        t_start = time.perf_counter()
        for role, cmd in commands.items():
            print(f"  $ {shlex.join(cmd)}")
            log = work / f"{role}.log"
            logs.append(log)
            with open(log, "wb") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "pdwire", *cmd[1:]], stdout=out, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )  # fmt: skip
        _wait_routable(admin, "prefill-0", procs, 180)
        print(f"  registered in etcd, discovered and handshaken in {time.perf_counter() - t_start:.1f}s")
        t0 = time.perf_counter()
        result: dict[str, Any] = admin_call(
            admin,
            {
                "cmd": "run",
                "requests": args.requests,
                "min_tokens": args.min_tokens,
                "max_tokens": args.max_tokens,
            },
            args.timeout + 120,
        )
        wall = time.perf_counter() - t0
        n, ok = result["requests"], result["ok"]
        print(f"  requests: {n} ({args.min_tokens}-{args.max_tokens} tokens), all concurrent")
        print(f"  verified: {ok}/{n} requests byte for byte on every decode rank, in {wall:.2f}s")
        if result.get("p50_ms") is not None:
            print(f"  request latency (queued -> verified on every rank): p50 {result['p50_ms']:.1f} ms")
        for f in result["failed"][:10]:
            print(f"  FAILED room {f['room']} ({', '.join(f['kinds'])}): {f['reason']}", file=sys.stderr)
        codes = []
        for p in reversed(procs):  # decode first, as an operator drains a deployment
            p.send_signal(signal.SIGTERM)
            codes.append(p.wait(120))
        print(f"  stopped decode and prefill with SIGTERM: exit status {codes[0]}, {codes[1]}")
        good = ok == n and codes == [0, 0]
        print("  result: OK" if good else "  result: FAILED")
        if not good:
            _show_logs(logs)
        return 0 if good else 1
    except (RuntimeError, TimeoutError, OSError, KeyError, subprocess.TimeoutExpired) as exc:
        print(f"\npdwire demo --serve: {exc}", file=sys.stderr)
        _show_logs(logs)
        return EXIT_NOT_RUN  # the demo could not run; 1 is for a request that failed verification
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        etcd.stop()
