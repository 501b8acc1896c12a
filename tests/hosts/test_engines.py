"""Real NIXL (UCX tcp on the veth) and Mooncake move bytes between the two hosts' namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pdwire.runtime.backends import available_backends
from tests.support.netns import Host, Proc, TwoHosts

ROOT = Path(__file__).resolve().parents[2]
NBYTES = 32 << 20
ENGINES = [pytest.param(b, marks=pytest.mark.engine(b)) for b in ("nixl", "mooncake")]


def _json_line(p: Proc, key: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in p.log().splitlines():
            if line.startswith("{") and key in line:
                out: dict[str, Any] = json.loads(line)
                return out
        if not p.alive():
            break
        time.sleep(0.05)
    raise AssertionError(f"{p.name}: no {key!r} line within {timeout_s}s:\n{p.log()[-3000:]}")


def _tx_bytes(h: Host) -> int:
    [link] = json.loads(h.run(["ip", "-s", "-j", "link", "show", "dev", h.dev]).stdout)
    return int(link["stats64"]["tx"]["bytes"])


def _run_pair(
    net: TwoHosts,
    backend: str,
    target_opts: list[str],
    source_opts: list[str],
    env: dict[str, str] | None = None,
) -> tuple[dict[str, Any], Proc]:
    """Target on host b, source on host a; the source's result line and the target process."""
    if backend not in available_backends():
        pytest.fail(f"{backend} does not import here; ./dev setup installs it")
    a, b = net.a, net.b
    peer = [sys.executable, "-m", "tests.hosts.engine_peer"]
    target = b.popen(
        [*peer, "target", backend, str(NBYTES), *target_opts], name="target", cwd=ROOT, env=env or b.env()
    )
    md = _json_line(target, '"md"', 90)
    source = a.popen(
        [*peer, "source", backend, str(NBYTES), "11", *source_opts],
        name="source",
        cwd=ROOT,
        stdin=subprocess.PIPE,
        env=env or a.env(),
    )
    assert source.popen.stdin is not None
    source.popen.stdin.write((json.dumps(md) + "\n").encode())
    source.popen.stdin.flush()
    return _json_line(source, '"state"', 120), target


def _host_options(backend: str, h: Host) -> list[str]:
    """What `pdwire serve` derives from the host's address (backends.options.host_defaults)."""
    if backend == "mooncake":
        return [f"hostname={h.addr}"]
    return [f"net_devices={h.dev}", "transports=tcp"]


def _plain_env() -> dict[str, str]:
    """No UCX_* settings of the fixture's: only backend options say where to go."""
    env = dict(os.environ)
    env["UCX_NET_DEVICES"] = "lo"  # the single-host default ./dev exports: the options must win
    env.pop("UCX_TLS", None)
    return env


@pytest.mark.parametrize("backend", ENGINES)
def test_bytes_cross_the_wire_intact(backend: str, net: TwoHosts) -> None:
    before = _tx_bytes(net.a)
    sent, target = _run_pair(
        net, backend, _host_options(backend, net.b), _host_options(backend, net.a), _plain_env()
    )
    assert sent["state"] == "DONE", sent
    got = _json_line(target, '"sha"', 60)
    assert got["sha"] == sent["sha"]
    # over the veth, not shared memory or cma: at least every byte went out on host a's end
    assert _tx_bytes(net.a) - before >= NBYTES
    print(f"{backend}: {NBYTES >> 20} MiB across the namespaces in {sent['seconds']:.2f}s")


@pytest.mark.parametrize("backend", ENGINES)
def test_an_address_the_peer_cannot_reach_fails_when_adding_it_naming_the_address(
    backend: str, net: TwoHosts
) -> None:
    # the single-host defaults on both hosts: Mooncake advertises 127.0.0.1, UCX uses lo
    opts = [] if backend == "mooncake" else ["net_devices=lo"]
    sent, _ = _run_pair(net, backend, opts, opts, _plain_env())
    assert sent["state"] == "PEER_REFUSED", sent
    if backend == "mooncake":
        assert "Mooncake session 127.0.0.1:" in sent["reason"] and "hostname=" in sent["reason"]
    else:
        assert "advertises UCX devices 'lo': 127.0.0.1" in sent["reason"], sent["reason"]
