"""SGLang's plugin entry point: makes ``--disaggregation-transfer-backend pdwire`` a backend.

SGLang 0.5.23 has no transfer-backend registry: ``TransferBackend`` is a closed enum and
``get_kv_class`` an if-chain (``sglang.srt.disaggregation.utils``). It does have a general
plugin mechanism: every function registered under the entry-point group
``sglang.srt.plugins`` (pdwire's ``pyproject.toml`` registers :func:`register` as ``pdwire``;
``SGLANG_PLUGINS`` filters by that name) runs in every SGLang process (server, scheduler,
detokenizer, engine) before the server arguments are parsed, and SGLang then applies the
hooks the plugins registered in its ``HookRegistry``, rewriting the ``from X import Y``
bindings of modules that already imported the original.

:func:`register` does three things, each idempotent:

1. adds the member ``TransferBackend.PDWIRE = "pdwire"`` to the enum in place, so
   ``TransferBackend("pdwire")`` resolves and every existing member keeps its identity (the
   schedulers compare members with ``==``);
2. adds ``"pdwire"`` to the CLI choices (``add_disagg_transfer_backend_choices``);
3. registers an AROUND hook on ``get_kv_class`` that answers pdwire's manager, sender, receiver
   and bootstrap server for ``TransferBackend.PDWIRE`` and defers to SGLang for every other
   backend (``KVArgs`` stays SGLang's for all of them);
4. registers an AROUND hook on the decode queue's ``_init_kv_manager`` that hands a pdwire
   manager the KV head counts SGLang's decode ``KVArgs`` leaves unset.

The classes themselves are imported only when SGLang asks for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from typing import Any

logger = logging.getLogger(__name__)

BACKEND_NAME = "pdwire"
MEMBER_NAME = "PDWIRE"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
DECODE_INIT = "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager"


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


def decode_init_hook(original: Callable[..., Any], queue: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND SGLang's decode ``_init_kv_manager``: hands the KV head counts SGLang's decode
    ``KVArgs`` leaves unset (per rank from the pool, the model's from the model config) to a
    pdwire manager built inside it; other backends ignore them."""
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
        return original(queue, *args, **kwargs)
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
    for target, fn in ((GET_KV_CLASS, get_kv_class_hook), (DECODE_INIT, decode_init_hook)):
        if not any(hook is fn for _, hook, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, fn, HookType.AROUND)
    logger.info("pdwire: transfer backend %r registered with SGLang", BACKEND_NAME)
