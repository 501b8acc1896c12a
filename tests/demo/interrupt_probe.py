"""Run inside a private /dev/shm (tests/demo/test_cli.py): start `pdwire demo`, Ctrl-C it once
its requests are in flight, and report what it left behind, as JSON on stdout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    args = sys.argv[1:]
    # as from a terminal: SIGINT at its default even when the suite runs as a background job of a
    # non-interactive shell (which starts it with SIGINT ignored, and Python keeps it ignored)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdwire", "demo", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    out: list[str] = []
    for line in proc.stdout:
        out.append(line)
        if "handshaken" in line:
            break
    time.sleep(0.5)
    during = sorted(os.listdir("/dev/shm"))
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: to every process of the group
    try:
        rc = proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = -9
    out += proc.stdout.readlines()
    err = proc.stderr.read()
    deadline = time.monotonic() + 15
    alive = True
    while alive and time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
            time.sleep(0.2)
        except ProcessLookupError:
            alive = False
    after = sorted(os.listdir("/dev/shm"))
    print(json.dumps({"rc": rc, "stdout": "".join(out), "stderr": err, "during": during, "after": after,
                      "group_alive": alive}))  # fmt: skip


if __name__ == "__main__":
    main()
