"""Shared by the codec benchmarks: today's hand-written frame helpers (the baseline) and the timer.

The helpers are written the way SGLang's PD code writes its frames: ``struct`` with native
``Q`` pointer lists, ``pack_int_lists`` (u32 count + u32 byte lengths + payloads) for lists of
lists, ASCII decimal integers, and everything unpacked back to Python lists.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import struct
import time
import timeit
from collections.abc import Callable, Mapping
from typing import TypeVar

import msgspec
import numpy as np


def pack_list_of_buffers(bufs: list[bytes]) -> bytes:
    if not bufs:
        return b""
    return struct.pack(f"<{len(bufs) + 1}I", len(bufs), *(len(b) for b in bufs)) + b"".join(bufs)


def unpack_list_of_buffers(buf: bytes) -> list[bytes]:
    if not buf:
        return []
    (n,) = struct.unpack_from("<I", buf, 0)
    lens = struct.unpack_from(f"<{n}I", buf, 4)
    pos, out = 4 + 4 * n, []
    for ln in lens:
        out.append(buf[pos : pos + ln])
        pos += ln
    return out


def pack_int_lists(lists: list[list[int]], fmt: str) -> bytes:
    return pack_list_of_buffers([struct.pack(f"<{len(a)}{fmt}", *a) for a in lists])


def unpack_int_lists(buf: bytes, fmt: str) -> list[list[int]]:
    if not buf:
        return []
    (n,) = struct.unpack_from("<I", buf, 0)
    lens = struct.unpack_from(f"<{n}I", buf, 4)
    pos, size, out = 4 + 4 * n, struct.calcsize(fmt), []
    for ln in lens:
        out.append(list(struct.unpack_from(f"<{ln // size}{fmt}", buf, pos)))
        pos += ln
    return out


def native_u64(ptrs: list[int]) -> bytes:
    return b"".join(struct.pack("Q", p) for p in ptrs)


def unpack_u64(buf: bytes) -> list[int]:
    return list(struct.unpack(f"{len(buf) // 8}Q", buf))


def ascii_int(v: int) -> bytes:
    return str(v).encode("ascii")


# ---------------------------------------------------------------------------- timing


K = TypeVar("K")
TIMERS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def codec_arguments(description: str) -> argparse.ArgumentParser:
    """The options every codec benchmark takes: rounds, a quick smoke mode and the timer."""
    ap = argparse.ArgumentParser(description=description)
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
    """A fixed pure-Python workload timed with every benchmark: its spread shows the machine's phases."""
    return sum(_REFERENCE_RANGE)


_REFERENCE_RANGE = range(100)


def machine_line(repeat: int, timer: str, load: float, reference: list[float]) -> str:
    """The header line every codec table starts with: machine, library versions, the reference loop."""
    return (
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"msgspec {msgspec.__version__}, numpy {np.__version__}; medians of {repeat} interleaved rounds "
        f"({timer} time); load average at start {load:.1f}; reference loop (sum(range(100))) "
        f"median {statistics.median(reference):.2f} µs, fastest {min(reference):.2f} µs"
    )
