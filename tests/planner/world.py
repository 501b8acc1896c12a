"""A simulated PD deployment for oracle tests: every rank's memory as numpy buffers.

The expected decode contents come from ONE full tensor per (component, tensor, layer), sharded
with plain numpy slicing (``np.split`` along heads or sub-blocks, row by row), never with the
planner's offset formulas. The planner's plans are executed with the reference executor;
afterwards every byte of every decode allocation must equal: the untouched random bytes outside
the destination items, and inside them exactly the shard the decode rank must hold.

Each side lays its memory out on its own (``SideLayout``): packed items, pages or slots with
padding (a stride larger than the item), K and V interleaved in one buffer per layer (per page,
or per head inside a page as vLLM's CPU attention does: a head stride), the
tensors of a component sharing one slot at offsets, and a state component aliasing the KV
layers' memory (vLLM's groups on the same blocks). Where memory aliases, the request's indices
keep the components on different items, as an engine's allocator does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdwire.runtime.descriptors import DescriptorTable
from pdwire.runtime.planner import (
    AuxBuffer,
    HeadGeometry,
    Indexing,
    KvPool,
    Layout,
    ParallelRank,
    RankMemory,
    StateKind,
    StatePool,
    StateTensor,
    has_tp_sharded_state,
    prepare_peer,
    regions,
    route_decode_rank,
)
from pdwire.runtime.planner.reference_executor import AddressSpace, execute

GiB = 1 << 30


@dataclass(frozen=True)
class KvSpec:
    layers: int
    total_heads: int
    bytes_per_head: int
    page_size: int
    src_layout: Layout
    dst_layout: Layout
    is_mla: bool = False


@dataclass(frozen=True)
class TensorSpec:
    """A sharded state tensor: per row (``outer`` rows) an axis of sub-blocks (full sizes) of
    ``unit`` bytes per element. A paged replicated tensor: ``blocks=(1,)``, ``unit`` = bytes per
    page. ``declare``: which sides declare the sub-block split; ``replicated``: a tensor holding
    the same bytes on every rank inside an axis-sharded component."""

    name: str
    blocks: tuple[int, ...]
    unit: int
    declare: str = "both"  # "both", "prefill", "decode"
    outer: int = 1
    replicated: bool = False


@dataclass(frozen=True)
class ComponentSpec:
    kind: StateKind
    layers: int
    tensors: tuple[TensorSpec, ...] = ()
    replicated: bool = False
    heads: KvSpec | None = None  # head-sharded paged K/V component (non-MLA SWA)
    pool_items: int = 8
    indexing: Indexing | None = None  # None: slot for mamba, page otherwise


@dataclass(frozen=True)
class SideLayout:
    """How one side places its items. Defaults: one packed buffer per tensor-layer."""

    kv_interleaved: bool = False  # K and V of a layer in one buffer, K then V in every page stride
    kv_pad: int = 0  # stride bytes past what a page uses
    # K and V of a layer in one buffer, per head inside a page: head h's K page, its V page, then
    # kv_head_pad bytes (vLLM CPU's [blocks, heads, 2 * block_size, head_size]); needs HND
    kv_heads_interleaved: bool = False
    kv_head_pad: int = 0
    # K and V of a layer in one buffer side by side per token and head (vLLM's GPU backends:
    # [blocks, heads, block_size, 2 * head_size] in LBHNC order for HND, LBNHC for NHD)
    kv_units_interleaved: bool = False
    state_shared: bool = False  # a component's tensors share one slot per layer, at offsets
    state_pad: int = 0
    alias_state: bool = False  # state component 0 lives in the KV layers' buffers (needs state_shared)


@dataclass(frozen=True)
class World:
    prefill_tp: int
    decode_tp: int
    kv: KvSpec | None
    components: tuple[ComponentSpec, ...] = ()
    aux_items: tuple[int, ...] = ()  # bytes per item of each aux buffer
    prefill_pp: int = 1
    decode_pp_matches: bool = False  # decode PP == prefill PP (else decode PP = 1 and holds all layers)
    kv_pool_pages: int = 8
    src_pages: tuple[int, ...] = ()
    dst_pages: tuple[int, ...] = ()
    state_src: tuple[tuple[int, ...], ...] = ()
    state_dst: tuple[tuple[int, ...], ...] = ()
    aux_index: tuple[int, int] = (0, 1)
    aux_pool_items: int = 4
    high_addresses: bool = True
    region_gap: int = 64
    seed: int = 0
    src_side: SideLayout = SideLayout()
    dst_side: SideLayout = SideLayout()


# ---- independent sharding (numpy slicing only) --------------------------------------------------


def oracle_heads(tp: int, rank: int, heads: int) -> np.ndarray:
    """Global head ids held by a rank: even split, or replication ``rank // (tp / heads)``."""
    if heads >= tp:
        return np.split(np.arange(heads), tp)[rank]
    return np.repeat(np.arange(heads), tp // heads)[rank : rank + 1]


def oracle_page(full_page: np.ndarray, heads: np.ndarray, layout: Layout) -> np.ndarray:
    """full_page: [page_size, H, B] -> this rank's page bytes in its layout."""
    part = full_page[:, heads, :]
    return (part if layout is Layout.NHD else part.transpose(1, 0, 2)).reshape(-1)


def oracle_slot(full_slot: np.ndarray, blocks: tuple[int, ...], tp: int, rank: int) -> np.ndarray:
    """full_slot: [rows, sum(blocks), unit] -> per row, this rank's share of every sub-block."""
    rows = []
    for row in full_slot:
        parts = np.split(row, np.cumsum(blocks)[:-1])
        rows.append(np.concatenate([np.split(part, tp)[rank] for part in parts]))
    return np.concatenate(rows).reshape(-1)


# ---- building ranks --------------------------------------------------------------------------


def _stage_layers(total: int, stages: int) -> list[range]:
    bounds = [total * s // stages for s in range(stages + 1)]
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


Key = tuple[str, str, int]  # (component, tensor, global layer)


@dataclass
class Rank:
    memory: RankMemory
    space: AddressSpace
    views: dict[Key, tuple[int, int]] = field(default_factory=dict)  # key -> (address of item 0, stride)
    # key -> (head stride, token stride, bytes per unit, layout): the item's (token, head) units
    # lie apart, written unit by unit
    unit_places: dict[Key, tuple[int, int, int, Layout]] = field(default_factory=dict)


class Allocator:
    def __init__(self, base: int, gap: int, rng: np.random.Generator) -> None:
        self.next = base
        self.gap = gap
        self.rng = rng
        self.space = AddressSpace()

    def take(self, length: int) -> int:
        base = self.next
        self.space.allocate(base, length, self.rng)
        self.next += length + self.gap
        return base


def _kv_item(spec: KvSpec, tp: int) -> int:
    heads = 1 if spec.is_mla else max(1, spec.total_heads // tp)
    return spec.page_size * heads * spec.bytes_per_head


def _indexing(comp: ComponentSpec) -> Indexing:
    if comp.indexing is not None:
        return comp.indexing
    return Indexing.SLOT if comp.kind is StateKind.MAMBA else Indexing.PAGE


def _tensor_items(comp: ComponentSpec, tp: int, side: str) -> list[tuple[str, int, dict]]:
    """(name, bytes per item, StateTensor sharding fields) of every tensor of a component."""
    if comp.heads is not None:
        item = _kv_item(comp.heads, tp)
        return [(name, item, {}) for name in ("k", "v")]
    out = []
    for t in comp.tensors:
        if comp.replicated or t.replicated:
            out.append((t.name, t.outer * sum(t.blocks) * t.unit, {"replicated": t.replicated}))
            continue
        axis = sum(t.blocks) // tp
        declared = t.declare in ("both", side) and len(t.blocks) > 1
        fields = {
            "sharded_axis_size": axis,
            "sub_block_sizes": t.blocks if declared else None,
            "outer_rows": t.outer,
        }
        out.append((t.name, t.outer * axis * t.unit, fields))
    return out


def aliasing(world: World) -> bool:
    """Some side keeps state component 0 in the KV layers' buffers."""
    return (world.src_side.alias_state or world.dst_side.alias_state) and world.kv is not None


def state_pool(world: World, ci: int) -> int:
    """Items of component ``ci`` per buffer. An aliased component takes the items after the KV
    pages (its indices are drawn there), on both sides so that the same indices fit."""
    comp = world.components[ci]
    return comp.pool_items + (world.kv_pool_pages if ci == 0 and aliasing(world) else 0)


def build_rank(world: World, side: str, tp_rank: int, pp_rank: int, full: FullData) -> Rank:
    tp = world.prefill_tp if side == "prefill" else world.decode_tp
    layout = world.src_side if side == "prefill" else world.dst_side
    holds_all = side == "decode" and not world.decode_pp_matches
    pp = 1 if holds_all else world.prefill_pp
    stage = 0 if holds_all else pp_rank
    rng = np.random.default_rng([world.seed, side == "prefill", tp_rank, pp_rank])
    base = ((5 + tp_rank) << 33) + (7 << 20) if world.high_addresses else 4096 * (1 + tp_rank)
    alloc = Allocator(base, world.region_gap, rng)
    rank = Rank(RankMemory(ParallelRank(tp, tp_rank)), alloc.space)
    # a state component aliasing the KV layers: both share the KV buffers and one page stride
    alias = layout.alias_state and world.kv is not None and bool(world.components)
    alias_items = _tensor_items(world.components[0], tp, side) if alias else []
    alias_slot = sum(item for _, item, _ in alias_items)
    kv_pool = None
    first_layer = 0
    kv_buffers: dict[int, tuple[int, int]] = {}  # global layer -> (K buffer base, length)
    if world.kv is not None:
        spec = world.kv
        layers = _stage_layers(spec.layers, pp)[stage]
        first_layer = layers.start
        item = _kv_item(spec, tp)
        names = ("latent",) if spec.is_mla else ("k", "v")
        per_head = layout.kv_heads_interleaved and not spec.is_mla
        per_unit = layout.kv_units_interleaved and not per_head and not spec.is_mla
        interleaved = (layout.kv_interleaved or per_head or per_unit) and not spec.is_mla
        heads = 1 if spec.is_mla else max(1, spec.total_heads // tp)
        kv_layout = spec.src_layout if side == "prefill" else spec.dst_layout
        span = spec.page_size * spec.bytes_per_head  # one head's part of a K (or V) page
        unit = spec.bytes_per_head
        head_stride = token_stride = None
        if per_head:
            assert kv_layout is Layout.HND, "heads apart need head-major pages"
            head_stride, token_stride = 2 * span + layout.kv_head_pad, unit
        elif per_unit and kv_layout is Layout.HND:
            head_stride, token_stride = 2 * span, 2 * unit
        elif per_unit:
            head_stride, token_stride = 2 * unit, heads * 2 * unit
        used = heads * head_stride if per_head else item * (2 if interleaved else 1)
        v_at = span if per_head else unit if per_unit else item  # where V starts in the page stride
        stride = max(used, alias_slot) + layout.kv_pad
        pages = state_pool(world, 0) if alias else world.kv_pool_pages
        length = stride * pages
        addrs: dict[str, list[int]] = {name: [] for name in names}
        for name in names:
            for layer in layers:
                if interleaved and name == "v":
                    addr = addrs["k"][layer - layers.start]
                    rank.views[("kv", "v", layer)] = (addr + v_at, stride)
                else:
                    addr = alloc.take(length)
                    rank.views[("kv", name, layer)] = (addr, stride)
                    kv_buffers.setdefault(layer, (addr, length))
                if head_stride is not None and token_stride is not None:
                    rank.unit_places[("kv", name, layer)] = (head_stride, token_stride, unit, kv_layout)
                addrs[name].append(addr)
        kv_pool = KvPool(
            tuple(addrs[names[0]]),
            tuple(addrs["v"]) if not spec.is_mla else (),
            (length,) * len(layers),
            item,
            spec.page_size,
            kv_layout,
            heads,
            1 if spec.is_mla else spec.total_heads,
            spec.bytes_per_head,
            spec.is_mla,
            page_stride=stride,
            v_offset=v_at if interleaved else 0,
            head_stride=head_stride,
            token_stride=token_stride if per_unit else None,
        )
    components = []
    for ci, comp in enumerate(world.components):
        layers = _stage_layers(comp.layers, pp)[stage]
        heads_geometry = None
        if comp.heads is not None:
            spec = comp.heads
            heads_per_rank = max(1, spec.total_heads // tp)
            head_layout = spec.src_layout if side == "prefill" else spec.dst_layout
            heads_geometry = HeadGeometry(
                spec.page_size, head_layout, heads_per_rank, spec.total_heads, spec.bytes_per_head
            )
        items = _tensor_items(comp, tp, side)
        aliased = alias and ci == 0
        shared = layout.state_shared or aliased
        slot_used = sum(item for _, item, _ in items)
        offsets = [sum(item for _, item, _ in items[:i]) if shared else 0 for i in range(len(items))]
        pool = state_pool(world, ci)
        tensors = []
        shared_bases: dict[int, tuple[int, int, int]] = {}  # layer -> (base, length, stride)
        for ti, (name, item, fields) in enumerate(items):
            bases, lens = [], []
            for layer in layers:
                if aliased:
                    addr, length = kv_buffers[layer]
                    stride = length // pool
                elif shared:
                    if layer not in shared_bases:
                        stride = slot_used + layout.state_pad
                        shared_bases[layer] = (alloc.take(stride * pool), stride * pool, stride)
                    addr, length, stride = shared_bases[layer]
                else:
                    stride = item + layout.state_pad
                    length = stride * pool
                    addr = alloc.take(length)
                bases.append(addr)
                lens.append(length)
                rank.views[(f"state{ci}", name, layer)] = (addr + offsets[ti], stride)
            tensors.append(
                StateTensor(
                    name,
                    tuple(bases),
                    tuple(lens),
                    item,
                    slot_stride=stride if layers else None,
                    offset=offsets[ti],
                    **fields,
                )
            )
        components.append(
            StatePool(
                comp.kind, _indexing(comp), tuple(tensors), comp.replicated, heads_geometry, tuple(layers)
            )
        )
    aux = []
    for ai, item in enumerate(world.aux_items):
        addr = alloc.take(item * world.aux_pool_items)
        rank.views[("aux", str(ai), 0)] = (addr, item)
        aux.append(AuxBuffer(str(ai), addr, item * world.aux_pool_items, item))
    rank.memory = RankMemory(
        ParallelRank(tp, tp_rank, pp, stage), kv_pool, tuple(components), tuple(aux), first_layer
    )
    if side == "prefill":
        fill_prefill(world, rank, full)
    return rank


# ---- full data and expectations -----------------------------------------------------------------


class FullData:
    """One full (unsharded) value per logical item: KV pages [ps, H, B], slots [rows, axis, unit]."""

    def __init__(self, world: World) -> None:
        rng = np.random.default_rng([world.seed, 99])
        self.items: dict[Key, list[np.ndarray]] = {}
        if world.kv is not None:
            spec = world.kv
            heads = 1 if spec.is_mla else spec.total_heads
            for name in ("latent",) if spec.is_mla else ("k", "v"):
                for layer in range(spec.layers):
                    self.items[("kv", name, layer)] = [
                        rng.integers(0, 256, (spec.page_size, heads, spec.bytes_per_head), dtype=np.uint8)
                        for _ in world.src_pages
                    ]
        for ci, comp in enumerate(world.components):
            count = len(world.state_src[ci])
            for layer in range(comp.layers):
                if comp.heads is not None:
                    spec = comp.heads
                    for name in ("k", "v"):
                        self.items[(f"state{ci}", name, layer)] = [
                            rng.integers(
                                0, 256, (spec.page_size, spec.total_heads, spec.bytes_per_head), np.uint8
                            )
                            for _ in range(count)
                        ]
                else:
                    for t in comp.tensors:
                        self.items[(f"state{ci}", t.name, layer)] = [
                            rng.integers(0, 256, (t.outer, sum(t.blocks), t.unit), dtype=np.uint8)
                            for _ in range(count)
                        ]
        for ai, item in enumerate(world.aux_items):
            self.items[("aux", str(ai), 0)] = [rng.integers(0, 256, (1, 1, item), dtype=np.uint8)]


def shard(world: World, key: Key, full: np.ndarray, tp: int, rank: int, side: str) -> np.ndarray:
    comp_name, tensor, _ = key
    if comp_name == "aux":
        return full.reshape(-1)
    if comp_name == "kv":
        spec = world.kv
        assert spec is not None
        if spec.is_mla:
            return full.reshape(-1)
        layout = spec.src_layout if side == "prefill" else spec.dst_layout
        return oracle_page(full, oracle_heads(tp, rank, spec.total_heads), layout)
    comp = world.components[int(comp_name[5:])]
    if comp.heads is not None:
        layout = comp.heads.src_layout if side == "prefill" else comp.heads.dst_layout
        return oracle_page(full, oracle_heads(tp, rank, comp.heads.total_heads), layout)
    spec = next(t for t in comp.tensors if t.name == tensor)
    if comp.replicated or spec.replicated:
        return full.reshape(-1)
    return oracle_slot(full, spec.blocks, tp, rank)


def _indices(world: World, key: Key, side: str) -> tuple[int, ...]:
    """Indices of ``key``'s items on one side; aux lands on every decode PP stage (from the last
    prefill stage it reads)."""
    comp_name = key[0]
    if comp_name == "kv":
        return world.src_pages if side == "prefill" else world.dst_pages
    if comp_name == "aux":
        return (world.aux_index[0] if side == "prefill" else world.aux_index[1],)
    ci = int(comp_name[5:])
    return world.state_src[ci] if side == "prefill" else world.state_dst[ci]


def _write_items(world: World, rank: Rank, full: FullData, side: str, target: AddressSpace) -> None:
    tp, tp_rank = rank.memory.position.tp_size, rank.memory.position.tp_rank
    for key, (start, stride) in rank.views.items():
        for position, index in enumerate(_indices(world, key, side)):
            data = shard(world, key, full.items[key][position], tp, tp_rank, side)
            if key in rank.unit_places:  # page bytes in the layout's order, each unit at its place
                head_stride, token_stride, unit, kv_layout = rank.unit_places[key]
                page = start + index * stride
                tokens = world.kv.page_size if world.kv is not None else 0
                rows = (
                    data.reshape(-1, tokens, unit)
                    if kv_layout is Layout.HND
                    else data.reshape(tokens, -1, unit)
                )
                for outer, row in enumerate(rows):
                    for inner, part in enumerate(row):
                        h, t = (outer, inner) if kv_layout is Layout.HND else (inner, outer)
                        target.view(page + h * head_stride + t * token_stride, unit)[:] = part
            else:
                target.view(start + index * stride, len(data))[:] = data


def fill_prefill(world: World, rank: Rank, full: FullData) -> None:
    _write_items(world, rank, full, "prefill", rank.space)


# ---- running a world ---------------------------------------------------------------------------


@dataclass
class Outcome:
    tables: list[DescriptorTable]  # every non-empty group table executed
    per_pair: dict[
        tuple[int, int, int], int
    ]  # (decode rank, prefill stage, prefill rank) -> descriptor count


def assert_minimal_and_inside(table: DescriptorTable, src: RankMemory, dst: RankMemory) -> None:
    pairs = table.mergeable_pairs()
    assert len(pairs) == 0, f"mergeable rows {pairs[:5].tolist()}"
    outside = table.rows_outside(regions(src), regions(dst))
    assert len(outside) == 0, f"rows outside their regions: {outside[:5].tolist()}"


def run_world(world: World) -> Outcome:
    """Build every rank, plan every (prefill, decode) pair the routing asks for, execute, check."""
    full = FullData(world)
    stages = world.prefill_pp
    prefill = {
        (s, p): build_rank(world, "prefill", p, s, full)
        for s in range(stages)
        for p in range(world.prefill_tp)
    }
    decode_stages = range(stages) if world.decode_pp_matches else range(1)
    outcome = Outcome([], {})
    is_mla = world.kv is not None and world.kv.is_mla
    sharded = has_tp_sharded_state(prefill[(0, 0)].memory)
    for ds in decode_stages:
        for d in range(world.decode_tp):
            rank = build_rank(world, "decode", d, ds, full)
            expected = AddressSpace()
            for base, buffer in rank.space.snapshot():
                expected.map(base, buffer)
            route = route_decode_rank(
                world.prefill_tp,
                world.decode_tp,
                d,
                is_mla=is_mla,
                prefill_pp=stages,
                decode_pp=stages if world.decode_pp_matches else 1,
                decode_pp_rank=ds,
                sharded_state=sharded,
            )
            written: list[DescriptorTable] = []
            for s in route.prefill_pp_stages:
                for p in route.prefill_ranks:
                    source = prefill[(s, p)]
                    plan = prepare_peer(source.memory, rank.memory)
                    assert plan.is_dummy == (p in route.dummy_prefill_ranks)
                    plan.check_request(world.dst_pages, world.state_dst, world.aux_index[1])
                    groups = [plan.plan_kv_chunk(0, world.src_pages, world.dst_pages)]
                    groups += plan.plan_state(world.state_src, world.state_dst)
                    groups.append(plan.plan_aux(*world.aux_index))
                    count = 0
                    for group in groups:
                        table = group.table
                        assert_minimal_and_inside(table, source.memory, rank.memory)
                        execute(table, source.space, rank.space, regions(source.memory), regions(rank.memory))
                        count += len(table)
                        if len(table):
                            written.append(table)
                    outcome.per_pair[(d, s, p)] = count
            _assert_no_two_writers(written)
            _write_items(world, rank, full, "decode", expected)
            _assert_same_memory(rank, expected)
            outcome.tables.extend(written)
    return outcome


def _assert_no_two_writers(tables: list[DescriptorTable]) -> None:
    """Destination ranges of everything written into one decode rank are pairwise disjoint."""
    if not tables:
        return
    joined = DescriptorTable.concat(tables)
    order = np.argsort(joined.dst_addr, kind="stable")
    starts, lengths = joined.dst_addr[order], joined.length[order]
    assert bool(np.all(starts[1:] >= starts[:-1] + lengths[:-1])), "two descriptors write the same bytes"


def _assert_same_memory(rank: Rank, expected: AddressSpace) -> None:
    """Every byte of every allocation: the expected shard inside destination items, else untouched."""
    tp_rank = rank.memory.position.tp_rank
    for (base, actual), (_, wanted) in zip(rank.space.snapshot(), expected.snapshot(), strict=True):
        if not np.array_equal(actual, wanted):
            diff = np.flatnonzero(actual != wanted)
            owners = [
                key
                for key, (start, stride) in rank.views.items()
                if start <= base + int(diff[0]) < start + stride * 4096
            ]
            raise AssertionError(
                f"decode rank {tp_rank} allocation at {base:#x}: {len(diff)} bytes differ, "
                f"first at offset {int(diff[0])} (buffers there: {owners[:3]})"
            )
