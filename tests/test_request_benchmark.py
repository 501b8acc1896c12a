"""The end-to-end request benchmark still runs: ``benchmarks/request.py --quick`` moves a small
hybrid request through real worker processes on every installed backend, checks before it prints
a row that the bytes posted are the request's and the descriptors posted are the planner's, and
verifies every decode byte after the runs; a row that fails prints FAILED and the script exits 1.
Each case runs with staging off and on: the P2 -> D4 NHD case must stage (gather head slices into
the prefill rank's staging buffer and post few large writes), the P4 -> D2 NHD case must scatter
(whole source pages into the decode rank's receive staging buffer, copied into place there), and
both must still verify byte for byte.
Timing is not asserted (speed targets live in the benchmark)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdwire.runtime.backends import available_backends

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_request_benchmark_moves_and_verifies_a_request_on_every_backend() -> None:
    backends = [b for b in ("nixl", "local") if b in available_backends()]
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "request.py"),
            "--quick",
            "--backends",
            ",".join(backends),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.strip("|").split("|") for line in done.stdout.splitlines() if line.startswith("| ")]
    rows = [[c.strip() for c in r] for r in rows if r[0].strip() != "backend"]
    assert {r[0] for r in rows} == set(backends)
    assert len(rows) == 6 * len(backends)  # three TP pairs per backend, staging off and on
    for r in rows:
        assert r[14].endswith("MiB"), r  # bytes verified after the runs
        planned, engine_rows, posts = (int(r[i].replace(",", "")) for i in (6, 8, 9))
        assert planned > 0 and posts > 0, r
        if r[7] == "off":
            assert engine_rows == planned, r
        elif r[1] == "P2 -> D4":  # NHD head slices, gathered into few large writes
            assert int(r[7].split()[0]) > 0 and engine_rows < planned // 10, r
        elif r[1] == "P4 -> D2":  # NHD, strided destinations: KV scattered by the decode rank (the
            # SWA component's head slices, a fifth of the rows in this small model, go in place)
            assert " scattered" in r[7] and engine_rows < planned // 4, r
