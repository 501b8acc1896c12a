"""Across two hosts, a writer whose transfers are stuck (link cut) or stopped (SIGSTOP) when the
target revokes it changes no byte of the target's reused memory once it resumes (NIXL over UCX
tcp, Mooncake over TCP). Without the revocation its bytes land: see docs/fencing.md."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.hosts.test_engines import ENGINES, ROOT, _json_line
from tests.support.netns import Proc, TwoHosts

NBYTES = 2 << 20
STALL_S = 3.0  # the cut (or the stop) lasts this long; TCP retransmits what was in flight after it


def _send(p: Proc, line: str) -> None:
    assert p.popen.stdin is not None
    p.popen.stdin.write((line + "\n").encode())
    p.popen.stdin.flush()


def _lines(p: Proc, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in p.log().splitlines() if x.startswith("{") and key in x]


@pytest.mark.parametrize("fault", ["cut", "stop"])
@pytest.mark.parametrize("backend", ENGINES)
def test_a_revoked_writer_stuck_mid_transfer_changes_no_reused_byte_once_it_resumes(
    backend: str, fault: str, net: TwoHosts
) -> None:
    a, b = net.a, net.b
    t_opts = [f"hostname={b.addr}"] if backend == "mooncake" else []
    target = b.popen(
        [sys.executable, "-m", "tests.hosts.fence_target", backend, str(NBYTES), *t_opts],
        name="target", cwd=ROOT, stdin=subprocess.PIPE,
    )  # fmt: skip
    md = _json_line(target, '"md"', 90)
    writer = a.popen(
        [sys.executable, "-m", "tests.backends.writer", backend],
        name="writer", cwd=ROOT, stdin=subprocess.PIPE,
    )  # fmt: skip
    hello = {"agent": md["agent"], "md": md["md"], "size": NBYTES}
    if backend == "mooncake":
        hello["options"] = {"hostname": a.addr}
    _send(writer, json.dumps(hello))
    _json_line(writer, '"state": "DONE"', 90)  # streaming: a transfer is always in flight
    if fault == "cut":
        net.cut()
    else:
        writer.pause()
    try:
        time.sleep(0.5)
        _send(target, "revoke")
        revoked = _json_line(target, '"revoked"', 30)
        assert revoked["revoked"], revoked
        time.sleep(STALL_S)
    finally:
        net.restore() if fault == "cut" else writer.resume()
    resumed = time.monotonic()
    deadline = resumed + 60
    while not any(x["t"] > resumed for x in _lines(writer, '"t"')):  # it finished what was stuck
        assert time.monotonic() < deadline, f"the writer never resumed:\n{writer.log()[-2000:]}"
        assert writer.alive(), writer.log()[-2000:]
        time.sleep(0.2)
    time.sleep(1.0)  # and posted more from the metadata it holds
    _send(target, "check")
    checked = _json_line(target, '"changed"', 30)
    changed = checked["changed"]
    assert changed == 0, f"{changed} bytes of reused memory changed after the revocation"
