"""A simulated PD deployment for oracle tests: every rank's memory as numpy buffers.

The expected decode contents come from ONE full tensor per (component, tensor, layer), sharded
with plain numpy slicing (``np.split`` along heads or sub-blocks), never with the planner's offset
formulas. The planner's plans are executed with the reference executor; afterwards every byte of
every decode buffer must equal: the untouched random bytes outside the destination items, and
inside them exactly the shard the decode rank must hold.
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
    RankMemory,
    RankPosition,
    StateComponent,
    StateKind,
    StateTensor,
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
    """A Mamba tensor: sharded axis of sub-blocks (full sizes), ``unit`` bytes per axis element.
    A paged replicated tensor: ``blocks=(1,)`` and ``unit`` = bytes per page."""

    name: str
    blocks: tuple[int, ...]
    unit: int
    declare_sub_blocks: bool = True


@dataclass(frozen=True)
class ComponentSpec:
    kind: StateKind
    layers: int
    tensors: tuple[TensorSpec, ...] = ()
    replicated: bool = False
    heads: KvSpec | None = None  # head-sharded paged K/V component (non-MLA SWA)
    pool_items: int = 8


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
    """full_slot: [sum(blocks), unit] -> concatenation of this rank's share of every sub-block."""
    parts = np.split(full_slot, np.cumsum(blocks)[:-1])
    return np.concatenate([np.split(part, tp)[rank] for part in parts]).reshape(-1)


# ---- building ranks --------------------------------------------------------------------------


