"""Demo rank processes (real PrefillWorker / DecodeWorker, :mod:`pdwire.demo.rank`) on the
hosts of a :class:`~tests.support.netns.TwoHosts`, driven by a :class:`Cluster` like its own ranks.

    with Cluster(SPEC, CAP, backend) as cluster:
        pre = start_on(cluster, net.a, "prefill", "p", backend_options=..., chunk_delay_s=0.2)
        dec = start_on(cluster, net.b, "decode", "d", ...)
        cluster.connect(dec, pre); cluster.submit(dec, pre, 1, 48); ...   # as with its own ranks

A rank is ``python -m tests.hosts.netns_rank SOCKET`` started inside the host's namespace
(:meth:`Host.popen`): it connects to the parent's UNIX socket at the path SOCKET (a path, not an
abstract name: those are per network namespace, paths are not), receives its RankConfig and runs
``rank_main`` over that connection, the command pipe the cluster's own ranks get from
multiprocessing. Whatever crosses between the hosts (control plane, transfers) goes over the
veth pair, so cutting it cuts the rank off.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import os
import signal
import socket
import sys
import tempfile
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from pdwire.demo.cluster import Cluster, ClusterError, Group
from tests.support.netns import Host, Proc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_count = itertools.count()


class RankProcess:
    """A rank started on a host, with what :class:`Cluster` asks of a multiprocessing process."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.alive()

    def kill(self) -> None:
        self.proc.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(Exception):
            self.proc.popen.wait(timeout)

    def log(self) -> str:
        return self.proc.log()


def backend_options(backend: str, host: Host) -> dict[str, object]:
    """What ``pdwire serve --advertise <host addr>`` gives the backend on that host; NIXL also over
    UCX tcp only (the namespaces share a kernel: cma or shared memory would bypass the wire)."""
    if backend == "mooncake":
        return {"hostname": host.addr}
    return {"net_devices": host.dev, "transports": "tcp"}


def rank_env() -> dict[str, str]:
    """The single-host defaults the cluster sets: only the backend options say where to go."""
    env = dict(os.environ)
    env["UCX_NET_DEVICES"] = "lo"
    env.pop("UCX_TLS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def start_on(
    cluster: Cluster, host: Host, role: str, engine_id: str, timeout_s: float = 120.0, **overrides: Any
) -> Group:
    """Start one rank (TP 1) of ``engine_id`` on ``host``; ``overrides`` replace RankConfig fields
    (``bind`` defaults to the host's address, ``backend_options`` to :func:`backend_options`)."""
    overrides.setdefault("bind", f"tcp://{host.addr}:0")
    overrides.setdefault(
        "backend_options", backend_options(overrides.get("backend", cluster.base.backend), host)
    )
    cfg = replace(cluster.base, role=role, engine_id=engine_id, tp=1, rank=0, **overrides)
    # short: a socket path has room for 107 bytes, and pytest's folders can take most of them
    path = os.path.join(tempfile.gettempdir(), f"pdwire-rank-{os.getpid()}-{next(_count)}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(1)
        proc = host.popen(
            [sys.executable, "-m", "tests.hosts.netns_rank", path],
            name=engine_id, cwd=ROOT, env=rank_env(),
        )  # fmt: skip
        listener.settimeout(timeout_s)
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            proc.kill()
            raise ClusterError(
                f"{engine_id} on host {host.name} did not start:\n{proc.log()[-3000:]}"
            ) from None
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    sock.setblocking(True)
    conn = Connection(sock.detach())
    conn.send(cfg)
    g = Group(role, engine_id, 1, [RankProcess(proc)], [conn], [""])  # type: ignore[list-item]
    cluster.groups.append(g)
    try:
        (msg,) = cluster._gather(g, "ready", timeout_s).values()
    except ClusterError as exc:
        raise ClusterError(f"{exc}\n{proc.log()[-3000:]}") from None
    g.endpoints[0] = msg[2]
    return g


def main() -> None:
    from pdwire.demo.rank import rank_main

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stack dump into the log, for a hang
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    conn = Connection(sock.detach())
    rank_main(conn.recv(), conn)


if __name__ == "__main__":
    main()
