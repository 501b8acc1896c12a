"""The staging cost model's constants, measured: engine cost per post, per row and per byte, and the
host copy's cost per row and per byte.

    .venv/bin/python benchmarks/staging_costs.py [--backends nixl,local] [--repeats 5]

Engine: two agents of one backend in this process; tables of R rows of L bytes (scattered
destinations) for R in 256..16384 and L in 512, 4096, 32768; post -> DONE, medians; then the
least-squares fit ``t = post + R * row + R * L * byte``. Host copy: ``HostCopier.copy`` of a
gather table (R rows of L bytes at a stride of 2L into one contiguous range), fitted the same
way. Prints each fit as the ``Costs(...)`` line ``runtime/staging/cost.py`` takes, and the
worst relative error of the fit over the grid.
"""

from __future__ import annotations

import os
import time

import numpy as np
from _common import arguments, load, machine, median_s, rows_table, single_host

from pdwire.runtime.backends import available_backends, create_backend
from pdwire.runtime.descriptors import DescriptorTable, Region
from pdwire.runtime.staging import HostCopier

ROWS = (256, 1024, 4096, 16384)
LENGTHS = (512, 4096, 32768)


def _fit(samples: list[tuple[int, int, float]]) -> tuple[np.ndarray, float]:
    """Least squares of t = a + rows * b + bytes * c in relative error (every sample weighs the
    same); returns (a, b, c) and the worst relative error."""
    a = np.asarray([[1.0, r, r * n] for r, n, _ in samples])
    t = np.asarray([s for *_, s in samples])
    coef, *_ = np.linalg.lstsq(a / t[:, None], np.ones(len(t)), rcond=None)
    coef = np.maximum(coef, 0.0)
    err = float(np.max(np.abs(a @ coef - t) / t))
    return coef, err


def engine(name: str, repeats: int) -> tuple[np.ndarray, float]:
    size = 2 * max(ROWS) * max(LENGTHS)
    a = create_backend(name, agent_name=f"cost-a-{os.getpid()}")
    b = create_backend(name, agent_name=f"cost-b-{os.getpid()}")
    try:
        sa, sb = a.allocate("src", size), b.allocate("dst", size)
        a.register([sa.region()])
        b.register([sb.region()])
        peer = a.add_peer(b.local_metadata())
        samples = []
        for length in LENGTHS:
            for rows in ROWS:
                if rows * length * 2 > size:
                    continue
                table = rows_table(
                    sa.address, sb.address, rows, length, (2 * length, 2 * length), scatter=True
                )

                def transfer(table: DescriptorTable = table) -> None:
                    h = a.post(peer, table, b"x")
                    while not (st := a.poll(h)).finished:
                        time.sleep(2e-5)  # Backend.wait backs off to 2 ms, which would be measured
                    a.release(h)
                    assert st.state.value == "DONE", st
                    b.receive_notifications()

                samples.append((rows, length, median_s(transfer, repeats, warmup=1)))
        return _fit(samples)
    finally:
        a.close()
        b.close()


def host_copy(repeats: int) -> tuple[np.ndarray, float]:
    size = 2 * max(ROWS) * max(LENGTHS)
    src = np.ones(size, np.uint8)
    dst = np.zeros(size // 2, np.uint8)
    dst.fill(1)
    regions = [Region(src.ctypes.data, size, name="src"), Region(dst.ctypes.data, len(dst), name="staging")]
    copier = HostCopier(regions)
    samples = []
    for length in LENGTHS:
        for rows in ROWS:
            table = rows_table(
                regions[0].base, regions[1].base, rows, length, (2 * length, length), dst_region=1
            )
            samples.append((rows, length, median_s(lambda t=table: copier.copy(t), repeats, warmup=1)))
    return _fit(samples)


def main() -> None:
    ap = arguments(__doc__, backends="nixl,local")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    single_host()
    print(machine(load()))
    (_, row, byte), err = host_copy(args.repeats)
    rate = 1 / max(byte, 1e-15) / 1e9
    print(f"host copy: copy_row_s={row * 1e6:.3f}e-6, copy_byte_s=1 / {rate:.2f}e9 (fit error {err:.0%})")
    for name in args.backends.split(","):
        if name not in available_backends():
            continue
        (post, row, byte), err = engine(name, args.repeats)
        print(
            f'"{name}": Costs(post_s={post * 1e6:.0f}e-6, engine_row_s={row * 1e6:.3f}e-6, '
            f"engine_byte_s=1 / {1 / max(byte, 1e-15) / 1e9:.2f}e9)  (fit error {err:.0%})"
        )
    print(f"{load()} at end")


if __name__ == "__main__":
    main()
