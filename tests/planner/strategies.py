"""Hypothesis strategies for small simulated deployments (few layers, small pages and heads)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from pdwire.runtime.planner import Layout, StateKind

from tests.planner.world import ComponentSpec, KvSpec, TensorSpec, World

# Oracle cases run hundreds of examples even in the ci profile; the dev profile raises them further.
ORACLE = settings(max_examples=max(300, settings.default.max_examples))

TP = st.sampled_from([1, 2, 4, 8])
HEADS = st.sampled_from([1, 2, 4, 8])
LAYOUT = st.sampled_from([Layout.NHD, Layout.HND])


@st.composite
def index_lists(draw: st.DrawFn, pool: int, count: int) -> tuple[int, ...]:
    """Contiguous runs, sorted subsets (runs with breaks) or shuffled subsets of ``range(pool)``."""
    shape = draw(st.sampled_from(["run", "sorted", "shuffled"]))
    if shape == "run":
        start = draw(st.integers(0, pool - count))
        return tuple(range(start, start + count))
    values = draw(st.lists(st.integers(0, pool - 1), unique=True, min_size=count, max_size=count))
    return tuple(sorted(values)) if shape == "sorted" else tuple(values)


@st.composite
def kv_specs(
    draw: st.DrawFn, *, is_mla: bool = False, layers: st.SearchStrategy[int] | None = None
) -> KvSpec:
    return KvSpec(
        layers=draw(layers if layers is not None else st.integers(1, 3)),
        total_heads=1 if is_mla else draw(HEADS),
        bytes_per_head=draw(st.integers(1, 4)),
        page_size=draw(st.integers(1, 4)),
        src_layout=draw(LAYOUT),
        dst_layout=draw(LAYOUT),
        is_mla=is_mla,
    )


@st.composite
def mamba_components(draw: st.DrawFn, prefill_tp: int, decode_tp: int, layers: int) -> ComponentSpec:
    """A Mamba component: a conv tensor of 1-3 independently sharded sub-blocks and a temporal tensor."""
    quantum = max(prefill_tp, decode_tp)
    conv_blocks = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    conv = TensorSpec("conv", tuple(k * quantum for k in conv_blocks), draw(st.integers(1, 4)))
    temporal = TensorSpec("temporal", (draw(st.integers(1, 2)) * quantum,), draw(st.integers(1, 6)))
    return ComponentSpec(StateKind.MAMBA, layers, (conv, temporal), pool_items=4)


@st.composite
def kv_worlds(draw: st.DrawFn, *, hetero: bool, is_mla: bool = False) -> World:
    prefill_tp, decode_tp = draw(TP), draw(TP)
    if not hetero and not is_mla:
        decode_tp = prefill_tp
    kv = draw(kv_specs(is_mla=is_mla))
    pool = 8
    count = draw(st.integers(0, 5))
    return World(
        prefill_tp,
        decode_tp,
        kv,
        kv_pool_pages=pool,
        src_pages=draw(index_lists(pool, count)),
        dst_pages=draw(index_lists(pool, count)),
        region_gap=draw(st.sampled_from([0, 64])),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def state_worlds(draw: st.DrawFn, *, mamba: bool, paged: bool) -> World:
    """Worlds with Mamba and/or paged (head-sharded SWA, replicated DSA) components and aux."""
    prefill_tp, decode_tp = draw(TP), draw(TP)
    layers = draw(st.integers(1, 3))
    components: list[ComponentSpec] = []
    src: list[tuple[int, ...]] = []
    dst: list[tuple[int, ...]] = []
    if mamba:
        components.append(draw(mamba_components(prefill_tp, decode_tp, layers)))
        src.append((draw(st.integers(0, 3)),))
        dst.append((draw(st.integers(0, 3)),))
    if paged:
        swa = draw(kv_specs(layers=st.just(layers)))
        components.append(ComponentSpec(StateKind.SWA, layers, heads=swa, pool_items=6))
        dsa = TensorSpec("indexer", (1,), draw(st.integers(1, 9)))
        components.append(ComponentSpec(StateKind.DSA, layers, (dsa,), replicated=True, pool_items=6))
        for _ in range(2):
            count = draw(st.integers(0, 4))
            src.append(draw(index_lists(6, count)))
            dst.append(draw(index_lists(6, count)))
    return World(
        prefill_tp,
        decode_tp,
        None,
        tuple(components),
        aux_items=tuple(draw(st.lists(st.integers(1, 8), max_size=2))),
        state_src=tuple(src),
        state_dst=tuple(dst),
        aux_index=(draw(st.integers(0, 3)), draw(st.integers(0, 3))),
        region_gap=draw(st.sampled_from([0, 64])),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def pp_worlds(draw: st.DrawFn) -> World:
    """Prefill PP stages (each a layer range) into decode PP 1 (all layers) or matching decode stages."""
    prefill_tp, decode_tp = draw(TP), draw(TP)
    stages = draw(st.integers(2, 3))
    is_mla = draw(st.booleans())
    kv = draw(kv_specs(is_mla=is_mla, layers=st.integers(1, 4)))
    mamba_layers = draw(st.integers(1, 4))
    components = () if is_mla else (draw(mamba_components(prefill_tp, decode_tp, mamba_layers)),)
    count = draw(st.integers(0, 4))
    return World(
        prefill_tp,
        decode_tp,
        kv,
        components,
        aux_items=(draw(st.integers(1, 8)),),
        prefill_pp=stages,
        decode_pp_matches=draw(st.booleans()),
        src_pages=draw(index_lists(8, count)),
        dst_pages=draw(index_lists(8, count)),
        state_src=((draw(st.integers(0, 3)),),) if components else (),
        state_dst=((draw(st.integers(0, 3)),),) if components else (),
        seed=draw(st.integers(0, 2**16)),
    )
