"""SGLang's plugin entry point: makes ``--disaggregation-transfer-backend pdwire`` a backend.

SGLang 0.5.23 has no transfer-backend registry (``TransferBackend`` is a closed enum,
``get_kv_class`` an if-chain), but it runs every function of the entry-point group
``sglang.srt.plugins`` in each of its processes before it parses the server arguments, and
then applies the hooks they registered in its ``HookRegistry`` (rewriting the ``from X import
Y`` bindings of modules that already imported the original). :func:`register` (idempotent)
adds ``TransferBackend.PDWIRE`` to the enum in place, adds ``pdwire`` to the CLI choices,
hooks ``get_kv_class`` to answer pdwire's classes for it, and hooks the queues'
``_init_kv_manager`` to hand a pdwire manager what ``KVArgs`` leave out (docs/sglang.md,
installing the plugin). The classes themselves are imported only when SGLang asks for them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from enum import Enum
from typing import Any

logger = logging.getLogger(__name__)

BACKEND_NAME = "pdwire"
MEMBER_NAME = "PDWIRE"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
DECODE_INIT = "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager"
PREFILL_INIT = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager"


def extend_enum(enum_cls: type[Enum], name: str, value: str) -> Enum:
    """Add ``name = value`` to ``enum_cls`` in place and return the member (the existing one
    if it is there already). Existing members are untouched, so ``==`` and ``is`` against
    them keep working in every module that imported the enum."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    if name in enum_cls._member_map_:
        raise ValueError(f"{enum_cls.__name__}.{name} exists with another value")
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__init__(value)  # type: ignore[misc]  # Enum's own __init__, a no-op for plain members
    # type.__setattr__: EnumType.__setattr__ guards the member names, and this is a new one
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def _pdwire_classes() -> dict[Any, type]:
    from sglang.srt.disaggregation.utils import KVClassType

    from pdwire.integrations.sglang import conn

    return {
        KVClassType.MANAGER: conn.PdwireKVManager,
        KVClassType.SENDER: conn.PdwireKVSender,
        KVClassType.RECEIVER: conn.PdwireKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.PdwireKVBootstrapServer,
    }


