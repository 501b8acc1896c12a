"""Validate and prepare one (prefill rank -> decode rank) peer, once per registration.

Everything that does not depend on a request is decided here: TP and PP mapping, which heads or
axis ranges this prefill rank writes into this decode rank, item-size agreement, the segment
pattern of every tensor, and the per-layer base addresses and region ids on both sides. The
result, a ``PeerPlan``, then turns each request's indices into descriptor tables.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdwire.runtime.planner.aliasing import DestinationOverlaps, destination_overlaps
from pdwire.runtime.planner.errors import (
    GeometryMismatch,
    MissingShardingInfo,
    PlanError,
    TopologyError,
)
from pdwire.runtime.planner.kernel import BufferSet
from pdwire.runtime.planner.model import (
    HeadGeometry,
    RankMemory,
    StatePool,
    StateTensor,
)
from pdwire.runtime.planner.patterns import Pattern, axis_slice, empty_pattern, head_slice, whole_item
from pdwire.runtime.planner.regions import RegionIndex, region_index
from pdwire.runtime.planner.routing import DecodeRoute, check_tp_sizes, heads_held, route_decode_rank
from pdwire.runtime.planner.validation import validate_memory


@dataclass(frozen=True, slots=True)
class SetGroup:
    """The buffer sets of one completion group (KV, one state component, aux). ``coalesce``: rows
    of different entries may meet (shared registrations that could not be fused), so the group's
    table is coalesced as a whole."""

    sets: tuple[BufferSet, ...]
    coalesce: bool = False


@dataclass(frozen=True, slots=True)
class PeerSetup:
    """What was decided for one (prefill rank, decode rank) pair, independent of any request."""

    route: DecodeRoute
    is_dummy: bool  # contacted but transfers nothing (MLA, P > D, not the first rank of the group)
    writes_aux: bool
    kv: SetGroup | None
    state: tuple[SetGroup | None, ...]  # per component; None: this rank writes nothing of it
    aux: SetGroup | None
    overlaps: DestinationOverlaps


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
    """Each row's overlap of the two ranks' shards of the sharded axis, per sub-block.

    A slot is ``[outer_rows][axis][inner]`` on both sides; both must agree on the rows and the
    bytes per axis element, and on the full axis size. Sub-blocks declared on one side only are
    taken from that side: both sides hold the same model (the handshake checks the fingerprint),
    and the split belongs to the model, not to a side (SGLang's decode never declares it).
    """

    def bad(why: str, kind: type[PlanError] = GeometryMismatch) -> PlanError:
        return kind(why, component=component, tensor=src.name)

    if src.sharded_axis_size is None or dst.sharded_axis_size is None:
        raise bad(
            f"TP differs (prefill {pair.src_tp}, decode {pair.dst_tp}) but the sharded-axis size is "
            f"missing on {'prefill' if src.sharded_axis_size is None else 'decode'}; "
            "a whole-slot copy would corrupt state",
            MissingShardingInfo,
        )
    if src.outer_rows != dst.outer_rows:
        raise bad(f"rows around the sharded axis differ: prefill {src.outer_rows}, decode {dst.outer_rows}")
    src_unit = src.bytes_per_slot // (src.sharded_axis_size * src.outer_rows)
    dst_unit = dst.bytes_per_slot // (dst.sharded_axis_size * dst.outer_rows)
    if src_unit != dst_unit:
        raise bad(f"bytes per sharded-axis element differ: prefill {src_unit}, decode {dst_unit}")
    full = src.sharded_axis_size * pair.src_tp
    dst_full = dst.sharded_axis_size * pair.dst_tp
    if full != dst_full:
        raise bad(
            f"full axis size disagrees: prefill {src.sharded_axis_size}x{pair.src_tp}, "
            f"decode {dst.sharded_axis_size}x{pair.dst_tp}"
        )
    declared = [b for b in (src.sub_block_sizes, dst.sub_block_sizes) if b is not None]
    if len(declared) == 2 and declared[0] != declared[1]:
        raise bad(f"sub-block sizes differ: prefill {declared[0]}, decode {declared[1]}")
    blocks = declared[0] if declared else (full,)
    if sum(blocks) != full:
        raise bad(f"full axis size disagrees: sub-blocks sum {sum(blocks)}, the axis is {full}")
    for block in blocks:
        if block % pair.src_tp or block % pair.dst_tp:
            raise bad(
                f"sub-block of size {block} cannot be sharded over TP {pair.src_tp} and {pair.dst_tp}",
                TopologyError,
            )
    return axis_slice(
        src_item=src.bytes_per_slot,
        dst_item=dst.bytes_per_slot,
        unit_bytes=src_unit,
        block_sizes=tuple(blocks),
        outer_rows=src.outer_rows,
        src_tp=pair.src_tp,
        src_rank=pair.src_rank,
        dst_tp=pair.dst_tp,
        dst_rank=pair.dst_rank,
    )


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor-layer of a transfer: its pattern and where its items are on each side."""

    tensor: str
    layer: int
    pattern: Pattern
    src: tuple[int, int, int, int]  # (address of item 0, region id, stride, capacity)
    dst: tuple[int, int, int, int]


def _capacity(region_len: int, offset: int, item: int, stride: int) -> int:
    """Items ``i`` whose bytes ``[offset + i*stride, + item)`` lie inside the registration."""
    return 0 if region_len < offset + item else (region_len - offset - item) // stride + 1


def _side(
    base: int, region_len: int, region: int, offset: int, item: int, stride: int
) -> tuple[int, int, int, int]:
    return (base + offset, region, stride, _capacity(region_len, offset, item, stride))


_Named = tuple[_Entry, tuple[str, int], tuple[str, int]]  # entry, (tensor, layer) limiting each side


def _fuse(members: list[_Entry], component: str) -> _Named | None:
    """Entries in one registration pair with equal strides as ONE entry whose pattern is the union
    of theirs (K and V interleaved per block, tensors sharing a slot): rows that meet across
    tensors then merge like rows inside one tensor. None when the union does not stay inside one
    destination stride (rows would not be sorted by destination any more)."""
    src0 = min(m.src[0] for m in members)
    dst0 = min(m.dst[0] for m in members)
    src_stride, dst_stride = members[0].src[2], members[0].dst[2]
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    for m in members:
        p = m.pattern
        rows[0].extend((p.src_off + np.uint64(m.src[0] - src0)).tolist())
        rows[1].extend((p.dst_off + np.uint64(m.dst[0] - dst0)).tolist())
        rows[2].extend(p.length.tolist())
    ends = [d + n for d, n in zip(rows[1], rows[2], strict=True)]
    if ends and max(ends) > dst_stride:
        return None
    order = sorted(range(len(ends)), key=rows[1].__getitem__)
    for a, b in itertools.pairwise(order):
        if rows[1][b] < ends[a]:
            raise GeometryMismatch(
                "two tensors write the same bytes of one destination item", component=component
            )
    pattern = Pattern.from_rows(rows[0], rows[1], rows[2], src_stride, dst_stride)
    src_limit = min(members, key=lambda m: m.src[3])
    dst_limit = min(members, key=lambda m: m.dst[3])
    entry = _Entry(
        "+".join(m.tensor for m in members),
        members[0].layer,
        pattern,
        (src0, members[0].src[1], src_stride, src_limit.src[3]),
        (dst0, members[0].dst[1], dst_stride, dst_limit.dst[3]),
    )
    return entry, (src_limit.tensor, src_limit.layer), (dst_limit.tensor, dst_limit.layer)


def _buffer_sets(component: str, entries: list[_Entry]) -> tuple[tuple[BufferSet, ...], bool]:
    """Fuse entries that share registrations, then group entries with equal patterns and strides.

    Returns the sets and whether rows of different entries may still meet (entries sharing a
    registration pair that could not be fused): then the group's table is coalesced as a whole.
    """
    by_pair: dict[tuple[int, int, int, int], list[_Entry]] = {}
    for e in entries:
        by_pair.setdefault((e.src[1], e.dst[1], e.src[2], e.dst[2]), []).append(e)
    fused: list[_Named] = []
    meets = False
    for members in by_pair.values():
        if len(members) > 1:
            result = _fuse(members, component)
            if result is not None:
                fused.append(result)
                continue
            meets = True
        fused.extend((m, (m.tensor, m.layer), (m.tensor, m.layer)) for m in members)
    regions_met = {(e.src[1], e.dst[1]) for e, _, _ in fused}
    if len(regions_met) < len(fused):
        meets = True  # same registrations, different strides: rows may still meet
    groups: dict[tuple[bytes, bytes, bytes, int, int], list[_Named]] = {}
    for item in fused:
        e = item[0]
        p = e.pattern
        key = (p.src_off.tobytes(), p.dst_off.tobytes(), p.length.tobytes(), e.src[2], e.dst[2])
        groups.setdefault(key, []).append(item)
    sets = []
    for named in groups.values():
        e0 = named[0][0]
        sets.append(
            BufferSet(
                component,
                tuple(m[0].tensor for m in named),
                tuple(m[0].layer for m in named),
                e0.pattern,
                np.asarray([m[0].src[0] for m in named], dtype=np.uint64),
                np.asarray([m[0].dst[0] for m in named], dtype=np.uint64),
                np.asarray([m[0].src[1] for m in named], dtype=np.uint32),
                np.asarray([m[0].dst[1] for m in named], dtype=np.uint32),
                np.asarray([m[0].src[3] for m in named], dtype=np.uint64),
                np.asarray([m[0].dst[3] for m in named], dtype=np.uint64),
                e0.src[2],
                e0.dst[2],
                tuple(m[1] for m in named),
                tuple(m[2] for m in named),
            )
        )
    return tuple(sets), meets


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
) -> SetGroup | None:
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
    src_layers = [local.first_layer + i for i in range(src.num_layers)]
    dst_layers = [remote.first_layer + i for i in range(dst.num_layers)]
    positions = _dst_positions(src_layers, dst_layers, "kv")
    if src.is_mla:
        pattern = _replicated_pattern(pair, src.bytes_per_page, dst.bytes_per_page, "kv", "latent")
        halves = [
            ("latent", src.k_base_addrs, li.kv_k, src.k_offset, dst.k_base_addrs, ri.kv_k, dst.k_offset)
        ]
    else:
        pattern = _head_pattern(pair, src.heads, dst.heads, "kv")
        halves = [
            ("k", src.k_base_addrs, li.kv_k, src.k_offset, dst.k_base_addrs, ri.kv_k, dst.k_offset),
            ("v", src.v_base_addrs, li.kv_v, src.v_offset, dst.v_base_addrs, ri.kv_v, dst.v_offset),
        ]
    entries = []
    for name, s_bases, s_ids, s_off, d_bases, d_ids, d_off in halves:
        for i, (layer, p) in enumerate(zip(src_layers, positions, strict=True)):
            entries.append(
                _Entry(
                    name,
                    layer,
                    pattern,
                    _side(s_bases[i], src.region_lens[i], s_ids[i], s_off, src.page_extent, src.stride),
                    _side(d_bases[p], dst.region_lens[p], d_ids[p], d_off, dst.page_extent, dst.stride),
                )
            )
    return SetGroup(*_buffer_sets("kv", entries))


