"""The codec benchmarks still run: they check before timing that every codec in a table carries
the same content (the floor and the baselines against pdwire's own frames), so a change that
breaks that equality, or the scripts themselves, fails here rather than when someone next
reproduces the tables in benchmarks/README.md. Timing is not asserted (speed targets live in the benchmarks).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--repeat", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _rows(lines: list[str]) -> list[tuple[str, str]]:
    """(message, codec) of every table row, header and rule lines left out."""
    cells = [line.strip("|").split("|") for line in lines if line.startswith("| ")]
    return [(c[0].strip(), c[1].strip()) for c in cells if c[0].strip() != "message"]


def test_codec_benchmark_prints_every_row_with_the_sglang_table() -> None:
    lines = _run("codec.py", "--sglang")
    assert lines[0].startswith("machine: ") and "reference loop" in lines[0]
    rows = _rows(lines)
    assert rows[:5] == [
        ("RegisterInfo", "pdwire"),
        ("RegisterInfo", "baseline"),
        ("TransferRequest", "pdwire"),
        ("TransferRequest", "floor"),
        ("TransferRequest", "baseline"),
    ]
    sglang = {message for message, _ in rows[5:]}
    assert sglang == {
        "sglang NixlRegister",
        "sglang MooncakeTransferInfo",
        "sglang MoriTransferInfo",
        "sglang NixlStatus",
    }
    assert {codec for _, codec in rows[5:]} == {"pdwire", "hand-written"}
    ratio = [line for line in lines if line.startswith("TransferRequest enc+dec, pdwire / floor per round: ")]
    assert len(ratio) == 1 and ratio[0].endswith("x"), ratio
