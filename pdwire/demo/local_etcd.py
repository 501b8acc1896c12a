"""A single-member etcd server on this host, for demos and tests (never for production).

``etcd_command`` is the one place the flags of such a server are written; ``LocalEtcd``
starts it on 127.0.0.1 with free ports and a throw-away data directory, and stops it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def etcd_command(
    etcd: str, name: str, data_dir: Path, host: str, client_port: int, peer_port: int
) -> list[str]:
    """The command line of a one-member cluster listening on ``host`` (client and peer port)."""
    h = f"[{host}]" if ":" in host else host
    client, peer = f"http://{h}:{client_port}", f"http://{h}:{peer_port}"
    return [
        etcd,
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster={name}={peer}",
        "--initial-cluster-state=new",
        "--logger=zap",
        "--log-level=warn",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalEtcd:
    def __init__(self, workdir: Path) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise FileNotFoundError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.client_port = _free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.log_path = workdir / "etcd.log"
        cmd = etcd_command(
            etcd, "pdwire-demo", workdir / "etcd-data", "127.0.0.1", self.client_port, _free_port()
        )
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {self.log_path.read_text(errors='replace')[-1000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd at {self.endpoint} not healthy within {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
