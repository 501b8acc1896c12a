"""An SGLang prefill engine on one host and a decode engine on another, over Mooncake and NIXL,
with the backends' host-facing options derived from SGLang's own flags.

Two network namespaces joined by a veth pair (``tests.support.netns.TwoHosts``, created and
removed by each test): host a runs SGLang's bootstrap server and a prefill rank, host b a decode
rank (``netns_engine.py``: SGLang's real pools, ``KVArgs`` from its ``_init_kv_manager``, its
manager, sender and receiver in its scheduler's order). Each engine gets ``--host`` its
namespace's address and nothing else says where to go: ``SGLANG_HOST_IP``, ``HOST_IP``,
``UCX_NET_DEVICES`` and ``UCX_TLS`` are removed from their environment (and SGLang's own address
finding has no route to try in a namespace). Mooncake: no IB device, so protocol tcp and the
hostname ``--host``; NIXL: ``--disaggregation-ib-device`` names the namespace's veth end, which
becomes UCX's device, and ``PDWIRE_BACKEND_OPTIONS=transports=tcp`` (the operator's explicit
option, merged over what is derived) keeps UCX off the shared memory two namespaces of one kernel
would find. Two rooms move; decode compares its pages, SWA window, Mamba slot and aux item byte
for byte with what prefill wrote, and its veth end must have received at least those bytes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from pdwire.runtime.backends import available_backends
from tests.support.netns import Host, Proc, TwoHosts

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
ROOMS = {5101: 21, 5102: 10}  # prompt tokens
SUCCESS = 4  # KVPoll.Success


def _env(backend: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("SGLANG_HOST_IP", "HOST_IP", "UCX_NET_DEVICES", "UCX_TLS", "PDWIRE_BACKEND_OPTIONS"):
        env.pop(name, None)
    env["PDWIRE_SGLANG_BACKEND"] = backend
    if backend == "nixl":
        env["PDWIRE_BACKEND_OPTIONS"] = "transports=tcp"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _start(host: Host, role: str, backend: str, bootstrap: Host, bport: int, ib: bool) -> Proc:
    argv = [
        sys.executable, "-m", "tests.sglang.backend.netns_engine", role, bootstrap.addr, str(bport),
        "30000", json.dumps(ROOMS), host.addr, *([host.dev] if ib else []),
    ]  # fmt: skip
    return host.popen(argv, name=f"{role}-{backend}", env=_env(backend), cwd=ROOT)


def _line(proc: Proc, prefix: str, timeout_s: float) -> str:
    """The first line of ``proc``'s output starting with ``prefix``, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in proc.log().splitlines():
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        if not proc.alive():
            break
        time.sleep(0.1)
    raise AssertionError(f"{proc.name}: no {prefix!r} line (alive: {proc.alive()}):\n{proc.log()[-4000:]}")


def _rx_bytes(host: Host) -> int:
    return int(host.run(["cat", f"/sys/class/net/{host.dev}/statistics/rx_bytes"]).stdout)


@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=pytest.mark.engine(b)) for b in ("mooncake", "nixl")]
)
def test_a_room_moves_between_hosts_on_the_options_sglangs_flags_give(backend: str, tmp_path: Path) -> None:
    if backend not in available_backends():
        pytest.fail(f"{backend} does not import here; ./dev setup installs it")
    ib = backend == "nixl"
    t0 = time.monotonic()
    with TwoHosts(tmp_path / "net") as net:
        a, b = net.a, net.b
        rx_before = _rx_bytes(b)
        bport = 18998
        prefill = _start(a, "prefill", backend, a, bport, ib)
        decode = _start(b, "decode", backend, a, bport, ib)
        p_rank = json.loads(_line(prefill, "RANK ", 180))
        d_rank = json.loads(_line(decode, "RANK ", 180))
        # what each rank derived from its --host (and --disaggregation-ib-device)
        for rank, host in ((p_rank, a), (d_rank, b)):
            assert rank["host"] == host.addr, rank
            assert rank["backend"] == backend, rank
            if backend == "mooncake":
                assert rank["options"] == {"hostname": host.addr, "protocol": "tcp"}, rank
                assert rank["session"].startswith(f"{host.addr}:"), rank
            else:
                assert rank["options"] == {"net_devices": host.dev, "transports": "tcp"}, rank
                assert rank["net_devices"] == host.dev, rank
        assert p_rank["endpoint"].startswith(f"tcp://{a.addr}:"), p_rank
        nbytes = int(_line(decode, "BYTES ", 60))
        d_done = json.loads(_line(decode, "DONE ", 180))
        p_done = json.loads(_line(prefill, "DONE ", 60))
        assert d_done == {str(r): SUCCESS for r in ROOMS}, decode.log()[-4000:]
        assert p_done == {str(r): SUCCESS for r in ROOMS}, prefill.log()[-4000:]
        assert decode.popen.wait(60) == 0, decode.log()[-4000:]  # its byte-for-byte check passed
        assert prefill.popen.wait(60) == 0, prefill.log()[-4000:]
        received = _rx_bytes(b) - rx_before
        assert received >= nbytes, f"decode's veth received {received} bytes, the rooms hold {nbytes}"
    print(f"{backend}: {len(ROOMS)} rooms ({nbytes} bytes) across the veth in {time.monotonic() - t0:.1f}s")
