"""`pdwire demo` as a user meets it: arguments refused in one line before anything starts,
instant help, the report as JSON, exit statuses, Ctrl-C leaving nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdwire.cli import main
from tests.workers.test_torch_memory import BLOCK_TORCH

ROOT = Path(__file__).resolve().parents[2]

BAD = [
    (["--prefill-tp", "0"], "--prefill-tp 0: must be 1..64"),
    (["--decode-tp", "-1"], "--decode-tp -1: must be 1..64"),
    (["--page-size", "0"], "--page-size 0: must be 1..4096"),
    (["--requests", "0"], "--requests 0: must be 1..4096"),
    (["--requests", "-3"], "--requests -3: must be 1..4096"),
    (["--min-tokens", "500", "--max-tokens", "10"], "--max-tokens 10: must be --min-tokens (500)..65535"),
    (["--layers", "0"], "--layers 0: must be 1..256"),
    (["--chunk-pages", "0"], "--chunk-pages 0: must be 1..65535"),
    (["--head-dim", "0"], "--head-dim 0: must be 1..4096"),
    (["--timeout", "0"], "--timeout 0: must be 0.1..86400"),
    (["--heads", "7"], "--prefill-tp 2: must divide --heads (7)"),
    (["--heads", "4", "--decode-tp", "8"], "--decode-tp 8: must divide --heads (4)"),
    (["--prefill-tp", "3", "--heads", "6"], "--prefill-tp 3: must divide the model's sharded sizes"),
    (["--requests", "4096", "--max-tokens", "65535"], "GiB per rank"),
    (["--backend", "no-such"], "invalid choice: 'no-such'"),
    (["--serve", "--json"], "--json: not with --serve"),
]


@pytest.mark.parametrize(("argv", "want"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_argument_is_one_line_and_exit_2_before_anything_starts(
    argv: list[str], want: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["demo", *argv])
    except SystemExit as exc:  # argparse's own refusals (an unknown choice) exit 2 too
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert want in lines[-1], err
    if "invalid choice" not in want:
        assert len(lines) == 1 and lines[0].startswith("pdwire demo: ")


def _no_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    code = BLOCK_TORCH + f"import sys\nfrom pdwire.cli import main\nsys.exit(main({list(argv)!r}))\n"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def test_help_needs_no_torch_and_shows_every_default() -> None:
    done = _no_torch("demo", "--help")
    assert done.returncode == 0, done.stderr
    for text in ("(default: 2)", "(default: 4)", "(default: 24)", "(default: 60.0)", "--json", "exit status"):
        assert text in done.stdout
    refused = _no_torch("demo", "--page-size", "0")  # validation needs no torch either
    assert refused.returncode == 2 and refused.stderr.strip() == "pdwire demo: --page-size 0: must be 1..4096"


def test_without_torch_the_demo_names_the_extra_in_one_line() -> None:
    done = _no_torch("demo", "--backend", "local")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("pdwire demo: needs torch, which is not installed: pip install 'pdwire[demo]'")
    assert "torch==2.13.0" in line and "cpu" in line


def test_the_demo_registers_its_backend_only_when_asked() -> None:
    # importing every demo module (and the serve command's glue) registers nothing; the demo's
    # command, its rank processes and `pdwire serve` call register_mori_fake() where they pick one
    code = (
        "import importlib, pkgutil, pdwire.demo as demo\n"
        "from pdwire.runtime.backends.registry import known_backends\n"
        "for m in pkgutil.iter_modules(demo.__path__):\n"
        "    importlib.import_module(f'pdwire.demo.{m.name}')\n"
        "importlib.import_module('pdwire.serve_command')\n"
        "before = 'mori-fake' in known_backends()\n"
        "demo.register_mori_fake()\n"
        "print(before, 'mori-fake' in known_backends())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["False", "True"]


def test_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdwire", "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.startswith("pdwire 0.1.0 (wire protocol versions 1.0, ")


@pytest.mark.slow
def test_json_report_mla_ignores_heads_and_no_progress_bar_off_a_terminal() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdwire", "demo", "--backend", "local", "--mla", "--heads", "7",
         "--prefill-tp", "1", "--decode-tp", "2", "--requests", "3", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # stdout is the JSON object alone
    assert report["result"] == "OK" and report["verified"] == report["requests"] == 3
    assert report["failed"] == [] and report["stray_writes"] == [] and report["bytes_moved"] > 0
    assert "kv_heads" not in report["model"] and report["model"]["mla"] is True
    assert "[#" not in done.stderr and "requests  " not in done.stderr  # no progress bar into a log


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_ctrl_c_stops_every_rank_and_removes_every_shared_memory_file() -> None:
    # in a private /dev/shm, so what other processes of this machine keep there does not count
    probe = ROOT / "tests" / "demo" / "interrupt_probe.py"
    demo = ["--backend", "local", "--prefill-tp", "2", "--decode-tp", "2", "--requests", "1000",
            "--min-tokens", "32", "--max-tokens", "256", "--layers", "1", "--heads", "2", "--head-dim", "16",
            "--timeout", "300"]  # fmt: skip
    script = f"mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} {probe} " + " ".join(demo)
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT, capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert any(n.startswith("pdwire-") for n in got["during"]), got["during"]  # the check can fail
    seen = f"rc {got['rc']}\nstderr:\n{got['stderr'][-4000:]}\nstdout:\n{got['stdout'][-2000:]}"
    assert got["rc"] == 130, seen
    assert "Traceback" not in got["stderr"] and "KeyboardInterrupt" not in got["stderr"], got["stderr"]
    assert "interrupted" in got["stderr"] and "stopped 4 rank processes" in got["stderr"]
    assert got["after"] == [], got["after"]
    assert not got["group_alive"]
