"""The RegisterInfo <-> planner-memory adapter, pure: values in, values out (docs/runtime.md).

``RegisterInfo.state_components[i]`` lists one entry per (tensor, layer), tensor major. A 1.2+
component describes itself and :func:`remote_memory` validates it against this side's model
(:class:`RegistrationMismatch` names component, tensor and field); a 1.1/1.0 peer sends no
self-description, so its structure is borrowed from this side's model. The memory kind is never
on the wire. A peer without ``layer_ids`` (before 1.3) is accepted only without PP.

Descriptor-addressed engines (MoRI) publish one blob per region; RegisterInfo carries them split
like the memory (``mem_descs`` per component, ``kv_mem_descs``, ``aux_mem_descs`` from 1.2, at the
tail of ``kv_mem_descs`` for 1.1); :func:`join_region_descs` rebuilds the region order, one blob
per registration where buffers alias. What 1.4 added (item layouts, head stride, sharded axes,
SGLang kinds, aliasing) is refused by name for an older peer (:func:`check_layout_version`)
before anything is planned; the codec's DowngradeError is the last line behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from pdwire import wire
from pdwire.runtime.descriptors import MemoryKind
from pdwire.runtime.planner import (
    UNPLANNABLE_KINDS,
    AuxBuffer,
    HeadGeometry,
    Indexing,
    KvPool,
    Layout,
    RankMemory,
    StateKind,
    StatePool,
    StateTensor,
    has_tp_sharded_state,
    region_index,
)
from pdwire.runtime.session.failures import HandshakeError, RegistrationMismatch
from pdwire.runtime.session.hello import LAYOUTS_SINCE, SELF_DESCRIBING_SINCE, geometry_of, rank_of
from pdwire.wire import features

# same names on both sides; nsa from 1.3, SGLang's other kinds from 1.4 (the codec refuses
# them for older peers, and check_layout_version names them first)
_KIND_TO_WIRE = {kind: wire.StateType[kind.name] for kind in StateKind}
_WIRE_TO_KIND = {v: k for k, v in _KIND_TO_WIRE.items()}


_INDEXING_TO_WIRE = {
    Indexing.SLOT: wire.StateIndexing.SLOT,
    Indexing.PAGE: wire.StateIndexing.PAGE,
    Indexing.ROW: wire.StateIndexing.ROW,
}
_WIRE_TO_INDEXING = {v: k for k, v in _INDEXING_TO_WIRE.items()}
_LAYOUT_TO_WIRE = {Layout.NHD: wire.KvLayout.NHD, Layout.HND: wire.KvLayout.HND}
_WIRE_TO_LAYOUT = {v: k for k, v in _LAYOUT_TO_WIRE.items()}


def _sharding(c: StatePool) -> wire.StateSharding:
    if c.heads is not None:
        return wire.StateSharding.HEADS
    return wire.StateSharding.REPLICATED if c.replicated else wire.StateSharding.AXIS


def _heads_to_wire(h: HeadGeometry | None) -> wire.HeadSharding | None:
    if h is None:
        return None
    head_stride, token_stride = wire_unit_strides(h)
    return wire.HeadSharding(
        page_size=h.page_size,
        layout=_LAYOUT_TO_WIRE[h.layout],
        kv_heads_per_rank=h.kv_heads_per_rank,
        kv_heads_total=h.total_kv_heads,
        bytes_per_head=h.bytes_per_head,
        head_stride=head_stride,
        token_stride=token_stride,
    )


def heads_from_wire(h: wire.HeadSharding) -> HeadGeometry:
    return HeadGeometry(
        h.page_size,
        _WIRE_TO_LAYOUT[wire.KvLayout(h.layout)],
        h.kv_heads_per_rank,
        h.kv_heads_total,
        h.bytes_per_head,
        int(h.head_stride) or None,
        int(h.token_stride) or None,
    )


def kv_heads_to_wire(memory: RankMemory) -> wire.HeadSharding | None:
    """The head geometry of ``memory``'s KV pool (what a decode rank plans scatters with);
    None without a KV pool or for MLA."""
    kv = memory.kv
    if kv is None or kv.is_mla:
        return None
    # which heads and tokens, not where they lie: decode places scattered bytes in its own order,
    # so the prefill rank's strides stay home (and a 1.4 decode peer can take the answer)
    return _heads_to_wire(replace(kv.heads, head_stride=None, token_stride=None))


def _u64(values: list[int] | tuple[int, ...]) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


def _split_region_descs(memory: RankMemory, descs: Sequence[bytes]) -> tuple[list[bytes], list[list[bytes]]]:
    """Region-ordered descriptor blobs -> (kv_mem_descs, one mem_descs list per component)."""
    if not descs:
        return [], [[] for _ in memory.state]
    idx = region_index(memory)
    if len(descs) != idx.count:  # one per registration: aliased buffers share one
        raise HandshakeError(f"the backend published {len(descs)} memory descriptors for {idx.count} regions")
    blobs = [bytes(d) for d in descs]
    kv = [blobs[i] for i in (*idx.kv_k, *idx.kv_v, *idx.aux)]
    comps = [[blobs[i] for t in c for i in t] for c in idx.state]
    return kv, comps


def join_region_descs(info: wire.RegisterInfo, memory: RankMemory | None = None) -> tuple[bytes, ...]:
    """The peer's descriptor blobs in its region order (what the backend's add_peer expects).

    Empty when the peer sent none (engines that address memory by address). ``memory`` is the
    peer's memory as :func:`remote_memory` built it: where its buffers alias, one blob per
    registration is kept (the buffers of one registration must carry the same blob). Raises
    :class:`HandshakeError` naming the field whose count does not match its regions.
    """
    comps = info.state_components
    if not info.kv_mem_descs and not info.aux_mem_descs and not any(c.mem_descs for c in comps):
        return ()
    nk, nv, na = len(info.k_base_addrs), len(info.v_base_addrs), len(info.aux_base_addrs)
    if info.aux_mem_descs:  # 1.2: the aux buffers have their own list
        if len(info.aux_mem_descs) != na:
            raise HandshakeError(
                f"RegisterInfo.aux_mem_descs: {len(info.aux_mem_descs)} descriptors for {na} aux regions"
            )
        if len(info.kv_mem_descs) != nk + nv:
            raise HandshakeError(
                f"RegisterInfo.kv_mem_descs: {len(info.kv_mem_descs)} descriptors for {nk} K and {nv} V "
                "regions (aux descriptors are in aux_mem_descs)"
            )
    elif len(info.kv_mem_descs) != nk + nv + na:  # 1.1 form (or 1.2 without aux buffers)
        raise HandshakeError(
            f"RegisterInfo.kv_mem_descs: {len(info.kv_mem_descs)} descriptors for {nk} K, {nv} V "
            f"and {na} aux regions"
        )
    for ci, c in enumerate(comps):
        if len(c.mem_descs) != len(c.base_addrs):
            raise HandshakeError(
                f"RegisterInfo.state_components[{ci}].mem_descs: {len(c.mem_descs)} descriptors "
                f"for {len(c.base_addrs)} regions"
            )
    kv = [bytes(d) for d in (*info.kv_mem_descs, *info.aux_mem_descs)]
    state = [bytes(d) for c in comps for d in c.mem_descs]
    per_buffer = (*kv[: nk + nv], *state, *kv[nk + nv :])  # the planner's canonical buffer order
    if memory is None:
        return per_buffer
    idx = region_index(memory)
    if not idx.aliased:
        return per_buffer
    ids = (*idx.kv_k, *idx.kv_v, *(i for c in idx.state for t in c for i in t), *idx.aux)
    if len(ids) != len(per_buffer):
        raise HandshakeError(f"RegisterInfo: {len(per_buffer)} memory descriptors for {len(ids)} buffers")
    joined: dict[int, bytes] = {}
    for rid, blob in zip(ids, per_buffer, strict=True):
        if joined.setdefault(rid, blob) != blob:
            raise HandshakeError(
                f"RegisterInfo: buffers of registration {rid} (aliased memory) carry different descriptors"
            )
    return tuple(joined[rid] for rid in range(idx.count))


def _fmt(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def wire_unit_strides(h: HeadGeometry) -> tuple[int, int]:
    """(head stride, token stride) as the wire carries them: 0 where a stride equals the layout's
    packed default or changes no address (one head, one token), so a packed or single-head
    geometry still travels to a peer that does not know the strides."""
    packed = replace(h, head_stride=None, token_stride=None)
    head = h.head_step if h.kv_heads_per_rank > 1 and h.head_step != packed.head_step else 0
    token = h.token_step if h.page_size > 1 and h.token_step != packed.token_step else 0
    return head, token


def wire_head_stride(kv: KvPool) -> int:
    """``RegisterInfo.kv_head_stride`` (0 for MLA and packed heads)."""
    return 0 if kv.is_mla else wire_unit_strides(kv.heads)[0]


def wire_token_stride(kv: KvPool) -> int:
    """``RegisterInfo.kv_token_stride`` (0 for MLA and packed tokens)."""
    return 0 if kv.is_mla else wire_unit_strides(kv.heads)[1]


def layout_needs(memory: RankMemory, *, own_layout: bool) -> list[tuple[tuple[int, int], str]]:
    """What of ``memory`` needs a protocol version, as (version, what) pairs, each named.

    ``own_layout``: include where this rank places its items (strides, offsets, aliasing), which
    only matters for the rank whose registration travels (decode); the model's structure (the
    sharded axis, replicated tensors, kinds, indexing) is the same on both sides. Versions come
    from the schema (``pdwire.wire.features``), never typed here.
    """
    out: list[tuple[tuple[int, int], str]] = []
    kv = memory.kv
    if own_layout and kv is not None:
        if kv.stride != kv.bytes_per_page:
            since = features.field_since("RegisterInfo", "kv_page_stride")
            out.append((since, f"KV page stride {kv.stride} (a page uses {kv.bytes_per_page} bytes)"))
        if kv.k_offset or kv.v_offset:
            since = features.field_since("RegisterInfo", "v_page_offset")
            out.append((since, f"K/V offsets {kv.k_offset}/{kv.v_offset} inside a page"))
        if wire_head_stride(kv):
            # 1.4 knows a head stride between head-major pages only
            field = "kv_head_stride" if kv.layout is Layout.HND else "kv_token_stride"
            since = features.field_since("RegisterInfo", field)
            out.append((since, f"KV head stride {kv.head_stride} (one head's page is {kv.head_span} bytes)"))
        if wire_token_stride(kv):
            since = features.field_since("RegisterInfo", "kv_token_stride")
            out.append((since, f"KV token stride {kv.token_stride} (one unit is {kv.bytes_per_head} bytes)"))
    for ci, c in enumerate(memory.state):
        where = f"state_components[{ci}] ({c.kind.value})"
        kind_since = features.enum_value_since("StateType", _KIND_TO_WIRE[c.kind].name.lower())
        if kind_since > (1, 0):
            out.append((kind_since, f"{where}: state kind {c.kind.value}"))
        index_since = features.enum_value_since("StateIndexing", _INDEXING_TO_WIRE[c.indexing].name.lower())
        if c.indexing is Indexing.ROW:
            out.append((index_since, f"{where}: row indexing"))
        if own_layout and c.heads is not None and any(wire_unit_strides(c.heads)):
            since = features.field_since("HeadSharding", "token_stride")
            out.append((since, f"{where}: head and token strides {wire_unit_strides(c.heads)}"))
        for t in c.tensors:
            if own_layout and (t.stride != t.bytes_per_slot or t.offset):
                out.append(
                    (LAYOUTS_SINCE, f"{where} tensor {t.name}: slot stride {t.stride} / offset {t.offset}")
                )
            if t.outer_rows != 1:
                out.append(
                    (LAYOUTS_SINCE, f"{where} tensor {t.name}: sharded axis after {t.outer_rows} rows")
                )
            if t.replicated:
                out.append(
                    (LAYOUTS_SINCE, f"{where} tensor {t.name}: replicated inside an axis-sharded component")
                )
    if own_layout:
        idx = region_index(memory)
        if idx.aliased:
            out.append((LAYOUTS_SINCE, f"aliased registrations ({idx.count} registrations for more buffers)"))
    return out


def check_layout_version(
    version: tuple[int, int],
    memory: RankMemory,
    peer: str,
    *,
    own_layout: bool,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    """Refuse a peer whose agreed version lacks what this side's memory uses, naming each part.

    Run by both sides after the Hello exchange (decode with ``own_layout=True``: its item layout
    travels in its registration). Besides what a registration describes, MLA with TP-sharded
    state from a larger prefill TP needs the behaviour promised from 1.4: every prefill rank of
    a group writes its state shard, where older peers expect one writer and dummies.
    """
    needs = [(since, what) for since, what in layout_needs(memory, own_layout=own_layout) if since > version]
    kv = memory.kv
    mla_writers = kv is not None and kv.is_mla and prefill_tp > decode_tp and has_tp_sharded_state(memory)
    if mla_writers and version < LAYOUTS_SINCE:
        needs.append(
            (
                LAYOUTS_SINCE,
                f"MLA with TP-sharded state from prefill TP {prefill_tp} to decode TP {decode_tp} "
                "(every prefill rank writes its state shard)",
            )
        )
    if needs:
        need = _fmt(max(since for since, _ in needs))
        raise HandshakeError(
            f"peer {peer!r} agreed on {_fmt(version)}, which cannot describe what this rank's memory "
            f"uses: {'; '.join(what for _, what in needs)}; both peers must speak {need} or newer"
        )


def _check_kind(kind: StateKind | None, where: str) -> None:
    """A state kind the planner cannot move is refused by name, before any registration."""
    if kind in UNPLANNABLE_KINDS:
        raise HandshakeError(f"{where}: state kind {kind.value} cannot be moved: {UNPLANNABLE_KINDS[kind]}")


def _check_kinds(memory: RankMemory, side: str) -> None:
    for ci, c in enumerate(memory.state):
        _check_kind(c.kind, f"{side} state_components[{ci}]")


def _tensor_layout(t: StateTensor) -> wire.StateTensorLayout:
    return wire.StateTensorLayout(
        slot_stride=0 if t.stride == t.bytes_per_slot else t.stride,
        offset=t.offset,
        outer_rows=t.outer_rows,
        replicated=t.replicated,
    )


def register_info(
    memory: RankMemory,
    *,
    endpoint: str,
    engine_id: str,
    agent_name: str,
    agent_metadata: bytes,
    region_descs: Sequence[bytes] = (),
    version: tuple[int, int] = wire.NEWEST,
    geometry: wire.ParallelGeometry | None = None,
    scatter: tuple[int, int] = (0, 0),
) -> wire.RegisterInfo:
    """The decode rank's registration, from the same description its planner uses.

    ``region_descs`` are the backend's per-region memory descriptors in region order
    (``PeerMetadata.region_descs``); empty for engines that address memory by address.
    ``version`` is the agreed one: below 1.2 the aux descriptors ride at the tail of
    ``kv_mem_descs`` (the component self-description is always filled; the codec drops it
    for older peers, which borrow the structure from their own model). ``geometry`` is the
    rank's place as its Hello gave it (default: ``memory.position``'s).
    ``scatter`` is the receive staging buffer (base, length), registered after the planner's
    regions (its descriptor is the last of ``region_descs``); advertised from 1.4.
    """
    kv = memory.kv
    if kv is None:
        raise HandshakeError("a decode rank without a KV pool cannot register")
    _check_kinds(memory, "this rank's")
    needs = [(since, what) for since, what in layout_needs(memory, own_layout=True) if since > version]
    if needs:
        raise HandshakeError(
            f"RegisterInfo {_fmt(version)} cannot describe {'; '.join(what for _, what in needs)} "
            f"(from {_fmt(max(since for since, _ in needs))})"
        )
    pos = memory.position
    scatter_descs: list[bytes] = []
    if scatter[1] and region_descs:
        region_descs, scatter_descs = region_descs[:-1], [bytes(region_descs[-1])]
    if version < LAYOUTS_SINCE:
        scatter, scatter_descs = (0, 0), []
    kv_descs, comp_descs = _split_region_descs(memory, region_descs)
    comps = []
    for c, descs in zip(memory.state, comp_descs, strict=True):
        layouts = [_tensor_layout(t) for t in c.tensors]
        bases: list[int] = []
        lens: list[int] = []
        per_slot: list[int] = []
        shard: list[int] = []
        blocks: list[np.ndarray] = []
        for t in c.tensors:
            n = len(t.base_addrs)
            bases += t.base_addrs
            lens += t.region_lens
            per_slot += [t.bytes_per_slot] * n
            if c.heads is not None:
                full = c.heads.total_kv_heads  # head-sharded paged tensor: the head axis
            elif c.replicated or t.sharded_axis_size is None:
                full = 0
            else:
                full = t.sharded_axis_size * pos.tp_size
            shard += [full] * n
            blocks += [_u64(t.sub_block_sizes or ())] * n
        comps.append(
            wire.StateComponent(
                type=_KIND_TO_WIRE[c.kind],
                base_addrs=_u64(bases),
                region_lens=_u64(lens),
                bytes_per_slot=_u64(per_slot),
                shard_axis_sizes=_u64(shard),
                sub_blocks=blocks if any(len(b) for b in blocks) else [],
                mem_descs=descs,
                tensor_names=[t.name for t in c.tensors],
                indexing=_INDEXING_TO_WIRE[c.indexing],
                sharding=_sharding(c),
                heads=_heads_to_wire(c.heads),
                # explicit from 1.3; the codec drops 0..n-1 for older peers and refuses others
                layer_ids=np.asarray(c.global_layer_ids(), dtype=np.uint32),
                # from 1.4; all defaults (the 1.3 meaning) travel as none
                tensor_layouts=layouts if any(x != wire.StateTensorLayout() for x in layouts) else [],
            )
        )
    aux_descs: list[bytes] = []
    if version >= SELF_DESCRIBING_SINCE:  # 1.2: the aux descriptors get their own list
        nkv = len(kv.k_base_addrs) + len(kv.v_base_addrs)
        kv_descs, aux_descs = kv_descs[:nkv], kv_descs[nkv:]
    aux = memory.aux
    return wire.RegisterInfo(
        endpoint=endpoint,
        engine_id=engine_id,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        geometry=geometry or geometry_of(pos),
        first_layer=memory.first_layer,
        num_layers=kv.num_layers,
        k_base_addrs=_u64(kv.k_base_addrs),
        v_base_addrs=_u64(kv.v_base_addrs),
        bytes_per_page=_u64([kv.bytes_per_page] * kv.num_layers),
        region_lens=_u64(kv.region_lens),
        num_pages=kv.region_lens[0] // kv.stride if kv.region_lens else 0,
        page_size=kv.page_size,
        kv_layout=wire.KvLayout.NHD if kv.layout is Layout.NHD else wire.KvLayout.HND,
        kv_heads_per_rank=kv.kv_heads_per_rank,
        kv_heads_total=kv.total_kv_heads,
        bytes_per_head=kv.bytes_per_head,
        is_mla=kv.is_mla,
        aux_base_addrs=_u64([a.base_addr for a in aux]),
        aux_lens=_u64([a.region_len for a in aux]),
        aux_item_lens=_u64([a.bytes_per_item for a in aux]),
        kv_mem_descs=kv_descs,
        state_components=comps,
        aux_mem_descs=aux_descs,
        kv_page_stride=0 if kv.stride == kv.bytes_per_page else kv.stride,
        k_page_offset=kv.k_offset,
        v_page_offset=kv.v_offset,
        kv_head_stride=wire_head_stride(kv),
        kv_token_stride=wire_token_stride(kv),
        scatter_base=scatter[0],
        scatter_len=scatter[1],
        scatter_mem_descs=scatter_descs,
    )


def _ints(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in a)


def _split_layers(ci: int, wc: wire.StateComponent, nt: int) -> int:
    n = len(wc.base_addrs)
    if n == 0 or n % nt:
        raise HandshakeError(f"state component {ci}: {n} tensor entries do not split into {nt} tensors")
    # every per-entry list lines up with base_addrs (the optional ones may be empty); a short
    # list would otherwise surface as an IndexError deep in the component builders
    for name, optional in (("region_lens", False), ("bytes_per_slot", False), ("shard_axis_sizes", True),
                           ("sub_blocks", True)):  # fmt: skip
        got = len(getattr(wc, name))
        if got != n and not (optional and got == 0):
            raise HandshakeError(
                f"RegisterInfo.state_components[{ci}].{name}: {got} entries for {n} base addresses"
            )
    return n // nt


def _wire_tensor(
    where: str,
    wc: wire.StateComponent,
    name: str,
    ti: int,
    layers: int,
    axis: int | None,
    layout: wire.StateTensorLayout | None = None,
) -> StateTensor:
    """Tensor ``ti`` of a registered component: its ``layers`` entries (the wire lists them tensor major).

    The planner models one slot size, sharded-axis size and sub-block split per tensor, so the
    per-layer entries must agree; a registration whose layers differ is refused here rather
    than planned with the first layer's geometry (which would write the others' bytes wrong).
    """
    sl = slice(ti * layers, (ti + 1) * layers)
    per_layer: list[tuple[str, list[tuple[int, ...]]]] = [
        ("bytes_per_slot", [(int(x),) for x in wc.bytes_per_slot[sl]]),
        ("shard_axis_sizes", [(int(x),) for x in wc.shard_axis_sizes[sl]]),
        ("sub_blocks", [_ints(b) for b in wc.sub_blocks[sl]]),
    ]
    for field, values in per_layer:
        if len(set(values)) > 1:
            raise RegistrationMismatch(
                where, name, field, f"layers differ ({sorted(set(values))}); one value per tensor is required"
            )
    blocks = _ints(wc.sub_blocks[sl.start]) if wc.sub_blocks else ()
    placed = layout if layout is not None else wire.StateTensorLayout()
    if placed.replicated and axis is not None:
        raise RegistrationMismatch(where, name, "tensor_layouts", "replicated with a sharded axis size")
    return StateTensor(
        name,
        _ints(wc.base_addrs[sl]),
        _ints(wc.region_lens[sl]),
        int(wc.bytes_per_slot[sl.start]),
        axis,
        blocks or None,
        slot_stride=int(placed.slot_stride) or None,
        offset=int(placed.offset),
        outer_rows=int(placed.outer_rows),
        replicated=bool(placed.replicated),
    )


def _rank_axis(where: str, tensor: str, full: int, tp_size: int) -> int:
    """The peer rank's share of a TP-sharded axis; a full size TP does not divide is refused
    (rounding down would give every rank a share that ends short of the next one's start)."""
    if full % tp_size:
        raise RegistrationMismatch(
            where,
            tensor,
            "shard_axis_sizes",
            f"full size {full} cannot be split over the peer's TP {tp_size}",
        )
    return full // tp_size


def _borrowed_component(
    ci: int, wc: wire.StateComponent, lc: StatePool, info: wire.RegisterInfo, layout: Layout
) -> StatePool:
    """A 1.1/1.0 component: tensor names, count, indexing and replication from the local model."""
    g = info.geometry
    layers = _split_layers(ci, wc, len(lc.tensors))
    n = len(wc.base_addrs)
    shard = _ints(wc.shard_axis_sizes) or (0,) * n
    per_slot = _ints(wc.bytes_per_slot)
    tensors = []
    heads: HeadGeometry | None = None
    for ti, lt in enumerate(lc.tensors):
        first = ti * layers
        full = shard[first]
        axis = None
        if lc.heads is not None and full:
            hpr = max(1, full // g.tp_size)
            heads = HeadGeometry(info.page_size, layout, hpr, full, per_slot[first] // (info.page_size * hpr))
        elif full:
            axis = _rank_axis(f"state_components[{ci}] ({lc.kind.value})", lt.name, full, g.tp_size)
        tensors.append(
            _wire_tensor(f"state_components[{ci}] ({lc.kind.value})", wc, lt.name, ti, layers, axis)
        )
    replicated = heads is None and all(t.sharded_axis_size is None for t in tensors) and lc.replicated
    indexing = Indexing.SLOT if lc.kind is StateKind.MAMBA else Indexing.PAGE
    return StatePool(
        lc.kind, indexing, tuple(tensors), replicated=replicated, heads=heads, memory_kind=lc.memory_kind
    )


def _described_component(ci: int, wc: wire.StateComponent, lc: StatePool, tp_size: int) -> StatePool:
    """A 1.2 component, from its own registration (only the memory kind is this side's)."""
    where = f"state_components[{ci}] ({lc.kind.value})"
    names = list(wc.tensor_names)
    if len(set(names)) != len(names):
        raise RegistrationMismatch(where, "", "tensor_names", f"names repeat: {names}")
    layers = _split_layers(ci, wc, len(names))
    indexing = _WIRE_TO_INDEXING.get(wire.StateIndexing(wc.indexing))
    if indexing is None:
        raise RegistrationMismatch(
            where, "", "indexing", "unspecified although the component names its tensors"
        )
    sharding = wire.StateSharding(wc.sharding)
    if sharding == wire.StateSharding.UNSPECIFIED:
        raise RegistrationMismatch(
            where, "", "sharding", "unspecified although the component names its tensors"
        )
    if (wc.heads is not None) != (sharding == wire.StateSharding.HEADS):
        raise RegistrationMismatch(
            where,
            "",
            "heads",
            f"{'present' if wc.heads is not None else 'absent'} with sharding {sharding.name.lower()}",
        )
    heads = None if wc.heads is None else heads_from_wire(wc.heads)
    shard = _ints(wc.shard_axis_sizes) or (0,) * len(wc.base_addrs)  # lengths checked by _split_layers
    layouts = list(wc.tensor_layouts)
    if layouts and len(layouts) != len(names):
        raise RegistrationMismatch(
            where, "", "tensor_layouts", f"{len(layouts)} layouts for {len(names)} tensors"
        )
    tensors = []
    for ti, name in enumerate(names):
        full = shard[ti * layers]
        axis = (
            _rank_axis(where, name, full, tp_size) if sharding == wire.StateSharding.AXIS and full else None
        )
        tensors.append(_wire_tensor(where, wc, name, ti, layers, axis, layouts[ti] if layouts else None))
    return StatePool(
        lc.kind,
        indexing,
        tuple(tensors),
        replicated=sharding == wire.StateSharding.REPLICATED,
        heads=heads,
        memory_kind=lc.memory_kind,
    )


def _check_against_local(where: str, peer: StatePool, lc: StatePool, peer_tp: int, local: RankMemory) -> None:
    """Refuse a self-described component whose structure differs from this side's model.

    Per-rank sizes may differ with TP (a sharded tensor's slot is the rank's share), so sharded
    sizes are compared as full (unsharded) sizes; layer counts may differ with PP and are the
    planner's to check.
    """
    peer_names, local_names = [t.name for t in peer.tensors], [t.name for t in lc.tensors]
    if peer_names != local_names:
        raise RegistrationMismatch(
            where, "", "tensor_names", f"peer has {peer_names}, this side {local_names}"
        )
    if peer.indexing is not lc.indexing:
        raise RegistrationMismatch(
            where, "", "indexing", f"peer indexes by {peer.indexing.value}, this side by {lc.indexing.value}"
        )
    peer_sh, local_sh = _sharding(peer), _sharding(lc)
    if peer_sh != local_sh:
        raise RegistrationMismatch(
            where, "", "sharding", f"peer is {peer_sh.name.lower()}, this side {local_sh.name.lower()}"
        )
    local_tp = local.position.tp_size
    if peer.heads is not None and lc.heads is not None:
        for name in ("page_size", "total_kv_heads", "bytes_per_head"):
            a, b = getattr(peer.heads, name), getattr(lc.heads, name)
            if a != b:
                raise RegistrationMismatch(where, "", f"heads.{name}", f"peer has {a}, this side {b}")
    for pt, lt in zip(peer.tensors, lc.tensors, strict=True):
        if pt.replicated != lt.replicated:
            raise RegistrationMismatch(
                where,
                pt.name,
                "tensor_layouts.replicated",
                f"peer has {pt.replicated}, this side {lt.replicated}",
            )
        whole = peer_sh == wire.StateSharding.REPLICATED or pt.replicated  # the same bytes on every rank
        if whole and pt.bytes_per_slot != lt.bytes_per_slot:
            raise RegistrationMismatch(
                where,
                pt.name,
                "bytes_per_slot",
                f"peer has {pt.bytes_per_slot}, this side {lt.bytes_per_slot}",
            )
        if peer_sh == wire.StateSharding.AXIS and not pt.replicated:
            p_full = None if pt.sharded_axis_size is None else pt.sharded_axis_size * peer_tp
            l_full = None if lt.sharded_axis_size is None else lt.sharded_axis_size * local_tp
            if p_full != l_full:
                raise RegistrationMismatch(
                    where,
                    pt.name,
                    "shard_axis_sizes",
                    f"full sharded axis: peer {p_full}, this side {l_full}",
                )
            # an even split along the axis: the whole slot is the rank's share times TP
            if pt.bytes_per_slot * peer_tp != lt.bytes_per_slot * local_tp:
                raise RegistrationMismatch(
                    where,
                    pt.name,
                    "bytes_per_slot",
                    f"full slot bytes: peer {pt.bytes_per_slot} x TP {peer_tp}, "
                    f"this side {lt.bytes_per_slot} x TP {local_tp}",
                )
        # a split declared by one side only is the model's (the fingerprints matched): the
        # planner takes it from that side; two different splits are a disagreement
        declared = pt.sub_block_sizes is not None and lt.sub_block_sizes is not None
        if declared and pt.sub_block_sizes != lt.sub_block_sizes:
            raise RegistrationMismatch(
                where, pt.name, "sub_blocks", f"peer has {pt.sub_block_sizes}, this side {lt.sub_block_sizes}"
            )
        if pt.outer_rows != lt.outer_rows:
            raise RegistrationMismatch(
                where,
                pt.name,
                "tensor_layouts.outer_rows",
                f"peer has {pt.outer_rows}, this side {lt.outer_rows}",
            )


def _layer_ids(ci: int, wc: wire.StateComponent, comp: StatePool, pp_size: int) -> tuple[int, ...] | None:
    """The layers a registered component's entries hold (1.3); None (0..n-1) only for a peer
    without PP, the one case where an older peer's silence means what it says."""
    where = f"RegisterInfo.state_components[{ci}].layer_ids"
    ids = tuple(int(x) for x in wc.layer_ids)
    if not ids:
        if pp_size > 1:
            raise HandshakeError(
                f"{where}: none from PP stage of {pp_size} (a peer before 1.3 cannot say which layers "
                "its state holds, and layers 0..n-1 would be another stage's)"
            )
        return None
    if len(ids) != comp.num_layers or len(set(ids)) != len(ids):
        raise HandshakeError(f"{where}: {list(ids)} for {comp.num_layers} layers; one distinct id per layer")
    if pp_size == 1 and ids == tuple(range(len(ids))):
        return None  # what None means: the planner models a rank without PP this way
    return ids


def remote_memory(info: wire.RegisterInfo, local: RankMemory) -> RankMemory:
    """The decode rank's memory as the planner models it.

    A self-described component (1.2) is built from the registration and validated against
    ``local``'s; a 1.1 or 1.0 component is shaped after ``local``'s (see the module doc).
    Raises :class:`HandshakeError` naming the field when the registration cannot describe a
    peer of this model (component count or kind, per-layer counts, page geometry), and its
    subclass :class:`RegistrationMismatch` naming component, tensor and field when a
    self-described component disagrees with this side's.
    """
    g = info.geometry
    per_page = _ints(info.bytes_per_page)
    if len(set(per_page)) > 1 or len(per_page) != len(info.k_base_addrs):
        raise HandshakeError(f"RegisterInfo.bytes_per_page must be one value per layer, got {list(per_page)}")
    layout = Layout.NHD if info.kv_layout == wire.KvLayout.NHD else Layout.HND
    local_kv = local.kv
    kv = KvPool(
        _ints(info.k_base_addrs), _ints(info.v_base_addrs), _ints(info.region_lens),
        per_page[0] if per_page else 0,
        info.page_size, layout, info.kv_heads_per_rank, info.kv_heads_total, info.bytes_per_head,
        is_mla=info.is_mla,
        memory_kind=local_kv.memory_kind if local_kv is not None else MemoryKind.DRAM,
        page_stride=int(info.kv_page_stride) or None,
        k_offset=int(info.k_page_offset), v_offset=int(info.v_page_offset),
        head_stride=int(info.kv_head_stride) or None,
        token_stride=int(info.kv_token_stride) or None,
    )  # fmt: skip
    _check_kinds(local, "this rank's")
    if len(info.state_components) != len(local.state):
        raise HandshakeError(
            f"RegisterInfo.state_components: peer has {len(info.state_components)} components, "
            f"this side {len(local.state)}"
        )
    state = []
    for ci, (wc, lc) in enumerate(zip(info.state_components, local.state, strict=True)):
        kind = _WIRE_TO_KIND.get(wire.StateType(wc.type))
        _check_kind(kind, f"peer state_components[{ci}]")
        if kind is not lc.kind:
            raise HandshakeError(
                f"state component {ci}: peer has {wire.StateType(wc.type).name}, this side {lc.kind.name}"
            )
        if wc.tensor_names:
            comp = _described_component(ci, wc, lc, g.tp_size)
            _check_against_local(f"state_components[{ci}] ({kind.value})", comp, lc, g.tp_size, local)
        else:
            comp = _borrowed_component(ci, wc, lc, info, layout)
        state.append(replace(comp, layer_ids=_layer_ids(ci, wc, comp, g.pp_size)))
    names = [a.name for a in local.aux]
    aux_lens, items = _ints(info.aux_lens), _ints(info.aux_item_lens)
    if len(info.aux_base_addrs) != len(names):
        raise HandshakeError(
            f"RegisterInfo.aux_base_addrs: peer has {len(info.aux_base_addrs)} aux buffers, "
            f"this side {len(names)}"
        )
    for field, values in (("aux_lens", aux_lens), ("aux_item_lens", items)):
        if len(values) != len(names):
            raise HandshakeError(f"RegisterInfo.{field}: {len(values)} entries for {len(names)} aux buffers")
    aux = tuple(
        AuxBuffer(names[i], int(info.aux_base_addrs[i]), aux_lens[i], items[i]) for i in range(len(names))
    )
    position = rank_of(g, f"decode {info.engine_id!r}")
    return RankMemory(position, kv, tuple(state), aux, int(info.first_layer))
