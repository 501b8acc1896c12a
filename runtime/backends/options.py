"""Backend options: one mechanism for every engine's host-facing and tuning settings.

A backend's options are its constructor's keyword arguments beyond ``agent_name`` and
``transfer_timeout_s``: values from Python, or text (``--backend-option``, a config file,
``PDWIRE_BACKEND_OPTIONS``) converted by the constructor's annotation in
:func:`resolve_options`, which refuses an unknown name or a bad value with one
:class:`BackendOptionError` naming both. Each backend documents them in ``OPTION_DOCS``. The
text forms and :func:`host_defaults` (the host-facing options derived from the one address a
rank advertises): docs/deployment.md, "Backend options".
"""

from __future__ import annotations

import importlib
import inspect
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdwire.runtime.backends.errors import BackendError
from pdwire.runtime.netif import interface_of, is_loopback

ENV = "PDWIRE_BACKEND_OPTIONS"
_COMMON = {"self", "agent_name", "transfer_timeout_s"}
_NONE = "none"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


class BackendOptionError(BackendError, ValueError):
    """An option a backend does not have, or a value it cannot take; the text names both."""


@dataclass(frozen=True, slots=True)
class BackendOption:
    name: str
    annotation: Any  # the constructor's annotation, resolved
    default: Any
    doc: str

    @property
    def type_name(self) -> str:
        t = self.annotation
        return t.__name__ if isinstance(t, type) else str(t).replace("typing.", "")


def backend_class(name: str) -> type:
    """The class ``create_backend(name)`` builds (imports its module, not its engine)."""
    from pdwire.runtime.backends.registry import factory_entry

    module, cls = factory_entry(name)
    found: type = getattr(importlib.import_module(module), cls)
    return found


def declared_options(name: str) -> dict[str, BackendOption]:
    """The options of backend ``name``: its constructor's keyword arguments, typed and documented."""
    cls = backend_class(name)
    init = cls.__init__  # type: ignore[misc]
    hints = typing.get_type_hints(init)
    docs: Mapping[str, str] = getattr(cls, "OPTION_DOCS", {})
    out: dict[str, BackendOption] = {}
    for p in inspect.signature(init).parameters.values():
        if p.name in _COMMON or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        if p.default is p.empty:  # a required argument (MoRI's api) is not an option
            continue
        out[p.name] = BackendOption(p.name, hints.get(p.name, Any), p.default, docs.get(p.name, ""))
    return out


def _convert(backend: str, opt: BackendOption, value: object) -> Any:
    t = opt.annotation
    args = typing.get_args(t)
    optional = (typing.get_origin(t) in (typing.Union, types.UnionType)) and type(None) in args
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() == _NONE):
            return None
        t = next(a for a in args if a is not type(None))

    def bad(why: str) -> BackendOptionError:
        return BackendOptionError(f"backend {backend!r} option {opt.name!r} ({opt.type_name}): {why}")

    if t is bool:
        if isinstance(value, bool):
            return value
        word = value.strip().lower() if isinstance(value, str) else None
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise bad(f"{value!r} is not a boolean")
    if t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise bad(f"{value!r} is not an integer")
    if t is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise bad(f"{value!r} is not a number")
    if t is str:
        if isinstance(value, str):
            return value
        raise bad(f"{value!r} is not a string")
    if typing.get_origin(t) is dict:
        if isinstance(value, Mapping):
            return {str(k): str(v) for k, v in value.items()}
        if isinstance(value, str):
            out: dict[str, str] = {}
            for item in filter(None, (i.strip() for i in value.split(";"))):
                k, sep, v = item.partition(":")
                if not sep or not k:
                    raise bad(f"{item!r} in {value!r} is not key:value")
                out[k.strip()] = v.strip()
            return out
        raise bad(f"{value!r} is not a mapping (key:value;key:value)")
    return value  # an annotation this mechanism has no text form for: passed as given


def resolve_options(backend: str, options: Mapping[str, object]) -> dict[str, Any]:
    """``options`` checked against backend ``backend``'s declared options and converted to their types."""
    declared = declared_options(backend)
    out: dict[str, Any] = {}
    for key, value in options.items():
        opt = declared.get(key)
        if opt is None:
            known = ", ".join(sorted(declared)) or "none"
            raise BackendOptionError(f"backend {backend!r} has no option {key!r} (its options: {known})")
        out[key] = _convert(backend, opt, value)
    return out


def parse_pairs(items: Sequence[str], where: str = "--backend-option") -> dict[str, str]:
    """``["k=v", ...]`` (also ``"k=v,k=v"`` items) -> ``{k: v}``; a malformed item is named."""
    out: dict[str, str] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            k, sep, v = part.partition("=")
            if not sep or not k.strip():
                raise BackendOptionError(f"{where}: {part!r} is not name=value")
            out[k.strip()] = v.strip()
    return out


def options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    text = (os.environ if environ is None else environ).get(ENV, "")
    return parse_pairs([text], ENV) if text.strip() else {}


def host_defaults(backend: str, advertise_host: str | None) -> dict[str, Any]:
    """Host-facing options implied by the address this rank advertises (only those it declares).

    Mooncake advertises ``hostname`` and MoRI ``host`` to peers: both become the address.
    NIXL/UCX advertises the interfaces in ``net_devices``: the one holding the address (none
    for a loopback address or a host name, where UCX's own default stands).
    """
    if not advertise_host:
        return {}
    declared = declared_options(backend)
    out: dict[str, Any] = {}
    if "hostname" in declared:
        out["hostname"] = advertise_host
    if "host" in declared:
        out["host"] = advertise_host
    if "net_devices" in declared and not is_loopback(advertise_host):
        dev = interface_of(advertise_host)
        if dev is not None:
            out["net_devices"] = dev
    return out


def describe(backend: str) -> str:
    """Human-readable list of ``backend``'s options (for --help and docs)."""
    lines = []
    for opt in declared_options(backend).values():
        lines.append(f"  {opt.name} ({opt.type_name}, default {opt.default!r}): {opt.doc}")
    return "\n".join(lines) or "  (no options)"
