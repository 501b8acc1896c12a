"""The control-plane benchmark and its A/B against the release build still run: one short
alternating pair on the local backend, each build imported from where it should be, every row
parsed. Timing is not asserted (speed targets live in the benchmarks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_ab_benchmark_runs_the_release_build_and_this_one_and_reports_every_row() -> None:
    args = ["--pairs", "1", "--rounds", "1", "--backends", "local"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "control_plane_ab.py"), *args],
        capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    reference, current = lines[0], lines[1]
    assert reference.startswith("reference: ") and "/site/pdwire/runtime/" in reference, reference
    assert current == f"current: pdwire.runtime from {ROOT / 'runtime' / '__init__.py'}", current
    rows = {c[0].strip(): c[1:] for c in (line.strip("|").split("|") for line in lines) if len(c) == 4}
    for key in ("raw pyzmq round trip", "local c1 latency p50", "local c64 wall/request"):
        ratio = float(rows[key][2])
        assert ratio > 0, (key, rows[key])
