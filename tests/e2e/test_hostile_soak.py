"""A real prefill rank under a soak of hostile connections keeps a flat memory footprint.

``benchmarks/hostile_soak.py`` at a size CI affords: more connections than the connection table
holds (``MAX_CONNECTIONS``), each sending a Hello, garbage, a registration with garbage backend
metadata and a request from a peer that never registered; the rank's RSS must stop growing once
its tables are full, and it must have read every message (nothing dropped unread, nothing crashed).
The full soak (10k connections, 100k messages, both modes) is the benchmark's default run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdwire.runtime.workers.prefill import MAX_CONNECTIONS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_soak_past_the_connection_table_leaves_rss_flat() -> None:
    connections = MAX_CONNECTIONS + 1000
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "benchmarks" / "hostile_soak.py"), "--modes", "insecure",
            "--connections", str(connections), "--messages", str(connections * 6), "--sample", "500",
        ],
        capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = re.search(r"^insecure: .* ([+-][\d.]+) MiB \(flat", done.stdout, re.M)
    assert summary is not None, done.stdout
    stats = json.loads(
        re.search(r"rank stats: (\{.*\}) \(limits", done.stdout)[1].replace("'", '"')  # type: ignore[index]
    )
    assert stats["messages_in"] == connections * 6  # every message read by the live rank
    assert stats["connections"] <= MAX_CONNECTIONS and stats["connections_evicted"] > 0
    assert stats["failures_total"] >= connections * 2  # the registration and the request, refused