def _tensor_side(t: StateTensor, layer: int, region: int) -> tuple[int, int, int, int]:
    return _side(t.base_addrs[layer], t.region_lens[layer], region, t.offset, t.bytes_per_slot, t.stride)


def _tensor_pattern(pair: _Pair, src_c: StatePool, dst_c: StatePool, si: int, name: str) -> Pattern:
    src, dst = src_c.tensors[si], dst_c.tensors[si]
    if src_c.heads is not None or dst_c.heads is not None:
        if src_c.heads is None or dst_c.heads is None:
            raise GeometryMismatch("head geometry given on one side only", component=name, tensor=src.name)
        return _head_pattern(pair, src_c.heads, dst_c.heads, name)
    if src.replicated != dst.replicated:
        raise GeometryMismatch("tensor replicated on one side only", component=name, tensor=src.name)
    if pair.same_tp:
        if src.bytes_per_slot != dst.bytes_per_slot:
            raise GeometryMismatch(
                f"bytes per slot differ: prefill {src.bytes_per_slot}, decode {dst.bytes_per_slot} "
                "(dtype or shape mismatch)",
                component=name,
                tensor=src.name,
            )
        both_axes = src.sharded_axis_size is not None and dst.sharded_axis_size is not None
        if both_axes and src.outer_rows != dst.outer_rows:
            raise GeometryMismatch(
                f"rows around the sharded axis differ: prefill {src.outer_rows}, decode {dst.outer_rows} "
                "(the same bytes in another order)",
                component=name,
                tensor=src.name,
            )
        return whole_item(src.bytes_per_slot)
    if src_c.replicated or src.replicated:
        return _replicated_pattern(pair, src.bytes_per_slot, dst.bytes_per_slot, name, src.name)
    return _axis_pattern(pair, src, dst, name)


