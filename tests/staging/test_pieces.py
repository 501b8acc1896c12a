"""The host copier, the staging arena and the cost model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdwire.runtime.descriptors import DescriptorTable, MemoryKind, Region
from pdwire.runtime.staging import (
    CopyError,
    CostModel,
    Costs,
    HostCopier,
    Mode,
    StagingArena,
    gather,
    scatter,
)


def _regions(*buffers: np.ndarray) -> list[Region]:
    return [Region(b.ctypes.data, len(b), name=f"r{i}") for i, b in enumerate(buffers)]


def _table(rows: list[tuple[int, int, int, int, int]], regions: list[Region]) -> DescriptorTable:
    """rows of (src region, src offset, dst region, dst offset, length)."""
    a = np.asarray(rows, dtype=np.uint64).reshape(-1, 5)
    bases = np.asarray([r.base for r in regions], np.uint64)
    return DescriptorTable(
        bases[a[:, 0].astype(int)] + a[:, 1], bases[a[:, 2].astype(int)] + a[:, 3], a[:, 4].copy(),
        a[:, 0].astype(np.uint32), a[:, 2].astype(np.uint32),
    )  # fmt: skip


def _expected(rows: list[tuple[int, int, int, int, int]], buffers: list[np.ndarray]) -> list[np.ndarray]:
    out = [b.copy() for b in buffers]
    for sr, so, dr, do, n in rows:
        out[dr][do : do + n] = buffers[sr][so : so + n]
    return out


def copy_case(
    length: int, count: int, grid: bool, seed: int, direction: str
) -> tuple[np.ndarray, np.ndarray, list[Region], list[tuple[int, int, int, int, int]]]:
    """(src, dst, their regions, rows from src to dst) of a gather, a scatter or neither."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, size=length * count * 6 + 64, dtype=np.uint8)
    dst = rng.integers(0, 256, size=length * count * 6 + 64, dtype=np.uint8)
    # disjoint places two rows apart, in random order; off the grid every other row moves a little
    slots = rng.permutation(3 * count)[:count] * 2 * length
    scattered = [int(p) + (0 if grid or i % 2 == 0 else int(rng.integers(1, 8))) for i, p in enumerate(slots)]
    start = int(rng.integers(0, 16))
    packed = [start + i * length for i in range(len(scattered))]
    pairs = {
        "gather": (scattered, packed),
        "scatter": (packed, scattered),
        "neither": (scattered, scattered[::-1]),
    }
    rows = [(0, s, 1, d, length) for s, d in zip(*pairs[direction], strict=True)]
    return src, dst, _regions(src, dst), rows


COPY_CASES = dict(
    length=st.sampled_from([8, 24, 512, 1000, 70000]),
    count=st.integers(1, 40),
    grid=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    direction=st.sampled_from(["gather", "scatter", "neither"]),
)


@settings(max_examples=200)
@given(**COPY_CASES)
def test_host_copier_matches_a_row_by_row_copy(
    length: int, count: int, grid: bool, seed: int, direction: str
) -> None:
    src, dst, regions, rows = copy_case(length, count, grid, seed, direction)
    want = _expected(rows, [src, dst])
    HostCopier(regions).copy(_table(rows, regions))
    assert np.array_equal(dst, want[1]) and np.array_equal(src, want[0])


def test_host_copier_refuses_a_row_outside_its_region_and_copies_nothing() -> None:
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
    regions = _regions(src, dst)
    table = _table([(0, 0, 1, 0, 512), (0, 3800, 1, 512, 512)], regions)
    with pytest.raises(CopyError, match="row 1: src"):
        HostCopier(regions).copy(table)
    assert not dst.any()


