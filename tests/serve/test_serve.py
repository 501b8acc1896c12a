"""``pdwire serve`` on one host: real processes, a real etcd server, the local backend.

(The same commands across two hosts, over NIXL and Mooncake and under faults, are in
tests/hosts/test_two_hosts.py.)
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.etcd_server import EtcdServer
from tests.support.serve import ROOT, SMALL_MODEL, start_serve, wait_log, wait_routable


def _shm_files(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/pdwire-{pid}-*")


def test_prefill_and_decode_find_each_other_move_requests_and_stop_cleanly(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    spec = etcd.spec("/serve1", ttl_s=3)
    common = ["--backend", "local", "--discovery", spec]
    p = start_serve(tmp_path, "prefill", "--engine-id", "p", "--tp", "2", *common)
    d = start_serve(tmp_path, "decode", "--engine-id", "d", "--tp", "1", *common, admin=True)
    try:
        wait_log(d, "admin socket", 120)
        wait_routable(d, "p", 120)
        result = d.admin({"cmd": "run", "requests": 6, "min_tokens": 8, "max_tokens": 90})
        assert result["ok"] == 6, result
        ctl = [sys.executable, "-m", "pdwire", "ctl", str(d.admin_path)]
        out = subprocess.run([*ctl, "status"], capture_output=True, text=True, timeout=120, cwd=ROOT)
        status = json.loads(out.stdout)
        assert status["registry_reachable"] and status["groups"]["p"]["ranks"] == ["tp0.pp0", "tp1.pp0"]
        out = subprocess.run(
            [*ctl, "run", "2", "--max-tokens", "40"], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert out.returncode == 0 and json.loads(out.stdout)["ok"] == 2, out.stdout
        keys = etcd.etcdctl("get", "--prefix", "/serve1", "--keys-only").split()
        assert sorted(keys) == [
            "/serve1/decode/d/tp0.pp0",
            "/serve1/prefill/p/tp0.pp0",
            "/serve1/prefill/p/tp1.pp0",
        ]
        # a long wave, stopped in the middle: every room is released, nothing is left behind
        pids = [p.proc.pid, d.proc.pid]
        assert all(_shm_files(pid) for pid in pids)
        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(d.admin, {"cmd": "run", "requests": 400, "max_tokens": 90}, 120)
            at = wait_log(d, "400 requests of", 60)
            assert p.proc.terminate() == 0, p.log()[-3000:]
            wait_log(d, "prefill p is not routable any more", 60, after=at)
            assert d.proc.terminate() == 0, d.log()[-3000:]
            answer = big.result(60)
        # every request of the stopped wave is accounted for: done before the stop, or failed typed
        assert answer.get("stopped") or answer["ok"] + len(answer["failed"]) == 400, answer
        assert answer["failed"], "the prefill engine stopped in the middle of the wave"
        for f in answer["failed"]:
            assert f["kinds"] and "unspecified" not in f["kinds"], f
        assert "stopped" in p.log() and "stopped" in d.log()
        for pid in pids:
            assert _shm_files(pid) == [], f"shared-memory files left by {pid}"
        assert etcd.etcdctl("get", "--prefix", "/serve1") == ""
        assert not os.path.exists(str(d.admin_path))
    finally:
        p.proc.kill()
        d.proc.kill()


def test_static_discovery_from_flags(tmp_path: Path) -> None:
    p = start_serve(tmp_path, "prefill", "--engine-id", "p", "--backend", "local", "--bind", "127.0.0.1:0")
    try:
        wait_log(p, "rank 0/1: listening on", 120)
        endpoint = p.log().split("advertised as ")[1].split()[0]
        d = start_serve(
            tmp_path, "decode", "--engine-id", "d", "--backend", "local", "--prefill", f"p={endpoint}",
            "--requests", "3", "--exit-after",
        )  # fmt: skip
        assert d.proc.popen.wait(120) == 0, d.log()[-3000:]
        assert "wave 1: 3/3 requests ok" in d.log()
    finally:
        p.proc.kill()


def test_an_unreachable_prefill_endpoint_is_named_and_retried_not_waited_on(tmp_path: Path) -> None:
    d = start_serve(
        tmp_path, "decode", "--engine-id", "d", "--backend", "local", "--prefill", "p=tcp://127.0.0.1:1",
        "--handshake-timeout", "20", admin=True,
    )  # fmt: skip
    try:
        wait_log(d, "decode d: 1 ranks", 120)
        status = d.admin({"cmd": "status"}, 10)  # answered while the handshake waits: the loop is free
        assert status["groups"]["p"]["connecting"] and not status["groups"]["p"]["routable"], status
        wait_log(d, "handshake with prefill p (tcp://127.0.0.1:1) failed", 120)
        assert "no TCP connection to it was ever established" in d.log()
        status = d.admin({"cmd": "status"}, 10)
        group = status["groups"]["p"]
        assert not group["routable"] and "not reachable from this host" in group["last_error"], group
        assert d.proc.terminate() == 0
    finally:
        d.proc.kill()


def test_bad_settings_exit_2_naming_them(tmp_path: Path) -> None:
    serve = [sys.executable, "-m", "pdwire", "serve", "prefill", "--engine-id", "p", *SMALL_MODEL]
    bad = subprocess.run([*serve, "--bind", "0.0.0.0"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "give --advertise" in bad.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "pdwire", "serve", "prefill", "--engine-id", "p", "--backend", "local",
         "--backend-option", "hostname=10.0.0.1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert bad.returncode == 2 and "backend 'local' has no option 'hostname'" in bad.stderr


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_list_backend_options(backend: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdwire", "serve", "prefill", "--engine-id", "p", "--backend", backend,
         "--list-backend-options"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0
    assert ("hostname" if backend == "mooncake" else "net_devices") in out.stdout


def test_the_demo_in_the_deployments_shape() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdwire", "demo", "--serve", "--backend", "local", "--requests", "4",
         "--prefill-tp", "2", "--decode-tp", "1", *SMALL_MODEL],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "$ pdwire serve prefill --engine-id prefill-0 --tp 2" in out.stdout
    assert "$ pdwire serve decode --engine-id decode-0 --tp 1" in out.stdout
    assert "verified: 4/4 requests byte for byte" in out.stdout
    assert "exit status 0, 0" in out.stdout and "result: OK" in out.stdout
