"""vLLM's block layouts on GPU backends, without a GPU: the layout vLLM resolves with
PdwireConnector beside its CUDA attention backends' declarations, and K|V-per-token caches
built by vLLM's own ``create_kv_cache_views`` in LBHNC (HND) and LBNHC (NHD, FlashAttention's
default) moved byte for byte across TP sizes, either layout on either side.

Each prefill cache holds a known value per (block, global head, token, K/V, element); after
the planner's tables are executed, every decode rank must hold, read through vLLM's own view
and FlashAttention's ``split(head_size, dim=-1)``, exactly its heads of the source blocks in
its destination blocks, and nothing else may change.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

from pdwire.integrations.vllm.connector import PdwireConnector
from pdwire.integrations.vllm.memory import AttentionGroup, LayoutError, describe, layer_tensor
from pdwire.runtime.planner import Layout, prepare_peer, regions, route_decode_rank
from pdwire.runtime.planner.reference_executor import AddressSpace, execute

HEADS, HEAD, BLOCK, BLOCKS, LAYERS = 4, 8, 16, 6, 2  # model KV heads, head size, tokens per block
LAYOUTS = {Layout.HND: KVCacheLayout.LBHNC, Layout.NHD: KVCacheLayout.LBNHC}


def _config(use_mla: bool) -> SimpleNamespace:
    kv = KVTransferConfig(
        kv_connector="PdwireConnector",
        kv_connector_module_path="pdwire.integrations.vllm",
        kv_role="kv_producer",
    )
    return SimpleNamespace(
        cache_config=CacheConfig(), kv_transfer_config=kv, model_config=SimpleNamespace(use_mla=use_mla)
    )


def test_the_connector_asks_for_lbhnc_and_vllm_resolves_it_beside_flash_attention() -> None:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend

    assert PdwireConnector.get_required_kvcache_layout(_config(use_mla=False)) == "LBHNC"
    assert PdwireConnector.get_required_kvcache_layout(_config(use_mla=True)) is None  # one latent
    # FlashAttention declares no layout: vLLM would pick LBNHC; with pdwire it takes LBHNC
    names = [[x.name for x in get_supported_kv_cache_layouts([FlashAttentionBackend])]]
    assert names[0][0] == "LBNHC"
    assert resolve_kv_cache_layout(_config(use_mla=False), names) is KVCacheLayout.LBHNC  # type: ignore[arg-type]
    # a backend that only runs LBNHC keeps it (vLLM warns), and pdwire plans that too (below)
    flex = [[x.name for x in get_supported_kv_cache_layouts([FlexAttentionBackend])]]
    assert resolve_kv_cache_layout(_config(use_mla=False), flex) is KVCacheLayout.LBNHC  # type: ignore[arg-type]


def _spec() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)


class Rank:
    """One rank's vLLM cache: LAYERS layer views over one raw allocation, in ``layout``."""

    def __init__(self, tp: int, rank: int, layout: Layout, space: AddressSpace, fill: bool) -> None:
        heads = HEADS // tp
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD, dtype=torch.float32)
        page = spec.page_size_bytes
        self.raw = torch.zeros(LAYERS * BLOCKS * page, dtype=torch.int8)
        tensor = KVCacheTensor(
            size=self.raw.numel(), layers=["l0", "l1"], layer_stride=BLOCKS * page, block_stride=page
        )
        views = create_kv_cache_views(self.raw, spec, BLOCKS, LAYOUTS[layout], tensor)
        self.views = dict(zip(("l0", "l1"), views, strict=True))
        self.heads = range(rank * heads, (rank + 1) * heads)
        if fill:
            for name, view in self.views.items():
                view.copy_(_values(int(name[1]), self.heads))
        else:
            self.raw.fill_(-1)
        space.map(self.raw.data_ptr(), self.raw.numpy().view(np.uint8))
        group = AttentionGroup(("l0", "l1"), BLOCK, heads, HEAD, 4, HEADS, kv_per_token=True)
        tensors = {name: layer_tensor(name, v) for name, v in self.views.items()}
        self.memory = describe(
            [group], tensors, BLOCKS, tp_size=tp, tp_rank=rank, layer_ids={"l0": 0, "l1": 1}
        ).memory


def _values(layer: int, heads: range) -> torch.Tensor:
    """[blocks, heads, block, 2 x head]: layer, block, global head, token, K/V and element in each
    value (exact in float32)."""
    b, h, t, c = torch.meshgrid(
        torch.arange(BLOCKS),
        torch.tensor(list(heads)),
        torch.arange(BLOCK),
        torch.arange(2 * HEAD),
        indexing="ij",
    )
    return (((layer * BLOCKS + b) * HEADS + h) * BLOCK + t) * 2 * HEAD + c + 1.0


