"""SGLang's ``KVArgs`` as pdwire's memory description (``RankMemory``).

Pure: it reads the fields SGLang 0.5.23's ``PrefillBootstrapQueue._init_kv_manager`` and
``DecodePreallocQueue._init_kv_manager`` fill and never imports SGLang, so it is testable
without it. What SGLang lays out:

* **KV**: ``kv_data_ptrs`` is ``[K_0 .. K_{L-1}, V_0 .. V_{L-1}]`` (MLA: one latent per
  layer), a draft model's own ``[K.., V..]`` appended (``num_draft_entries``);
  ``kv_item_lens[l]`` is one token-major (NHD) page of layer ``l``.
* **State**: one pdwire component per entry of ``state_types``, in that order (both sides
  build the list with the same code; pdwire matches components by position and checks their
  kinds). Entries are tensor-major x layer; ``state_layer_ids`` names each entry's layer,
  which says where one tensor ends. How each of SGLang's 13 kinds is indexed and sharded is
  the table in docs/sglang.md.
* **Aux**: ``aux_data_ptrs`` / ``aux_item_lens``, host memory, one item per request.
"""

from __future__ import annotations

import itertools
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import pdwire.runtime.engine as pd

# SGLang's decode queue leaves KVArgs.kv_head_num / total_kv_head_num unset (its backends slice
# heads on the prefill side from the decode's bytes); pdwire describes both sides, so the plugin's
# hook on DecodePreallocQueue._init_kv_manager passes (heads per rank, model heads) in here.
DECODE_KV_HEADS: ContextVar[tuple[int, int] | None] = ContextVar("pdwire_decode_kv_heads", default=None)


def fill_decode_heads(args: Any) -> None:
    """Set a decode rank's head counts on ``args`` from :data:`DECODE_KV_HEADS` where SGLang left
    them unset."""
    heads = DECODE_KV_HEADS.get()
    if heads is None:
        return
    if not int(getattr(args, "kv_head_num", 0) or 0):
        args.kv_head_num = heads[0]
    if not int(getattr(args, "total_kv_head_num", 0) or 0):
        args.total_kv_head_num = heads[1]


@dataclass(frozen=True, slots=True)
class PoolLayers:
    """Where a rank's layers sit in the model, read from SGLang's pools by the plugin's hooks on
    the queues' ``_init_kv_manager`` where ``KVArgs`` leaves it out (an ``SWAKVPool``'s layers,
    Mamba state in the request pool; docs/sglang.md, pipeline parallelism): a PP stage holds a
    slice of the layers. ``kv_start`` is the full-attention-relative index of the rank's first
    KV layer (None: SGLang's value holds; ``kv_start_missing``: SGLang's value is wrong under PP
    and the right one unknown), ``state`` the layer ids per state kind, in the order of the
    component's layers (repeated per tensor where the component has more buffers than layers)."""

    kv_start: int | None = None
    state: tuple[tuple[str, tuple[int, ...]], ...] = ()
    kv_start_missing: bool = False
    # class names (with their bases) of the KV pool and its sub-pools, for refused_pool_kind
    pool_classes: tuple[str, ...] = ()


POOL_LAYERS: ContextVar[PoolLayers | None] = ContextVar("pdwire_pool_layers", default=None)


