"""The torch helper describes tensors exactly as the planner models them, and refuses what it
cannot describe by name; the rest of pdwire imports without torch at all."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from pdwire.runtime import torch_memory as tm
from pdwire.runtime.engine import (
    ConfigError,
    Indexing,
    KvPool,
    Layout,
    MemoryKind,
    ParallelRank,
    RankMemory,
    StateKind,
    StatePool,
    regions,
)
from pdwire.runtime.planner import prepare_peer


def test_a_hybrid_rank_is_described_from_its_tensors() -> None:
    pages, heads, page, dim = 6, 2, 4, 8
    k = [torch.zeros(pages, heads, page, dim, dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.zeros(pages, heads, page, dim, dtype=torch.bfloat16) for _ in range(2)]
    kv = tm.kv_pool(k, v, page_size=page, layout=Layout.HND, kv_heads_per_rank=heads, total_kv_heads=8)
    assert kv.k_base_addrs == tuple(t.data_ptr() for t in k) and kv.v_base_addrs == tuple(
        t.data_ptr() for t in v
    )
    assert (
        kv.bytes_per_page == heads * page * dim * 2
        and kv.region_lens == (pages * heads * page * dim * 2,) * 2
    )
    assert (kv.bytes_per_head, kv.memory_kind, kv.kv_heads_per_rank, kv.total_kv_heads) == (
        dim * 2,
        MemoryKind.DRAM,
        2,
        8,
    )
    conv = tm.state_tensor(
        "conv", [torch.zeros(3, 16, 4, dtype=torch.float16)], sharded=True, sub_blocks=(16, 16, 32)
    )
    assert (conv.bytes_per_slot, conv.sharded_axis_size, conv.sub_block_sizes) == (
        16 * 4 * 2,
        16,
        (16, 16, 32),
    )
    mamba = tm.state_component(StateKind.MAMBA, Indexing.SLOT, [conv], device="cpu")
    aux = tm.aux_buffer("out", torch.zeros(5, 8, dtype=torch.int32))
    assert (aux.bytes_per_item, aux.region_len) == (32, 160)
    memory = RankMemory(ParallelRank(4, 1), kv, (mamba,), (aux,))
    assert len(regions(memory)) == 2 + 2 + 1 + 1  # K and V per layer, one conv layer, aux


def test_mla_latent_pool() -> None:
    lat = [torch.zeros(4, 16, 1, 64, dtype=torch.int8)]
    kv = tm.kv_pool(
        lat, None, page_size=16, layout=Layout.NHD, kv_heads_per_rank=1, total_kv_heads=1, is_mla=True
    )
    assert (kv.is_mla, kv.v_base_addrs, kv.bytes_per_head, kv.bytes_per_page) == (True, (), 64, 16 * 64)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: tm.state_tensor("t", [torch.zeros(8, 32).as_strided((8, 32), (16, 1))]), "pages overlap"),
        (lambda: tm.state_tensor("t", [torch.zeros(4, 3, 5)], sharded=3), "not a per-slot axis"),
        (lambda: tm.aux_buffer("a", torch.zeros(4, 8, dtype=torch.uint8)[:, :4]), "must be packed"),
        (lambda: tm.state_tensor("t", [torch.zeros(4, 8), torch.zeros(4, 9)]), "different sizes"),
        (lambda: tm.state_tensor("t", [torch.zeros(4, 8)], sub_blocks=(4, 4)), "pass sharded="),
        (lambda: tm.state_tensor("t", [[1, 2]]), "must be a torch.Tensor"),
        (lambda: tm.state_tensor("t", []), "non-empty sequence"),
        (
            lambda: tm.kv_pool([torch.zeros(4, 8)], [torch.zeros(5, 8)], page_size=2, layout=Layout.NHD,
                               kv_heads_per_rank=1, total_kv_heads=1),
            "same number of pages",
        ),
        (
            lambda: tm.kv_pool([torch.zeros(4, 8)], None, page_size=2, layout=Layout.NHD, kv_heads_per_rank=1,
                               total_kv_heads=1),
            "an MLA pool has no V tensors",
        ),
    ],
)  # fmt: skip
def test_what_cannot_be_described_is_refused_by_name(make, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=needle):
        make()


def test_padded_pages_interleaved_k_v_and_a_shared_mamba_page_are_described_with_strides_and_offsets() -> (
    None
):
    kv = torch.zeros(5, 2, 4, 2, 8, dtype=torch.uint8)  # vLLM: [blocks, K|V, block_size, heads, head_size]
    pool = tm.kv_pool(
        [kv[:, 0]], [kv[:, 1]], page_size=4, layout=Layout.NHD, kv_heads_per_rank=2, total_kv_heads=2
    )
    page = 4 * 2 * 8
    assert pool.k_base_addrs == pool.v_base_addrs == (kv.data_ptr(),)
    assert (pool.page_stride, pool.k_offset, pool.v_offset, pool.bytes_per_page) == (2 * page, 0, page, page)
    assert pool.region_lens == (kv.numel(),)  # the whole tensor, registered once
    mamba_page = torch.zeros(3, 100, dtype=torch.uint8)  # conv and SSM state in one padded page
    conv = mamba_page[:, :24].view(3, 6, 4)
    ssm = mamba_page[:, 24:56].view(3, 2, 16)
    conv_t = tm.state_tensor("conv", [conv], sharded=True)
    ssm_t = tm.state_tensor("ssm", [ssm], sharded=True)
    assert (conv_t.bytes_per_slot, conv_t.slot_stride) == (24, 100)
    c = tm.state_component(StateKind.MAMBA, Indexing.SLOT, [conv_t, ssm_t], device="cpu")
    a, b = c.tensors
    assert a.base_addrs == b.base_addrs == (mamba_page.data_ptr(),) and (a.offset, b.offset) == (0, 24)
    transposed = tm.state_tensor("conv_t", [torch.zeros(3, 3, 8)], sharded=2)  # [slots, kernel-1, dim/TP]
    assert (transposed.sharded_axis_size, transposed.outer_rows) == (8, 3)


def _moved(
    src: RankMemory, dst: RankMemory, src_pages: list[int], dst_pages: list[int], slots: tuple[int, int]
) -> None:
    """Plan one request with the planner and execute it as plain memmoves."""
    plan = prepare_peer(src, dst).plan_request(
        np.asarray(src_pages), np.asarray(dst_pages), [[slots[0]]], [[slots[1]]]
    )
    t = plan.table()
    for s_, d_, n_ in zip(t.src_addr.tolist(), t.dst_addr.tolist(), t.length.tolist(), strict=True):
        ctypes.memmove(d_, s_, n_)


def test_a_vllm_like_strided_layout_moves_byte_for_byte_into_a_packed_one_across_tp() -> None:
    g = torch.Generator().manual_seed(5)
    blocks, page, heads, hd, conv_c, width, ssm_h, state = 6, 4, 4, 8, 8, 3, 4, 16
    kv = torch.randint(0, 255, (blocks, 2, page, heads, hd), dtype=torch.uint8, generator=g)
    mamba_page = torch.randint(0, 255, (blocks, 256), dtype=torch.uint8, generator=g)
    conv = mamba_page[:, : conv_c * width].view(blocks, conv_c, width)
    ssm = mamba_page[:, 64 : 64 + ssm_h * state].view(blocks, ssm_h, state)

    def mamba(conv: torch.Tensor, ssm: torch.Tensor) -> StatePool:
        tensors = [tm.state_tensor("conv", [conv], sharded=True), tm.state_tensor("ssm", [ssm], sharded=True)]
        return tm.state_component(StateKind.MAMBA, Indexing.SLOT, tensors, device="cpu")

    def pool(k: torch.Tensor, v: torch.Tensor, tp: int) -> KvPool:
        return tm.kv_pool(
            [k], [v], page_size=page, layout=Layout.NHD, kv_heads_per_rank=heads // tp, total_kv_heads=heads
        )

    src = RankMemory(ParallelRank(1, 0), pool(kv[:, 0], kv[:, 1], 1), (mamba(conv, ssm),))
    for rank in range(2):  # decode TP 2, packed tensors of its own
        k = torch.zeros(blocks, page, heads // 2, hd, dtype=torch.uint8)
        v = torch.zeros_like(k)
        d_conv = torch.zeros(blocks, conv_c // 2, width, dtype=torch.uint8)
        d_ssm = torch.zeros(blocks, ssm_h // 2, state, dtype=torch.uint8)
        dst = RankMemory(ParallelRank(2, rank), pool(k, v, 2), (mamba(d_conv, d_ssm),))
        _moved(src, dst, [4, 1, 2], [0, 5, 3], (2, 1))
        h = slice(rank * heads // 2, (rank + 1) * heads // 2)
        assert torch.equal(k[[0, 5, 3]], kv[[4, 1, 2], 0][:, :, h])
        assert torch.equal(v[[0, 5, 3]], kv[[4, 1, 2], 1][:, :, h])
        assert torch.equal(d_conv[1], conv[2, rank * conv_c // 2 : (rank + 1) * conv_c // 2])
        assert torch.equal(d_ssm[1], ssm[2, rank * ssm_h // 2 : (rank + 1) * ssm_h // 2])
        untouched = torch.ones(blocks, dtype=torch.bool)
        untouched[[0, 5, 3]] = False
        assert not k[untouched].any() and not v[untouched].any()  # nothing outside the request's pages


BLOCK_TORCH = """
import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is made unimportable for this test")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def run_without_torch(code: str) -> str:
    full = BLOCK_TORCH + textwrap.dedent(code)
    result = subprocess.run(
        [sys.executable, "-c", full], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_module_outside_the_demo_imports_with_torch_unimportable() -> None:
    out = run_without_torch(
        """
        import importlib, pkgutil, sys
        names = []
        for top in ("pdwire", "pdwire.wire", "pdwire.codegen", "pdwire.schema", "pdwire.runtime"):
            pkg = importlib.import_module(top)
            for m in pkgutil.walk_packages(pkg.__path__, top + "."):
                # the demo builds its caches with torch, an engine's plugin imports its engine
                # (which imports torch); the runtime they are built on, serve included, never does
                skip = ("pdwire.demo.", "pdwire.integrations.")
                if m.name.startswith(skip) or m.name == "pdwire.__main__":
                    continue
                importlib.import_module(m.name)
                names.append(m.name)
        assert "torch" not in sys.modules
        from pdwire.runtime import torch_memory
        try:
            torch_memory.aux_buffer("out", object())
        except Exception as exc:
            print(type(exc).__name__, exc)
        print(len(names), "pdwire.runtime.engine" in names, "pdwire.runtime.workers.prefill" in names)
        """
    )
    lines = out.strip().splitlines()
    assert lines[0].startswith("ConfigError pdwire.runtime.torch_memory needs torch")
    count, engine, prefill = lines[1].split()
    assert int(count) > 50 and engine == prefill == "True"
