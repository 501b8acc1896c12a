"""``pdwire serve`` processes for tests: start them (on a namespace host, or here), read their
logs, talk to a decode server's admin socket.

    p = start_serve(workdir, "prefill", "--engine-id", "p", "--tp", "2", host=net.a, ...)
    d = start_serve(workdir, "decode", ..., admin=True)
    wait_log(d, "connected to prefill p", 60)
    result = d.admin({"cmd": "run", "requests": 8})       # {"ok": 8, "failed": [], ...}
    p.proc.terminate()                                     # SIGTERM: a clean stop, exit status 0

Every process runs ``python -m pdwire serve`` with the small model of :data:`SMALL_MODEL`
(unless the caller gives memory flags), its output in a log file of the workdir.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdwire.serve.admin import admin_call
from tests.support.netns import Host, Proc

ROOT = Path(__file__).resolve().parents[2]
# small on purpose: every byte is generated, moved and verified on a 2-core machine
SMALL_MODEL = ("--layers", "2", "--heads", "4", "--head-dim", "16", "--page-size", "4")


@dataclass
class Served:
    proc: Proc
    admin_path: str | None = None

    def admin(self, command: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        assert self.admin_path is not None, "started without admin=True"
        return admin_call(self.admin_path, command, timeout_s)

    def log(self) -> str:
        return self.proc.log()


def start_serve(
    workdir: Path,
    role: str,
    *args: str,
    host: Host | None = None,
    admin: bool = False,
    env: dict[str, str] | None = None,
    name: str | None = None,
) -> Served:
    name = name or role
    argv = [sys.executable, "-m", "pdwire", "serve", role, *SMALL_MODEL, *args]
    admin_path = None
    if admin:
        admin_path = str(workdir / f"{name}-{os.getpid()}-{time.monotonic_ns()}.sock")
        argv += ["--admin", admin_path]
    if host is not None:
        proc = host.popen(argv, name=name, env=env or host.env(), cwd=ROOT)
    else:
        log_path = workdir / f"{name}-{time.monotonic_ns()}.log"
        with open(log_path, "wb") as log:
            p = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env or dict(os.environ),
                cwd=ROOT,
                start_new_session=True,
            )
        proc = Proc(name, p, log_path)
    return Served(proc, admin_path)


def wait_log(s: Served, text: str, timeout_s: float, *, after: int = 0) -> int:
    """Wait until ``text`` appears in the log (past offset ``after``); its offset. Fails with the log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = s.log()
        at = log.find(text, after)
        if at >= 0:
            return at
        if not s.proc.alive():
            break
        time.sleep(0.1)
    raise AssertionError(
        f"{s.proc.name}: no {text!r} within {timeout_s}s (alive: {s.proc.alive()}):\n{s.log()[-4000:]}"
    )


def wait_routable(d: Served, engine: str, timeout_s: float, routable: bool = True) -> dict[str, Any]:
    """Poll the decode server's status until prefill ``engine`` is (or is no longer) routable."""
    deadline = time.monotonic() + timeout_s
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = d.admin({"cmd": "status"}, 30)
        g = status["groups"].get(engine)
        if bool(g and g["routable"]) == routable:
            return status
        time.sleep(0.2)
    raise AssertionError(
        f"prefill {engine} routable={not routable} after {timeout_s}s: {status}\n{d.log()[-3000:]}"
    )