def _prepare_state(
    pair: _Pair, local: RankMemory, remote: RankMemory, li: RegionIndex, ri: RegionIndex
) -> tuple[SetGroup, ...]:
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
        entries = []
        for si, (src_t, dst_t) in enumerate(zip(src_c.tensors, dst_c.tensors, strict=True)):
            if src_t.name != dst_t.name:
                raise GeometryMismatch(
                    f"tensor {si} is {src_t.name!r} on prefill and {dst_t.name!r} on decode", component=name
                )
            pattern = _tensor_pattern(pair, src_c, dst_c, si, name)
            for i, (layer, p) in enumerate(zip(src_layers, positions, strict=True)):
                src_side = _tensor_side(src_t, i, li.state[ci][si][i])
                entries.append(
                    _Entry(src_t.name, layer, pattern, src_side, _tensor_side(dst_t, p, ri.state[ci][si][p]))
                )
        out.append(SetGroup(*_buffer_sets(name, entries)))
    return tuple(out)


def _prepare_aux(local: RankMemory, remote: RankMemory, li: RegionIndex, ri: RegionIndex) -> SetGroup:
    if len(local.aux) != len(remote.aux):
        raise GeometryMismatch(
            f"prefill has {len(local.aux)} aux buffers, decode {len(remote.aux)}", component="aux"
        )
    entries = []
    for ai, (src, dst) in enumerate(zip(local.aux, remote.aux, strict=True)):
        if src.bytes_per_item != dst.bytes_per_item:
            raise GeometryMismatch(
                f"bytes per item differ: prefill {src.bytes_per_item}, decode {dst.bytes_per_item}",
                component="aux",
                tensor=src.name,
            )
        item = src.bytes_per_item
        entries.append(
            _Entry(
                src.name,
                0,
                whole_item(item),
                _side(src.base_addr, src.region_len, li.aux[ai], 0, item, item),
                _side(dst.base_addr, dst.region_len, ri.aux[ai], 0, item, item),
            )
        )
    return SetGroup(*_buffer_sets("aux", entries))


