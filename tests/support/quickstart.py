"""Running a doc's quick start as written: its shell blocks, the environment without the suite's
``PDWIRE_*`` variables, and a probe of a rank's control socket (CURVE on the generated keys)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import zmq
import zmq.utils.monitor

from pdwire.runtime.control_auth import ControlAuth

ROOT = Path(__file__).resolve().parents[2]
KEYS = Path(".pdwire") / "keys"  # where the quick starts put the keys, under HOME


def doc_blocks(text: str, section: str) -> list[str]:
    """The fenced ``bash`` blocks of ``section`` (a heading line, up to the next ``## `` heading)."""
    start = text.index(section + "\n")
    end = text.find("\n## ", start + len(section))
    body = text[start : end if end >= 0 else len(text)]
    return re.findall(r"```bash\n(.*?)```", body, flags=re.S)


def commands(block: str) -> list[str]:
    """The block's commands, one string each (backslash continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", "", block)
    lines = (line.strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def environment(home: Path) -> dict[str, str]:
    """This process's environment less every ``PDWIRE_*`` variable (the suite sets
    ``PDWIRE_INSECURE_CONTROL=1``), ``HOME`` at ``home``, this venv's tools first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDWIRE_")}
    env["HOME"] = str(home)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_bash(script: str, env: dict[str, str], timeout_s: float = 120.0) -> str:
    """``script`` in ``bash -e``; its stdout (a failing command fails the test with its output)."""
    out = subprocess.run(
        ["bash", "-ec", script], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert out.returncode == 0, (script, out.stdout, out.stderr)
    return out.stdout


def handshake(endpoint: str, auth: ControlAuth | None, timeout_ms: int = 30_000) -> int:
    """The first handshake event (``zmq.EVENT_HANDSHAKE_*``) a DEALER connecting to ``endpoint``
    sees: plain ZMTP with ``auth`` None, else CURVE with its keys; 0 if none came."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if auth is not None:
        assert auth.server_key is not None
        sock.setsockopt(zmq.CURVE_SERVERKEY, auth.server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, auth.secret_key)
    events = (
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    monitor = sock.get_monitor_socket(events)
    try:
        sock.connect(endpoint)
        if not monitor.poll(timeout_ms):
            return 0
        return int(zmq.utils.monitor.recv_monitor_message(monitor)["event"])
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
        ctx.term()


def assert_curve_on(endpoint: str, keys: ControlAuth) -> None:
    """``endpoint`` serves CURVE on ``keys`` only: a plain peer and a key it never gave out are
    refused, a peer holding the deployment's keys completes the handshake."""
    assert handshake(endpoint, None) == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    assert handshake(endpoint, keys) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    public, secret = zmq.curve_keypair()
    stranger = ControlAuth(public, secret, server_key=keys.server_key)
    assert handshake(endpoint, stranger) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
