"""Self-consistency of one rank's memory description, checked before any peer is prepared."""

from __future__ import annotations

import itertools

from pdwire.runtime.planner.errors import GeometryMismatch, PlanError, TopologyError, UnsupportedTransfer
from pdwire.runtime.planner.model import UNPLANNABLE_KINDS, HeadGeometry, Indexing, KvPool, Layout, RankMemory

U64_LIMIT = 1 << 64


def _bad(side: str, component: str, tensor: str, why: str) -> GeometryMismatch:
    return GeometryMismatch(f"{side}: {why}", component=component, tensor=tensor)


def _check_buffers(
    side: str, component: str, tensor: str, bases: tuple[int, ...], lens: tuple[int, ...], item: int
) -> None:
    if item <= 0:
        raise _bad(side, component, tensor, f"item size must be positive, got {item}")
    if len(bases) != len(lens):
        raise _bad(side, component, tensor, f"{len(bases)} base addresses but {len(lens)} region lengths")
    for layer, (base, length) in enumerate(zip(bases, lens, strict=True)):
        if base < 0 or length < 0 or base + length > U64_LIMIT:
            raise GeometryMismatch(
                f"{side}: region [{base:#x}, +{length}) is not inside the 64-bit address space",
                component=component,
                tensor=tensor,
                layer=layer,
            )


def _check_item_placement(
    side: str, component: str, tensor: str, item: int, stride: int, offset: int
) -> None:
    """An item lies inside its stride: ``offset + item <= stride`` (both non-negative)."""
    if stride < 1 or offset < 0 or offset + item > stride:
        why = f"an item of {item} bytes at offset {offset} does not fit a stride of {stride} bytes"
        raise _bad(side, component, tensor, why)