def has_tp_sharded_state(memory: RankMemory) -> bool:
    """Some state tensor holds a different share on each TP rank (head- or axis-sharded)."""
    return any(
        not c.replicated and (c.heads is not None or any(not t.replicated for t in c.tensors))
        for c in memory.state
    )


def prepare_peer_setup(local: RankMemory, remote: RankMemory) -> PeerSetup:
    """Validate both descriptions against each other for this pair of ranks; raise a PlanError.

    Both descriptions are taken to be of the same model (the handshake checks the fingerprint
    before it prepares a peer): where one side leaves out a detail of the model's layout (sub-block
    sizes), the other side's is used.
    """
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
        sharded_state=has_tp_sharded_state(local),
    )
    if lp.tp_rank not in route.prefill_ranks:
        raise TopologyError(f"prefill TP rank {lp.tp_rank} does not feed decode TP rank {rp.tp_rank}")
    earlier = route.prefill_ranks[: route.prefill_ranks.index(lp.tp_rank)]
    pair = _Pair(lp.tp_size, lp.tp_rank, rp.tp_size, rp.tp_rank, earlier)
    li, ri = region_index(local), region_index(remote)
    is_dummy = lp.tp_rank in route.dummy_prefill_ranks
    kv = _prepare_kv(pair, local, remote, li, ri)
    state = _prepare_state(pair, local, remote, li, ri)
    aux = _prepare_aux(local, remote, li, ri)
    overlaps = destination_overlaps(remote, ri)
    # the aux item comes from the last PP stage a decode rank reads: the prefill's last stage for
    # a decode of one stage, each stage's own for equal PP (every decode stage reads it, as SGLang's)
    writes_aux = pair.first_writer and lp.pp_rank == route.prefill_pp_stages[-1]
    if is_dummy:
        return PeerSetup(route, True, False, None, tuple(None for _ in state), None, overlaps)
    return PeerSetup(route, False, writes_aux, kv, state, aux if writes_aux else None, overlaps)