def _stage_layers(total: int, stages: int) -> list[range]:
    bounds = [total * s // stages for s in range(stages + 1)]
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


@dataclass
class Rank:
    memory: RankMemory
    space: AddressSpace
    buffers: dict[tuple[str, str, int], np.ndarray] = field(
        default_factory=dict
    )  # (comp, tensor, layer) -> bytes


class Allocator:
    def __init__(self, base: int, gap: int, rng: np.random.Generator) -> None:
        self.next = base
        self.gap = gap
        self.rng = rng
        self.space = AddressSpace()

    def take(self, length: int) -> tuple[int, np.ndarray]:
        base = self.next
        buffer = self.space.allocate(base, length, self.rng)
        self.next += length + self.gap
        return base, buffer


def _kv_item(spec: KvSpec, tp: int) -> int:
    heads = 1 if spec.is_mla else max(1, spec.total_heads // tp)
    return spec.page_size * heads * spec.bytes_per_head


def build_rank(world: World, side: str, tp_rank: int, pp_rank: int, full: FullData) -> Rank:
    tp = world.prefill_tp if side == "prefill" else world.decode_tp
    holds_all = side == "decode" and not world.decode_pp_matches
    pp = 1 if holds_all else world.prefill_pp
    stage = 0 if holds_all else pp_rank
    rng = np.random.default_rng([world.seed, side == "prefill", tp_rank, pp_rank])
    base = ((5 + tp_rank) << 33) + (7 << 20) if world.high_addresses else 4096 * (1 + tp_rank)
    alloc = Allocator(base, world.region_gap, rng)
    rank = Rank(RankMemory(RankPosition(tp, tp_rank)), alloc.space)
    kv_pool = None
    first_layer = 0
    if world.kv is not None:
        spec = world.kv
        layers = _stage_layers(spec.layers, pp)[stage]
        first_layer = layers.start
        item = _kv_item(spec, tp)
        names = ("latent",) if spec.is_mla else ("k", "v")
        addrs: dict[str, list[int]] = {name: [] for name in names}
        for name in names:
            for layer in layers:
                addr, buffer = alloc.take(item * world.kv_pool_pages)
                addrs[name].append(addr)
                rank.buffers[("kv", name, layer)] = buffer
        heads = 1 if spec.is_mla else max(1, spec.total_heads // tp)
        layout = spec.src_layout if side == "prefill" else spec.dst_layout
        kv_pool = KvPool(
            tuple(addrs[names[0]]),
            tuple(addrs["v"]) if not spec.is_mla else (),
            (item * world.kv_pool_pages,) * len(layers),
            item,
            spec.page_size,
            layout,
            heads,
            1 if spec.is_mla else spec.total_heads,
            spec.bytes_per_head,
            spec.is_mla,
        )
    components = []
    for ci, comp in enumerate(world.components):
        layers = _stage_layers(comp.layers, pp)[stage]
        tensors = []
        heads_geometry = None
        if comp.heads is not None:
            spec = comp.heads
            heads_per_rank = max(1, spec.total_heads // tp)
            layout = spec.src_layout if side == "prefill" else spec.dst_layout
            heads_geometry = HeadGeometry(
                spec.page_size, layout, heads_per_rank, spec.total_heads, spec.bytes_per_head
            )
            item = _kv_item(spec, tp)
            tensor_list = [(name, item, None, None) for name in ("k", "v")]
        else:
            tensor_list = []
            for t in comp.tensors:
                if comp.replicated:
                    tensor_list.append((t.name, sum(t.blocks) * t.unit, None, None))
                else:
                    axis = sum(t.blocks) // tp
                    blocks = t.blocks if t.declare_sub_blocks and len(t.blocks) > 1 else None
                    tensor_list.append((t.name, axis * t.unit, axis, blocks))
        for name, item, axis, blocks in tensor_list:
            bases = []
            for layer in layers:
                addr, buffer = alloc.take(item * comp.pool_items)
                bases.append(addr)
                rank.buffers[(f"state{ci}", name, layer)] = buffer
            tensors.append(
                StateTensor(name, tuple(bases), (item * comp.pool_items,) * len(layers), item, axis, blocks)
            )
        indexing = Indexing.SLOT if comp.kind is StateKind.MAMBA else Indexing.PAGE
        components.append(
            StateComponent(
                comp.kind, indexing, tuple(tensors), comp.replicated, heads_geometry, tuple(layers)
            )
        )
    aux = []
    for ai, item in enumerate(world.aux_items):
        addr, buffer = alloc.take(item * world.aux_pool_items)
        rank.buffers[("aux", str(ai), 0)] = buffer
        aux.append(AuxBuffer(str(ai), addr, item * world.aux_pool_items, item))
    rank.memory = RankMemory(
        RankPosition(tp, tp_rank, pp, stage, first_layer), kv_pool, tuple(components), tuple(aux)
    )
    if side == "prefill":
        fill_prefill(world, rank, full)
    return rank


# ---- full data and expectations -----------------------------------------------------------------


class FullData:
    """One full (unsharded) value per logical item: KV pages [ps, H, B], slots [axis, unit], pages."""

    def __init__(self, world: World) -> None:
        rng = np.random.default_rng([world.seed, 99])
        self.items: dict[tuple[str, str, int], list[np.ndarray]] = {}
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
                            rng.integers(0, 256, (sum(t.blocks), t.unit), dtype=np.uint8)
                            for _ in range(count)
                        ]
        for ai, item in enumerate(world.aux_items):
            self.items[("aux", str(ai), 0)] = [rng.integers(0, 256, (1, 1, item), dtype=np.uint8)]


def shard(
    world: World, key: tuple[str, str, int], full: np.ndarray, tp: int, rank: int, side: str
) -> np.ndarray:
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
    if comp.replicated:
        return full.reshape(-1)
    spec = next(t for t in comp.tensors if t.name == tensor)
    return oracle_slot(full, spec.blocks, tp, rank)


def _indices(
    world: World, key: tuple[str, str, int], side: str, not_aux_stage: bool = False
) -> tuple[int, ...]:
    """Indices of ``key``'s items on one side; aux lands only on the last decode PP stage."""
    comp_name = key[0]
    if comp_name == "aux" and side == "decode" and not_aux_stage:
        return ()
    if comp_name == "kv":
        return world.src_pages if side == "prefill" else world.dst_pages
    if comp_name == "aux":
        return (world.aux_index[0] if side == "prefill" else world.aux_index[1],)
    ci = int(comp_name[5:])
    return world.state_src[ci] if side == "prefill" else world.state_dst[ci]


def _write_items(world: World, rank: Rank, full: FullData, side: str) -> None:
    tp, tp_rank = rank.memory.position.tp_size, rank.memory.position.tp_rank
    for key, buffer in rank.buffers.items():
        indices = _indices(world, key, side)
        for position, index in enumerate(indices):
            data = shard(world, key, full.items[key][position], tp, tp_rank, side)
            buffer[index * len(data) : (index + 1) * len(data)] = data


def fill_prefill(world: World, rank: Rank, full: FullData) -> None:
    _write_items(world, rank, full, "prefill")


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
    for ds in decode_stages:
        for d in range(world.decode_tp):
            rank = build_rank(world, "decode", d, ds, full)
            before = {key: buffer.copy() for key, buffer in rank.buffers.items()}
            route = route_decode_rank(
                world.prefill_tp,
                world.decode_tp,
                d,
                is_mla=is_mla,
                prefill_pp=stages,
                decode_pp=stages if world.decode_pp_matches else 1,
                decode_pp_rank=ds,
            )
            written: list[DescriptorTable] = []
            for s in route.prefill_pp_stages:
                for p in route.prefill_ranks:
                    source = prefill[(s, p)]
                    plan = prepare_peer(source.memory, rank.memory)
                    assert plan.is_dummy == (p in route.dummy_prefill_ranks)
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
            _assert_decode_holds(world, rank, before, full)
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


def _assert_decode_holds(world: World, rank: Rank, before: dict, full: FullData) -> None:
    tp, tp_rank = rank.memory.position.tp_size, rank.memory.position.tp_rank
    for key, buffer in rank.buffers.items():
        expected = before[key].copy()
        not_aux_stage = rank.memory.position.pp_rank != rank.memory.position.pp_size - 1
        for position, index in enumerate(_indices(world, key, "decode", not_aux_stage)):
            data = shard(world, key, full.items[key][position], tp, tp_rank, "decode")
            expected[index * len(data) : (index + 1) * len(data)] = data
        if not np.array_equal(buffer, expected):
            diff = np.flatnonzero(buffer != expected)
            raise AssertionError(
                f"decode rank {tp_rank} buffer {key}: {len(diff)} bytes differ, "
                f"first at offset {int(diff[0])}"
            )
