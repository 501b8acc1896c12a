"""The deterministic region list of one rank: what backends register and descriptors point into.

Canonical buffer order: KV K buffers of every held layer, then V (MLA: latent only), then per
state component, per tensor, one buffer per layer, then the aux buffers. Buffers whose extents
overlap are ONE registration spanning their union (aliasing, docs/planner.md), numbered by its
first buffer, so without aliasing region ``i`` is buffer ``i``. ``DescriptorTable.src_region`` /
``dst_region`` index exactly this list.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdwire.runtime.descriptors import MemoryKind, Region
from pdwire.runtime.planner.errors import GeometryMismatch
from pdwire.runtime.planner.model import RankMemory
from pdwire.runtime.planner.validation import validate_memory


@dataclass(frozen=True, slots=True)
class RegionIndex:
    """The region of each buffer in ``regions(memory)``; aliased buffers share one."""

    kv_k: tuple[int, ...]
    kv_v: tuple[int, ...]
    state: tuple[tuple[tuple[int, ...], ...], ...]  # [component][tensor][layer]
    aux: tuple[int, ...]
    count: int = 0  # number of distinct registrations

    @property
    def aliased(self) -> bool:
        """Some registration is addressed by more than one buffer."""
        buffers = len(self.kv_k) + len(self.kv_v) + sum(len(t) for c in self.state for t in c) + len(self.aux)
        return self.count < buffers


@dataclass(frozen=True, slots=True)
class _Buffer:
    name: str
    base: int
    length: int
    kind: MemoryKind
    device_id: int


def _buffers(memory: RankMemory) -> list[_Buffer]:
    """Every buffer in canonical order."""
    out: list[_Buffer] = []
    kv = memory.kv
    if kv is not None:
        latent = "latent" if kv.is_mla else "k"
        for layer, (base, length) in enumerate(zip(kv.k_base_addrs, kv.region_lens, strict=True)):
            global_layer = memory.first_layer + layer
            out.append(_Buffer(f"kv.{latent}.L{global_layer}", base, length, kv.memory_kind, kv.device_id))
        v_lens = () if kv.is_mla else kv.region_lens
        for layer, (base, length) in enumerate(zip(kv.v_base_addrs, v_lens, strict=True)):
            global_layer = memory.first_layer + layer
            out.append(_Buffer(f"kv.v.L{global_layer}", base, length, kv.memory_kind, kv.device_id))
    for ci, component in enumerate(memory.state):
        layer_ids = component.global_layer_ids()
        for tensor in component.tensors:
            for li, (base, length) in enumerate(zip(tensor.base_addrs, tensor.region_lens, strict=True)):
                layer = layer_ids[li] if li < len(layer_ids) else li
                name = f"state{ci}.{component.kind.value}.{tensor.name}.L{layer}"
                out.append(_Buffer(name, base, length, component.memory_kind, component.device_id))
    for aux in memory.aux:
        out.append(_Buffer(f"aux.{aux.name}", aux.base_addr, aux.region_len, MemoryKind.DRAM, 0))
    return out


def _group(buffers: list[_Buffer]) -> tuple[list[int], list[list[int]]]:
    """Region id of every buffer and the members of every region (overlapping extents join).

    A sweep over extents sorted by base: a buffer starting before the running end of the current
    group overlaps it. Zero-length buffers overlap nothing and stay registrations of their own.
    """
    order = sorted(range(len(buffers)), key=lambda i: (buffers[i].base, i))
    groups: list[list[int]] = []
    current: list[int] | None = None
    end = -1
    for i in order:
        b = buffers[i]
        if b.length == 0:
            groups.append([i])
        elif current is not None and b.base < end:
            current.append(i)
            end = max(end, b.base + b.length)
        else:
            current = [i]
            groups.append(current)
            end = b.base + b.length
    groups.sort(key=min)
    region_of = [0] * len(buffers)
    for rid, members in enumerate(groups):
        members.sort()
        for i in members:
            region_of[i] = rid
    return region_of, groups


def region_index(memory: RankMemory) -> RegionIndex:
    buffers = _buffers(memory)
    region_of, groups = _group(buffers)
    position = iter(region_of)

    def take(count: int) -> tuple[int, ...]:
        return tuple(next(position) for _ in range(count))

    kv_k = take(len(memory.kv.k_base_addrs)) if memory.kv else ()
    kv_v = take(len(memory.kv.v_base_addrs)) if memory.kv else ()
    state = tuple(
        tuple(take(len(tensor.base_addrs)) for tensor in component.tensors) for component in memory.state
    )
    aux = take(len(memory.aux))
    return RegionIndex(kv_k, kv_v, state, aux, len(groups))


def regions(memory: RankMemory, side: str = "local") -> list[Region]:
    """One Region per registration, in ``region_index`` order. Raises a PlanError on a
    self-contradicting description (including aliased buffers of different memory kinds)."""
    validate_memory(memory, side)
    buffers = _buffers(memory)
    _, groups = _group(buffers)
    out: list[Region] = []
    for members in groups:
        first = buffers[members[0]]
        for i in members[1:]:
            other = buffers[i]
            if (other.kind, other.device_id) != (first.kind, first.device_id):
                raise GeometryMismatch(
                    f"{side}: {first.name} and {other.name} share memory but differ in memory kind or "
                    f"device ({first.kind.value}:{first.device_id} vs {other.kind.value}:{other.device_id})"
                )
        base = min(buffers[i].base for i in members)
        end = max(buffers[i].base + buffers[i].length for i in members)
        name = first.name if len(members) == 1 else f"{first.name}+{len(members) - 1}"
        out.append(Region(base, end - base, first.kind, first.device_id, name))
    return out
