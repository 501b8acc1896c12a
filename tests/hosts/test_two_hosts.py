"""Prefill on one host, decode on another, found through etcd: ``pdwire serve`` across two
network namespaces, over NIXL (UCX tcp on the veth) and Mooncake, with faults.

One deployment per backend (module fixture): host a runs etcd and ``pdwire serve prefill``,
host b ``pdwire serve decode`` with an admin socket; the TP sizes differ (NIXL: prefill 2 ->
decode 1, Mooncake: prefill 1 -> decode 2), every request is the hybrid demo model (KV,
Mamba conv q|k|v and temporal state, SWA, aux) and is verified byte for byte on every
decode rank. The scenarios run in order on that deployment:

1. no fault;
2. 1% loss each way (nftables);
3. a 3 s cut while a wave is in flight: every request completes (over Mooncake too, whose
   completion notifications sent during the cut are lost: decode takes the sender's Success);
4. a cut longer than the rooms' deadline: they fail typed (timeout) within it, their slots
   come back once prefill fenced after the link returned, and the next wave succeeds;
5. the prefill process killed mid-wave: its lease expires, decode stops routing to it, the
   rooms that needed it fail typed; a restarted prefill is picked up and serves again.

Only the backend options say which interface to use: the processes get ``UCX_NET_DEVICES=lo``
(the single-host default) and no ``UCX_TLS``; ``--advertise`` gives Mooncake its hostname and
NIXL its device, ``--backend-option transports=tcp`` keeps UCX off the shared-memory paths the
two namespaces of one kernel would otherwise find.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdwire.runtime.backends import available_backends
from tests.support.etcd_server import EtcdServer
from tests.support.netns import TwoHosts
from tests.support.serve import Served, start_serve, wait_log, wait_routable

pytestmark = pytest.mark.slow

TTL_S = 3
POOLS = ("--pages", "4096", "--swa-pages", "1024", "--slots", "65", "--aux-items", "65")
GEOMETRY = {"nixl": (2, 1), "mooncake": (1, 2)}  # (prefill TP, decode TP)
# (requests, min tokens, max tokens) of a plain wave and of a long one (in flight for a while).
# Mooncake's TCP transport moves about a thousand small descriptors a second across the veth on
# this loaded machine (NIXL: tens of thousands), so its waves are smaller.
WAVES = {"nixl": ((8, 16, 400), (16, 200, 800)), "mooncake": ((6, 16, 200), (8, 100, 300))}


@dataclass
class Deployment:
    backend: str
    net: TwoHosts
    etcd: EtcdServer
    prefill: Served
    decode: Served
    workdir: Path
    restarts: int = 0

    def prefill_args(self) -> list[str]:
        tp, _ = GEOMETRY[self.backend]
        return [
            "--engine-id", "prefill-a", "--tp", str(tp), "--bind", "0.0.0.0:17000",
            "--advertise", self.net.a.addr, *_backend_flags(self.backend),
            "--discovery", self.etcd.spec("/pd", TTL_S), *POOLS,
        ]  # fmt: skip

    def start_prefill(self) -> Served:
        self.restarts += 1
        return start_serve(
            self.workdir,
            "prefill",
            *self.prefill_args(),
            host=self.net.a,
            env=_env(),
            name=f"prefill{self.restarts}",
        )

    def run(self, requests: int, timeout_s: float = 180, **kw: Any) -> dict[str, Any]:
        return self.decode.admin({"cmd": "run", "requests": requests, **kw}, timeout_s)


def _backend_flags(backend: str) -> list[str]:
    # NIXL: UCX over tcp only (the two namespaces share a kernel: cma or shared memory would
    # bypass the wire); its device, like Mooncake's hostname, comes from --advertise
    return ["--backend", backend, *(["--backend-option", "transports=tcp"] if backend == "nixl" else [])]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["UCX_NET_DEVICES"] = "lo"  # the options must win over the single-host default
    env.pop("UCX_TLS", None)
    return env


@pytest.fixture(
    scope="module", params=[pytest.param(b, marks=pytest.mark.engine(b)) for b in ("nixl", "mooncake")]
)
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    backend: str = request.param
    if backend not in available_backends():
        pytest.fail(f"{backend} does not import here; ./dev setup installs it")
    workdir = tmp_path_factory.mktemp(f"two-hosts-{backend}")
    with TwoHosts(workdir / "net") as net:
        etcd = EtcdServer(workdir, host=net.a.addr, netns=net.a.netns).start()
        try:
            dep = Deployment(backend, net, etcd, None, None, workdir)  # type: ignore[arg-type]
            dep.prefill = dep.start_prefill()
            _, decode_tp = GEOMETRY[backend]
            dep.decode = start_serve(
                workdir, "decode",
                "--engine-id", "decode-b", "--tp", str(decode_tp), "--advertise", net.b.addr,
                *_backend_flags(backend),
                "--discovery", etcd.spec("/pd", TTL_S), "--handshake-timeout", "5", *POOLS,
                host=net.b, admin=True, env=_env(),
            )  # fmt: skip
            wait_log(dep.decode, "admin socket", 120)
            wait_routable(dep.decode, "prefill-a", 120)
            yield dep
            assert dep.decode.proc.terminate() == 0, dep.decode.log()[-3000:]
            assert dep.prefill.proc.terminate() == 0, dep.prefill.log()[-3000:]
        finally:
            etcd.close()


def _assert_all_ok(result: dict[str, Any], n: int) -> None:
    assert result["ok"] == n, result


def _long_wave(dep: Deployment, pool: ThreadPoolExecutor) -> tuple[Future[dict[str, Any]], int]:
    """A bigger wave on a thread; returns once decode queued it (its transfers are starting)."""
    n, lo, hi = WAVES[dep.backend][1]
    at = len(dep.decode.log())
    wave = pool.submit(dep.run, n, 240, min_tokens=lo, max_tokens=hi)
    wait_log(dep.decode, f"{n} requests of {lo}-{hi} tokens queued", 60, after=at)
    return wave, n


def _plain_wave(dep: Deployment) -> None:
    """A wave that must succeed in full."""
    n, lo, hi = WAVES[dep.backend][0]
    _assert_all_ok(dep.run(n, min_tokens=lo, max_tokens=hi), n)


def test_no_fault(deployment: Deployment) -> None:
    _plain_wave(deployment)
    status = deployment.decode.admin({"cmd": "status"})
    assert status["registry_reachable"] and status["groups"]["prefill-a"]["routable"]


def test_one_percent_loss(deployment: Deployment) -> None:
    with deployment.net.loss(1):
        _plain_wave(deployment)


def test_a_3s_cut_mid_wave_is_ridden_out(deployment: Deployment) -> None:
    with ThreadPoolExecutor(1) as pool:
        wave, n = _long_wave(deployment, pool)
        t0 = time.monotonic()
        timer = deployment.net.cut_for(3.0)
        result = wave.result(240)
        took = time.monotonic() - t0
    timer.join()
    # Over Mooncake a completion notification sent during the cut is lost (Mooncake logs the
    # failed send and reports the batch done); decode takes the sender's Success for it
    _assert_all_ok(result, n)
    print(f"{deployment.backend}: a wave of {n} across a 3 s cut took {took:.1f}s after the cut began")
    _plain_wave(deployment)  # and the deployment serves again at once


def test_a_cut_longer_than_the_deadline_fails_rooms_typed_and_the_next_wave_succeeds(
    deployment: Deployment,
) -> None:
    d = deployment.decode
    deployment.net.cut()
    try:
        # the link stays down until every room of the wave has failed: the cut outlasts the deadline
        t0 = time.monotonic()
        result = deployment.run(4, 60, min_tokens=16, max_tokens=200, room_timeout_s=3.0)
        took = time.monotonic() - t0
        time.sleep(1.0)
    finally:
        deployment.net.restore()
    assert result["ok"] == 0, result
    kinds = {k for f in result["failed"] for k in f["kinds"]}
    assert kinds == {"timeout"}, result
    # within the deadline: the rooms end at their own 3 s deadline (the margin is for starting
    # the wave on a loaded machine), not at the handshake or the run's timeout
    assert took < 3.0 + 10.0, f"rooms failed {took:.1f}s into the cut, deadline 3 s"
    print(
        f"{deployment.backend}: 4 rooms failed typed {sorted(kinds)} {took:.1f}s into the cut (deadline 3 s)"
    )
    # once prefill fenced (its statuses arrive with the link), the slots come back and a wave succeeds
    _plain_wave(deployment)
    status = d.admin({"cmd": "status"})
    assert status["unrevocable"] == 0, status  # every failed room fenced or revoked


def test_a_killed_prefill_leaves_with_its_lease_and_a_restarted_one_serves(deployment: Deployment) -> None:
    d = deployment.decode
    at = len(d.log())
    with ThreadPoolExecutor(1) as pool:
        wave, _ = _long_wave(deployment, pool)
        deployment.prefill.proc.kill()  # SIGKILL: no withdrawal, only the lease's expiry tells
        killed = time.monotonic()
        wait_log(d, "prefill prefill-a is not routable any more", 60, after=at)
        noticed = time.monotonic() - killed
        # a restarted prefill engine registers again and is connected again; the requests of the
        # wave that had not started yet wait for it
        deployment.prefill = deployment.start_prefill()
        wait_routable(d, "prefill-a", 120)
        result = wave.result(240)
    failed = result["failed"]
    assert failed, result  # the rooms in flight at the kill
    for f in failed:
        assert f["kinds"] and "unspecified" not in f["kinds"], f
    kinds = sorted({k for f in failed for k in f["kinds"]})
    print(
        f"{deployment.backend}: decode stopped routing {noticed:.1f}s after the kill (lease ttl {TTL_S}s); "
        f"{result['ok']} requests ok, {len(failed)} failed {kinds}"
    )
    _plain_wave(deployment)
    assert d.admin({"cmd": "status"})["unreleased_slots"] == 0


@pytest.mark.engine("mooncake")
def test_a_decode_rank_advertising_an_address_prefill_cannot_reach_is_refused_at_the_handshake(
    tmp_path: Path,
) -> None:
    """Mooncake's default hostname (127.0.0.1) on the decode host: the registration is refused,
    naming the session, and no request is ever started against it."""
    with TwoHosts(tmp_path / "net") as net:
        p = start_serve(
            tmp_path, "prefill", "--engine-id", "p", "--bind", f"{net.a.addr}:17000", "--backend", "mooncake",
            host=net.a, env=_env(),
        )  # fmt: skip
        wait_log(p, "rank 0/1: listening on", 120)
        d = start_serve(
            tmp_path, "decode", "--engine-id", "d", "--advertise", net.b.addr, "--backend", "mooncake",
            "--backend-option", "hostname=127.0.0.1", "--prefill", f"p=tcp://{net.a.addr}:17000",
            "--handshake-timeout", "10", host=net.b, env=_env(),
        )  # fmt: skip
        wait_log(d, "handshake with prefill p", 120)
        log = d.log()
        assert "refused the registration" in log and "Mooncake session 127.0.0.1:" in log, log[-3000:]
        assert "hostname=" in log
        assert "wave" not in log
