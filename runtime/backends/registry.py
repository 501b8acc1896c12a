"""Backends by name: ``create_backend("nixl" | "local" | "mooncake" | "mori-fake", ...)``.

A new backend is one module with a :class:`~.base.Backend` subclass plus one line in
``_FACTORIES``; the conformance suite picks it up from :func:`known_backends`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from pdwire.runtime.backends.base import Backend, BackendUnavailable

# name -> (module, class, engine module that must import for the backend to be available)
_FACTORIES: dict[str, tuple[str, str, str | None]] = {
    "nixl": ("pdwire.runtime.backends.nixl", "NixlBackend", "nixl._api"),
    "local": ("pdwire.runtime.backends.local", "LocalBackend", None),
    "mooncake": ("pdwire.runtime.backends.mooncake", "MooncakeBackend", "mooncake.engine"),
    "mori-fake": ("pdwire.runtime.backends.mori", "MoriFakeBackend", None),
}


def known_backends() -> list[str]:
    return list(_FACTORIES)


@functools.cache
def _import_error(name: str) -> str | None:
    engine = _FACTORIES[name][2]
    if engine is None:
        return None
    try:
        importlib.import_module(engine)
    except Exception as exc:  # an engine's import can fail in many ways (missing .so, ABI)
        return f"{type(exc).__name__}: {exc}"
    return None


def available_backends() -> list[str]:
    """Names whose engine imports here (importing NIXL also imports torch: ~2 s, once)."""
    return [n for n in _FACTORIES if _import_error(n) is None]


def default_backend() -> str:
    """NIXL when it imports, otherwise the dependency-free local backend."""
    return "nixl" if _import_error("nixl") is None else "local"


def create_backend(name: str | None = None, **kwargs: Any) -> Backend:
    """Instantiate a backend; ``kwargs`` go to its constructor (agent_name, transfer_timeout_s, ...)."""
    name = name or default_backend()
    if name not in _FACTORIES:
        raise BackendUnavailable(f"unknown backend {name!r}; known: {', '.join(_FACTORIES)}")
    err = _import_error(name)
    if err is not None:
        raise BackendUnavailable(f"backend {name!r} cannot be used here: its engine does not import ({err})")
    module, cls, _ = _FACTORIES[name]
    factory: Callable[..., Backend] = getattr(importlib.import_module(module), cls)
    return factory(**kwargs)