def test_staged_steps_through_the_host_copier_write_what_direct_writes() -> None:
    """A gather then the staged write, both executed on real memory, equal the direct table."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, size=64 * 1024, dtype=np.uint8)
    direct_dst, staged_dst = np.zeros(32 * 1024, np.uint8), np.zeros(32 * 1024, np.uint8)
    staging = np.zeros(32 * 1024, np.uint8)
    # NHD-like: 64 tokens of 1 KiB on the source, 512 B slices packed on the destination
    rows = [(0, t * 1024 + 512, 1, t * 512, 512) for t in range(64)]
    regions = _regions(src, direct_dst, staging)
    HostCopier(regions).copy(_table(rows, regions))
    regions2 = _regions(src, staged_dst, staging)
    plan = gather(_table(rows, regions2), regions2[2].base, 2)
    assert len(plan.write) == 1
    HostCopier(regions2).copy(plan.gather)
    HostCopier(regions2).copy(plan.write)  # the engine's part, here a local copy
    assert np.array_equal(direct_dst, staged_dst)


def test_arena_reuses_freed_ranges_and_never_overcommits() -> None:
    arena = StagingArena(64 << 10)
    a = arena.alloc(20 << 10)
    b = arena.alloc(20 << 10)
    c = arena.alloc(20 << 10)
    assert (a, b, c) == (0, 20 << 10, 40 << 10)
    assert arena.alloc(8 << 10) is None  # 4 KiB left
    arena.free(b)
    assert arena.alloc(24 << 10) is None  # 20 KiB hole, 4 KiB tail: no contiguous 24
    assert arena.alloc(16 << 10) == 20 << 10
    arena.free(a)
    arena.free(c)
    arena.free(20 << 10)
    assert arena.in_use == 0 and arena.alloc(64 << 10) == 0
    assert not arena.fits_ever(65 << 10) and not StagingArena(0).fits_ever(1)


def _nhd_table(tokens: int, pages: int) -> DescriptorTable:
    n = tokens * pages
    s = np.arange(n, dtype=np.uint64) * np.uint64(1024)
    d = np.arange(n, dtype=np.uint64) * np.uint64(512)
    return DescriptorTable(
        s, d + np.uint64(1 << 40), np.full(n, 512, np.uint64), np.zeros(n, np.uint32), np.zeros(n, np.uint32)
    )


def test_cost_model_stages_many_small_rows_and_leaves_few_large_ones_direct() -> None:
    nixl = CostModel(Costs(post_s=60e-6, engine_row_s=2.2e-6, engine_byte_s=1 / 5e9))
    small = nixl.choose(_nhd_table(64, 64))  # 4096 rows of 512 B, destinations contiguous
    assert small.mode is Mode.GATHER and small.saving > 0.5
    big = _nhd_table(1, 64)
    big = DescriptorTable(
        big.src_addr * np.uint64(64),
        big.dst_addr,
        np.full(64, 32768, np.uint64),
        big.src_region,
        big.dst_region,
    )
    assert nixl.choose(big).mode is Mode.DIRECT  # 64 rows: below min_rows
    cheap_rows = CostModel(Costs(post_s=60e-6, engine_row_s=0.05e-6, engine_byte_s=1 / 5e9))
    choice = cheap_rows.choose(_nhd_table(64, 64))
    assert choice.mode is Mode.DIRECT  # an engine this cheap per row gains nothing from a copy
    assert set(choice.estimates) == {Mode.DIRECT, Mode.GATHER}
    assert (
        CostModel.for_backend("nixl").choose(_nhd_table(64, 64), modes=(Mode.GATHER, Mode.SCATTER)).mode
        is Mode.GATHER
    )
    assert len(scatter(_nhd_table(64, 4), 0, 1).write) == 64 * 4  # strided sources stay rows


def test_host_copier_refuses_device_memory_by_row() -> None:
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
    regions = _regions(src, dst)
    regions[1] = Region(regions[1].base, regions[1].length, MemoryKind.VRAM, name="gpu")
    with pytest.raises(CopyError, match="row 0: dst region 1 is device memory"):
        HostCopier(regions).copy(_table([(0, 0, 1, 0, 512)], regions))