def fill_layer_ids(args: Any) -> None:
    """Complete ``args`` from :data:`POOL_LAYERS`: ``prefill_start_layer`` where the pool knows
    better, ``state_layer_ids`` of components SGLang left without (a kind that occurs once, with
    as many ids as buffers)."""
    layers = POOL_LAYERS.get()
    if layers is None:
        return
    if layers.kv_start is not None:
        args.prefill_start_layer = layers.kv_start
    kinds = state_kinds(args)
    ids = [list(x) for x in (_get(args, "state_layer_ids") or [])]
    ids += [[] for _ in range(len(kinds) - len(ids))]
    ptrs = _get(args, "state_data_ptrs") or []
    for kind, layer_ids in layers.state:
        if kinds.count(kind) != 1 or not layer_ids:
            continue
        ci = kinds.index(kind)
        n = len(ptrs[ci]) if ci < len(ptrs) else 0
        if not ids[ci] and n and n % len(layer_ids) == 0:
            ids[ci] = list(layer_ids) * (n // len(layer_ids))  # tensor-major x layer (SWA: K.., V..)
    args.state_layer_ids = ids


def missing_pp_layer_ids(args: Any, decode: bool = False) -> list[str]:
    """What a PP stage cannot place on the other side: state components without layer ids, and
    the KV start layer where the pool's is known to be wrong (decode: unless the plugin's hook
    read it from the pool, SGLang's decode KVArgs carry none)."""
    kinds = state_kinds(args)
    out = [f"state[{ci}]:{kind}" for ci, kind in enumerate(kinds) if not _has(args, "state_layer_ids", ci)]
    layers = POOL_LAYERS.get()
    if layers is not None and layers.kv_start_missing:
        out.insert(0, "the KV start layer (model_config.full_attention_layer_ids unknown)")
    elif decode and _get(args, "kv_data_ptrs") and (layers is None or layers.kv_start is None):
        out.insert(0, "the KV start layer (not read from the decode's pool)")
    return out


# SGLang 0.5.23's pools pdwire does not carry, by class or base (docs/sglang.md, pool kinds): what
# their KVArgs register would not be the whole KV, or not per layer as K and V / one latent
_UNIFIED = "--enable-unified-memory: one shared buffer of page envelopes holds every layer"
_REFUSED_POOLS = {
    "NoOpMHATokenToKVPool": "it stores no KV (placeholders of embedding-mode prefill)",
    "MHATokenToKVPoolFP4": "its FP4 block scales are not in KVArgs (only the packed K/V would move)",
    "MLATokenToKVPoolFP4": "its FP4 block scales are not in KVArgs (only the packed latents would move)",
    "MiniMaxM3Nvfp4KVPool": "its NVFP4 rows are packed per token, not K and V per layer",
    "PageMajorMHATokenToKVPool": "it has no per-layer regions",
    "PageInterleaveKVPoolMixin": "each rank holds an interleaved share of the logical pages",
    "UnifiedMHATokenToKVPool": _UNIFIED,
    "UnifiedMLATokenToKVPool": _UNIFIED,
    "UnifiedSWAKVPool": _UNIFIED,
    "UnifiedHybridLinearKVPool": _UNIFIED,
    "DeepSeekV4TokenToKVPool": "its KV is bucketed by compression ratio, not by layer",
}


def refused_pool_kind(args: Any) -> str | None:
    """``"KIND: why"`` when the rank's pool is one pdwire does not carry: from the pool classes
    the plugin's hooks saw (:data:`POOL_LAYERS`), else from what ``KVArgs`` give away."""
    layers = POOL_LAYERS.get()
    for name in layers.pool_classes if layers is not None else ():
        if name in _REFUSED_POOLS:
            return f"{name}: {_REFUSED_POOLS[name]}"
    if _get(args, "mla_compression_ratios") is not None:
        return f"DeepSeekV4TokenToKVPool: {_REFUSED_POOLS['DeepSeekV4TokenToKVPool']}"
    if _get(args, "kv_buf_groups") is not None:
        return "an NPU pool (KVArgs.kv_buf_groups): pdwire registers CUDA and host memory only"
    return None


def pool_refusal(args: Any) -> str | None:
    """The start-up refusal of a pool kind pdwire does not carry (:func:`refused_pool_kind`)."""
    refused = refused_pool_kind(args)
    if refused is None:
        return None
    return (
        f"pdwire: SGLang pool {refused}; the pdwire transfer backend does not carry it "
        "(see docs/sglang.md, pool kinds)"
    )


class KVArgsError(ValueError):
    """KVArgs that cannot describe a rank's memory; names the field and component."""


# SGLang's page-indexed kinds of unknown sharding; the other unknown ones are row-indexed
_PAGE_UNKNOWN = {"qsa_compressed", "minimax_index_k", "minimax_dense_kv", "block_scale", "block_scale_swa"}


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where the rank sits (from SGLang's parallel state, not from KVArgs: ``tp_*`` of ``rank``
    is the attention TP group) and what its pools are."""

    rank: pd.ParallelRank
    is_mla: bool = False
    memory_kind: pd.MemoryKind = pd.MemoryKind.VRAM
    device_id: int = 0  # the GPU the pools live on (SGLang's ``KVArgs.gpu_id``)


def _ints(values: Any, what: str) -> list[int]:
    if values is None:
        return []
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise KVArgsError(f"KVArgs.{what} must be a list of integers: {exc}") from None


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _has(args: Any, name: str, ci: int) -> bool:
    lists = _get(args, name) or []
    return ci < len(lists) and bool(lists[ci])


def _buffers(args: Any, prefix: str, ci: int | None = None) -> list[list[int]]:
    """``{prefix}_data_ptrs``, ``_data_lens`` and ``_item_lens`` (state: of component ``ci``),
    checked to be as long as each other."""
    names = [f"{prefix}_{f}" for f in ("data_ptrs", "data_lens", "item_lens")]
    if ci is None:
        out = [_ints(_get(args, name), name) for name in names]
    else:
        out = [_ints((_get(args, name) or [])[ci], f"{name}[{ci}]") for name in names]
        names = [f"{name}[{ci}]" for name in names]
    if len({len(v) for v in out}) != 1:
        raise KVArgsError("KVArgs: " + ", ".join(f"{len(v)} {n}" for v, n in zip(out, names, strict=True)))
    return out


def _heads(args: Any, geo: Geometry, what: str) -> tuple[int, int]:
    """(KV heads per rank, the model's), for a non-MLA pool."""
    heads = int(_get(args, "kv_head_num", 0) or 0)
    if heads < 1:
        raise KVArgsError(f"KVArgs.kv_head_num must be >= 1 for a non-MLA {what}, got {heads}")
    return heads, int(_get(args, "total_kv_head_num", 0) or 0) or heads * geo.rank.tp_size


def _kv_pool(args: Any, geo: Geometry) -> pd.KvPool | None:
    ptrs, lens, items = _buffers(args, "kv")
    if not ptrs:
        return None
    if len(set(items)) != 1:
        raise KVArgsError(
            f"KVArgs.kv_item_lens differ between layers ({sorted(set(items))}); pdwire needs one page size"
        )
    page_size = int(_get(args, "page_size", 0) or 0)
    if page_size < 1:
        raise KVArgsError(f"KVArgs.page_size must be >= 1, got {page_size}")
    page_bytes = items[0]
    if page_bytes % page_size:
        raise KVArgsError(f"KVArgs.kv_item_lens[0]={page_bytes} is not a multiple of page_size {page_size}")
    if geo.is_mla:
        return pd.KvPool(
            k_base_addrs=tuple(ptrs), v_base_addrs=(), region_lens=tuple(lens), bytes_per_page=page_bytes,
            page_size=page_size, layout=pd.Layout.NHD, kv_heads_per_rank=1, total_kv_heads=1,
            bytes_per_head=page_bytes // page_size, is_mla=True, memory_kind=geo.memory_kind,
            device_id=geo.device_id,
        )  # fmt: skip
    draft = int(_get(args, "num_draft_entries", 0) or 0)
    target = len(ptrs) - draft
    if target % 2 or draft % 2 or target < 0:
        raise KVArgsError(
            f"KVArgs: {len(ptrs)} KV buffers with {draft} draft entries do not split into K and V halves"
        )

    def halves(seq: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        t, d = seq[:target], seq[target:]
        return tuple(t[: target // 2] + d[: draft // 2]), tuple(t[target // 2 :] + d[draft // 2 :])

    k, v = halves(ptrs)
    k_lens, v_lens = halves(lens)
    if k_lens != v_lens:
        raise KVArgsError("KVArgs.kv_data_lens: a layer's K and V buffers differ in length")
    heads, total = _heads(args, geo, "model")
    if (page_bytes // page_size) % heads:
        raise KVArgsError(
            f"KVArgs: {page_bytes // page_size} bytes per token do not split into {heads} heads"
        )
    return pd.KvPool(
        k_base_addrs=k, v_base_addrs=v, region_lens=k_lens, bytes_per_page=page_bytes, page_size=page_size,
        layout=pd.Layout.NHD, kv_heads_per_rank=heads, total_kv_heads=total,
        bytes_per_head=page_bytes // page_size // heads, memory_kind=geo.memory_kind,
        device_id=geo.device_id,
    )  # fmt: skip


def _entry_list(args: Any, name: str, ci: int, n: int, default: Any) -> list[Any]:
    lists = _get(args, name) or []
    if ci >= len(lists) or not lists[ci]:
        return [default] * n
    entries = list(lists[ci])
    if len(entries) < n:
        raise KVArgsError(f"KVArgs.{name}[{ci}] has {len(entries)} entries for {n} state buffers")
    return entries[:n]  # SGLang's lists may run longer (speculative buffers are not registered)


def _split_tensors(
    n: int, layer_ids: list[int], kind: str, ci: int, signature: list[tuple[Any, ...]]
) -> tuple[int, tuple[int, ...] | None]:
    """(entries per tensor, the tensor's layer ids) from the tensor-major x layer entry list.

    Without layer ids (SGLang's request-pool Mamba state sends none) a tensor is a run of
    entries with the same item size, sharded axis and sub-blocks; every run must be as long."""
    if not layer_ids:
        runs = [1]
        for a, b in itertools.pairwise(signature):
            if a == b:
                runs[-1] += 1
            else:
                runs.append(1)
        if len(set(runs)) != 1:
            raise KVArgsError(
                f"KVArgs state component {ci} ({kind}): without state_layer_ids the buffers do not split "
                f"into tensors of equal layer counts (runs {runs})"
            )
        return runs[0], None
    if len(layer_ids) != n:
        raise KVArgsError(f"KVArgs.state_layer_ids[{ci}] ({kind}) has {len(layer_ids)} ids for {n} buffers")
    per = len(dict.fromkeys(layer_ids))
    if n % per:
        raise KVArgsError(f"KVArgs.state_layer_ids[{ci}] ({kind}) do not repeat per tensor")
    first = tuple(layer_ids[:per])
    for t in range(n // per):
        if tuple(layer_ids[t * per : (t + 1) * per]) != first:
            raise KVArgsError(f"KVArgs.state_layer_ids[{ci}] ({kind}): tensor {t} names other layers")
    return per, first


def _state_component(args: Any, ci: int, kind_value: str, geo: Geometry) -> pd.StatePool:
    try:
        kind = pd.StateKind(kind_value)
    except ValueError:
        raise KVArgsError(
            f"KVArgs.state_types[{ci}]: state kind {kind_value!r} is not known to pdwire"
        ) from None
    ptrs, lens, items = _buffers(args, "state", ci)
    n = len(ptrs)
    if n == 0:
        raise KVArgsError(f"KVArgs state component {ci} ({kind.value}) has no buffers")
    layer_ids = (
        _ints(_get(args, "state_layer_ids")[ci], f"state_layer_ids[{ci}]")
        if _has(args, "state_layer_ids", ci)
        else []
    )

    def tensor(name: str, lo: int, hi: int, **extra: Any) -> pd.StateTensor:
        sizes = set(items[lo:hi])
        if len(sizes) != 1:
            raise KVArgsError(
                f"KVArgs.state_item_lens[{ci}] ({kind.value}): tensor {name} has item sizes {sorted(sizes)}"
            )
        return pd.StateTensor(name, tuple(ptrs[lo:hi]), tuple(lens[lo:hi]), items[lo], **extra)

    base: dict[str, Any] = {"kind": kind, "memory_kind": geo.memory_kind, "device_id": geo.device_id}
    if kind is pd.StateKind.MAMBA:
        dims = (
            _ints(_entry_list(args, "state_dim_per_tensor", ci, n, 0), f"state_dim_per_tensor[{ci}]")
            if _has(args, "state_dim_per_tensor", ci)
            else []
        )
        outer = _ints(
            _entry_list(args, "state_slice_outer_counts", ci, n, 1), f"state_slice_outer_counts[{ci}]"
        )
        groups = _entry_list(args, "state_conv_shard_groups", ci, n, None)
        signature = [
            (items[i], dims[i] if dims else None, outer[i], tuple(groups[i]) if groups[i] else None)
            for i in range(n)
        ]
        per, ids = _split_tensors(n, layer_ids, kind.value, ci, signature)
        tensors = []
        for t in range(n // per):
            lo, hi = t * per, (t + 1) * per
            dim = dims[lo] if dims else None
            sub = groups[lo]
            tensors.append(
                tensor(
                    f"state{t}", lo, hi,
                    sharded_axis_size=dim if dim else None,
                    replicated=dim == 0,
                    outer_rows=outer[lo] if dim else 1,
                    sub_block_sizes=tuple(int(s) for s in sub) if sub else None,
                )
            )  # fmt: skip
        return pd.StatePool(indexing=pd.Indexing.SLOT, tensors=tuple(tensors), layer_ids=ids, **base)
    if kind is pd.StateKind.SWA and not geo.is_mla:
        if n % 2:
            raise KVArgsError(f"KVArgs state component {ci} (swa): {n} buffers do not split into K and V")
        half = n // 2
        ids = tuple(layer_ids[:half]) if layer_ids else None
        page_size = int(_get(args, "page_size", 1) or 1)
        layout_name = str(_get(args, "swa_kv_cache_layout", None) or "nhd").upper()
        if layout_name not in ("NHD", "HND"):
            raise KVArgsError(f"KVArgs.swa_kv_cache_layout {layout_name.lower()!r}: pdwire knows nhd and hnd")
        heads, total = _heads(args, geo, "SWA component")
        if items[0] % (page_size * heads):
            raise KVArgsError(
                f"KVArgs: SWA page of {items[0]} bytes does not split into {page_size} x {heads} heads"
            )
        geom = pd.HeadGeometry(
            page_size, pd.Layout(layout_name), heads, total, items[0] // page_size // heads
        )
        return pd.StatePool(
            indexing=pd.Indexing.PAGE, tensors=(tensor("k", 0, half), tensor("v", half, n)), heads=geom,
            layer_ids=ids, **base,
        )  # fmt: skip
    # the rest are one buffer per layer: SWA (MLA), DSA and NSA replicated, the others unknown
    replicated = kind in (pd.StateKind.SWA, pd.StateKind.DSA, pd.StateKind.NSA)
    return pd.StatePool(
        indexing=pd.Indexing.PAGE if replicated or kind.value in _PAGE_UNKNOWN else pd.Indexing.ROW,
        tensors=(tensor("buf", 0, n),), replicated=replicated,
        layer_ids=tuple(layer_ids) if layer_ids and len(set(layer_ids)) == n else None, **base,
    )  # fmt: skip


def _aux(args: Any) -> tuple[pd.AuxBuffer, ...]:
    ptrs, lens, items = _buffers(args, "aux")
    return tuple(
        pd.AuxBuffer(f"aux{i}", p, ln, it)
        for i, (p, ln, it) in enumerate(zip(ptrs, lens, items, strict=True))
    )


def state_kinds(args: Any) -> list[str]:
    """The state kinds of ``args`` in component order (SGLang's ``StateType`` values)."""
    return [str(getattr(t, "value", t)) for t in (_get(args, "state_types") or [])]


def rank_memory(args: Any, geo: Geometry) -> pd.RankMemory:
    """``RankMemory`` of one SGLang rank; :class:`KVArgsError` names what does not fit."""
    first_layer = int(_get(args, "prefill_start_layer", 0) or 0)
    kv = _kv_pool(args, geo)
    state = tuple(_state_component(args, ci, k, geo) for ci, k in enumerate(state_kinds(args)))
    return pd.RankMemory(geo.rank, kv=kv, state=state, aux=_aux(args), first_layer=first_layer)
