"""The deterministic region list of one rank: what backends register and descriptors point into.

Order: KV K buffers of every held layer, then V buffers (MLA: the latent buffers only), then for
each state component, for each tensor, one region per layer, then one region per aux buffer.
``DescriptorTable.src_region`` / ``dst_region`` are indices into exactly this list.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdwire.runtime.descriptors import MemoryKind, Region
from pdwire.runtime.planner.model import RankMemory
from pdwire.runtime.planner.validation import validate_memory


@dataclass(frozen=True, slots=True)
class RegionIndex:
    """Where each buffer's region sits in ``regions(memory)``."""

    kv_k: tuple[int, ...]
    kv_v: tuple[int, ...]
    state: tuple[tuple[tuple[int, ...], ...], ...]  # [component][tensor][layer]
    aux: tuple[int, ...]


def region_index(memory: RankMemory) -> RegionIndex:
    next_id = 0

    def take(count: int) -> tuple[int, ...]:
        nonlocal next_id
        ids = tuple(range(next_id, next_id + count))
        next_id += count
        return ids

    kv_k = take(len(memory.kv.k_base_addrs)) if memory.kv else ()
    kv_v = take(len(memory.kv.v_base_addrs)) if memory.kv else ()
    state = tuple(
        tuple(take(len(tensor.base_addrs)) for tensor in component.tensors) for component in memory.state
    )
    aux = take(len(memory.aux))
    return RegionIndex(kv_k, kv_v, state, aux)


def regions(memory: RankMemory, side: str = "local") -> list[Region]:
    """One Region per registered buffer, in ``region_index`` order. Raises a PlanError on a
    self-contradicting description."""
    validate_memory(memory, side)
    out: list[Region] = []
    kv = memory.kv
    if kv is not None:
        latent = "latent" if kv.is_mla else "k"
        for layer, (base, length) in enumerate(zip(kv.k_base_addrs, kv.region_lens, strict=True)):
            global_layer = memory.position.first_layer + layer
            out.append(Region(base, length, kv.memory_kind, kv.device_id, f"kv.{latent}.L{global_layer}"))
        v_lens = () if kv.is_mla else kv.region_lens
        for layer, (base, length) in enumerate(zip(kv.v_base_addrs, v_lens, strict=True)):
            global_layer = memory.position.first_layer + layer
            out.append(Region(base, length, kv.memory_kind, kv.device_id, f"kv.v.L{global_layer}"))
    for ci, component in enumerate(memory.state):
        layer_ids = component.global_layer_ids()
        for tensor in component.tensors:
            for li, (base, length) in enumerate(zip(tensor.base_addrs, tensor.region_lens, strict=True)):
                layer = layer_ids[li] if li < len(layer_ids) else li
                name = f"state{ci}.{component.kind.value}.{tensor.name}.L{layer}"
                out.append(Region(base, length, component.memory_kind, component.device_id, name))
    for aux in memory.aux:
        out.append(Region(aux.base_addr, aux.region_len, MemoryKind.DRAM, 0, f"aux.{aux.name}"))
    return out
