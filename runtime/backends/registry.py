"""Backends by name: ``create_backend("nixl" | "local" | "mooncake", ...)``.

A new backend is one module with a :class:`~.contract.Backend` subclass plus one line in
``_FACTORIES``; the conformance suite picks it up from :func:`known_backends`. Code outside
the production backends (the demo's ``mori-fake``, an engine integration's own adapter) adds
one with :func:`register_backend`; it is then created by name like the others.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from pdwire.runtime.backends.contract import Backend
from pdwire.runtime.backends.errors import BackendUnavailable

# name -> (module, class, engine module that must import for the backend to be available)
_FACTORIES: dict[str, tuple[str, str, str | None]] = {
    "nixl": ("pdwire.runtime.backends.nixl", "NixlBackend", "nixl._api"),
    "local": ("pdwire.runtime.backends.local", "LocalBackend", None),
    "mooncake": ("pdwire.runtime.backends.mooncake", "MooncakeBackend", "mooncake.engine"),
}


def register_backend(name: str, module: str, cls: str, transfer_engine: str | None = None) -> None:
    """Make ``create_backend(name)`` build ``module.cls``; ``transfer_engine`` is the module of the
    transfer engine it drives, which must import for the backend to be available. Registering the
    same entry again is a no-op; another entry under a taken name is refused (two backends
    answering to one name would be a silent swap)."""
    entry = (module, cls, transfer_engine)
    old = _FACTORIES.get(name)
    if old is not None and old != entry:
        raise BackendUnavailable(f"backend name {name!r} is taken by {old[0]}.{old[1]}")
    _FACTORIES[name] = entry


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


def backend_problem(name: str) -> str | None:
    """Why backend ``name`` cannot be created here (unknown, or its engine does not import, with
    the extra that brings it), or None when it can."""
    try:
        factory_entry(name)
    except BackendUnavailable as exc:
        return str(exc)
    err = _import_error(name)
    if err is None:
        return None
    hint = ""
    if name in ("nixl", "mooncake") and err.startswith("ModuleNotFoundError"):
        hint = "; it comes with the `engines` extra: pip install 'pdwire[engines]' (docs/cli.md)"
    return f"backend {name!r} cannot be used here: its engine does not import ({err}){hint}"


def available_backends() -> list[str]:
    """Names whose engine imports here (importing NIXL also imports torch: ~2 s, once)."""
    return [n for n in _FACTORIES if _import_error(n) is None]


def default_backend() -> str:
    """NIXL when it imports, otherwise the dependency-free local backend."""
    return "nixl" if _import_error("nixl") is None else "local"


def factory_entry(name: str) -> tuple[str, str]:
    """(module, class) of backend ``name``; BackendUnavailable names the known ones."""
    if name not in _FACTORIES:
        raise BackendUnavailable(f"unknown backend {name!r}; known: {', '.join(_FACTORIES)}")
    module, cls, _ = _FACTORIES[name]
    return module, cls


def create_backend(name: str | None = None, **kwargs: Any) -> Backend:
    """Instantiate a backend. ``agent_name`` and ``transfer_timeout_s`` are common to all; every
    other keyword is one of the backend's options (:mod:`.options`), checked and converted
    (text from a command line is fine) before the engine is touched: an unknown option or a
    bad value raises BackendOptionError naming it."""
    from pdwire.runtime.backends.options import resolve_options

    name = name or default_backend()
    factory_entry(name)
    common: dict[str, Any] = {k: kwargs.pop(k) for k in ("agent_name", "transfer_timeout_s") if k in kwargs}
    kwargs = {**common, **resolve_options(name, kwargs)}
    problem = backend_problem(name)
    if problem is not None:
        raise BackendUnavailable(problem)
    module, cls, _ = _FACTORIES[name]
    factory: Callable[..., Backend] = getattr(importlib.import_module(module), cls)
    return factory(**kwargs)