def _check_disjoint_in_item(
    side: str, component: str, members: list[tuple[str, tuple[int, ...], int, int, int]]
) -> None:
    """Tensors of one index space on the same buffers (same bases, same stride) must not claim the
    same bytes of one item: ``members`` are (name, bases, stride, offset, item)."""
    placed: dict[tuple[tuple[int, ...], int], list[tuple[int, int, str]]] = {}
    for name, bases, stride, offset, item in members:
        if not bases:
            continue
        placed.setdefault((bases, stride), []).append((offset, offset + item, name))
    for windows in placed.values():
        windows.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(windows):
            if start < end:
                raise GeometryMismatch(
                    f"{side}: {first} and {second} overlap inside one item of the same buffer",
                    component=component,
                    tensor=second,
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


def _check_unit_strides(side: str, kv: KvPool) -> None:
    """Head and token strides place a page's (token, head) units apart, never on each other: the
    inner axis (tokens in HND, heads in NHD) at least one unit apart, the outer one at least a
    whole inner run apart."""
    if kv.head_stride is None and kv.token_stride is None:
        return
    g = kv.heads
    hnd = kv.layout is Layout.HND
    inner, outer = (g.token_step, g.head_step) if hnd else (g.head_step, g.token_step)
    inner_name, outer_name = ("token", "head") if hnd else ("head", "token")
    count = g.page_size if hnd else g.kv_heads_per_rank
    if inner < g.bytes_per_head:
        raise GeometryMismatch(
            f"{side}: {inner_name} stride {inner} is smaller than one unit "
            f"(bytes_per_head = {g.bytes_per_head})",
            component="kv",
        )
    span = (count - 1) * inner + g.bytes_per_head
    if outer < span:
        what = "one head's page" if hnd else "one token's heads"
        raise GeometryMismatch(
            f"{side}: {outer_name} stride {outer} is smaller than {what} ({span} bytes)", component="kv"
        )


def validate_memory(memory: RankMemory, side: str) -> None:
    """Raise a PlanError if ``memory`` contradicts itself; say nothing about the peer."""
    pos = memory.position  # it checked its ranks against its sizes when it was built
    if memory.first_layer < 0:
        raise TopologyError(f"{side}: first layer {memory.first_layer} invalid")
    kv = memory.kv
    if kv is not None:
        _check_buffers(side, "kv", "k", kv.k_base_addrs, kv.region_lens, kv.bytes_per_page)
        if kv.is_mla:
            if kv.v_base_addrs:
                raise GeometryMismatch(
                    f"{side}: an MLA pool has one latent buffer per layer, no V", component="kv"
                )
            if kv.head_stride is not None or kv.token_stride is not None:
                raise GeometryMismatch(f"{side}: an MLA pool has no head or token stride", component="kv")
        else:
            _check_buffers(side, "kv", "v", kv.v_base_addrs, kv.region_lens, kv.bytes_per_page)
            geometry = HeadGeometry(
                kv.page_size, kv.layout, kv.kv_heads_per_rank, kv.total_kv_heads, kv.bytes_per_head
            )
            check_head_geometry(side, "kv", geometry, pos.tp_size, kv.bytes_per_page)
            _check_unit_strides(side, kv)
        if kv.page_size < 1:
            raise GeometryMismatch(f"{side}: page_size must be >= 1", component="kv")
        _check_item_placement(side, "kv", "k", kv.page_extent, kv.stride, kv.k_offset)
        halves = [("k", kv.k_base_addrs, kv.k_offset)]
        if not kv.is_mla:
            _check_item_placement(side, "kv", "v", kv.page_extent, kv.stride, kv.v_offset)
            halves.append(("v", kv.v_base_addrs, kv.v_offset))
        elif kv.v_offset:
            raise GeometryMismatch(f"{side}: an MLA pool has no V offset", component="kv")
        # with wider strides K and V of one page may interleave, never share a byte
        members = [
            (name if len(windows) == 1 else f"{name} run {h}", bases, kv.stride, start, length)
            for name, bases, offset in halves
            for windows in (kv.head_windows(offset),)
            for h, (start, length) in enumerate(windows)
        ]
        _check_disjoint_in_item(side, "kv", members)
    for ci, component in enumerate(memory.state):
        name = f"state[{ci}]:{component.kind.value}"
        if not component.tensors:
            raise GeometryMismatch(f"{side}: a state component needs at least one tensor", component=name)
        if component.kind in UNPLANNABLE_KINDS:
            raise UnsupportedTransfer(
                f"{side}: state kind {component.kind.value} cannot be planned: "
                f"{UNPLANNABLE_KINDS[component.kind]}",
                component=name,
            )
        names = [tensor.name for tensor in component.tensors]
        if len(set(names)) != len(names):
            raise GeometryMismatch(f"{side}: tensor names repeat: {names}", component=name)
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
                raise _bad(side, name, tensor.name, "tensors of one component must hold the same layers")
            if component.heads is not None:
                check_head_geometry(side, name, component.heads, pos.tp_size, tensor.bytes_per_slot)
            _check_item_placement(
                side, name, tensor.name, tensor.bytes_per_slot, tensor.stride, tensor.offset
            )
            axis = tensor.sharded_axis_size
            if tensor.outer_rows < 1:
                raise _bad(side, name, tensor.name, f"outer_rows must be >= 1, got {tensor.outer_rows}")
            if axis is not None and (axis < 1 or tensor.bytes_per_slot % (axis * tensor.outer_rows)):
                raise _bad(
                    side,
                    name,
                    tensor.name,
                    f"bytes_per_slot {tensor.bytes_per_slot} is not outer_rows {tensor.outer_rows} "
                    f"x sharded_axis_size {axis} x whole bytes per element",
                )
            if axis is None and tensor.outer_rows != 1:
                raise _bad(side, name, tensor.name, f"outer_rows {tensor.outer_rows} without a sharded axis")
            if tensor.replicated and axis is not None:
                raise _bad(
                    side,
                    name,
                    tensor.name,
                    "a tensor is either replicated or sharded along an axis, not both",
                )
            blocks = tensor.sub_block_sizes
            if blocks is not None and (not blocks or min(blocks) < 1):
                raise _bad(side, name, tensor.name, "sub_block_sizes must be positive")
        _check_disjoint_in_item(
            side,
            name,
            [(t.name, t.base_addrs, t.stride, t.offset, t.bytes_per_slot) for t in component.tensors],
        )
    for aux in memory.aux:
        _check_buffers(side, "aux", aux.name, (aux.base_addr,), (aux.region_len,), aux.bytes_per_item)
