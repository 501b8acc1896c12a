"""Hypothesis strategies for small simulated deployments (few layers, small pages and heads)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import settings
from hypothesis import strategies as st

from pdwire.runtime.planner import Indexing, Layout, StateKind
from tests.planner.world import ComponentSpec, KvSpec, SideLayout, TensorSpec, World

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
def side_layouts(draw: st.DrawFn, *, alias: bool = False) -> SideLayout:
    """Packed, padded, interleaved, shared-slot or aliased placement of one side's items."""
    shared = draw(st.booleans())
    return SideLayout(
        kv_interleaved=draw(st.booleans()),
        kv_pad=draw(st.sampled_from([0, 0, 3, 16])),
        state_shared=shared,
        state_pad=draw(st.sampled_from([0, 0, 5])),
        alias_state=alias and draw(st.booleans()),
    )


@st.composite
def mamba_components(
    draw: st.DrawFn, prefill_tp: int, decode_tp: int, layers: int, *, extended: bool = False
) -> ComponentSpec:
    """A Mamba component: a conv tensor of 1-3 independently sharded sub-blocks and a temporal tensor.

    ``extended``: the conv axis may sit after 1-3 rows (Kimi-Linear's transposed conv), the
    sub-block split may be declared by one side only, and a replicated tensor may join."""
    quantum = max(prefill_tp, decode_tp)
    conv_blocks = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    outer = draw(st.integers(1, 3)) if extended else 1
    declare = draw(st.sampled_from(["both", "prefill", "decode"])) if extended else "both"
    conv = TensorSpec(
        "conv", tuple(k * quantum for k in conv_blocks), draw(st.integers(1, 4)), declare, outer
    )
    temporal = TensorSpec("temporal", (draw(st.integers(1, 2)) * quantum,), draw(st.integers(1, 6)))
    tensors = [conv, temporal]
    if extended and draw(st.booleans()):
        tensors.insert(
            draw(st.integers(0, 2)), TensorSpec("norm", (1,), draw(st.integers(1, 5)), replicated=True)
        )
    return ComponentSpec(StateKind.MAMBA, layers, tuple(tensors), pool_items=4)


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


# kinds beyond mamba/swa/dsa that SGLang 0.5.23 sends, as they are addressed and split there
ROW_KINDS = (StateKind.SWA_RING, StateKind.C128_STATE, StateKind.REQUEST_ROW, StateKind.QSA_PENDING)
PAGE_KINDS = (
    StateKind.QSA_COMPRESSED,
    StateKind.BLOCK_SCALE,
    StateKind.BLOCK_SCALE_SWA,
    StateKind.MINIMAX_INDEX_K,
    StateKind.MINIMAX_DENSE_KV,
    StateKind.NSA,
)


@st.composite
def hybrid_worlds(draw: st.DrawFn) -> World:
    """KV (MLA or GQA) with Mamba state on any axis, replicated row- and page-indexed kinds, any TP
    pair (MLA with prefill TP > decode TP included), each side in its own memory layout (strides,
    offsets, K/V interleaved, tensors sharing a slot, Mamba aliasing the KV layers)."""
    prefill_tp, decode_tp = draw(TP), draw(TP)
    is_mla = draw(st.booleans())
    layers = draw(st.integers(1, 3))
    kv = draw(kv_specs(is_mla=is_mla, layers=st.just(layers)))
    pool = 6
    components = [draw(mamba_components(prefill_tp, decode_tp, layers, extended=True))]
    src_side, dst_side = draw(side_layouts(alias=True)), draw(side_layouts(alias=True))
    aliased = src_side.alias_state or dst_side.alias_state
    mamba_pool = components[0].pool_items
    first = pool if aliased else 0  # an aliased Mamba slot lives after the KV pages
    src: list[tuple[int, ...]] = [(draw(st.integers(first, first + mamba_pool - 1)),)]
    dst: list[tuple[int, ...]] = [(draw(st.integers(first, first + mamba_pool - 1)),)]
    for kind in draw(st.lists(st.sampled_from(ROW_KINDS + PAGE_KINDS), max_size=2, unique=True)):
        indexing = Indexing.ROW if kind in ROW_KINDS else Indexing.PAGE
        tensors = tuple(
            TensorSpec(name, (1,), draw(st.integers(1, 7)))
            for name in draw(st.sampled_from([("t",), ("k", "v")]))
        )
        components.append(
            ComponentSpec(kind, layers, tensors, replicated=True, pool_items=5, indexing=indexing)
        )
        count = draw(st.integers(0, 3))
        src.append(draw(index_lists(5, count)))
        dst.append(draw(index_lists(5, count)))
    count = draw(st.integers(0, 4))
    return World(
        prefill_tp,
        decode_tp,
        kv,
        tuple(components),
        aux_items=(draw(st.integers(1, 8)),),
        kv_pool_pages=pool,
        src_pages=draw(index_lists(pool, count)),
        dst_pages=draw(index_lists(pool, count)),
        state_src=tuple(src),
        state_dst=tuple(dst),
        aux_index=(draw(st.integers(0, 3)), draw(st.integers(0, 3))),
        region_gap=draw(st.sampled_from([0, 64])),
        seed=draw(st.integers(0, 2**16)),
        src_side=src_side,
        dst_side=dst_side,
    )


