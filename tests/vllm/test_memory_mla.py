"""An MLA cache (DeepSeek-V2-style) as the connector describes it, checked byte for byte through
pdwire's planner.

vLLM 0.32's MLA backends (``CPU_MLA`` here, the GPU MLA backends alike) view each layer as
``[blocks, 1, block_size, latent]``: per token one latent of ``kv_lora_rank + qk_rope_head_dim``
elements, no heads and no V, the same bytes on every TP rank. The description is an MLA
``KvPool`` copied whole, so every TP pair works: prefill TP 2 -> decode TP 1 takes the latent from
one prefill rank (the other rank's bytes, poisoned here, never land), prefill TP 1 -> decode TP 2
writes every decode rank. Every other destination byte stays untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from pdwire.integrations.vllm.memory import (
    AttentionGroup,
    Described,
    LayerTensor,
    LayoutError,
    MambaGroup,
    MlaGroup,
    describe,
)
from pdwire.runtime.planner import has_tp_sharded_state, prepare_peer, regions, route_decode_rank
from pdwire.runtime.planner.reference_executor import AddressSpace, execute

F32 = 4
BLOCKS, N, LATENT = 6, 16, 576  # blocks, tokens per block (CPU_MLA's only size), 512 + 64 elements
TOKEN = LATENT * F32
PAGE = N * TOKEN
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


@dataclass
class Rank:
    space: AddressSpace
    described: Described
    latent: list[np.ndarray]  # per layer the raw bytes [blocks, block stride]


def mla_tensor(name: str, base: int, stride: int = PAGE) -> LayerTensor:
    """A layer as vLLM views it: ``[blocks, 1, block_size, latent]`` (the size-1 head dim's stride
    is the page, as ``create_kv_cache_views`` makes it)."""
    return LayerTensor(name, base, (stride, PAGE, TOKEN, F32), (BLOCKS, 1, N, LATENT))


def build_rank(tp: int, r: int, base: int, seed: int, *, stride: int = PAGE, strided: bool = True) -> Rank:
    space = AddressSpace()
    rng = np.random.default_rng(seed)
    bufs = [space.allocate(base + i * (1 << 32), BLOCKS * stride, rng) for i in range(len(LAYERS))]
    tensors = {n: mla_tensor(n, base + i * (1 << 32), stride) for i, n in enumerate(LAYERS)}
    d = describe(
        [MlaGroup(tuple(LAYERS), N, TOKEN)],
        tensors,
        BLOCKS,
        tp_size=tp,
        tp_rank=r,
        layer_ids={n: i for i, n in enumerate(LAYERS)},
        strided=strided,
    )
    return Rank(space, d, [b.reshape(BLOCKS, stride) for b in bufs])


def test_describes_one_replicated_latent_per_layer() -> None:
    d = build_rank(2, 1, 1 << 40, 0).described
    kv = d.memory.kv
    assert kv is not None and kv.is_mla and d.tp_sliceable
    assert kv.v_base_addrs == () and kv.num_layers == len(LAYERS)
    assert (kv.kv_heads_per_rank, kv.total_kv_heads, kv.bytes_per_head) == (1, 1, TOKEN)
    assert (kv.layout.value, kv.page_size, kv.bytes_per_page, kv.stride) == ("NHD", N, PAGE, PAGE)
    assert kv.page_stride is None and kv.region_lens == (BLOCKS * PAGE, BLOCKS * PAGE)
    assert d.kv_group == 0 and d.state_groups == () and not has_tp_sharded_state(d.memory)


def test_a_padded_block_stride_is_the_page_stride_and_only_the_latents_move() -> None:
    padded = build_rank(1, 0, 1 << 40, 0, stride=PAGE + 256).described.memory.kv
    assert padded is not None and (padded.bytes_per_page, padded.page_stride) == (PAGE, PAGE + 256)
    assert padded.region_lens[0] == (BLOCKS - 1) * (PAGE + 256) + PAGE
    whole = build_rank(1, 0, 1 << 40, 0, stride=PAGE + 256, strided=False).described.memory.kv
    assert whole is not None and (whole.bytes_per_page, whole.page_stride) == (PAGE + 256, None)


def move(prefill_tp: int, decode_tp: int, stride: int = PAGE) -> None:
    """The prompt in prefill blocks [4, 1], written to decode blocks [2, 3] of every decode rank."""
    rng = np.random.default_rng(7)
    latent = [rng.integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8) for _ in LAYERS]  # one logical cache
    src_pages, dst_pages = [4, 1], [2, 3]
    routes = [route_decode_rank(prefill_tp, decode_tp, d, is_mla=True) for d in range(decode_tp)]
    dummies = {p for route in routes for p in route.dummy_prefill_ranks}
    assert len(dummies) == max(0, prefill_tp - decode_tp)  # one writer per decode rank
    prefill = []
    for r in range(prefill_tp):
        rank = build_rank(prefill_tp, r, (1 << 40) + r * (1 << 36), r, stride=stride)
        for li, a in enumerate(rank.latent):
            # every rank holds the same latent; a dummy rank's copy is poisoned: it must never land
            a[:, :PAGE] = 255 - latent[li] if r in dummies else latent[li]
        prefill.append(rank)
    for d in range(decode_tp):
        rank = build_rank(decode_tp, d, (1 << 44) + d * (1 << 36), 100 + d, stride=stride)
        before = [a.copy() for a in rank.latent]
        route = routes[d]
        writers = [p for p in route.prefill_ranks if p not in route.dummy_prefill_ranks]
        assert writers == [route.prefill_ranks[0]] and route.expected_responses == 1
        for p in route.prefill_ranks:  # the dummy ranks plan too, and must write nothing
            src_mem, dst_mem = prefill[p].described.memory, rank.described.memory
            table = prepare_peer(src_mem, dst_mem).plan_request(src_pages, dst_pages, (), ()).table()
            execute(table, prefill[p].space, rank.space, regions(src_mem), regions(dst_mem))
        for li, a in enumerate(rank.latent):
            expected = before[li].copy()
            for s, t in zip(src_pages, dst_pages, strict=True):
                expected[t, :PAGE] = latent[li][s]
            np.testing.assert_array_equal(a, expected, err_msg=f"decode rank {d} layer {li}")


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (2, 4)])
def test_latent_moves_byte_for_byte_across_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    move(prefill_tp, decode_tp)


def test_latent_with_a_padded_block_stride_moves_without_its_padding() -> None:
    move(2, 1, stride=PAGE + 256)


def test_refuses_mla_layouts_that_split_a_block_and_a_second_kv_group() -> None:
    g = MlaGroup(("a",), N, TOKEN)

    def one(
        t: LayerTensor, groups: list[AttentionGroup | MambaGroup | MlaGroup | None] | None = None
    ) -> None:
        tensors = {"a": t, "b": mla_tensor("b", 1 << 41)}
        describe(groups or [g], tensors, BLOCKS, tp_size=1, tp_rank=0, layer_ids={"a": 0, "b": 1})

    token_outer = LayerTensor("a", 1 << 40, (PAGE, PAGE, BLOCKS * TOKEN, F32), (BLOCKS, 1, N, LATENT))
    with pytest.raises(LayoutError, match=r"MLA layer a: .* a block's latents contiguous"):
        one(token_outer)
    with pytest.raises(LayoutError, match=r"MLA layer a: .*expected"):
        one(LayerTensor("a", 1 << 40, (PAGE, PAGE, TOKEN, F32), (BLOCKS - 1, 1, N, LATENT)))
    with pytest.raises(LayoutError, match=r"MLA layer a: .*expected"):  # a latent of another size
        one(LayerTensor("a", 1 << 40, (PAGE, PAGE, TOKEN, F32), (BLOCKS, 1, N, LATENT // 2)))
    with pytest.raises(LayoutError, match="MLA layer a: a block stride of"):
        one(mla_tensor("a", 1 << 40, stride=PAGE // 2))
    with pytest.raises(LayoutError, match="both full attention"):
        one(mla_tensor("a", 1 << 40), [g, MlaGroup(("b",), N, TOKEN)])
