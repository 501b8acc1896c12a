"""The demo's small hybrid model: one rank's transfer memory, laid out as torch tensors.

A rank holds, in one buffer allocated through the transfer backend (so engines can register
it), int16 tensors shaped like a small hybrid model's caches:

* attention KV pool, per layer ``[pages, heads_local, page_size, head_dim]`` for K and for V
  (HND), or for MLA one latent ``[pages, page_size, 1, latent_dim]`` per layer;
* non-MLA: a Mamba component (per Mamba layer a conv state ``[slots, conv_local, width]``
  whose channels are the concatenation of independently sharded q|k|v sub-blocks, and a
  temporal state ``[slots, ssm_heads_local, ssm_head_dim, ssm_state]``) plus an SWA pool
  sharded by KV head like the KV pool;
* MLA: an SWA pool and a DSA indexer pool, both replicated across TP (the DSA indexer uses
  the KV page ids);
* one aux buffer ``[aux_slots, aux_bytes]``.

The same :class:`ModelSpec` describes the planner's :class:`RankMemory` for the rank, so the
registration and the tensors cannot drift apart.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch
from pdwire.runtime.descriptors import MemoryKind, Region
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
    heads_held,
    regions,
)

ELEM = 2  # bytes per element: every cache tensor is int16 (bit patterns, never arithmetic)
ALIGN = 64


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes of the demo model; every TP-sharded size must divide by both TP sizes."""

    layers: int = 4
    kv_heads: int = 8
    head_dim: int = 64
    page_size: int = 16
    mla: bool = False
    latent_dim: int = 96  # MLA: latent elements per token
    mamba_layers: int = 2
    conv_blocks: tuple[int, ...] = (32, 32, 64)  # full q|k|v conv channels
    conv_width: int = 3
    ssm_heads: int = 8
    ssm_head_dim: int = 8
    ssm_state: int = 16
    swa_layers: int = 2
    swa_window_pages: int = 4
    dsa_layers: int = 2
    dsa_dim: int = 32
    aux_bytes: int = 64

    @property
    def conv_channels(self) -> int:
        return sum(self.conv_blocks)

    def fingerprint(self) -> bytes:
        """Identity of the model: both sides must hold the same one (weights and geometry)."""
        return hashlib.sha256(repr(self).encode()).digest()[:16]

    def component_kinds(self) -> tuple[StateKind, ...]:
        """State components present, in order (a component with zero layers is absent)."""
        if self.mla:
            pairs = ((StateKind.SWA, self.swa_layers), (StateKind.DSA, self.dsa_layers))
        else:
            pairs = ((StateKind.MAMBA, self.mamba_layers), (StateKind.SWA, self.swa_layers))
        return tuple(k for k, n in pairs if n > 0)

    def check_tp(self, tp: int) -> None:
        sharded = [] if self.mla else [self.kv_heads, *self.conv_blocks, self.ssm_heads]
        for size in sharded:
            if size % tp:
                raise ValueError(f"model size {size} does not divide by TP {tp}; pick sizes divisible by TP")


@dataclass(frozen=True, slots=True)
class Capacity:
    """How many pages/slots/items each pool of a rank holds."""

    pages: int
    slots: int  # Mamba slots; slot 0 is the dummy slot and never handed out
    swa_pages: int
    aux_items: int


@dataclass
class RankCaches:
    """One rank's cache tensors (views into ``buffer``) and their planner description."""

    spec: ModelSpec
    position: RankPosition
    capacity: Capacity
    buffer: torch.Tensor  # the flat uint8 backing store
    tensors: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # name -> per layer
    memory: RankMemory = field(init=False)

    @property
    def tp(self) -> int:
        return self.position.tp_size

    @property
    def rank(self) -> int:
        return self.position.tp_rank

    def regions(self) -> list[Region]:
        return regions(self.memory)

    def address(self, t: torch.Tensor) -> int:
        return int(t.data_ptr())


def _local_heads(spec: ModelSpec, tp: int, rank: int) -> int:
    lo, hi = heads_held(tp, rank, spec.kv_heads)
    return hi - lo


