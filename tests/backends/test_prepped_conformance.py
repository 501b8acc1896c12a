"""Repeated slot-grid layouts: every backend writes exactly the bytes the rows name, however many
times a layout repeats; on NIXL the repeats go through prepped descriptor lists by themselves.

A table whose rows are all one length, each a whole slot of that length in its region (a KV page
grid, or head slices of a few hundred bytes), is what the planner gives for every chunk of a
request: the same layout, other slots. Each post is checked against a numpy oracle of the
rows; on NIXL the first post of a layout goes the ordinary way and the next ones through
``make_prepped_xfer``, and tables off the grid (a row not slot-aligned, rows of two lengths)
never do.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from pdwire.runtime.backends import TransferState
from pdwire.runtime.backends.nixl import NixlBackend
from pdwire.runtime.descriptors import DescriptorTable
from tests.backends.test_conformance import params, source

SLOT = 256
SIZE = 1 << 20  # a region: 4096 slots
ROWS = 512


def grid_table(
    rng: np.random.Generator, src: list[Any], dst: list[Any], *, shift: int = 0
) -> DescriptorTable:
    """ROWS slot-sized rows from random slots of ``src``'s regions to distinct slots of ``dst``'s."""
    sreg = rng.integers(0, len(src), ROWS).astype(np.uint32)
    dreg = rng.integers(0, len(dst), ROWS).astype(np.uint32)
    slots = SIZE // SLOT
    sslot = rng.integers(0, slots, ROWS).astype(np.uint64)
    # distinct destinations, so that the oracle is the rows applied in any order
    flat = rng.permutation(len(dst) * slots)[:ROWS]
    dreg, dslot = (flat // slots).astype(np.uint32), (flat % slots).astype(np.uint64)
    sbase = np.array([b.address for b in src], dtype=np.uint64)
    dbase = np.array([b.address for b in dst], dtype=np.uint64)
    return DescriptorTable(
        sbase[sreg] + sslot * np.uint64(SLOT) + np.uint64(shift),
        dbase[dreg] + dslot * np.uint64(SLOT),
        np.full(ROWS, SLOT, dtype=np.uint64),
        sreg,
        dreg,
    )


def prepped(b: Any) -> int:
    return b.prepped_posts if isinstance(b, NixlBackend) else 0


def oracle(t: DescriptorTable, src: list[Any], dst: list[Any], want: list[np.ndarray]) -> None:
    for i in range(len(t)):
        s, d = int(t.src_region[i]), int(t.dst_region[i])
        so, do = int(t.src_addr[i]) - src[s].address, int(t.dst_addr[i]) - dst[d].address
        want[d][do : do + int(t.length[i])] = src[s].array[so : so + int(t.length[i])]


@pytest.mark.parametrize("name", params())
def test_repeated_grid_layouts_land_exactly_their_rows(name: str, backends: Any) -> None:
    a, b = backends(name, agent_name=f"{name}-grid-a"), backends(name, agent_name=f"{name}-grid-b")
    src = [source(a, SIZE, seed=21 + i) for i in range(2)]
    dst = [b.allocate(f"dst{i}", SIZE) for i in range(2)]
    b.register([d.region() for d in dst])
    peer = a.add_peer(b.local_metadata())
    want = [np.zeros(SIZE, dtype=np.uint8) for _ in dst]
    rng = np.random.default_rng(4)
    tables = [grid_table(rng, src, dst) for _ in range(4)]
    off_grid = grid_table(rng, src, dst, shift=1)  # every row a byte past its slot
    two_lengths = grid_table(rng, src, dst)
    two_lengths.length[::2] = SLOT // 2
    for i, t in enumerate([*tables, off_grid, off_grid, two_lengths, two_lengths]):
        before = prepped(a)
        h = a.post(peer, t, f"grid-{i}".encode())
        assert a.wait(h, 30).state is TransferState.DONE
        a.release(h)
        oracle(t, src, dst, want)
        for d, w in zip(dst, want, strict=True):
            assert np.array_equal(d.array, w), (name, i)
        got: list[bytes] = []
        for _ in range(200):
            got += [n.payload for n in b.receive_notifications()]
            if got:
                break
            time.sleep(0.01)
        assert got == [f"grid-{i}".encode()], (name, i, got)
        if name == "nixl":  # the repeats of the grid layout, and nothing off it, went prepped
            assert prepped(a) - before == (1 if 1 <= i < len(tables) else 0), i
