"""A/B of benchmarks/control_plane.py: a released build against the working tree, in one run.

    .venv/bin/python benchmarks/control_plane_ab.py [--ref 6c4b694] [--pairs 4] [--rounds 3]

The VM this project runs on changes speed by up to 3x between phases, so figures from two
sessions cannot be compared. This script installs the build at ``--ref`` (a commit or release
tag) into a temporary folder, then runs the working tree's ``control_plane.py`` against each
build in alternating order (A B, B A, ...) so that both see the same machine, and reports per
row the median over the pairs of each build and the ratio current / reference. The raw pyzmq
round trip each run measures is reported alongside as the machine's yardstick.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import arguments, head, load, machine

ROOT = Path(__file__).resolve().parent.parent
NUM = r"(-?[\d.]+) ms"
OPT = rf"(?:{NUM}|-)"
ROW = re.compile(rf"^\| (\w+) \| (\d+) \| \d+ \| {NUM} \| {NUM} \| {NUM} \| {NUM} \| {OPT} \| {OPT} \|")
RTT = re.compile(r"raw pyzmq round trip .* p50 (\d+) us")
METRICS = ("latency p50", "latency p99", "data p50", "overhead p50", "amortised", "wall/request")


def install(ref: str, into: Path) -> Path:
    """A regular (non-editable) install of the build at ``ref``; returns its site folder."""
    tree, site = into / "src", into / "site"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target"]
    subprocess.run([*pip, str(site), str(tree)], check=True, capture_output=True)
    return site


def run(site: Path | None, backends: str, rounds: int, cwd: Path) -> dict[str, float]:
    """One control_plane.py run against the build installed in ``site`` (None: the working
    tree's editable install); returns {"backend c<n> metric": ms}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDWIRE_")}
    if site is not None:  # the reference build shadows the editable install of the working tree
        env["PYTHONPATH"] = str(site)
    script = ROOT / "benchmarks" / "control_plane.py"
    args = [sys.executable, str(script), "--backends", backends, "--rounds", str(rounds)]
    # cwd outside the repository: '' on sys.path must not find the working tree's pdwire/
    out = subprocess.run(args, env=env, cwd=cwd, check=True, capture_output=True, text=True).stdout
    got: dict[str, float] = {}
    for line in out.splitlines():
        if m := RTT.search(line):
            got["raw pyzmq round trip"] = int(m.group(1)) / 1e3
        elif m := ROW.match(line):
            backend, conc, *values = m.groups()
            for name, value in zip(METRICS, values, strict=True):
                if value is not None:
                    got[f"{backend} c{conc} {name}"] = float(value)
    if not any(" c1 " in k for k in got):
        raise SystemExit(f"no result rows from {script}:\n{out}")
    return got


def which_runtime(site: Path | None, cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(site)) if site else dict(os.environ)
    probe = "import pdwire.runtime; print(pdwire.runtime.__file__)"
    return subprocess.run([sys.executable, "-c", probe], env=env, cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, backends="nixl,local")
    ap.add_argument("--ref", default="6c4b694", help="the reference build: a commit or release tag")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdwire-ab-") as tmp:
        base = Path(tmp)
        builds = {"reference": install(args.ref, base), "current": None}
        for name, site in builds.items():
            print(f"{name}: pdwire.runtime from {which_runtime(site, base)}")
        print(machine(load()))
        results: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
        for pair in range(args.pairs):
            order = list(builds) if pair % 2 == 0 else list(reversed(builds))
            for name in order:
                results[name].append(run(builds[name], args.backends, args.rounds, base))
                print(f"pair {pair + 1}/{args.pairs}: {name} done", file=sys.stderr, flush=True)
    print()
    print(f"Medians of {args.pairs} alternating runs each (ms); reference {args.ref}, current: working tree")
    print()
    print(head("row", "reference (range)", "current (range)", "current / reference"))
    for key in results["reference"][0]:
        ref, cur = ([r[key] for r in results[name] if key in r] for name in builds)
        ratio = statistics.median(cur) / statistics.median(ref)
        print(f"| {key} | {spread(ref)} | {spread(cur)} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