def get_kv_class_hook(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """The AROUND hook on SGLang's ``get_kv_class``: pdwire's classes for ``PDWIRE``."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    pdwire = getattr(TransferBackend, MEMBER_NAME, None)
    if pdwire is None or transfer_backend != pdwire or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    return _pdwire_classes().get(class_type)


def pool_layers(pool: Any, req_pool: Any, model_config: Any) -> Any:
    """The layers SGLang's pools know and its ``KVArgs`` leave out (``PoolLayers``): an
    ``SWAKVPool``'s ``layers_mapping`` (global layer id -> (sub-pool index, is SWA)) gives the
    SWA layer ids and, with the model's ``full_attention_layer_ids``, the full-attention-relative
    start in place of its ``start_layer`` (0 on every PP stage); the request pool's Mamba pool
    gives ``get_state_layer_ids()``, which SGLang passes on only for a ``HybridLinearKVPool``."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from pdwire.integrations.sglang.memory import PoolLayers

    state: list[tuple[str, tuple[int, ...]]] = []
    kv_start: int | None = None
    kv_start_missing = False
    if isinstance(pool, SWAKVPool):
        mapping = dict(getattr(pool, "layers_mapping", None) or {})
        by_index = sorted(mapping.items(), key=lambda kv: kv[1][0])
        swa = tuple(int(g) for g, (_, is_swa) in by_index if is_swa)
        full = [int(g) for g, (_, is_swa) in by_index if not is_swa]
        if swa:
            state.append(("swa", swa))
        model_full = getattr(model_config, "full_attention_layer_ids", None)
        if full and model_full is not None:
            kv_start = sum(1 for i in model_full if int(i) < min(full))
        elif full:
            kv_start_missing = True
    get_ids = getattr(getattr(req_pool, "mamba_pool", None), "get_state_layer_ids", None)
    if callable(get_ids):
        mamba = tuple(int(i) for i in get_ids())
        if mamba:
            state.append(("mamba", mamba))
    return PoolLayers(kv_start, tuple(state), kv_start_missing, pool_classes(pool))


def pool_classes(pool: Any) -> tuple[str, ...]:
    """The class names, bases included, of a KV pool and its sub-pools (full, SWA), which
    ``memory.refused_pool_kind`` checks against the kinds pdwire does not carry."""
    pools = [pool, getattr(pool, "full_kv_pool", None), getattr(pool, "swa_kv_pool", None)]
    names = (c.__name__ for p in pools if p is not None for c in type(p).__mro__)
    return tuple(dict.fromkeys(names))


def decode_kv_start(pool: Any, model_config: Any) -> int | None:
    """A decode PP stage's full-attention-relative first KV layer, which SGLang's decode
    ``KVArgs`` leave out (its prefill computes it alike, ``_transfer_start_layer``): the pool's
    ``start_layer``, counted in full-attention layers for a ``HybridLinearKVPool``."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    start = getattr(pool, "start_layer", None)
    if start is None:
        return None
    if not isinstance(pool, HybridLinearKVPool):
        return int(start)
    full = getattr(getattr(model_config, "hf_text_config", None), "full_attention_layer_ids", None)
    return None if full is None else sum(1 for i in full if int(i) < int(start))


def _with_pool_layers(
    original: Callable[..., Any], queue: Any, req_pool: Any, *args: Any, decode: bool = False, **kwargs: Any
) -> Any:
    from pdwire.integrations.sglang.memory import POOL_LAYERS

    try:
        layers = pool_layers(queue.token_to_kv_pool, req_pool, queue.scheduler.model_config)
        if decode and layers.kv_start is None and not layers.kv_start_missing:
            start = decode_kv_start(queue.token_to_kv_pool, queue.scheduler.model_config)
            layers = dataclasses.replace(layers, kv_start=start)
    except Exception:  # a pool this SGLang build lays out otherwise: KVArgs as SGLang made them
        logger.debug("pdwire: no layer ids from the pools", exc_info=True)
        layers = None
    token = POOL_LAYERS.set(layers)
    try:
        _refuse_pool(queue)
        return original(queue, *args, **kwargs)
    finally:
        POOL_LAYERS.reset(token)


def _refuse_pool(queue: Any) -> None:
    """A pdwire queue's pool of a kind pdwire does not carry, refused by name before SGLang builds
    its KVArgs (for some of them, SGLang 0.5.23's own ``_init_kv_manager`` fails with an
    AttributeError that names nothing)."""
    from types import SimpleNamespace

    from pdwire.integrations.sglang.memory import pool_refusal

    if str(getattr(getattr(queue, "transfer_backend", None), "value", "")) != BACKEND_NAME:
        return
    refused = pool_refusal(SimpleNamespace())  # the pool classes only: KVArgs are not made yet
    if refused is not None:
        raise ValueError(refused)


def prefill_init_hook(original: Callable[..., Any], queue: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND SGLang's prefill ``_init_kv_manager``: hands the layers the pools know
    (:func:`pool_layers`) to a pdwire manager built inside it; other backends ignore them."""
    req_pool = getattr(getattr(queue, "scheduler", None), "req_to_token_pool", None)
    return _with_pool_layers(original, queue, req_pool, *args, **kwargs)


def decode_init_hook(original: Callable[..., Any], queue: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND SGLang's decode ``_init_kv_manager``: hands the KV head counts SGLang's decode
    ``KVArgs`` leaves unset (per rank from the pool, the model's from the model config) and the
    layers the pools know (:func:`pool_layers`) to a pdwire manager built inside it; other
    backends ignore them."""
    from pdwire.integrations.sglang.memory import DECODE_KV_HEADS

    heads = None
    try:
        pool = queue.token_to_kv_pool
        pool = getattr(pool, "full_kv_pool", pool)
        heads = (int(pool.head_num), int(queue.scheduler.model_config.get_total_num_kv_heads()))
    except (AttributeError, TypeError, ValueError):  # MLA pools have no head_num
        pass
    token = DECODE_KV_HEADS.set(heads)
    try:
        req_pool = getattr(queue, "req_to_token_pool", None)
        return _with_pool_layers(original, queue, req_pool, *args, decode=True, **kwargs)
    finally:
        DECODE_KV_HEADS.reset(token)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (see the module notes)."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    extend_enum(TransferBackend, MEMBER_NAME, BACKEND_NAME)
    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    hooks = (
        (GET_KV_CLASS, get_kv_class_hook),
        (DECODE_INIT, decode_init_hook),
        (PREFILL_INIT, prefill_init_hook),
    )
    for target, fn in hooks:
        if not any(hook is fn for _, hook, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, fn, HookType.AROUND)
    logger.info("pdwire: transfer backend %r registered with SGLang", BACKEND_NAME)
