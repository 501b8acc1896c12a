"""vLLM's KV cache tensors as pdwire's memory description (``RankMemory``).

What vLLM 0.32 lays out (``register_kv_caches``) and how pdwire describes it is the table in
docs/vllm.md: a full-attention group as a head-major ``KvPool`` with K and V on the same bases
(sliceable by head, so prefill and decode may run different TP sizes), a Mamba group as a
slot-indexed ``StatePool`` of its conv and SSM tensors at their offsets inside a padded page,
and with the hybrid allocator the groups alias (one registration; pdwire's planner registers
overlapping extents once and refuses a request whose destinations overlap). The Mamba TP
sharding is read off the local shapes; where they cannot say it is left unknown. An MLA group
(DeepSeek, Kimi) is one latent per token and layer, the same bytes on every TP rank: an MLA
``KvPool`` copied whole for any TP pair. A sliding-window or chunked-local group is a paged
SWA ``StatePool`` sharded by KV head whose request indices are its live pages only
(:class:`WindowGroup`); in a model of window groups only, the first one is the KV pool.

:func:`describe` is pure over :class:`LayerTensor` facts so it is testable without vLLM;
:func:`describe_vllm` reads them from vLLM's config and tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pdwire.runtime.engine as pd


class LayoutError(ValueError):
    """A vLLM cache layout the connector cannot describe; names the group or layer."""


@dataclass(frozen=True)
class LayerTensor:
    """What the connector needs of one registered layer tensor."""

    name: str
    data_ptr: int
    strides_bytes: tuple[int, ...]  # per dim, in bytes
    shape: tuple[int, ...]
    device: str = "cpu"  # "cpu" or "cuda"
    device_id: int = 0


@dataclass(frozen=True)
class AttentionGroup:
    """A full-attention KV cache group: ``block_size`` tokens of ``num_kv_heads`` x ``head_size``
    elements of ``dtype_bytes`` per block for K and again for V."""

    layers: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    total_kv_heads: int | None = None  # the model's KV heads; None: num_kv_heads x TP
    # K and V side by side per token and head in the last axis (every backend but CPU_ATTN, which
    # reads a head's part of a block as its K page and then its V page)
    kv_per_token: bool = False


@dataclass(frozen=True)
class MambaGroup:
    """A Mamba KV cache group: per block the state tensors ``shapes`` (bytes ``state_bytes`` each,
    in this order inside the page). ``conv_split``: the FULL x | B | C channel sizes of Mamba2's
    conv state when sharded by them; ``conv_dim_first``: the conv state is ``[channels, kernel-1]``."""

    layers: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    state_bytes: tuple[int, ...]
    conv_split: tuple[int, ...] | None
    conv_dim_first: bool


@dataclass(frozen=True)
class MlaGroup:
    """A multi-head latent attention (MLA) KV cache group: per token one latent vector of
    ``token_bytes`` (``kv_lora_rank + qk_rope_head_dim`` elements; no heads, no V), replicated on
    every TP rank."""

    layers: tuple[str, ...]
    block_size: int
    token_bytes: int


@dataclass(frozen=True)
class WindowGroup:
    """A sliding-window or chunked-local attention KV cache group: blocks laid out like a
    full-attention group's (``attention``), but only the blocks the request's next token attends
    are live; vLLM's ``SlidingWindowManager`` / ``ChunkedLocalAttentionManager`` put the null
    block in the others. Exactly one of ``sliding_window`` (tokens, its trailing edge widened by
    ``extra_retained`` tokens) and ``chunk`` (chunked-local attention's chunk size) is set."""

    attention: AttentionGroup
    sliding_window: int | None = None
    chunk: int | None = None
    extra_retained: int = 0

    @property
    def kind(self) -> str:
        return "chunked-local" if self.chunk is not None else "sliding-window"

    def skipped_tokens(self, num_tokens: int) -> int:
        """Tokens outside the window of the token after ``num_tokens`` computed ones: vLLM's
        ``get_num_skipped_tokens``, which frees their blocks on prefill and leaves them null on
        decode, so both sides agree on it."""
        if self.chunk is not None:
            return (num_tokens // self.chunk) * self.chunk
        assert self.sliding_window is not None
        return max(0, num_tokens - self.sliding_window + 1 - self.extra_retained)

    def live_pages(self, num_tokens: int) -> range:
        """Block positions (in the request's block table) still live after ``num_tokens``."""
        bs = self.attention.block_size
        return range(self.skipped_tokens(num_tokens) // bs, math.ceil(num_tokens / bs))


Group = AttentionGroup | MambaGroup | MlaGroup | WindowGroup


def kv_window(groups: Sequence[Group | None]) -> int | None:
    """The window group whose live pages are the KV page list, in a model without a
    full-attention (or MLA) group: the first one; None when the model has such a group (window
    groups are then state components)."""
    if any(g is not None and not isinstance(g, WindowGroup | MambaGroup) for g in groups):
        return None
    return next((i for i, g in enumerate(groups) if isinstance(g, WindowGroup)), None)


@dataclass(frozen=True)
class Described:
    """The memory, and how vLLM's per-group block ids map onto pdwire's request indices."""

    memory: pd.RankMemory
    kv_group: int | None  # index of the attention group among the transfer groups
    state_groups: tuple[int, ...]  # per state component, the index of its group
    tp_sliceable: bool = False  # can a peer of another TP size take a slice of these items


def describe(
    groups: Sequence[Group | None],
    tensors: Mapping[str, LayerTensor],
    num_blocks: int,
    *,
    tp_size: int,
    tp_rank: int,
    layer_ids: Mapping[str, int],
    strided: bool = True,
    head_strided: bool = True,
    pp_size: int = 1,
    pp_rank: int = 0,
    first_layer: int = 0,
) -> Described:
    """Build the rank's ``RankMemory``. ``groups`` are vLLM's transfer groups in order (None for a
    group of a kind the connector does not move, which is refused); ``layer_ids`` give each
    layer's global index in the model.

    ``strided`` (a wire that carries item strides and offsets, pdwire 1.4) describes a Mamba page
    as its conv and SSM tensors at their offsets with the page as slot stride, and an attention
    item without its padding; without it each item is the whole stride. ``head_strided`` (a wire
    that carries a KV head stride, pdwire 1.4, and ``strided``) describes attention blocks by head
    (see :func:`_kv_pool`); without it they are opaque items, equal TP only."""
    kv_group: int | None = None
    kv: pd.KvPool | None = None
    mla = False  # the KV pool is a real MLA latent (not opaque blocks): replicated, any TP pair
    state: list[pd.StatePool] = []
    state_groups: list[int] = []
    for gi, g in enumerate(groups):
        if g is None:
            raise LayoutError(f"KV cache group {gi} is of a kind pdwire's vLLM connector does not transfer")
        if isinstance(g, AttentionGroup | MlaGroup):
            if kv is not None:
                raise LayoutError(
                    f"KV cache groups {kv_group} and {gi} are both full attention with their own block "
                    "tables; pdwire's request indices carry one KV page list"
                )
            if isinstance(g, MlaGroup):
                kv, mla = _mla_pool(g, tensors, num_blocks, strided), True
            else:
                by_head = strided and head_strided
                kv = _kv_pool(g, tensors, num_blocks, strided, by_head, tp_size)
            kv_group = gi
        elif isinstance(g, WindowGroup) and gi == kv_window(groups):
            kv = _kv_pool(g.attention, tensors, num_blocks, strided, strided and head_strided, tp_size)
            kv_group = gi
        elif isinstance(g, WindowGroup):
            by_head = strided and head_strided
            state.append(_window_pool(g, tensors, num_blocks, strided, by_head, tp_size, layer_ids))
            state_groups.append(gi)
        else:
            state.append(_mamba(g, tensors, num_blocks, tp_size, layer_ids, strided))
            state_groups.append(gi)
    if kv is None:
        raise LayoutError("no full-attention KV cache group: pdwire needs one KV page list per request")
    memory = pd.RankMemory(
        pd.ParallelRank(tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank),
        kv=kv,
        state=tuple(state),
        first_layer=first_layer,
    )
    return Described(memory, kv_group, tuple(state_groups), mla or not kv.is_mla)


def _layers(
    what: str,
    g_layers: Sequence[str],
    tensors: Mapping[str, LayerTensor],
    check: Callable[[str, LayerTensor], None],
) -> tuple[list[int], int, pd.MemoryKind, int]:
    """(base addresses, block stride, memory kind, device id) of a group's layers, each passed
    through ``check``; one stride and one device for the whole group."""
    stride: int | None = None
    kinds = set()
    for name in g_layers:
        t = tensors[name]
        check(name, t)
        s = t.strides_bytes[0]
        if stride is not None and s != stride:
            raise LayoutError(f"{what} layer {name}: block stride {s} differs from the group's {stride}")
        stride = s
        kinds.add((pd.MemoryKind.DRAM, 0) if t.device == "cpu" else (pd.MemoryKind.VRAM, t.device_id))
    if len(kinds) != 1:
        raise LayoutError(f"{what} layers live on different devices: {sorted(kinds)}")
    assert stride is not None
    kind, device_id = kinds.pop()
    return [tensors[name].data_ptr for name in g_layers], stride, kind, device_id


def _kv_pool(
    g: AttentionGroup,
    tensors: Mapping[str, LayerTensor],
    num_blocks: int,
    strided: bool,
    by_head: bool,
    tp_size: int,
) -> pd.KvPool:
    """vLLM 0.32 views every attention layer as ``[blocks, heads, block_size, 2 * head_size]``,
    its strides in the resolved block layout's order (LBHNC: heads outer inside a block, HND;
    LBNHC: tokens outer, NHD). What the last axis holds depends on the backend: K and V side by
    side per token and head (FlashAttention, FlashInfer, Triton: ``split(head_size, dim=-1)``), or
    for the CPU backend (``cpu_attn.py``: a view ``[blocks, heads, 2 * block_size, head_size]``
    chunked in two along dim 2, LBHNC only) each head's K page (``block_size x head_size``) and
    then its V page (:attr:`AttentionGroup.kv_per_token`).

    ``by_head``: described as it is, K and V on the same bases, a (token, head) unit of K (or V)
    at ``head_stride`` and ``token_stride``, so the planner slices it by head for any TP pair
    (:attr:`Described.tp_sliceable`). Otherwise (a wire without strides) one opaque item per
    block, copied whole: exact between equal TP sizes only."""
    es = g.dtype_bytes
    unit = g.head_size * es  # one token's K (or V) of one head
    item = g.num_kv_heads * g.block_size * 2 * unit  # one block of one layer
    want = (num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_size)
    hnd = (g.block_size * 2 * unit, 2 * unit)  # (head, token) strides of LBHNC
    nhd = (2 * unit, g.num_kv_heads * 2 * unit)  # of LBNHC
    allowed = {hnd: pd.Layout.HND} if not g.kv_per_token else {hnd: pd.Layout.HND, nhd: pd.Layout.NHD}
    found: set[tuple[int, int]] = set()

    def check(name: str, t: LayerTensor) -> None:
        if t.shape != want:
            raise LayoutError(
                f"attention layer {name}: shape {t.shape}, expected [blocks, heads, block, 2 x head] {want}"
            )
        head_token = (t.strides_bytes[1], t.strides_bytes[2])
        if t.strides_bytes[3] != es or head_token not in allowed or t.strides_bytes[0] < item:
            names = " or ".join(f"{'LBHNC' if v is pd.Layout.HND else 'LBNHC'}" for v in allowed.values())
            raise LayoutError(
                f"attention layer {name}: strides {t.strides_bytes} do not keep a block's heads, tokens and "
                f"K|V together in a block layout pdwire plans ({names}; VLLM_KV_CACHE_LAYOUT picks one)"
            )
        found.add(head_token)
        if len(found) > 1:
            raise LayoutError(f"attention layer {name}: a block layout different from the group's others")

    bases, stride, kind, device_id = _layers("attention", g.layers, tensors, check)
    if by_head:
        (head_stride, token_stride) = found.pop()
        span = g.block_size * unit  # one head's K (or V) page
        total = g.total_kv_heads if g.total_kv_heads is not None else g.num_kv_heads * tp_size
        if not g.kv_per_token:  # CPU: per head its K page, then its V page
            head_stride, token_stride = 2 * span, unit
        return pd.KvPool(
            k_base_addrs=tuple(bases),
            v_base_addrs=tuple(bases),
            region_lens=tuple((num_blocks - 1) * stride + item for _ in bases),
            bytes_per_page=g.num_kv_heads * span,  # what K (and again V) uses in a block
            page_size=g.block_size,
            layout=allowed[(head_stride, token_stride)] if g.kv_per_token else pd.Layout.HND,
            kv_heads_per_rank=g.num_kv_heads,
            total_kv_heads=total,
            bytes_per_head=unit,
            memory_kind=kind,
            device_id=device_id,
            page_stride=stride,
            v_offset=unit if g.kv_per_token else span,
            head_stride=head_stride,
            token_stride=token_stride if g.kv_per_token else None,
        )
    # one replicated-looking latent per block, copied whole; without strides on the wire an item
    # is the whole stride (padding included)
    return _whole_blocks(
        bases, num_blocks, stride, item if strided else stride, g.block_size, kind, device_id
    )


def _whole_blocks(
    bases: Sequence[int],
    num_blocks: int,
    stride: int,
    item: int,
    block_size: int,
    kind: pd.MemoryKind,
    device: int,
) -> pd.KvPool:
    """A pool of one latent-like item per block and layer (``is_mla``): copied whole, never sliced."""
    return pd.KvPool(
        k_base_addrs=tuple(bases),
        v_base_addrs=(),
        region_lens=tuple((num_blocks - 1) * stride + item for _ in bases),
        bytes_per_page=item,
        page_size=block_size,
        layout=pd.Layout.NHD,
        kv_heads_per_rank=1,
        total_kv_heads=1,
        bytes_per_head=item // block_size,
        is_mla=True,
        memory_kind=kind,
        device_id=device,
        page_stride=stride if stride != item else None,
    )


def _mla_pool(g: MlaGroup, tensors: Mapping[str, LayerTensor], num_blocks: int, strided: bool) -> pd.KvPool:
    """vLLM 0.32 views an MLA layer as ``[blocks, 1, block_size, latent]`` (``CPU_MLA`` and the
    GPU MLA backends alike): a block's latents are one contiguous page, the block stride read off
    the tensor. Every TP rank holds the whole latent, so the pool is one replicated "head"
    (``is_mla``) that the planner copies whole between any TP sizes: prefill TP > decode TP, one
    prefill rank of each group writes; prefill TP < decode TP, the prefill writes every decode
    rank it feeds. Without item strides on the wire an item is the whole block stride."""
    page = g.block_size * g.token_bytes

    def check(name: str, t: LayerTensor) -> None:
        inner = [(d, s) for d, s in zip(t.shape[1:], t.strides_bytes[1:], strict=True) if d != 1]
        latent_ok = len(inner) == 2 and inner[1][0] * inner[1][1] == g.token_bytes
        if t.shape[0] != num_blocks or not latent_ok or inner[0] != (g.block_size, g.token_bytes):
            raise LayoutError(
                f"MLA layer {name}: shape {t.shape}, strides {t.strides_bytes} B: expected "
                f"[{num_blocks} blocks, 1, {g.block_size} tokens, latent] with a block's latents contiguous "
                f"({g.token_bytes} B per token); pdwire's vLLM connector moves MLA caches laid out like "
                "vLLM 0.32's MLA backends"
            )
        if t.strides_bytes[0] < page:
            raise LayoutError(
                f"MLA layer {name}: a block stride of {t.strides_bytes[0]} B cannot hold {page} B"
            )

    bases, stride, kind, device_id = _layers("MLA", g.layers, tensors, check)
    return _whole_blocks(
        bases, num_blocks, stride, page if strided else stride, g.block_size, kind, device_id
    )


def _mamba(
    g: MambaGroup,
    tensors: Mapping[str, LayerTensor],
    num_blocks: int,
    tp: int,
    layer_ids: Mapping[str, int],
    strided: bool,
) -> pd.StatePool:
    used = sum(g.state_bytes)

    def check(name: str, t: LayerTensor) -> None:
        if t.shape[0] != num_blocks:
            raise LayoutError(f"Mamba layer {name}: shape {t.shape} does not start with {num_blocks} blocks")
        if t.strides_bytes[0] < used:
            raise LayoutError(
                f"Mamba layer {name}: a block of {t.strides_bytes[0]} B cannot hold its {used} B of state"
            )

    bases, stride, kind, device_id = _layers("Mamba", g.layers, tensors, check)
    lens = tuple((num_blocks - 1) * stride + used for _ in bases)
    tensors_out: list[pd.StateTensor] = []
    offset = 0
    names = ("conv", "ssm") if len(g.shapes) == 2 else tuple(f"state{i}" for i in range(len(g.shapes)))
    for i, (shape, nbytes) in enumerate(zip(g.shapes, g.state_bytes, strict=True)):
        axis_size: int | None = None
        outer_rows = 1
        sub_blocks: tuple[int, ...] | None = None
        if g.conv_split is not None and i == 0:
            # conv: [kernel - 1, channels] (channels sharded, kernel - 1 rows before it) or transposed
            channels = shape[0] if g.conv_dim_first else shape[-1]
            if sum(g.conv_split) == channels * tp:
                axis_size = channels
                outer_rows = 1 if g.conv_dim_first else math.prod(shape[:-1])
                sub_blocks = g.conv_split
        elif g.conv_split is not None and i == 1:
            axis_size = shape[0]  # SSM state [heads, head_dim, d_state]: sharded by heads
        tensors_out.append(
            pd.StateTensor(
                name=names[i],
                base_addrs=tuple(bases),
                region_lens=lens,
                bytes_per_slot=nbytes,
                sharded_axis_size=axis_size,
                sub_block_sizes=sub_blocks,
                slot_stride=stride,
                offset=offset,
                outer_rows=outer_rows,
            )
        )
        offset += nbytes
    if not strided:  # a wire without item strides: the whole page
        whole = tuple(num_blocks * stride for _ in bases)
        tensors_out = [pd.StateTensor("page", tuple(bases), whole, bytes_per_slot=stride)]
    return pd.StatePool(
        kind=pd.StateKind.MAMBA,
        indexing=pd.Indexing.SLOT,
        tensors=tuple(tensors_out),
        layer_ids=tuple(layer_ids[name] for name in g.layers),
        memory_kind=kind,
        device_id=device_id,
    )


def _window_pool(
    g: WindowGroup,
    tensors: Mapping[str, LayerTensor],
    num_blocks: int,
    strided: bool,
    by_head: bool,
    tp_size: int,
    layer_ids: Mapping[str, int],
) -> pd.StatePool:
    """A window group as a paged SWA state component: the request's live pages are its index
    list, matched position by position with decode's. Its blocks are described as a full-attention
    group's KV pool (:func:`_kv_pool`) and re-cut as one state tensor sharded by KV head (the
    wire's head geometry has no head or token stride, a sharded axis has rows): head-major blocks
    (LBHNC: each head's K and V together, vLLM CPU's K page then V page or K|V per token) are
    ``[heads][K and V of the head]``, token-major ones (LBNHC) ``[tokens][heads][K|V]``, so any
    TP pair slices them. Opaque blocks (a wire without strides) are one whole-block tensor,
    equal TP only."""
    kv = _kv_pool(g.attention, tensors, num_blocks, strided, by_head, tp_size)
    common: dict[str, Any] = dict(
        kind=pd.StateKind.SWA,
        indexing=pd.Indexing.PAGE,
        layer_ids=tuple(layer_ids[name] for name in g.attention.layers),
        memory_kind=kv.memory_kind,
        device_id=kv.device_id,
    )
    if kv.is_mla:  # opaque blocks: copied whole
        page = pd.StateTensor("kv", kv.k_base_addrs, kv.region_lens, kv.bytes_per_page, slot_stride=kv.stride)
        return pd.StatePool(tensors=(page,), **common)
    heads, unit = kv.kv_heads_per_rank, kv.bytes_per_head
    if kv.layout is pd.Layout.HND and kv.head_stride == 2 * kv.head_span:
        rows = 1
    elif kv.layout is pd.Layout.NHD and (kv.head_stride, kv.token_stride) == (2 * unit, heads * 2 * unit):
        rows = kv.page_size
    else:
        raise LayoutError(
            f"{g.kind} KV cache group of layers {g.attention.layers[0]}..{g.attention.layers[-1]}: heads "
            f"{kv.head_stride} B and tokens {kv.token_stride} B apart is a block layout pdwire cannot "
            "describe as state (LBHNC or LBNHC with K and V on the same bases)"
        )
    # heads replicated over ranks (fewer KV heads than TP): left unknown, equal TP only
    axis = heads if heads * tp_size == kv.total_kv_heads else None
    t = pd.StateTensor(
        "kv", kv.k_base_addrs, kv.region_lens, heads * 2 * kv.head_span, sharded_axis_size=axis,
        slot_stride=kv.stride, offset=kv.k_offset, outer_rows=rows,
    )  # fmt: skip
    return pd.StatePool(tensors=(t,), **common)


# ---------------------------------------------------------------------- from vLLM objects


def layer_tensor(name: str, t: Any) -> LayerTensor:
    """The facts of one torch tensor."""
    size = t.element_size()
    return LayerTensor(
        name=name,
        data_ptr=int(t.data_ptr()),
        strides_bytes=tuple(int(s) * size for s in t.stride()),
        shape=tuple(int(d) for d in t.shape),
        device=t.device.type,
        device_id=0 if t.device.index is None else int(t.device.index),
    )


def vllm_groups(vllm_config: Any, kv_cache_config: Any) -> list[Group | None]:
    """vLLM's transfer groups as :data:`Group` values (None for kinds not transferred)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    out: list[Group | None] = []
    for g in kv_cache_config.transfer_groups:
        spec = g.kv_cache_spec
        layers = tuple(g.layer_names)
        if isinstance(spec, MLAAttentionSpec):  # before FullAttentionSpec, its base class
            out.append(_mla_group(vllm_config, spec, layers))
        elif isinstance(spec, FullAttentionSpec) and not isinstance(spec, SlidingWindowSpec):
            if spec.head_size_v != spec.head_size:
                out.append(None)
                continue
            out.append(
                AttentionGroup(
                    layers,
                    spec.block_size,
                    spec.num_kv_heads,
                    spec.head_size,
                    torch.empty((), dtype=spec.dtype).element_size(),
                    int(vllm_config.model_config.get_total_num_kv_heads()),
                    kv_per_token=_kv_per_token(vllm_config, layers),
                )
            )
        elif isinstance(spec, MambaSpec):
            tp = int(vllm_config.parallel_config.tensor_parallel_size)
            out.append(mamba_group(spec, layers, tp, vllm_config.model_config.hf_text_config))
        elif isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
            out.append(_window_group(vllm_config, spec, layers))
        else:
            out.append(None)
    return out


def _window_group(vllm_config: Any, spec: Any, layers: tuple[str, ...]) -> WindowGroup:
    """A sliding-window or chunked-local spec as a :class:`WindowGroup`; the window kinds whose
    blocks are not laid out like full attention's are refused by name."""
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec, SlidingWindowSpec

    kind = type(spec).__name__
    what = f"{kind} KV cache group of layers {layers[0]}..{layers[-1]}"
    if isinstance(spec, SlidingWindowMLASpec):
        raise LayoutError(
            f"{what}: sliding-window MLA (DeepSeek-V4); pdwire's vLLM connector moves sliding-window "
            "groups laid out like full attention (K and V per head)"
        )
    if spec.head_size_v != spec.head_size:
        raise LayoutError(f"{what}: V heads of {spec.head_size_v} differ from K heads of {spec.head_size}")
    attention = AttentionGroup(
        layers,
        int(spec.block_size),
        int(spec.num_kv_heads),
        int(spec.head_size),
        torch.empty((), dtype=spec.dtype).element_size(),
        int(vllm_config.model_config.get_total_num_kv_heads()),
        kv_per_token=_kv_per_token(vllm_config, layers),
    )
    if isinstance(spec, SlidingWindowSpec):
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return WindowGroup(attention, sliding_window=int(spec.sliding_window), extra_retained=extra)
    return WindowGroup(attention, chunk=int(spec.attention_chunk_size))


def _mla_group(vllm_config: Any, spec: Any, layers: tuple[str, ...]) -> MlaGroup:
    """An MLA spec as an :class:`MlaGroup`; the MLA caches whose bytes are not one latent per
    token of a block (DeepSeek-V4's compressed states, DeepSeek-V3.2's indexer cache, tokens
    sharded over decode context parallel ranks) are refused by name."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, SparseCacheRole

    what = f"MLA KV cache group of layers {layers[0]}..{layers[-1]}"
    if isinstance(spec, HiddenStateCacheSpec):
        raise LayoutError(f"{what} is a hidden-state cache, not attention; pdwire moves attention KV only")
    if spec.tokens_per_state != 1 or spec.model_version is not None:
        raise LayoutError(
            f"{what}: {spec.tokens_per_state} tokens per stored state (model version {spec.model_version}); "
            "pdwire's vLLM connector moves MLA caches of one latent per token (DeepSeek-V2/V3, Kimi), "
            "not DeepSeek-V4's compressed caches"
        )
    if spec.cache_role != SparseCacheRole.SPARSE:
        raise LayoutError(
            f"{what}: a sparse-attention {spec.cache_role.value} cache (DeepSeek-V3.2); pdwire's vLLM "
            "connector moves the MLA latent only, not indexer caches"
        )
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    if spec.dcp_sharded and dcp > 1:
        raise LayoutError(
            f"{what}: decode context parallel size {dcp} shards each request's latents over ranks; "
            "pdwire moves whole latents, run without decode context parallelism"
        )
    if spec.num_heads != 1 or spec.real_page_size_bytes % spec.block_size:
        raise LayoutError(
            f"{what}: {spec.num_heads} head slots, {spec.real_page_size_bytes} B per block of "
            f"{spec.block_size} tokens; pdwire's vLLM connector moves one latent per token"
        )
    return MlaGroup(layers, int(spec.block_size), int(spec.real_page_size_bytes // spec.block_size))


def _kv_per_token(vllm_config: Any, layers: tuple[str, ...]) -> bool:
    """Whether the layers' attention backend keeps K and V side by side per token and head: every
    backend but CPU_ATTN (the layers' own backends once the model is built, else the default)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    return all(b.get_name() != "CPU_ATTN" for b in get_current_attn_backends(vllm_config, list(layers)))


def mamba_group(spec: Any, layers: tuple[str, ...], tp: int, hf: Any) -> MambaGroup:
    """A vLLM ``MambaSpec`` (any ``mamba_type``) as a :class:`MambaGroup`; ``hf``: the model's HF
    text config (Mamba2's groups are read off it)."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    state_bytes = tuple(
        math.prod(s) * torch.empty((), dtype=d).element_size()
        for s, d in zip(spec.shapes, spec.dtypes, strict=True)
    )
    dim_first = bool(is_conv_state_dim_first())
    shapes = tuple(tuple(int(x) for x in s) for s in spec.shapes)
    return MambaGroup(layers, shapes, state_bytes, conv_split(spec, shapes, tp, hf, dim_first), dim_first)


def conv_split(
    spec: Any, shapes: tuple[tuple[int, ...], ...], tp: int, hf: Any, dim_first: bool
) -> tuple[int, ...] | None:
    """The conv state's channel sections at full size, each sharded over TP on its own (the
    temporal state, if any, sharded by its first axis); None where the split is not clean (vLLM
    replicates Mamba2 groups over ranks) or the kind unknown: such state moves between equal TP
    sizes only, and the handshake refuses other pairs by name.

    Mamba1 and short conv: one section; Mamba2: x | B | C; GDN (Qwen3-Next): q | k | v, read off
    the local shapes (the temporal state is ``[v_heads / TP, head_v_dim, head_k_dim]``)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind

    channels = shapes[0][0] if dim_first else shapes[0][-1]
    kind = spec.mamba_type
    if kind in (Kind.MAMBA1, Kind.SHORT_CONV) and len(shapes) == (2 if kind == Kind.MAMBA1 else 1):
        return (channels * tp,)
    if kind == Kind.GDN_ATTN and len(shapes) == 2 and len(shapes[1]) == 3:
        value = shapes[1][0] * shapes[1][1]
        key2 = channels - value
        if key2 <= 0 or key2 % 2:
            return None
        return (key2 // 2 * tp, key2 // 2 * tp, value * tp)
    if kind != Kind.MAMBA2 or len(shapes) != 2:
        return None

    def first(*names: str) -> Any:  # the HF configs of Mamba2 models spell these differently
        return next((getattr(hf, a) for a in names if getattr(hf, a, None)), None)

    groups = first("mamba_n_groups", "n_groups")
    heads = first("mamba_n_heads", "mamba_num_heads", "n_heads")
    d_state = first("mamba_d_state", "ssm_state_size", "state_size")
    ssm_heads_local, head_dim = shapes[1][0], shapes[1][1]
    if groups is None or heads is None or d_state is None or groups % tp or heads % tp:
        return None  # vLLM replicates groups over ranks then: not a clean split
    if ssm_heads_local * tp != heads:
        return None
    x = heads * head_dim
    bc = groups * d_state
    return (x, bc, bc)


def describe_vllm(
    vllm_config: Any, kv_cache_config: Any, kv_caches: Mapping[str, Any], tp_rank: int, pp_rank: int = 0
) -> Described:
    """:func:`describe` over vLLM's objects (``register_kv_caches``' tensors)."""
    groups = vllm_groups(vllm_config, kv_cache_config)
    tensors = {name: layer_tensor(name, t) for name, t in kv_caches.items()}
    order = {name: i for i, name in enumerate(_model_layer_order(kv_caches))}
    pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
    return describe(
        groups,
        tensors,
        int(kv_cache_config.num_blocks),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        tp_rank=tp_rank,
        layer_ids=order,
        pp_size=pp_size,
        pp_rank=pp_rank,
        first_layer=stage_first_layer(groups, pp_size),
    )


def stage_first_layer(groups: Sequence[Group | None], pp_size: int) -> int:
    """The model index of a PP stage's first KV layer, pdwire's global id of it: a stage holds a
    run of the model's layers, and with attention in every layer (a dense or MLA model) its KV
    layers are that run. A model with state or window groups interleaves other layers, whose KV
    layers a stage cannot name by one first layer: refused with PP by name."""
    if pp_size == 1:
        return 0
    from vllm.model_executor.models.utils import extract_layer_index

    others = [type(g).__name__ for g in groups if not isinstance(g, AttentionGroup | MlaGroup)]
    kv = [g for g in groups if isinstance(g, AttentionGroup | MlaGroup)]
    if others or len(kv) != 1:
        raise LayoutError(
            f"pipeline parallelism (PP {pp_size}) with KV cache groups {others or len(kv)}: pdwire moves a "
            "PP stage's KV of dense and MLA models; run hybrid and sliding-window models with PP 1"
        )
    ids = sorted(extract_layer_index(name) for name in kv[0].layers)
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise LayoutError(f"PP stage KV layers {ids} are not one run of the model's layers")
    return int(ids[0])


def _model_layer_order(kv_caches: Mapping[str, Any]) -> list[str]:
    """Layer names by the layer index vLLM puts in them (``model.layers.7.mixer``)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return sorted(kv_caches, key=lambda n: (extract_layer_index(n), n))
