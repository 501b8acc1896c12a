"""u64 arithmetic: regions above 4 GiB, index * item_len above 2**31 and 2**32, top of the address space."""

from __future__ import annotations

import numpy as np

from pdwire.runtime.planner import KvPool, Layout, ParallelRank, RankMemory, prepare_peer, regions
from pdwire.runtime.planner.reference_executor import AddressSpace, execute

ITEM = 1 << 20  # 1 MiB pages: index 5000 is ~4.9 GiB into the region


def _pool(base: int, pages: int, layout: Layout = Layout.NHD, heads: int = 4, tp: int = 1) -> KvPool:
    per_rank = heads // tp
    bytes_per_head = ITEM // (16 * heads)
    item = 16 * per_rank * bytes_per_head
    return KvPool(
        (base,), (base + (1 << 40),), (item * pages,), item, 16, layout, per_rank, heads, bytes_per_head
    )


def test_whole_page_addresses_are_exact_above_4_gib() -> None:
    src_base, dst_base = 0x7F00_0000_0000, (1 << 63) + (1 << 33)  # bit 63 set, as on XPU
    src = RankMemory(ParallelRank(1, 0), _pool(src_base, 1 << 14))
    dst = RankMemory(ParallelRank(1, 0), _pool(dst_base, 1 << 14))
    table = prepare_peer(src, dst).plan_kv_chunk(0, [5000, 16000], [9000, 2100]).table
    assert table.src_addr.dtype == np.uint64
    rows = sorted(zip(table.src_addr.tolist(), table.dst_addr.tolist(), table.length.tolist(), strict=True))
    expected = sorted(
        (sb + s * ITEM, db + d * ITEM, ITEM)
        for sb, db in ((src_base, dst_base), (src_base + (1 << 40), dst_base + (1 << 40)))
        for s, d in ((5000, 9000), (16000, 2100))
    )
    assert rows == expected
    assert len(table.rows_outside(regions(src), regions(dst))) == 0


def test_head_slices_land_exactly_at_offsets_above_2_pow_32() -> None:
    # Sparse backing: only the touched pages exist as numpy buffers, at their true 64-bit addresses.
    src_base, dst_base = 3 << 34, 11 << 34
    src = RankMemory(ParallelRank(1, 0), _pool(src_base, 1 << 13, Layout.NHD, heads=4, tp=1))
    dst = RankMemory(ParallelRank(2, 1), _pool(dst_base, 1 << 13, Layout.HND, heads=4, tp=2))
    src_page, dst_page = 6000, 4500  # 6000 * 1 MiB > 2**32; 4500 * 512 KiB > 2**31
    src_item, dst_item = src.kv.bytes_per_page, dst.kv.bytes_per_page  # type: ignore[union-attr]
    rng = np.random.default_rng(1)
    src_space, dst_space = AddressSpace(), AddressSpace()
    src_k = src_space.allocate(src_base + src_page * src_item, src_item, rng)
    src_space.allocate(src_base + (1 << 40) + src_page * src_item, src_item, rng)
    dst_k = dst_space.allocate(dst_base + dst_page * dst_item, dst_item, rng)
    dst_space.allocate(dst_base + (1 << 40) + dst_page * dst_item, dst_item, rng)
    table = prepare_peer(src, dst).plan_kv_chunk(0, [src_page], [dst_page]).table
    execute(table, src_space, dst_space, regions(src), regions(dst))
    bytes_per_head = ITEM // 64
    full = src_k.reshape(16, 4, bytes_per_head)  # NHD page holding all 4 heads
    expected = full[:, 2:4, :].transpose(1, 0, 2).reshape(-1)  # decode rank 1 holds heads 2,3 in HND
    assert np.array_equal(dst_k, expected)
    # NHD -> HND: a (token, head) unit is adjacent to nothing on both sides: K/V x 16 tokens x 2 heads.
    assert len(table) == 2 * 16 * 2
    assert len(table.mergeable_pairs()) == 0
