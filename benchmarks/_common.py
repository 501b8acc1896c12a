"""What every benchmark shares: the machine line, the timers, medians and markdown tables.

A script imports it as ``_common`` (``benchmarks/`` is on ``sys.path`` when a script runs).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import timeit
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

K = TypeVar("K")
TIMERS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def single_host() -> None:
    """UCX on loopback and NIXL's log quiet: both sides of every benchmark run on this host."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def arguments(doc: str | None, backends: str | None = None) -> argparse.ArgumentParser:
    """A parser whose ``--help`` prints the script's docstring (its method), with ``--backends``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if backends is not None:
        ap.add_argument("--backends", default=backends)
    return ap


def machine(*extra: str) -> str:
    """The line every benchmark starts with: the machine, the libraries, then ``extra``."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "cpu")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return ", ".join(
        [
            f"machine: {platform.machine()}, {model}, {os.cpu_count()} CPUs, {mem:.0f} GiB",
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
            f"numpy {np.__version__}",
            *extra,
        ]
    )


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def median_s(fn: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` calls, after ``warmup`` untimed ones."""
    samples = []
    for i in range(warmup + repeats):
        t = time.perf_counter()
        fn()
        if i >= warmup:
            samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def rows_table(
    src: int,
    dst: int,
    rows: int,
    length: int,
    strides: tuple[int, int],
    scatter: bool = False,
    dst_region: int = 0,
) -> Any:
    """A DescriptorTable of ``rows`` rows of ``length`` bytes: row i from ``src + i * strides[0]`` to
    ``dst + j * strides[1]``, j = i or, with ``scatter``, a fixed random permutation of the rows."""
    from pdwire.runtime.descriptors import DescriptorTable

    i = np.arange(rows, dtype=np.uint64)
    j = np.random.default_rng(0).permutation(rows).astype(np.uint64) if scatter else i
    s, d = i * np.uint64(strides[0]) + np.uint64(src), j * np.uint64(strides[1]) + np.uint64(dst)
    regions = np.zeros(rows, np.uint32), np.full(rows, dst_region, np.uint32)
    return DescriptorTable(s, d, np.full(rows, length, np.uint64), *regions)


def table_row(cells: Iterable[object]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def head(*columns: str) -> str:
    """A markdown table's header and rule lines."""
    return table_row(columns) + "\n|" + "---|" * len(columns)


# ---------------------------------------------------------------------------- interleaved rounds


def codec_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options every codec benchmark takes: rounds, a quick smoke mode and the timer."""
    ap = arguments(doc)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--quick", action="store_true", help="short runs (a smoke check, numbers are noisier)")
    ap.add_argument(
        "--timer", choices=sorted(TIMERS), default="wall", help="wall clock, or this process's CPU time"
    )
    return ap


def _calibrate(fn: Callable[[], object], clock: Callable[[], float], seconds: float) -> int:
    """How many calls of ``fn`` take about ``seconds``."""
    number = 1
    while timeit.Timer(fn, timer=clock).timeit(number=number) < seconds:
        number *= 2
    return number


def interleaved_us(
    fns: Mapping[K, Callable[[], object]], repeat: int, quick: bool, timer: str = "wall"
) -> dict[K, list[float]]:
    """Per-call µs of every function in each of ``repeat`` rounds, the functions taking turns.

    Each round times every function once (the mean over about 5 ms of calls, 1 ms with
    ``quick``), so each cell samples the same stretches of machine time: this shared VM
    swings between a fast and a slow phase (a plain Python loop runs up to 1.8x slower in
    the slow one), and a cell measured in one block would carry its phase into the ratio.
    ``timer="cpu"`` counts this process's CPU time only, so time other jobs took does not count.
    """
    clock = TIMERS[timer]
    numbers = {k: _calibrate(fn, clock, 0.001 if quick else 0.005) for k, fn in fns.items()}
    runs: dict[K, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            n = numbers[k]
            runs[k].append(timeit.Timer(fn, timer=clock).timeit(number=n) / n * 1e6)
    return runs


def reference_loop() -> object:
    """A fixed pure-Python workload timed with every benchmark: its spread shows the machine's phases
    (about 0.75 µs when this shared VM runs in its fast phase, 1.4 µs in its slow one)."""
    return sum(_REFERENCE_RANGE)


_REFERENCE_RANGE = range(100)


def reference_text(runs: list[float]) -> str:
    median, fastest = statistics.median(runs), min(runs)
    return f"reference loop (sum(range(100))) median {median:.2f} µs, fastest {fastest:.2f} µs"