def _move(prefill_tp: int, decode_tp: int, src_layout: Layout, dst_layout: Layout) -> None:
    src_blocks, dst_blocks = [0, 4, 5], [3, 1, 2]
    spaces = [AddressSpace() for _ in range(prefill_tp)]
    prefill = [Rank(prefill_tp, p, src_layout, spaces[p], fill=True) for p in range(prefill_tp)]
    for d in range(decode_tp):
        space = AddressSpace()
        rank = Rank(decode_tp, d, dst_layout, space, fill=False)
        assert rank.memory.kv is not None and rank.memory.kv.layout is dst_layout
        for p in route_decode_rank(prefill_tp, decode_tp, d, is_mla=False).prefill_ranks:
            src = prefill[p]
            table = prepare_peer(src.memory, rank.memory).plan_kv_chunk(0, src_blocks, dst_blocks).table
            execute(table, spaces[p], space, regions(src.memory), regions(rank.memory))
        for name, view in rank.views.items():
            k, v = view.split(HEAD, dim=-1)  # how FlashAttention reads the block
            want = _values(int(name[1]), rank.heads)
            want_k, want_v = want.split(HEAD, dim=-1)
            for s, t in zip(src_blocks, dst_blocks, strict=True):
                assert torch.equal(k[t], want_k[s]) and torch.equal(v[t], want_v[s]), (name, s, t)
            untouched = [b for b in range(BLOCKS) if b not in dst_blocks]
            assert bool((view[untouched].view(torch.int8) == -1).all()), name


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2), (1, 1)])
@pytest.mark.parametrize("src_layout", list(Layout))
@pytest.mark.parametrize("dst_layout", list(Layout))
def test_side_by_side_caches_move_byte_for_byte_in_either_layout_across_tp(
    prefill_tp: int, decode_tp: int, src_layout: Layout, dst_layout: Layout
) -> None:
    _move(prefill_tp, decode_tp, src_layout, dst_layout)


@pytest.mark.parametrize("layout", list(Layout))
def test_equal_layouts_and_tp_move_a_block_of_a_layer_in_one_row(layout: Layout) -> None:
    src = Rank(1, 0, layout, AddressSpace(), fill=True)
    dst = Rank(1, 0, layout, AddressSpace(), fill=False)
    table = prepare_peer(src.memory, dst.memory).plan_kv_chunk(0, [0, 4], [3, 1]).table
    assert len(table) == 2 * LAYERS  # K and V of a block fused: one row per layer and block


def test_nhd_across_tp_is_one_row_per_token_and_layer() -> None:
    src = Rank(2, 0, Layout.NHD, AddressSpace(), fill=True)
    dst = Rank(1, 0, Layout.NHD, AddressSpace(), fill=False)
    table = prepare_peer(src.memory, dst.memory).plan_kv_chunk(0, [0], [3]).table
    assert len(table) == LAYERS * BLOCK  # this rank's two heads' K and V are adjacent per token


def test_a_cpu_attention_cache_in_lbnhc_is_refused_by_name() -> None:
    spec = _spec()
    raw = torch.zeros(BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=raw.numel(), layers=["l0"], layer_stride=BLOCKS * page, block_stride=page)
    (view,) = create_kv_cache_views(raw, spec, BLOCKS, KVCacheLayout.LBNHC, tensor)
    group = AttentionGroup(("l0",), BLOCK, HEADS, HEAD, 4, HEADS)  # CPU_ATTN: K page, then V page
    with pytest.raises(LayoutError, match=r"block layout pdwire plans \(LBHNC"):
        describe([group], {"l0": layer_tensor("l0", view)}, BLOCKS, tp_size=1, tp_rank=0, layer_ids={"l0": 0})
    head_page = page // HEADS  # LHBNC: a head's part of every block, then the next head's
    apart = KVCacheTensor(size=raw.numel(), layers=["l0"], layer_stride=BLOCKS * page, block_stride=head_page)
    (lhbnc,) = create_kv_cache_views(raw, spec, BLOCKS, KVCacheLayout.LHBNC, apart)
    gpu = AttentionGroup(("l0",), BLOCK, HEADS, HEAD, 4, HEADS, kv_per_token=True)
    with pytest.raises(LayoutError, match=r"LBHNC or LBNHC"):  # a head's blocks apart: not block-compact
        describe([gpu], {"l0": layer_tensor("l0", lhbnc)}, BLOCKS, tp_size=1, tp_rank=0, layer_ids={"l0": 0})
