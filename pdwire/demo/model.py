"""The demo's small hybrid model: one rank's transfer memory, laid out as torch tensors.

One buffer allocated through the transfer backend (so engines can register it) holds int16
tensors shaped like a hybrid model's caches (:func:`tensor_shapes`): the KV pool (HND K and V,
or one MLA latent), a Mamba component (conv state of independently sharded q|k|v sub-blocks,
temporal state) and an SWA pool, or for MLA a replicated SWA and DSA indexer pool; one aux
buffer. The same :class:`ModelSpec` describes the planner's :class:`RankMemory` for the rank,
so the registration and the tensors cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from pdwire.demo.spec import Capacity, ModelSpec
from pdwire.runtime import torch_memory as tm
from pdwire.runtime.descriptors import Region
from pdwire.runtime.engine import (
    HeadGeometry,
    Indexing,
    Layout,
    ParallelRank,
    RankMemory,
    StateKind,
    StatePool,
    regions,
)
from pdwire.runtime.planner import heads_held

__all__ = ["Capacity", "ModelSpec", "RankCaches", "build_caches", "bytes_needed"]

ELEM = 2  # bytes per element: every cache tensor is int16 (bit patterns, never arithmetic)
ALIGN = 64


@dataclass
class RankCaches:
    """One rank's cache tensors (views into ``buffer``) and their planner description."""

    spec: ModelSpec
    position: ParallelRank
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
    caches = RankCaches(spec, ParallelRank(tp, rank), cap, flat)
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


def _replicated_pages(kind: StateKind, name: str, ts: list[torch.Tensor]) -> StatePool:
    """A page-indexed component of one tensor, the same on every TP rank (MLA's SWA and DSA)."""
    return tm.state_component(
        kind, Indexing.PAGE, [tm.state_tensor(name, ts)], replicated=True, device=ts[0].device
    )


def _describe(c: RankCaches) -> RankMemory:
    """The rank's memory, described from its tensors with the public torch helper."""
    spec, t, tp = c.spec, c.tensors, c.tp
    hl = _local_heads(spec, tp, c.rank)
    state: list[StatePool] = []
    if spec.mla:
        kv = tm.kv_pool(
            t["kv.latent"], None, page_size=spec.page_size, layout=Layout.NHD,
            kv_heads_per_rank=1, total_kv_heads=1, is_mla=True,
        )  # fmt: skip
        if "swa.latent" in t:
            state.append(_replicated_pages(StateKind.SWA, "latent", t["swa.latent"]))
        if "dsa.index_k" in t:
            state.append(_replicated_pages(StateKind.DSA, "index_k", t["dsa.index_k"]))
    else:
        kv = tm.kv_pool(
            t["kv.k"], t["kv.v"], page_size=spec.page_size, layout=Layout.HND,
            kv_heads_per_rank=hl, total_kv_heads=spec.kv_heads,
        )  # fmt: skip
        if "mamba.conv" in t:
            conv = tm.state_tensor("conv", t["mamba.conv"], sharded=True, sub_blocks=spec.conv_blocks)
            temporal = tm.state_tensor("temporal", t["mamba.temporal"], sharded=True)
            state.append(
                tm.state_component(StateKind.MAMBA, Indexing.SLOT, [conv, temporal], device=c.buffer)
            )
        if "swa.k" in t:
            heads = HeadGeometry(spec.page_size, Layout.HND, hl, spec.kv_heads, spec.head_dim * ELEM)
            swa = [tm.state_tensor("k", t["swa.k"]), tm.state_tensor("v", t["swa.v"])]
            state.append(tm.state_component(StateKind.SWA, Indexing.PAGE, swa, heads=heads, device=c.buffer))
    return RankMemory(c.position, kv, tuple(state), (tm.aux_buffer("out", t["aux"][0]),))
