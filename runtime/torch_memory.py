"""Build a rank's memory description (the planner's ``RankMemory`` parts) from torch tensors.

For engines that hold their caches as tensors (vLLM's ``register_kv_caches``, SGLang's pools).
Every tensor is per layer, its first dimension the pages or slots of that layer::

    from pdwire.runtime import torch_memory as tm
    kv = tm.kv_pool(k, v, page_size=16, layout=Layout.HND, kv_heads_per_rank=2, total_kv_heads=8)
    conv = tm.state_tensor("conv", conv_layers, sharded=True, sub_blocks=(1024, 256, 256))
    ssm = tm.state_tensor("ssm", ssm_layers, sharded=True)
    mamba = tm.state_component(StateKind.MAMBA, Indexing.SLOT, [conv, ssm], device="cuda:0")
    memory = RankMemory(ParallelRank(tp_size, tp_rank), kv, (mamba,), (tm.aux_buffer("out", aux),))

Addresses come from ``data_ptr()``, sizes from shapes and strides; the memory kind is VRAM for
a CUDA (or other accelerator) tensor and DRAM for a CPU one, with the device index. A page or
slot is everything under the first dimension and must be one contiguous run of bytes; its
*stride* (``stride(0) * element_size()``) may be larger than that (padded pages, K and V
interleaved per block, a Mamba layer's conv and SSM state in one page). Views into one buffer
become one item at an offset inside a common stride (K and V of one KV tensor, the tensors of
one state component sharing a slot); tensors of different components on the same memory are
registered once and checked per request (the planner's aliasing rule). What cannot be
described is refused by name (:class:`~pdwire.runtime.config.ConfigError`).

torch is imported only when a function here is called; the rest of pdwire never imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from pdwire.runtime.config import ConfigError
from pdwire.runtime.descriptors import MemoryKind
from pdwire.runtime.planner import (
    AuxBuffer,
    HeadGeometry,
    Indexing,
    KvPool,
    Layout,
    StateKind,
    StatePool,
    StateTensor,
)

if TYPE_CHECKING:
    import torch


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only where torch is missing
        raise ConfigError(
            "pdwire.runtime.torch_memory needs torch; describe the memory directly instead"
        ) from exc
    return torch


def _check(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, _torch().Tensor):
        raise ConfigError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 1 or t.shape[0] < 1:
        raise ConfigError(
            f"{what}: the first dimension counts pages or slots and must be >= 1, got {tuple(t.shape)}"
        )
    item = t[0].numel() * t.element_size()
    if not t[0].is_contiguous():
        raise ConfigError(f"{what}: one page or slot (t[0], shape {tuple(t[0].shape)}) is not contiguous")
    if t.shape[0] > 1 and t.stride(0) * t.element_size() < item:
        raise ConfigError(
            f"{what}: the page/slot stride is {t.stride(0) * t.element_size()} bytes but a page/slot holds "
            f"{item} bytes: its pages overlap"
        )
    return cast("torch.Tensor", t)


def _bytes_per_item(t: torch.Tensor) -> int:
    return int(t[0].numel() * t.element_size())


def _stride(t: torch.Tensor) -> int:
    return int(t.stride(0) * t.element_size()) if t.shape[0] > 1 else _bytes_per_item(t)


def _span(t: torch.Tensor) -> int:
    """Bytes from the first page's start to the last page's end (what is registered)."""
    return int((t.shape[0] - 1) * _stride(t) + _bytes_per_item(t))


def _stride_or_none(stride: int, item: int) -> int | None:
    return None if stride == item else stride


def _kind(ts: Sequence[torch.Tensor], what: str) -> tuple[MemoryKind, int]:
    devices = {(t.device.type, t.device.index) for t in ts}
    if len(devices) != 1:
        raise ConfigError(f"{what}: tensors on several devices {sorted(map(str, devices))}")
    return _memory_kind(*devices.pop())


def _memory_kind(dev_type: str, index: int | None) -> tuple[MemoryKind, int]:
    return (MemoryKind.DRAM, 0) if dev_type == "cpu" else (MemoryKind.VRAM, index or 0)


def _layers(tensors: Sequence[Any], what: str) -> list[torch.Tensor]:
    if isinstance(tensors, str) or not isinstance(tensors, Sequence) or not tensors:
        raise ConfigError(f"{what} must be a non-empty sequence of per-layer tensors")
    layers = [_check(t, f"{what}[{i}]") for i, t in enumerate(tensors)]
    sizes = {_bytes_per_item(t) for t in layers}
    if len(sizes) != 1:
        raise ConfigError(f"{what}: layers hold pages/slots of different sizes {sorted(sizes)}")
    return layers


def kv_pool(
    k: Sequence[Any],
    v: Sequence[Any] | None,
    *,
    page_size: int,
    layout: Layout,
    kv_heads_per_rank: int,
    total_kv_heads: int,
    is_mla: bool = False,
) -> KvPool:
    """The paged KV cache: per held layer one K and one V tensor (MLA: one latent per layer,
    ``v=None``, ``kv_heads_per_rank == total_kv_heads == 1``), each ``[pages, ...]``."""
    ks = _layers(k, "kv_pool k")
    vs = [] if v is None else _layers(v, "kv_pool v")
    if is_mla != (v is None):
        raise ConfigError("kv_pool: an MLA pool has no V tensors, a non-MLA pool needs them")
    if vs and (len(vs) != len(ks) or {_bytes_per_item(t) for t in vs} != {_bytes_per_item(ks[0])}):
        raise ConfigError("kv_pool: V tensors must match K tensors in count and page size")
    page = _bytes_per_item(ks[0])
    heads = 1 if is_mla else kv_heads_per_rank
    if page % (page_size * heads):
        raise ConfigError(
            f"kv_pool: a page of {page} bytes does not split into {page_size} tokens x {heads} heads"
        )
    strides = {_stride(t) for t in (*ks, *vs)}
    if len(strides) != 1:
        raise ConfigError(f"kv_pool: K and V pages must share one stride, got {sorted(strides)} bytes")
    stride = strides.pop()
    kind, device = _kind([*ks, *vs], "kv_pool")
    k_bases = [int(t.data_ptr()) for t in ks]
    v_bases = [int(t.data_ptr()) for t in vs]
    k_offset = v_offset = 0
    lens = [_span(t) for t in ks]
    if vs:
        deltas = {v - k for k, v in zip(k_bases, v_bases, strict=True)}
        delta = deltas.pop() if len(deltas) == 1 else None
        if delta is not None and delta != 0 and abs(delta) + page <= stride:
            # K and V inside one page stride (one tensor [pages, 2, ...]): one base, two offsets
            k_offset, v_offset = max(0, -delta), max(0, delta)
            k_bases = v_bases = [min(k, v) for k, v in zip(k_bases, v_bases, strict=True)]
            lens = [(t.shape[0] - 1) * stride + max(k_offset, v_offset) + page for t in ks]
        elif any(_span(a) != _span(b) for a, b in zip(ks, vs, strict=True)):
            raise ConfigError("kv_pool: each layer's K and V tensors must hold the same number of pages")
    return KvPool(
        tuple(k_bases),
        tuple(v_bases),
        tuple(lens),
        page,
        page_size,
        layout,
        heads,
        1 if is_mla else total_kv_heads,
        page // (page_size * heads),
        is_mla=is_mla,
        memory_kind=kind,
        device_id=device,
        page_stride=_stride_or_none(stride, page),
        k_offset=k_offset,
        v_offset=v_offset,
    )


def state_tensor(
    name: str,
    layers: Sequence[Any],
    *,
    sharded: bool | int = False,
    sub_blocks: Sequence[int] | None = None,
    replicated: bool = False,
) -> StateTensor:
    """One tensor of a state component, per layer ``[slots or pages, ...]``. ``sharded``: TP splits
    one per-slot axis, True for dimension 1 or the dimension's index (a transposed conv state
    ``[slots, kernel-1, dim/TP]`` is ``sharded=2``); this rank's share is that dimension's length.
    ``sub_blocks``: the FULL sizes of independently sharded blocks on that axis (GDN conv q|k|v,
    Mamba2 x|B|C). ``replicated``: identical bytes on every rank inside an axis-sharded component."""
    ts = _layers(layers, f"state_tensor {name!r}")
    axis, outer = None, 1
    if sharded is not False:
        dim = 1 if sharded is True else int(sharded)
        if not 1 <= dim < ts[0].dim():
            raise ConfigError(
                f"state_tensor {name!r}: the sharded dimension {dim} is not a per-slot axis of shape "
                f"{tuple(ts[0].shape)}"
            )
        axis = int(ts[0].shape[dim])
        for d in range(1, dim):
            outer *= int(ts[0].shape[d])
    elif sub_blocks is not None:
        raise ConfigError(f"state_tensor {name!r}: sub_blocks describe a sharded axis; pass sharded=...")
    strides = {_stride(t) for t in ts}
    if len(strides) != 1:
        raise ConfigError(f"state_tensor {name!r}: layers have different slot strides {sorted(strides)}")
    item = _bytes_per_item(ts[0])
    return StateTensor(
        name,
        tuple(int(t.data_ptr()) for t in ts),
        tuple(_span(t) for t in ts),
        item,
        axis,
        None if sub_blocks is None else tuple(int(b) for b in sub_blocks),
        slot_stride=_stride_or_none(strides.pop(), item),
        outer_rows=outer,
        replicated=replicated,
    )


def _share_slots(tensors: Sequence[StateTensor]) -> tuple[StateTensor, ...]:
    """Tensors whose every layer lies inside the first tensor's slot stride (views of one slot, as
    vLLM puts conv and SSM state in one page) are described on one base with offsets."""
    if len(tensors) < 2:
        return tuple(tensors)
    stride = tensors[0].stride
    if any(t.stride != stride or len(t.base_addrs) != len(tensors[0].base_addrs) for t in tensors):
        return tuple(tensors)
    layers = len(tensors[0].base_addrs)
    bases = [min(t.base_addrs[li] for t in tensors) for li in range(layers)]
    offsets = []
    for t in tensors:
        deltas = {t.base_addrs[li] - bases[li] for li in range(layers)}
        if len(deltas) != 1 or deltas.pop() + t.bytes_per_slot > stride:
            return tuple(tensors)  # not one slot: separate buffers (registered once if they overlap)
        offsets.append(t.base_addrs[0] - bases[0])
    if not any(offsets):
        return tuple(tensors)
    out = []
    for t, off in zip(tensors, offsets, strict=True):
        lens = tuple(ln + off for ln in t.region_lens)  # the extent now starts at the shared base
        out.append(replace(t, base_addrs=tuple(bases), region_lens=lens, offset=off, slot_stride=stride))
    return tuple(out)


def state_component(
    kind: StateKind,
    indexing: Indexing,
    tensors: Sequence[StateTensor],
    *,
    replicated: bool = False,
    heads: HeadGeometry | None = None,
    layer_ids: Sequence[int] | None = None,
    device: Any,
) -> StatePool:
    """A state component of tensors from :func:`state_tensor`; ``device`` (a torch device, its
    name, or a tensor on it) is where they live: CPU memory is DRAM, anything else VRAM."""
    th = _torch()
    dev = device.device if isinstance(device, th.Tensor) else th.device(device)
    kind_, device_id = _memory_kind(dev.type, dev.index)
    return StatePool(
        kind,
        indexing,
        _share_slots(tensors),
        replicated=replicated,
        heads=heads,
        layer_ids=None if layer_ids is None else tuple(int(x) for x in layer_ids),
        memory_kind=kind_,
        device_id=device_id,
    )


def aux_buffer(name: str, tensor: Any) -> AuxBuffer:
    """A host buffer of per-request items, ``[items, ...]`` (CPU memory)."""
    t = _check(tensor, f"aux_buffer {name!r}")
    if t.device.type != "cpu":
        raise ConfigError(f"aux_buffer {name!r} must be in host memory, got a tensor on {t.device}")
    if _stride(t) != _bytes_per_item(t):
        raise ConfigError(
            f"aux_buffer {name!r}: its items must be packed (stride {_stride(t)}, item {_bytes_per_item(t)})"
        )
    return AuxBuffer(name, int(t.data_ptr()), _span(t), _bytes_per_item(t))
