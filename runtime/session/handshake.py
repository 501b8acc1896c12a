"""Handshake checks and the RegisterInfo <-> planner-memory adapter. Pure: values in, values out.

Both peers send a ``Hello`` first and run the same checks on the pair, so both refuse with
the same message: protocol and version agreement (the wire's ``agree``, whose error names
both sides' versions), opposite roles, identical model fingerprint (weights revision
included: KV of different weights must never mix), and TP sizes that divide one another.

The wire's ``RegisterInfo.state_components[i]`` lists one entry per (tensor, layer), tensor
major; the prefill side splits them back using its own component structure (same kinds,
same tensor count), refusing any count that does not split evenly.

Engines that address memory by descriptor (MoRI) publish one opaque blob per registered
region (``PeerMetadata.region_descs``, in the planner's region order). RegisterInfo carries
them split like the memory itself: each state component's blobs in its ``mem_descs``
(tensor major, per layer, like its ``base_addrs``); every other region's blob in
``kv_mem_descs``: KV K layers, KV V layers, then the aux buffers (the schema has no aux
descriptor list). :func:`join_region_descs` rebuilds the region-ordered tuple on the
prefill side. Version 1.0 cannot carry component descriptors, so a descriptor-addressed
backend refuses a 1.0 peer at the handshake (:func:`check_descriptors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pdwire.runtime.descriptors import MemoryKind
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
    region_index,
)
from pdwire.runtime.session.failures import HandshakeError

from pdwire import wire

_KIND_TO_WIRE = {
    StateKind.MAMBA: wire.StateType.MAMBA,
    StateKind.SWA: wire.StateType.SWA,
    StateKind.DSA: wire.StateType.DSA,
}
_WIRE_TO_KIND = {v: k for k, v in _KIND_TO_WIRE.items()}


@dataclass(frozen=True, slots=True)
class Identity:
    """What a worker says about itself in its Hello."""

    role: wire.Role
    engine_id: str
    tp_size: int
    tp_rank: int
    model: wire.ModelFingerprint
    versions: tuple[tuple[int, int], ...] = ()  # empty: everything this build supports

    def hello(self) -> wire.Hello:
        versions = (
            [wire.Version(major=a, minor=b) for a, b in self.versions]
            if self.versions
            else wire.hello_versions()
        )
        return wire.Hello(
            protocol=wire.PROTOCOL,
            versions=versions,
            role=self.role,
            engine_id=self.engine_id,
            geometry=wire.ParallelGeometry(tp_size=self.tp_size, tp_rank=self.tp_rank),
            model=self.model,
            capabilities=["per-component-state", "explicit-dummy"],
        )


def _fmt_model(m: wire.ModelFingerprint) -> str:
    layers = f"{m.num_layers}/{m.num_attention_layers}/{m.num_state_layers}"
    return f"{m.model_name}@{m.revision} {m.dtype} layers={layers}"


def check_hello(local: wire.Hello, remote: wire.Hello) -> tuple[int, int]:
    """The agreed version, or one :class:`HandshakeError` saying what differs on each side."""
    try:
        version = wire.agree(local, remote)
    except wire.WireError as exc:
        raise HandshakeError(f"{remote.role.name.lower()} {remote.engine_id!r} refused: {exc}") from exc
    if local.role == remote.role:
        raise HandshakeError(
            f"both peers are {local.role.name.lower()} workers ({local.engine_id!r}, {remote.engine_id!r})"
        )
    if local.model != remote.model:
        raise HandshakeError(
            f"model differs: this side serves {_fmt_model(local.model)}, "
            f"peer {remote.engine_id!r} serves {_fmt_model(remote.model)}"
        )
    a, b = local.geometry.tp_size, remote.geometry.tp_size
    if a < 1 or b < 1 or max(a, b) % min(a, b):
        raise HandshakeError(
            f"TP sizes {a} (this side) and {b} (peer {remote.engine_id!r}) do not divide one another"
        )
    return version


DESCRIPTORS_SINCE = (1, 1)  # first version whose StateComponent carries mem_descs


def check_descriptors(version: tuple[int, int], backend: str, by_descriptor: bool, peer: str) -> None:
    """Refuse a version that cannot carry this backend's memory descriptors, before any request.

    Run by both sides after :func:`check_hello` (both run the same backend: the metadata
    envelope enforces it), so both refuse with the same cause.
    """
    if by_descriptor and version < DESCRIPTORS_SINCE:
        have, need = f"{version[0]}.{version[1]}", f"{DESCRIPTORS_SINCE[0]}.{DESCRIPTORS_SINCE[1]}"
        raise HandshakeError(
            f"backend {backend!r} addresses memory by descriptor, and RegisterInfo {have} (agreed with "
            f"{peer!r}) cannot carry them (StateComponent.mem_descs exists since {need}); "
            f"both peers must speak {need} or newer"
        )


# --------------------------------------------------------------------------- RegisterInfo


def _u64(values: list[int] | tuple[int, ...]) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


def _split_region_descs(memory: RankMemory, descs: Sequence[bytes]) -> tuple[list[bytes], list[list[bytes]]]:
    """Region-ordered descriptor blobs -> (kv_mem_descs, one mem_descs list per component)."""
    if not descs:
        return [], [[] for _ in memory.state]
    idx = region_index(memory)
    total = len(idx.kv_k) + len(idx.kv_v) + sum(len(t) for c in idx.state for t in c) + len(idx.aux)
    if len(descs) != total:
        raise HandshakeError(f"the backend published {len(descs)} memory descriptors for {total} regions")
    blobs = [bytes(d) for d in descs]
    kv = [blobs[i] for i in (*idx.kv_k, *idx.kv_v, *idx.aux)]
    comps = [[blobs[i] for t in c for i in t] for c in idx.state]
    return kv, comps


def join_region_descs(info: wire.RegisterInfo) -> tuple[bytes, ...]:
    """The peer's descriptor blobs in its region order (what the backend's add_peer expects).

    Empty when the peer sent none (engines that address memory by address). Raises
    :class:`HandshakeError` naming the field whose count does not match its regions.
    """
    comps = info.state_components
    if not info.kv_mem_descs and not any(c.mem_descs for c in comps):
        return ()
    nk, nv, na = len(info.k_base_addrs), len(info.v_base_addrs), len(info.aux_base_addrs)
    if len(info.kv_mem_descs) != nk + nv + na:
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
    kv = [bytes(d) for d in info.kv_mem_descs]
    state = [bytes(d) for c in comps for d in c.mem_descs]
    return (*kv[: nk + nv], *state, *kv[nk + nv :])


def register_info(
    memory: RankMemory,
    *,
    endpoint: str,
    engine_id: str,
    agent_name: str,
    agent_metadata: bytes,
    region_descs: Sequence[bytes] = (),
) -> wire.RegisterInfo:
    """The decode rank's registration, from the same description its planner uses.

    ``region_descs`` are the backend's per-region memory descriptors in region order
    (``PeerMetadata.region_descs``); empty for engines that address memory by address.
    """
    kv = memory.kv
    if kv is None:
        raise HandshakeError("a decode rank without a KV pool cannot register")
    pos = memory.position
    kv_descs, comp_descs = _split_region_descs(memory, region_descs)
    comps = []
    for c, descs in zip(memory.state, comp_descs, strict=True):
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
            )
        )
    aux = memory.aux
    return wire.RegisterInfo(
        endpoint=endpoint,
        engine_id=engine_id,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        geometry=wire.ParallelGeometry(
            tp_size=pos.tp_size, tp_rank=pos.tp_rank, pp_size=pos.pp_size, pp_rank=pos.pp_rank
        ),
        first_layer=pos.first_layer,
        num_layers=kv.num_layers,
        k_base_addrs=_u64(kv.k_base_addrs),
        v_base_addrs=_u64(kv.v_base_addrs),
        bytes_per_page=_u64([kv.bytes_per_page] * kv.num_layers),
        region_lens=_u64(kv.region_lens),
        num_pages=kv.region_lens[0] // kv.bytes_per_page if kv.region_lens else 0,
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
    )


def _ints(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in a)


def remote_memory(info: wire.RegisterInfo, local: RankMemory) -> RankMemory:
    """The decode rank's memory as the planner models it, shaped after ``local``'s components.

    Raises :class:`HandshakeError` naming the field when the registration cannot describe a
    peer of this model (component count or kind, per-layer counts, page geometry).
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
    )  # fmt: skip
    if len(info.state_components) != len(local.state):
        raise HandshakeError(
            f"RegisterInfo.state_components: peer has {len(info.state_components)} components, "
            f"this side {len(local.state)}"
        )
    state = []
    for ci, (wc, lc) in enumerate(zip(info.state_components, local.state, strict=True)):
        kind = _WIRE_TO_KIND.get(wire.StateType(wc.type))
        if kind is not lc.kind:
            raise HandshakeError(
                f"state component {ci}: peer has {wire.StateType(wc.type).name}, this side {lc.kind.name}"
            )
        n, nt = len(wc.base_addrs), len(lc.tensors)
        if n == 0 or n % nt:
            raise HandshakeError(f"state component {ci}: {n} tensor entries do not split into {nt} tensors")
        layers = n // nt
        shard = _ints(wc.shard_axis_sizes) or (0,) * n
        per_slot = _ints(wc.bytes_per_slot)
        tensors = []
        heads: HeadGeometry | None = None
        for ti, lt in enumerate(lc.tensors):
            sl = slice(ti * layers, (ti + 1) * layers)
            full = shard[sl.start]
            blocks = _ints(wc.sub_blocks[sl.start]) if wc.sub_blocks else ()
            axis = None
            if lc.heads is not None and full:
                hpr = max(1, full // g.tp_size)
                heads = HeadGeometry(
                    info.page_size, layout, hpr, full, per_slot[sl.start] // (info.page_size * hpr)
                )
            elif full:
                axis = full // g.tp_size
            tensors.append(
                StateTensor(
                    lt.name,
                    _ints(wc.base_addrs[sl]),
                    _ints(wc.region_lens[sl]),
                    per_slot[sl.start],
                    axis,
                    blocks or None,
                )
            )
        replicated = heads is None and all(t.sharded_axis_size is None for t in tensors) and lc.replicated
        indexing = Indexing.SLOT if kind is StateKind.MAMBA else Indexing.PAGE
        state.append(
            StateComponent(
                kind, indexing, tuple(tensors), replicated=replicated, heads=heads, memory_kind=lc.memory_kind
            )
        )
    names = [a.name for a in local.aux]
    aux_lens, items = _ints(info.aux_lens), _ints(info.aux_item_lens)
    if len(info.aux_base_addrs) != len(names):
        raise HandshakeError(
            f"RegisterInfo.aux_base_addrs: peer has {len(info.aux_base_addrs)} aux buffers, "
            f"this side {len(names)}"
        )
    aux = tuple(
        AuxBuffer(names[i], int(info.aux_base_addrs[i]), aux_lens[i], items[i]) for i in range(len(names))
    )
    position = RankPosition(g.tp_size, g.tp_rank, g.pp_size, g.pp_rank, info.first_layer)
    return RankMemory(position, kv, tuple(state), aux)
