"""Self-consistency of one rank's memory description, checked before any peer is prepared."""

from __future__ import annotations

from pdwire.runtime.planner.errors import GeometryMismatch, PlanError, TopologyError
from pdwire.runtime.planner.model import HeadGeometry, Indexing, RankMemory

U64_LIMIT = 1 << 64


def _check_buffers(
    side: str, component: str, tensor: str, bases: tuple[int, ...], lens: tuple[int, ...], item: int
) -> None:
    if item <= 0:
        raise GeometryMismatch(
            f"{side}: item size must be positive, got {item}", component=component, tensor=tensor
        )
    if len(bases) != len(lens):
        raise GeometryMismatch(
            f"{side}: {len(bases)} base addresses but {len(lens)} region lengths",
            component=component,
            tensor=tensor,
        )
    for layer, (base, length) in enumerate(zip(bases, lens, strict=True)):
        if base < 0 or length < 0 or base + length > U64_LIMIT:
            raise GeometryMismatch(
                f"{side}: region [{base:#x}, +{length}) is not inside the 64-bit address space",
                component=component,
                tensor=tensor,
                layer=layer,
            )


def check_head_geometry(side: str, component: str, geometry: HeadGeometry, tp_size: int, item: int) -> None:
    for name in ("page_size", "kv_heads_per_rank", "total_kv_heads", "bytes_per_head"):
        if getattr(geometry, name) < 1:
            raise GeometryMismatch(f"{side}: {name} must be >= 1", component=component)
    if max(geometry.total_kv_heads, tp_size) % min(geometry.total_kv_heads, tp_size):
        raise TopologyError(
            f"{side}: {geometry.total_kv_heads} KV heads cannot be split over TP {tp_size}",
            component=component,
        )
    expected_per_rank = max(1, geometry.total_kv_heads // tp_size)
    if geometry.kv_heads_per_rank != expected_per_rank:
        raise GeometryMismatch(
            f"{side}: kv_heads_per_rank {geometry.kv_heads_per_rank} but {geometry.total_kv_heads} "
            f"heads over TP {tp_size} give {expected_per_rank}",
            component=component,
        )
    expected_item = geometry.page_size * geometry.kv_heads_per_rank * geometry.bytes_per_head
    if item != expected_item:
        raise GeometryMismatch(
            f"{side}: bytes per page {item} != page_size*kv_heads_per_rank*bytes_per_head = {expected_item}",
            component=component,
        )


def validate_memory(memory: RankMemory, side: str) -> None:
    """Raise a PlanError if ``memory`` contradicts itself; say nothing about the peer."""
    pos = memory.position
    if pos.tp_size < 1 or not 0 <= pos.tp_rank < pos.tp_size:
        raise TopologyError(f"{side}: TP rank {pos.tp_rank} outside TP size {pos.tp_size}")
    if pos.pp_size < 1 or not 0 <= pos.pp_rank < pos.pp_size or pos.first_layer < 0:
        raise TopologyError(f"{side}: PP rank {pos.pp_rank} / first layer {pos.first_layer} invalid")
    kv = memory.kv
    if kv is not None:
        _check_buffers(side, "kv", "k", kv.k_base_addrs, kv.region_lens, kv.bytes_per_page)
        if kv.is_mla:
            if kv.v_base_addrs:
                raise GeometryMismatch(
                    f"{side}: an MLA pool has one latent buffer per layer, no V", component="kv"
                )
        else:
            _check_buffers(side, "kv", "v", kv.v_base_addrs, kv.region_lens, kv.bytes_per_page)
            geometry = HeadGeometry(
                kv.page_size, kv.layout, kv.kv_heads_per_rank, kv.total_kv_heads, kv.bytes_per_head
            )
            check_head_geometry(side, "kv", geometry, pos.tp_size, kv.bytes_per_page)
        if kv.page_size < 1:
            raise GeometryMismatch(f"{side}: page_size must be >= 1", component="kv")
    for ci, component in enumerate(memory.state):
        name = f"state[{ci}]:{component.kind.value}"
        if not component.tensors:
            raise GeometryMismatch(f"{side}: a state component needs at least one tensor", component=name)
        layers = component.num_layers
        if component.layer_ids is None and pos.pp_size > 1:
            # None means layers 0..n-1, which is wrong for every stage but the first and
            # ambiguous for that one: two stages would both claim layer 0
            raise GeometryMismatch(
                f"{side}: PP stage {pos.pp_rank} of {pos.pp_size} must give the layer ids of its state",
                component=name,
            )
        if component.layer_ids is not None:
            if len(component.layer_ids) != layers:
                raise GeometryMismatch(
                    f"{side}: {len(component.layer_ids)} layer ids for {layers} layers", component=name
                )
            if len(set(component.layer_ids)) != layers or min(component.layer_ids, default=0) < 0:
                raise GeometryMismatch(
                    f"{side}: layer ids must be distinct and >= 0, got {component.layer_ids}", component=name
                )
        if component.replicated and component.heads is not None:
            raise PlanError(
                f"{side}: a component is either replicated or head-sharded, not both", component=name
            )
        if component.heads is not None and component.indexing is not Indexing.PAGE:
            raise PlanError(f"{side}: head-sharded components must be paged", component=name)
        for tensor in component.tensors:
            _check_buffers(
                side, name, tensor.name, tensor.base_addrs, tensor.region_lens, tensor.bytes_per_slot
            )
            if len(tensor.base_addrs) != layers:
                raise GeometryMismatch(
                    f"{side}: tensors of one component must hold the same layers",
                    component=name,
                    tensor=tensor.name,
                )
            if component.heads is not None:
                check_head_geometry(side, name, component.heads, pos.tp_size, tensor.bytes_per_slot)
            axis = tensor.sharded_axis_size
            if axis is not None and (axis < 1 or tensor.bytes_per_slot % axis):
                raise GeometryMismatch(
                    f"{side}: bytes_per_slot {tensor.bytes_per_slot} is not a multiple of "
                    f"sharded_axis_size {axis}",
                    component=name,
                    tensor=tensor.name,
                )
            blocks = tensor.sub_block_sizes
            if blocks is not None and (not blocks or min(blocks) < 1):
                raise GeometryMismatch(
                    f"{side}: sub_block_sizes must be positive", component=name, tensor=tensor.name
                )
    for aux in memory.aux:
        _check_buffers(side, "aux", aux.name, (aux.base_addr,), (aux.region_len,), aux.bytes_per_item)
