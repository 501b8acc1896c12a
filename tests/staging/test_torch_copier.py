"""The torch copier on CPU tensors: the same bytes as a row-by-row copy for gathers, scatters and
rows on no grid, rows outside every tensor refused before anything is copied, staging buffers
allocated where it copies. On a GPU the same code runs with CUDA tensors and a stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from pdwire.runtime.descriptors import MemoryKind
from pdwire.runtime.staging import CopyError
from pdwire.runtime.staging.torch_copy import TorchCopier
from tests.staging.test_pieces import COPY_CASES, _expected, _regions, _table, copy_case


@settings(max_examples=100, deadline=None)
@given(**COPY_CASES)
def test_torch_copier_matches_a_row_by_row_copy(
    length: int, count: int, grid: bool, seed: int, direction: str
) -> None:
    src, dst, regions, rows = copy_case(length, count, grid, seed, direction)
    want = _expected(rows, [src, dst])
    TorchCopier([torch.from_numpy(src), torch.from_numpy(dst)]).copy(_table(rows, regions))
    assert np.array_equal(dst, want[1]) and np.array_equal(src, want[0])


def test_torch_copier_refuses_a_row_outside_its_tensors_and_copies_nothing() -> None:
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
    table = _table([(0, 0, 1, 0, 512), (0, 3800, 1, 512, 512)], _regions(src, dst))
    with pytest.raises(CopyError, match=r"row 1: src .* is in no tensor"):
        TorchCopier([torch.from_numpy(src), torch.from_numpy(dst)]).copy(table)
    assert not dst.any()


def test_torch_copier_allocates_its_staging_buffer_on_its_device_and_copies_into_it() -> None:
    src = np.arange(4096, dtype=np.uint8)
    copier = TorchCopier([torch.from_numpy(src)])
    region = copier.buffer("pdwire-staging", 1024)
    assert region.length == 1024 and region.kind is MemoryKind.DRAM and region.name == "pdwire-staging"
    staging = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 1024).from_address(region.base))
    table = _table([(0, 100, 1, 0, 512), (0, 2000, 1, 512, 512)], [_regions(src)[0], region])
    copier.copy(table)
    assert np.array_equal(staging[:512], src[100:612]) and np.array_equal(staging[512:], src[2000:2512])


def test_a_torch_copier_copies_on_one_device() -> None:
    with pytest.raises(CopyError, match="on one device"):
        TorchCopier([])