def tensor_shapes(
    spec: ModelSpec, tp: int, rank: int, cap: Capacity
) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (per-layer shape, number of layers), in region order (KV K, KV V, state, aux)."""
    hl = _local_heads(spec, tp, rank)
    ps = spec.page_size
    out: dict[str, tuple[tuple[int, ...], int]] = {}
    if spec.mla:
        out["kv.latent"] = ((cap.pages, ps, 1, spec.latent_dim), spec.layers)
        if spec.swa_layers:
            out["swa.latent"] = ((cap.swa_pages, ps, spec.latent_dim), spec.swa_layers)
        if spec.dsa_layers:
            out["dsa.index_k"] = ((cap.pages, ps, spec.dsa_dim), spec.dsa_layers)
    else:
        # HND pages ([heads][tokens][head_dim]): a head slice of a page is one contiguous run,
        # so hetero-TP needs one descriptor per page instead of one per token.
        out["kv.k"] = ((cap.pages, hl, ps, spec.head_dim), spec.layers)
        out["kv.v"] = ((cap.pages, hl, ps, spec.head_dim), spec.layers)
        if spec.mamba_layers:
            conv = (cap.slots, spec.conv_channels // tp, spec.conv_width)
            out["mamba.conv"] = (conv, spec.mamba_layers)
            temporal = (cap.slots, spec.ssm_heads // tp, spec.ssm_head_dim, spec.ssm_state)
            out["mamba.temporal"] = (temporal, spec.mamba_layers)
        if spec.swa_layers:
            out["swa.k"] = ((cap.swa_pages, hl, ps, spec.head_dim), spec.swa_layers)
            out["swa.v"] = ((cap.swa_pages, hl, ps, spec.head_dim), spec.swa_layers)
    out["aux"] = ((cap.aux_items, spec.aux_bytes // ELEM), 1)
    return out


def bytes_needed(spec: ModelSpec, tp: int, rank: int, cap: Capacity) -> int:
    total = 0
    for shape, layers in tensor_shapes(spec, tp, rank, cap).values():
        per = int(np.prod(shape)) * ELEM
        total += layers * (-(-per // ALIGN) * ALIGN)
    return total


def build_caches(
    spec: ModelSpec, tp: int, rank: int, cap: Capacity, backing: npt.NDArray[np.uint8]
) -> RankCaches:
    """Carve the cache tensors out of ``backing`` (a flat uint8 array from ``Backend.allocate``)."""
    spec.check_tp(tp)
    flat = torch.from_numpy(backing)  # shares memory: writes land in the registered buffer
    caches = RankCaches(spec, RankPosition(tp, rank), cap, flat)
    offset = 0
    for name, (shape, layers) in tensor_shapes(spec, tp, rank, cap).items():
        per = int(np.prod(shape)) * ELEM
        views = []
        for _ in range(layers):
            views.append(flat[offset : offset + per].view(torch.int16).view(shape))
            offset += -(-per // ALIGN) * ALIGN
        caches.tensors[name] = views
    if offset > flat.numel():
        raise ValueError(f"backing buffer of {flat.numel()} bytes is smaller than the {offset} needed")
    caches.memory = _describe(caches)
    return caches


def _bases(ts: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(int(t.data_ptr()) for t in ts)


def _lens(ts: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.numel() * ELEM for t in ts)


def _per_item(ts: list[torch.Tensor]) -> int:
    return (ts[0].numel() // ts[0].shape[0]) * ELEM


def _tensor(
    name: str, ts: list[torch.Tensor], axis: int | None = None, blocks: tuple[int, ...] | None = None
) -> StateTensor:
    """One state tensor over its per-layer views (``axis``, ``blocks``: its TP sharding)."""
    return StateTensor(name, _bases(ts), _lens(ts), _per_item(ts), axis, blocks)


def _replicated_pages(kind: StateKind, name: str, ts: list[torch.Tensor]) -> StateComponent:
    """A page-indexed component of one tensor, the same on every TP rank (MLA's SWA and DSA)."""
    return StateComponent(
        kind, Indexing.PAGE, (_tensor(name, ts),), replicated=True, memory_kind=MemoryKind.DRAM
    )


def _describe(c: RankCaches) -> RankMemory:
    spec, t, tp = c.spec, c.tensors, c.tp
    hl = _local_heads(spec, tp, c.rank)
    dram = MemoryKind.DRAM
    state: list[StateComponent] = []
    if spec.mla:
        lat = t["kv.latent"]
        kv = KvPool(
            _bases(lat), (), _lens(lat), _per_item(lat), spec.page_size, Layout.NHD, 1, 1,
            spec.latent_dim * ELEM, is_mla=True, memory_kind=dram,
        )  # fmt: skip
        if "swa.latent" in t:
            state.append(_replicated_pages(StateKind.SWA, "latent", t["swa.latent"]))
        if "dsa.index_k" in t:
            state.append(_replicated_pages(StateKind.DSA, "index_k", t["dsa.index_k"]))
    else:
        k, v = t["kv.k"], t["kv.v"]
        kv = KvPool(
            _bases(k), _bases(v), _lens(k), _per_item(k), spec.page_size, Layout.HND, hl, spec.kv_heads,
            spec.head_dim * ELEM, memory_kind=dram,
        )  # fmt: skip
        if "mamba.conv" in t:
            state.append(StateComponent(
                StateKind.MAMBA, Indexing.SLOT,
                (
                    _tensor("conv", t["mamba.conv"], spec.conv_channels // tp, tuple(spec.conv_blocks)),
                    _tensor("temporal", t["mamba.temporal"], spec.ssm_heads // tp),
                ),
                memory_kind=dram,
            ))  # fmt: skip
        if "swa.k" in t:
            state.append(StateComponent(
                StateKind.SWA, Indexing.PAGE,
                (_tensor("k", t["swa.k"]), _tensor("v", t["swa.v"])),
                heads=HeadGeometry(spec.page_size, Layout.HND, hl, spec.kv_heads, spec.head_dim * ELEM),
                memory_kind=dram,
            ))  # fmt: skip
    aux = t["aux"][0]
    aux_buf = AuxBuffer("out", int(aux.data_ptr()), aux.numel() * ELEM, spec.aux_bytes)
    return RankMemory(c.position, kv, tuple(state), (aux_buf,))
