"""A real etcd server for tests: started on demand, bound to one address, removed afterwards.

    with EtcdServer(tmp_path) as etcd:              # 127.0.0.1, free ports, a fresh data dir
        disc = EtcdDiscovery([etcd.endpoint], prefix="/t1")
        etcd.pause(); ...; etcd.resume()           # SIGSTOP / SIGCONT: a server that hangs
        etcd.stop(); etcd.start()                  # the same ports and data: a restart

Inside a network namespace pass ``netns=`` and an address of that namespace (any port is
free in a fresh namespace); see ``tests/support/netns.py``. Needs the Debian packages
``etcd-server`` and ``etcd-client`` (``./dev setup`` installs them).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from pdwire.demo.local_etcd import etcd_command

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (etcd gets it by number, so a race is possible and rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdServer:
    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        netns: str | None = None,
        name: str = "pdwire-test",
    ) -> None:
        if not os.path.exists(ETCD):
            raise RuntimeError("etcd is not installed: ./dev setup installs etcd-server and etcd-client")
        self.host = host
        self.netns = netns
        self.client_port = client_port or (2379 if netns else free_port(host))
        self.peer_port = peer_port or (2380 if netns else free_port(host))
        self.data_dir = Path(workdir) / f"etcd-{name}-{self.client_port}"
        self.log_path = Path(workdir) / f"etcd-{name}-{self.client_port}.log"
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client listener (what EtcdDiscovery takes)."""
        return f"{self.host}:{self.client_port}"

    def spec(self, prefix: str = "/pdwire", ttl_s: int | None = None) -> str:
        """A discovery spec string for this server (``etcd://host:port/prefix[?ttl=]``)."""
        tail = f"?ttl={ttl_s}" if ttl_s else ""
        return f"etcd://{self.endpoint}{prefix}{tail}"

    def _command(self) -> list[str]:
        cmd = etcd_command(ETCD, self.name, self.data_dir, self.host, self.client_port, self.peer_port)
        return ["ip", "netns", "exec", self.netns, *cmd] if self.netns else cmd

    def start(self, timeout_s: float = 30.0) -> EtcdServer:
        assert self.proc is None, "already running"
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(self._command(), stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd not healthy within {timeout_s}s: {self.log_tail()}")

    def healthy(self) -> bool:
        if self.netns:  # the test process lives outside the namespace: ask from inside it
            cmd = [
                "ip",
                "netns",
                "exec",
                self.netns,
                "etcdctl",
                f"--endpoints={self.endpoint}",
                "--dial-timeout=1s",
                "endpoint",
                "health",
            ]
            return subprocess.run(cmd, capture_output=True, timeout=10, check=False).returncode == 0
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _signal(self, sig: int) -> None:
        assert self.proc is not None, "not running"
        os.killpg(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers (a hung server, a dead host's socket)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the server (SIGCONT first in case it is paused); the data directory stays."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def etcdctl(self, *args: str) -> str:
        """Run etcdctl against this server (from inside its namespace, if any)."""
        cmd = ["etcdctl", f"--endpoints={self.endpoint}", *args]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        env = {**os.environ, "ETCDCTL_API": "3"}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True, env=env)
        return out.stdout

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start() if self.proc is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
