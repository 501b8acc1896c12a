"""The two-host fixture itself: a private wire, faults that really act, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.netns import TwoHosts, reap_stale

ROOT = Path(__file__).resolve().parents[2]

# a TCP echo-once server / client and a UDP counter, as one-liners run inside a namespace
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen()
print("up", flush=True)
while True:
    c, _ = s.accept(); c.sendall(c.recv(100)); c.close()
"""
CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
    c.sendall(b"ping"); print(c.recv(100).decode())
except OSError as e:
    print("error", type(e).__name__)
"""
UDP_RECV = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 7001)); s.settimeout(60)
print("up", flush=True)
n = 0
while (m := s.recv(100)) != b"end":
    n += m == b"x"
print("count", n, flush=True)
"""
UDP_SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    s.sendto(sys.argv[2].encode(), (sys.argv[1], 7001))
    if i % 50 == 0: time.sleep(0.001)
"""


def _ping(net: TwoHosts, timeout_s: float = 2.0) -> str:
    out = net.a.run([sys.executable, "-c", CLIENT, net.b.addr, str(timeout_s)], timeout_s=timeout_s + 30)
    return out.stdout.strip()


def _start_server(net: TwoHosts) -> None:
    p = net.b.popen([sys.executable, "-u", "-c", SERVER, net.b.addr], name="server")
    deadline = time.monotonic() + 20
    while "up" not in p.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "up" in p.log(), p.log()


def test_the_hosts_reach_each_other_only_over_their_wire(net: TwoHosts) -> None:
    _start_server(net)
    assert _ping(net) == "ping"
    # host a has nothing but the wire: no default route, no other device
    routes = net.a.run(["ip", "-j", "route"]).stdout
    assert {r["dev"] for r in json.loads(routes)} == {net.a.dev}
    links = json.loads(net.a.run(["ip", "-j", "link"]).stdout)
    assert sorted(ln["ifname"] for ln in links) == sorted(["lo", net.a.dev])


def test_a_cut_stops_traffic_and_a_restore_brings_it_back(net: TwoHosts) -> None:
    _start_server(net)
    with net.cut_during():
        assert _ping(net, 1.0).startswith("error")
    assert _ping(net) == "ping"
    timer = net.cut_for(1.0)
    assert _ping(net, 0.3).startswith("error")
    timer.join()
    assert _ping(net) == "ping"


def test_loss_drops_about_the_share_asked_for(net: TwoHosts) -> None:
    recv = net.b.popen([sys.executable, "-u", "-c", UDP_RECV, net.b.addr], name="udp")
    deadline = time.monotonic() + 20
    while "up" not in recv.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    send = [sys.executable, "-c", UDP_SEND, net.b.addr]
    net.a.run([*send, "warm", "5"])  # neighbours resolved before any loss
    with net.loss(50):
        rules = net.a.run(["nft", "list", "ruleset"]).stdout
        assert "numgen random mod 10000 < 5000 drop" in rules
        net.a.run([*send, "x", "4000"])
    net.a.run([*send, "end", "3"])
    recv.popen.wait(30)
    got = int(recv.log().split()[-1])
    assert 1400 < got < 2600, got  # 50% of 4000, far outside any plausible random deviation
    assert "pdwire_fault" not in net.a.run(["nft", "list", "ruleset"]).stdout


def test_everything_is_removed_even_when_the_test_fails(tmp_path: Path) -> None:
    def names() -> set[str]:
        return {
            ln.split()[0]
            for ln in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True
            ).stdout.splitlines()
            if ln.strip()
        }

    with pytest.raises(RuntimeError, match="boom"), TwoHosts(tmp_path) as net:
        created = {net.a.netns, net.b.netns}
        assert created <= names()
        p = net.a.popen(["sleep", "600"], name="sleeper")
        p.pause()  # a stopped process is killed too
        raise RuntimeError("boom")
    assert not created & names()
    assert p.popen.poll() is not None


def test_leftovers_of_a_killed_run_are_reaped(tmp_path: Path) -> None:
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]);"
        "from tests.support.netns import TwoHosts;"
        "n = TwoHosts(sys.argv[2]); print(n.a.netns, n.b.netns, flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(ROOT), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    left = proc.stdout.readline().split()
    os.kill(proc.pid, signal.SIGKILL)  # no clean-up ran
    proc.wait(10)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(n in listed for n in left)
    assert set(left) <= set(reap_stale())
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in left)


def test_the_relay_wire_carries_traffic_and_delays_it(tmp_path: Path) -> None:
    with TwoHosts(tmp_path, link="relay") as net:
        _start_server(net)
        assert _ping(net) == "ping"
        assert net.relay_stats()["frames"] > 0
        with net.delay(200):
            t0 = time.monotonic()
            assert _ping(net, 10.0) == "ping"
            took = time.monotonic() - t0
        # connect + echo is two round trips of 400 ms each: a lower bound, which load cannot break
        assert took >= 0.8, took
        with net.cut_during():
            assert _ping(net, 1.0).startswith("error")
        assert _ping(net) == "ping"
