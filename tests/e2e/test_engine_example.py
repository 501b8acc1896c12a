"""The documented example (examples/engine_pair.py): a prefill and a decode engine written
against the engine API alone move hybrid requests from TP 1 to TP 2, byte for byte, with
decode's prefix skipped; with the local backend it runs with torch made unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdwire.runtime.backends import available_backends
from tests.workers.test_torch_memory import BLOCK_TORCH

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine_pair.py"


@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_the_engine_example_moves_its_requests_byte_for_byte(backend: str) -> None:
    if backend not in available_backends():
        pytest.fail(f"backend {backend} does not import here: CI must install it (./dev setup)")
    # NIXL's own package imports torch; the local backend and pdwire never do
    block = BLOCK_TORCH if backend == "local" else ""
    code = (
        block
        + "import runpy, sys\n"
        + f"sys.argv = ['engine_pair.py', '--backend', {backend!r}]\n"
        + f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "result: OK"
    assert sum("SUCCESS, byte for byte" in line for line in lines) == 4  # two requests x two decode ranks
