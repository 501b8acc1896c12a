"""The demo model's layout and content, moved by the real planner with plain memmove (no engine).

Checks that every decode rank ends with exactly the shard it must hold, for hetero-TP pairs,
MLA and non-MLA hybrids, chunked KV, and that no byte outside the destination slots moved.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest

from pdwire.demo.content import (
    RoomSlots,
    fill,
    fill_sentinel,
    full_tensors,
    pages_for,
    reset,
    untouched_problems,
    verify,
)
from pdwire.demo.model import Capacity, ModelSpec, RankCaches, build_caches, bytes_needed
from pdwire.runtime.descriptors import DescriptorTable
from pdwire.runtime.planner import prepare_peer, route_decode_rank

SPEC = ModelSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, conv_blocks=(8, 8, 16), ssm_heads=4)
CAP = Capacity(pages=24, slots=4, swa_pages=8, aux_items=4)


def make(spec: ModelSpec, tp: int, rank: int) -> tuple[RankCaches, np.ndarray]:
    backing = np.zeros(bytes_needed(spec, tp, rank, CAP), dtype=np.uint8)
    return build_caches(spec, tp, rank, CAP, backing), backing


def _spec(mla: bool) -> ModelSpec:
    return replace(SPEC, mla=mla)


def pick(rng: np.random.Generator, pool: int, n: int) -> np.ndarray:
    return rng.permutation(pool)[:n].astype(np.int32)


def run(table: DescriptorTable) -> None:
    for s, d, n in zip(table.src_addr.tolist(), table.dst_addr.tolist(), table.length.tolist(), strict=True):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)])
def test_planner_moves_exactly_each_decode_shard(p: int, d: int, mla: bool) -> None:
    spec = _spec(mla)
    pre = [make(spec, p, r) for r in range(p)]
    dec = [make(spec, d, r) for r in range(d)]
    for c, _ in dec:
        fill_sentinel(c)
    rng = np.random.default_rng(0)
    tokens = 37  # 10 pages, the last partly used; SWA keeps 4
    pages, swa = pages_for(spec, tokens)
    full = full_tensors(spec, seed=1, room=5, tokens=tokens)
    src = RoomSlots(pick(rng, CAP.pages, pages), 1, pick(rng, CAP.swa_pages, swa), 2)
    for c, _ in pre:
        fill(c, src, full)
    dst_of = []
    for dr, (dc, _) in enumerate(dec):
        dst = RoomSlots(pick(rng, CAP.pages, pages), 3, pick(rng, CAP.swa_pages, swa), dr % 4)
        dst_of.append(dst)
        route = route_decode_rank(p, d, dr, is_mla=mla)
        for pr in route.prefill_ranks:
            plan = prepare_peer(pre[pr][0].memory, dc.memory)
            assert plan.is_dummy == (pr in route.dummy_prefill_ranks)
            for chunk, (a, b) in enumerate([(0, 3), (3, 7), (7, pages)]):
                run(plan.plan_kv_chunk(chunk, src.pages[a:b], dst.pages[a:b]).table)
            for g in plan.plan_state(src.state_indices(spec), dst.state_indices(spec)):
                run(g.table)
            run(plan.plan_aux(src.aux, dst.aux).table)
    for dr, (dc, _) in enumerate(dec):
        assert verify(dc, dst_of[dr], full) == []
        reset(dc, dst_of[dr])
        assert untouched_problems(dc) == []


def test_verify_reports_a_corrupted_byte_and_a_stray_write() -> None:
    spec = _spec(False)
    c, _ = make(spec, 2, 1)
    fill_sentinel(c)
    full = full_tensors(spec, 1, 9, 8)
    slots = RoomSlots(np.asarray([4, 6], dtype=np.int32), 2, np.asarray([1, 0], dtype=np.int32), 3)
    fill(c, slots, full)  # what a perfect transfer leaves
    assert verify(c, slots, full) == []
    c.tensors["mamba.conv"][1][2, 5, 0] ^= 1
    problems = verify(c, slots, full)
    assert len(problems) == 1 and problems[0].startswith("mamba.conv layer 1: 1 of")
    reset(c, slots)
    c.tensors["kv.v"][0][7, 0, 0, 0] = 1  # page 7 belongs to no room
    assert [x.split(":")[0] for x in untouched_problems(c)] == ["kv.v layer 0"]


def test_content_is_deterministic_and_differs_per_room() -> None:
    spec = _spec(True)
    a, b, c = full_tensors(spec, 1, 5, 20), full_tensors(spec, 1, 5, 20), full_tensors(spec, 1, 6, 20)
    assert all(bool((a[k] == b[k]).all()) for k in a)
    assert not bool((a["kv.latent"] == c["kv.latent"]).all())


def test_tp_that_does_not_divide_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match="does not divide by TP 3"):
        make(_spec(False), 3, 0)