@st.composite
def laid_out_state_worlds(draw: st.DrawFn) -> World:
    """``state_worlds`` (Mamba, head-sharded SWA, replicated DSA, aux) with each side's own layout."""
    world = draw(state_worlds(mamba=True, paged=True))
    return World(
        **{
            **{f: getattr(world, f) for f in world.__dataclass_fields__},
            "src_side": draw(side_layouts()),
            "dst_side": draw(side_layouts()),
        }
    )


@st.composite
def head_interleaved_kv_worlds(draw: st.DrawFn) -> World:
    """Heterogeneous-TP KV where either side keeps each head's K and then its V inside a page
    (vLLM CPU: a head stride, HND), the other any layout."""
    world = draw(kv_worlds(hetero=True))
    assert world.kv is not None
    sides = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    layouts = []
    for per_head in sides:
        drawn = draw(side_layouts())
        layouts.append(
            SideLayout(
                kv_interleaved=drawn.kv_interleaved,
                kv_pad=drawn.kv_pad,
                kv_heads_interleaved=per_head,
                kv_head_pad=draw(st.sampled_from([0, 0, 2])) if per_head else 0,
            )
        )
    kv = KvSpec(
        **{
            **{f: getattr(world.kv, f) for f in world.kv.__dataclass_fields__},
            **{
                name: Layout.HND
                for name, per_head in zip(("src_layout", "dst_layout"), sides, strict=True)
                if per_head
            },
        }
    )
    fields = {f: getattr(world, f) for f in world.__dataclass_fields__}
    return World(**{**fields, "kv": kv, "src_side": layouts[0], "dst_side": layouts[1]})


@st.composite
def unit_interleaved_kv_worlds(draw: st.DrawFn) -> World:
    """Heterogeneous-TP KV where either side keeps K and V side by side per token and head (vLLM's
    GPU backends, LBHNC or LBNHC), the other any layout, each side HND or NHD."""
    world = draw(kv_worlds(hetero=True))
    assert world.kv is not None
    sides = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    layouts = []
    for per_unit in sides:
        drawn = draw(side_layouts())
        layouts.append(replace(drawn, kv_units_interleaved=per_unit, kv_heads_interleaved=False))
    kv = replace(world.kv, src_layout=draw(st.sampled_from(Layout)), dst_layout=draw(st.sampled_from(Layout)))
    return replace(world, kv=kv, src_side=layouts[0], dst_side=layouts[1])


@st.composite
def laid_out_kv_worlds(draw: st.DrawFn) -> World:
    """Heterogeneous-TP KV with strided pages and K/V interleaved on either side."""
    world = draw(kv_worlds(hetero=True))
    return World(
        **{
            **{f: getattr(world, f) for f in world.__dataclass_fields__},
            "src_side": draw(side_layouts()),
            "dst_side": draw(side_layouts()),
        }
    )
