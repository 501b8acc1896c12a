"""Staged and direct writes land the same bytes, on every backend.

A prefill-like table (per "token" a 512-byte head slice of a 1 KiB source row, pages scattered on
the destination) is posted twice to a real target process: as planned (one row per slice) into
one half of the target, and staged into the other half: gathered by the host copier into a
staging buffer the initiator allocated and registered after its other memory, then written as the
few large rows ``staging.transform.gather`` makes. The target hashes each half the moment its
notification arrives: both must equal the expected bytes (computed with numpy slicing).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pdwire.runtime.backends import TransferState
from pdwire.runtime.descriptors import DescriptorTable
from pdwire.runtime.staging import HostCopier, gather, scatter_write
from tests.backends.test_conformance import Target, params, sha, source

PAGES, TOKENS, ROW, SLICE = 48, 64, 1024, 512
HALF = PAGES * TOKENS * SLICE


@pytest.fixture
def target() -> Iterator[Any]:
    made: list[Target] = []

    def make(backend: str, nbytes: int) -> Target:
        made.append(Target(backend, nbytes))
        return made[-1]

    yield make
    for t in made:
        t.kill()


def slices(src: int, dst: int, perm: np.ndarray) -> DescriptorTable:
    p = np.repeat(np.arange(PAGES), TOKENS)
    t = np.tile(np.arange(TOKENS), PAGES)
    s = src + (p * TOKENS + t) * ROW + SLICE  # the second half of each source row
    d = dst + (perm[p] * TOKENS + t) * SLICE
    n = len(s)
    z = np.zeros(n, np.uint32)
    return DescriptorTable(
        s.astype(np.uint64), d.astype(np.uint64), np.full(n, SLICE, np.uint64), z, z.copy()
    )


@pytest.mark.parametrize("name", params())
def test_a_staged_table_lands_what_the_direct_table_lands(name: str, backends: Any, target: Any) -> None:
    tgt = target(name, 2 * HALF)
    a = backends(name, agent_name=f"{name}-stager")
    src = source(a, PAGES * TOKENS * ROW, seed=11)
    staging = a.allocate("staging", HALF)
    (staging_region,) = a.register([staging.region()])  # after the source, as a worker registers it
    peer = a.add_peer(tgt.md)
    d0 = peer.regions[0].base
    perm = np.random.default_rng(4).permutation(PAGES)
    direct = slices(src.address, d0, perm)
    plan = gather(slices(src.address, d0 + HALF, perm), staging.address, staging_region)
    assert len(plan.write) < len(direct) // TOKENS + PAGES  # one row per destination page run at most
    HostCopier(a.regions).copy(plan.gather)
    h1 = a.post(peer, direct, f"direct:0:{HALF}".encode())
    h2 = a.post(peer, plan.write, f"staged:{HALF}:{HALF}".encode())
    assert a.wait(h1, 60).state is TransferState.DONE
    assert a.wait(h2, 60).state is TransferState.DONE
    want = np.empty((PAGES, TOKENS, SLICE), np.uint8)
    want[perm] = src.array.reshape(PAGES, TOKENS, ROW)[:, :, SLICE:]
    notes = {n["payload"]: n["sha"] for n in tgt.notifications(2)}
    assert notes == {f"direct:0:{HALF}": sha(want), f"staged:{HALF}:{HALF}": sha(want)}
    a.release(h1)
    a.release(h2)


def whole_rows_into_slices(src: int, dst: int, perm: np.ndarray) -> DescriptorTable:
    """The decode-side scatter shape: per "token" a whole 512-byte source row (a page of them is
    contiguous) into the second half of a 1 KiB destination row, pages permuted."""
    p = np.repeat(np.arange(PAGES), TOKENS)
    t = np.tile(np.arange(TOKENS), PAGES)
    s = src + (p * TOKENS + t) * SLICE
    d = dst + (perm[p] * TOKENS + t) * ROW + SLICE
    n = len(s)
    z = np.zeros(n, np.uint32)
    return DescriptorTable(
        s.astype(np.uint64), d.astype(np.uint64), np.full(n, SLICE, np.uint64), z, z.copy()
    )


@pytest.mark.parametrize("name", params())
def test_a_scatter_write_lands_the_destination_bytes_in_destination_order(
    name: str, backends: Any, target: Any
) -> None:
    """What a scattering prefill rank posts (``scatter_write``: source rows into the decode
    rank's receive staging range, in destination order) lands, on every engine, exactly the bytes
    the direct table lands, in the order the decode rank's own copy reads them; the engine sees
    one row per source page instead of one per token."""
    span = PAGES * TOKENS * ROW
    tgt = target(name, 2 * span)
    a = backends(name, agent_name=f"{name}-scatterer")
    src = source(a, PAGES * TOKENS * SLICE, seed=12)
    peer = a.add_peer(tgt.md)
    d0 = peer.regions[0].base
    perm = np.random.default_rng(5).permutation(PAGES)
    direct = whole_rows_into_slices(src.address, d0, perm)
    write = scatter_write(direct, d0 + span, 0)  # the staging range: the target's second half
    assert len(write) <= PAGES and len(direct) == PAGES * TOKENS  # pages adjacent on both sides join
    h1 = a.post(peer, direct, f"direct:0:{span}".encode())
    h2 = a.post(peer, write, f"staged:{span}:{span}".encode())
    assert a.wait(h1, 60).state is TransferState.DONE
    assert a.wait(h2, 60).state is TransferState.DONE
    rows = src.array.reshape(PAGES, TOKENS, SLICE)
    placed = np.zeros((PAGES, TOKENS, ROW), np.uint8)
    placed[perm, :, SLICE:] = rows
    staged = np.zeros(span, np.uint8)
    in_order = rows[np.argsort(perm)].reshape(-1)  # destination order: pages by their place
    staged[: len(in_order)] = in_order
    notes = {n["payload"]: n["sha"] for n in tgt.notifications(2)}
    assert notes == {f"direct:0:{span}": sha(placed), f"staged:{span}:{span}": sha(staged)}
    a.release(h1)
    a.release(h2)
