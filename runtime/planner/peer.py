"""Validate and prepare one (prefill rank -> decode rank) peer, once per registration.

Everything that does not depend on a request is decided here: TP and PP mapping, which heads or
axis ranges this prefill rank writes into this decode rank, item-size agreement, the segment
pattern of every tensor, and the per-layer base addresses and region ids on both sides. The
result, a ``PeerPlan``, then turns each request's indices into descriptor tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pdwire.runtime.planner.errors import (
    GeometryMismatch,
    MissingShardingInfo,
    TopologyError,
    UnsupportedTransfer,
)
from pdwire.runtime.planner.kernel import BufferSet
from pdwire.runtime.planner.model import (
    HeadGeometry,
    KvPool,
    RankMemory,
    StateComponent,
    StateTensor,
)
from pdwire.runtime.planner.patterns import Pattern, axis_slice, empty_pattern, head_slice, whole_item
from pdwire.runtime.planner.regions import RegionIndex, region_index
from pdwire.runtime.planner.routing import DecodeRoute, check_tp_sizes, heads_held, route_decode_rank
from pdwire.runtime.planner.validation import validate_memory


@dataclass(frozen=True, slots=True)
class PeerSetup:
    """What was decided for one (prefill rank, decode rank) pair, independent of any request."""

    route: DecodeRoute
    is_dummy: bool  # contacted but transfers nothing (MLA, P > D, not the first rank of the group)
    writes_aux: bool
    kv: BufferSet | None
    state: tuple[tuple[BufferSet, ...], ...]  # [component][tensor]
    aux: tuple[BufferSet, ...]


@dataclass(frozen=True, slots=True)
class _Pair:
    """TP/PP facts of the pair used by every pattern decision."""

    src_tp: int
    src_rank: int
    dst_tp: int
    dst_rank: int
    earlier_in_group: tuple[int, ...]  # prefill ranks contacted before this one by the decode rank

    @property
    def same_tp(self) -> bool:
        return self.src_tp == self.dst_tp

    @property
    def first_writer(self) -> bool:
        return not self.earlier_in_group


def _head_pattern(pair: _Pair, src: HeadGeometry, dst: HeadGeometry, component: str) -> Pattern:
    """Heads both ranks hold, minus those an earlier prefill rank of the group already writes.

    With P > H several prefill ranks hold the same head; their bytes are identical, so only the
    first of them writes it (no two writers on one destination byte).
    """
    for name in ("page_size", "total_kv_heads", "bytes_per_head"):
        if getattr(src, name) != getattr(dst, name):
            raise GeometryMismatch(
                f"{name} differs: prefill {getattr(src, name)}, decode {getattr(dst, name)}",
                component=component,
            )
    src_lo, src_hi = heads_held(pair.src_tp, pair.src_rank, src.total_kv_heads)
    dst_lo, dst_hi = heads_held(pair.dst_tp, pair.dst_rank, dst.total_kv_heads)
    lo, hi = max(src_lo, dst_lo), min(src_hi, dst_hi)
    for earlier in pair.earlier_in_group:
        _, earlier_hi = heads_held(pair.src_tp, earlier, src.total_kv_heads)
        lo = max(lo, min(earlier_hi, dst_hi))
    return head_slice(src, dst, src_first_head=src_lo, dst_first_head=dst_lo, heads=(lo, max(lo, hi)))


def _replicated_pattern(pair: _Pair, src_item: int, dst_item: int, component: str, tensor: str) -> Pattern:
    if src_item != dst_item:
        raise GeometryMismatch(
            f"bytes per item differ: prefill {src_item}, decode {dst_item} (dtype or shape mismatch)",
            component=component,
            tensor=tensor,
        )
    return whole_item(src_item) if pair.first_writer else empty_pattern(src_item, dst_item)


def _axis_pattern(pair: _Pair, src: StateTensor, dst: StateTensor, component: str) -> Pattern:
    if src.sharded_axis_size is None or dst.sharded_axis_size is None:
        raise MissingShardingInfo(
            f"TP differs (prefill {pair.src_tp}, decode {pair.dst_tp}) but the sharded-axis size is "
            f"missing on {'prefill' if src.sharded_axis_size is None else 'decode'}; "
            "a whole-slot copy would corrupt state",
            component=component,
            tensor=src.name,
        )
    src_unit = src.bytes_per_slot // src.sharded_axis_size
    dst_unit = dst.bytes_per_slot // dst.sharded_axis_size
    if src_unit != dst_unit:
        raise GeometryMismatch(
            f"bytes per sharded-axis element differ: prefill {src_unit}, decode {dst_unit}",
            component=component,
            tensor=src.name,
        )
    full = src.sharded_axis_size * pair.src_tp
    # None is one block: a split declared on one side only is a disagreement about where each
    # rank's share lies (e.g. q|k|v versus one run), never a detail the other side may fill in
    blocks = src.sub_block_sizes or (full,)
    dst_blocks = dst.sub_block_sizes or (dst.sharded_axis_size * pair.dst_tp,)
    if blocks != dst_blocks and dst.sharded_axis_size * pair.dst_tp == full:
        raise GeometryMismatch(
            f"sub-block sizes differ: prefill {blocks}, decode {dst_blocks}",
            component=component,
            tensor=src.name,
        )
    if sum(blocks) != full or dst.sharded_axis_size * pair.dst_tp != full:
        raise GeometryMismatch(
            f"full axis size disagrees: sub-blocks sum {sum(blocks)}, "
            f"prefill {src.sharded_axis_size}x{pair.src_tp}, decode {dst.sharded_axis_size}x{pair.dst_tp}",
            component=component,
            tensor=src.name,
        )
    for block in blocks:
        if block % pair.src_tp or block % pair.dst_tp:
            raise TopologyError(
                f"sub-block of size {block} cannot be sharded over TP {pair.src_tp} and {pair.dst_tp}",
                component=component,
                tensor=src.name,
            )
    return axis_slice(
        src_item=src.bytes_per_slot,
        dst_item=dst.bytes_per_slot,
        unit_bytes=src_unit,
        block_sizes=tuple(blocks),
        src_tp=pair.src_tp,
        src_rank=pair.src_rank,
        dst_tp=pair.dst_tp,
        dst_rank=pair.dst_rank,
    )


def _capacity(lens: Sequence[int], item: int) -> np.ndarray:
    return np.asarray([length // item for length in lens], dtype=np.uint64)


def _buffer_set(
    component: str,
    tensors: tuple[str, ...],
    layers: tuple[int, ...],
    pattern: Pattern,
    src: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
    dst: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
) -> BufferSet:
    """``src``/``dst``: (base addresses, region lengths, region ids) per entry."""
    return BufferSet(
        component,
        tensors,
        layers,
        pattern,
        np.asarray(src[0], dtype=np.uint64),
        np.asarray(dst[0], dtype=np.uint64),
        np.asarray(src[2], dtype=np.uint32),
        np.asarray(dst[2], dtype=np.uint32),
        _capacity(src[1], pattern.src_item),
        _capacity(dst[1], pattern.dst_item),
    )


def _dst_positions(src_layers: Sequence[int], dst_layers: Sequence[int], component: str) -> list[int]:
    """Map each source layer (global id) to its position on the destination (PP slicing)."""
    where = {layer: position for position, layer in enumerate(dst_layers)}
    out = []
    for layer in src_layers:
        if layer not in where:
            raise GeometryMismatch("decode does not hold this layer", component=component, layer=layer)
        out.append(where[layer])
    return out


def _prepare_kv(
    pair: _Pair, local: RankMemory, remote: RankMemory, li: RegionIndex, ri: RegionIndex
) -> BufferSet | None:
    src, dst = local.kv, remote.kv
    if src is None and dst is None:
        return None
    if src is None or dst is None:
        raise GeometryMismatch("one side has a KV pool and the other has none", component="kv")
    if src.is_mla != dst.is_mla:
        raise GeometryMismatch(f"MLA flag differs: prefill {src.is_mla}, decode {dst.is_mla}", component="kv")
    if src.page_size != dst.page_size:
        raise GeometryMismatch(
            f"page size differs: prefill {src.page_size}, decode {dst.page_size}", component="kv"
        )
    src_layers = [local.position.first_layer + i for i in range(src.num_layers)]
    dst_layers = [remote.position.first_layer + i for i in range(dst.num_layers)]
    positions = _dst_positions(src_layers, dst_layers, "kv")
    if src.is_mla:
        pattern = _replicated_pattern(pair, src.bytes_per_page, dst.bytes_per_page, "kv", "latent")
        names: tuple[str, ...] = ("latent",) * len(src_layers)
        src_cols = (src.k_base_addrs, src.region_lens, li.kv_k)
        dst_cols = tuple(
            tuple(col[p] for p in positions) for col in (dst.k_base_addrs, dst.region_lens, ri.kv_k)
        )
        return _buffer_set("kv", names, tuple(src_layers), pattern, src_cols, dst_cols)  # type: ignore[arg-type]
    pattern = _head_pattern(pair, _heads_of(src), _heads_of(dst), "kv")
    names = ("k",) * len(src_layers) + ("v",) * len(src_layers)
    src_cols = (src.k_base_addrs + src.v_base_addrs, src.region_lens * 2, li.kv_k + li.kv_v)
    dst_cols = (
        tuple(dst.k_base_addrs[p] for p in positions) + tuple(dst.v_base_addrs[p] for p in positions),
        tuple(dst.region_lens[p] for p in positions) * 2,
        tuple(ri.kv_k[p] for p in positions) + tuple(ri.kv_v[p] for p in positions),
    )
    return _buffer_set("kv", names, tuple(src_layers) * 2, pattern, src_cols, dst_cols)


def _heads_of(kv: KvPool) -> HeadGeometry:
    return HeadGeometry(kv.page_size, kv.layout, kv.kv_heads_per_rank, kv.total_kv_heads, kv.bytes_per_head)


def _tensor_pattern(pair: _Pair, src_c: StateComponent, dst_c: StateComponent, si: int, name: str) -> Pattern:
    src, dst = src_c.tensors[si], dst_c.tensors[si]
    if src_c.heads is not None or dst_c.heads is not None:
        if src_c.heads is None or dst_c.heads is None:
            raise GeometryMismatch("head geometry given on one side only", component=name, tensor=src.name)
        return _head_pattern(pair, src_c.heads, dst_c.heads, name)
    if pair.same_tp:
        if src.bytes_per_slot != dst.bytes_per_slot:
            raise GeometryMismatch(
                f"bytes per slot differ: prefill {src.bytes_per_slot}, decode {dst.bytes_per_slot} "
                "(dtype or shape mismatch)",
                component=name,
                tensor=src.name,
            )
        return whole_item(src.bytes_per_slot)
    if src_c.replicated:
        return _replicated_pattern(pair, src.bytes_per_slot, dst.bytes_per_slot, name, src.name)
    return _axis_pattern(pair, src, dst, name)


def _prepare_state(
    pair: _Pair, local: RankMemory, remote: RankMemory, li: RegionIndex, ri: RegionIndex
) -> tuple[tuple[BufferSet, ...], ...]:
    if len(local.state) != len(remote.state):
        raise GeometryMismatch(f"prefill has {len(local.state)} state components, decode {len(remote.state)}")
    out = []
    for ci, (src_c, dst_c) in enumerate(zip(local.state, remote.state, strict=True)):
        name = f"state[{ci}]:{src_c.kind.value}"
        if src_c.kind != dst_c.kind or src_c.indexing != dst_c.indexing:
            raise GeometryMismatch(
                f"component kind differs: prefill {src_c.kind.value}/{src_c.indexing.value}, "
                f"decode {dst_c.kind.value}/{dst_c.indexing.value}",
                component=name,
            )
        if src_c.replicated != dst_c.replicated:
            raise GeometryMismatch("replicated on one side only", component=name)
        if len(src_c.tensors) != len(dst_c.tensors):
            raise GeometryMismatch(
                f"prefill has {len(src_c.tensors)} tensors, decode {len(dst_c.tensors)}", component=name
            )
        src_layers = src_c.global_layer_ids()
        positions = _dst_positions(src_layers, dst_c.global_layer_ids(), name)
        sets = []
        for si, (src_t, dst_t) in enumerate(zip(src_c.tensors, dst_c.tensors, strict=True)):
            pattern = _tensor_pattern(pair, src_c, dst_c, si, name)
            src_cols = (src_t.base_addrs, src_t.region_lens, li.state[ci][si])
            dst_cols = tuple(
                tuple(col[p] for p in positions)
                for col in (dst_t.base_addrs, dst_t.region_lens, ri.state[ci][si])
            )
            names = (src_t.name,) * len(src_layers)
            sets.append(_buffer_set(name, names, src_layers, pattern, src_cols, dst_cols))  # type: ignore[arg-type]
        out.append(tuple(sets))
    return tuple(out)


def _prepare_aux(
    local: RankMemory, remote: RankMemory, li: RegionIndex, ri: RegionIndex
) -> tuple[BufferSet, ...]:
    if len(local.aux) != len(remote.aux):
        raise GeometryMismatch(
            f"prefill has {len(local.aux)} aux buffers, decode {len(remote.aux)}", component="aux"
        )
    out = []
    for ai, (src, dst) in enumerate(zip(local.aux, remote.aux, strict=True)):
        if src.bytes_per_item != dst.bytes_per_item:
            raise GeometryMismatch(
                f"bytes per item differ: prefill {src.bytes_per_item}, decode {dst.bytes_per_item}",
                component="aux",
                tensor=src.name,
            )
        pattern = whole_item(src.bytes_per_item)
        out.append(
            _buffer_set(
                "aux",
                (src.name,),
                (0,),
                pattern,
                ((src.base_addr,), (src.region_len,), (li.aux[ai],)),
                ((dst.base_addr,), (dst.region_len,), (ri.aux[ai],)),
            )
        )
    return tuple(out)


def _has_sharded_state(memory: RankMemory) -> bool:
    return any(not c.replicated for c in memory.state)


def prepare_peer_setup(local: RankMemory, remote: RankMemory) -> PeerSetup:
    """Validate both descriptions against each other for this pair of ranks; raise a PlanError."""
    validate_memory(local, "prefill")
    validate_memory(remote, "decode")
    lp, rp = local.position, remote.position
    check_tp_sizes(lp.tp_size, rp.tp_size)
    if rp.pp_size not in (1, lp.pp_size):
        raise TopologyError(f"decode PP must be 1 or equal prefill PP {lp.pp_size}, got {rp.pp_size}")
    if rp.pp_size > 1 and rp.pp_rank != lp.pp_rank:
        raise TopologyError(f"prefill PP stage {lp.pp_rank} does not feed decode PP stage {rp.pp_rank}")
    is_mla = local.kv is not None and local.kv.is_mla
    route = route_decode_rank(
        lp.tp_size,
        rp.tp_size,
        rp.tp_rank,
        is_mla=is_mla,
        prefill_pp=lp.pp_size,
        decode_pp=rp.pp_size,
        decode_pp_rank=rp.pp_rank,
    )
    if lp.tp_rank not in route.prefill_ranks:
        raise TopologyError(f"prefill TP rank {lp.tp_rank} does not feed decode TP rank {rp.tp_rank}")
    earlier = route.prefill_ranks[: route.prefill_ranks.index(lp.tp_rank)]
    pair = _Pair(lp.tp_size, lp.tp_rank, rp.tp_size, rp.tp_rank, earlier)
    li, ri = region_index(local), region_index(remote)
    is_dummy = lp.tp_rank in route.dummy_prefill_ranks
    if is_dummy and _has_sharded_state(local):
        raise UnsupportedTransfer(
            "MLA with prefill TP > decode TP sends from one rank per group, but this model has "
            "TP-sharded state that the other ranks would have to write"
        )
    kv = _prepare_kv(pair, local, remote, li, ri)
    state = _prepare_state(pair, local, remote, li, ri)
    aux = _prepare_aux(local, remote, li, ri)
    writes_aux = pair.first_writer and lp.pp_rank == lp.pp_size - 1
    if is_dummy:
        return PeerSetup(route, True, False, None, tuple(() for _ in state), ())
    return PeerSetup(route, False, writes_aux, kv, state, aux if writes_aux else ())
