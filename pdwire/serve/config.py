"""What ``pdwire serve`` runs, from a config file, the environment and flags (docs/deployment.md
lists the settings). Pure: values in, one :class:`ServeConfig` or one :class:`ServeConfigError`
naming the setting out. Precedence: flags over the environment over the file; a file is YAML
with the flags' names plus two mappings, ``backend_options`` and ``memory``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from pdwire.runtime.backends.options import BackendOptionError, options_from_env, parse_pairs
from pdwire.runtime.endpoints import EndpointError, HostPort, check_advertisable, parse_host_port

ROLES = ("prefill", "decode")
ENV = {
    "discovery": "PDWIRE_DISCOVERY",
    "bind": "PDWIRE_BIND",
    "advertise": "PDWIRE_ADVERTISE",
    "control_keys": "PDWIRE_CONTROL_KEYS",
}


class ServeConfigError(ValueError):
    """A serve setting that cannot work; the text names it and where it came from."""


@dataclass(frozen=True)
class MemorySettings:
    """A rank's memory (``memory: {model: demo, ...}``): ``model`` names a registered memory
    model (:mod:`.memory`; ``pdwire serve`` registers the demo's hybrid model as ``demo``), the
    other fields describe its shape.

    Shapes as ``pdwire demo`` takes them; ``pages``/``slots``/``swa_pages``/``aux_items`` size
    each rank's pools; ``seed`` seeds the synthetic content (both sides must agree, or every
    request fails its byte-for-byte check: never silently)."""

    model: str = "demo"
    layers: int = 4
    kv_heads: int = 8
    head_dim: int = 64
    page_size: int = 16
    mla: bool = False
    pages: int = 512
    slots: int = 33
    swa_pages: int = 160
    aux_items: int = 33
    seed: int = 1


@dataclass(frozen=True)
class ServeConfig:
    role: str
    engine_id: str
    tp: int = 1
    ranks: tuple[int, ...] = ()  # the TP ranks this process runs (empty: all)
    backend: str | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    bind: str = "127.0.0.1"
    advertise: str | None = None
    discovery: str = ""
    prefill: tuple[str, ...] = ()  # decode, static discovery: ENGINE=tcp://h:p,tcp://h:p
    memory: MemorySettings = field(default_factory=MemorySettings)
    room_timeout_s: float = 30.0
    transfer_timeout_s: float = 20.0
    handshake_timeout_s: float = 10.0
    chunk_pages: int = 8
    admin: str | None = None  # decode: a UNIX socket path for run/status/stop commands
    requests: int = 0  # decode: a wave of this many requests once a prefill engine is connected
    min_tokens: int = 32
    max_tokens: int = 256
    exit_after: bool = False  # decode: stop after that wave (exit status 1 if any failed)
    log_level: str = "info"
    control_keys: str | None = None  # the key directory of the control plane (`pdwire keys generate`)
    insecure_control: bool = False  # run the control plane unauthenticated (explicitly)

    # ---------------------------------------------------------------- derived

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.ranks or tuple(range(self.tp))

    @property
    def bind_address(self) -> HostPort:
        return parse_host_port(self.bind, default_port=0)

    @property
    def advertise_address(self) -> HostPort | None:
        return parse_host_port(self.advertise, default_port=0) if self.advertise else None

    @property
    def advertise_host(self) -> str:
        """The host peers reach this process at: ``advertise``, else the bound host."""
        adv = self.advertise_address
        return adv.host if adv is not None else self.bind_address.host

    def rank_bind(self, tp_rank: int) -> str:
        """``tcp://HOST:PORT`` rank ``tp_rank`` binds: the base port plus the rank (0: any)."""
        b = self.bind_address
        return HostPort(b.host, b.port + tp_rank if b.port else 0).zmq

    def rank_advertise(self, tp_rank: int) -> str | None:
        """What rank ``tp_rank`` advertises (``tcp://HOST`` takes the bound port), or None: the bind."""
        adv = self.advertise_address
        if adv is None:
            return None
        host = f"[{adv.host}]" if ":" in adv.host else adv.host
        return f"tcp://{host}:{adv.port + tp_rank}" if adv.port else f"tcp://{host}"


def _fail(where: str, what: str) -> ServeConfigError:
    return ServeConfigError(f"{where}: {what}")


def _check(cfg: ServeConfig) -> ServeConfig:
    if cfg.role not in ROLES:
        raise _fail("role", f"{cfg.role!r} is not one of {', '.join(ROLES)}")
    if not cfg.engine_id:
        raise _fail("engine_id", "required (the engine this process is a rank of)")
    if not isinstance(cfg.tp, int) or cfg.tp < 1:
        raise _fail("tp", f"{cfg.tp!r} is not a TP size >= 1")
    for r in cfg.ranks:
        if not 0 <= r < cfg.tp:
            raise _fail("ranks", f"rank {r} is outside 0..{cfg.tp - 1}")
    if len(set(cfg.ranks)) != len(cfg.ranks):
        raise _fail("ranks", f"{list(cfg.ranks)} names a rank twice")
    if cfg.role == "decode" and cfg.ranks and sorted(cfg.ranks) != list(range(cfg.tp)):
        # every decode rank of a request must take part in its room: they live in one process
        raise _fail("ranks", "a decode engine runs all its TP ranks in one process")
    try:
        bind = cfg.bind_address
        adv = cfg.advertise_address
    except EndpointError as exc:
        raise _fail("bind/advertise", str(exc)) from None
    if adv is not None:
        if adv.is_wildcard:
            raise _fail("advertise", f"{cfg.advertise!r} is a wildcard; give the address peers reach")
    elif bind.is_wildcard:
        raise _fail(
            "advertise",
            f"bind {cfg.bind!r} listens on every interface: give --advertise, the address peers reach",
        )
    try:
        check_advertisable(HostPort(cfg.advertise_host, 1), "advertised host")
    except EndpointError as exc:
        raise _fail("advertise", str(exc)) from None
    if cfg.role == "prefill" and cfg.prefill:
        raise _fail("prefill", "only a decode engine lists prefill engines")
    if cfg.discovery and cfg.prefill:
        raise _fail("prefill", "give either --discovery or --prefill (a static list), not both")
    for name in ("room_timeout_s", "transfer_timeout_s", "handshake_timeout_s"):
        if not getattr(cfg, name) > 0:
            raise _fail(name, f"{getattr(cfg, name)!r} is not a positive number of seconds")
    if not 1 <= cfg.min_tokens <= cfg.max_tokens < 1 << 16:
        raise _fail("min_tokens/max_tokens", f"need 1 <= {cfg.min_tokens} <= {cfg.max_tokens} < 65536")
    if cfg.chunk_pages < 1:
        raise _fail("chunk_pages", f"{cfg.chunk_pages} is not >= 1")
    if cfg.requests < 0:
        raise _fail("requests", f"{cfg.requests} is negative")
    if not cfg.memory.model:
        raise _fail("memory.model", "empty (name a memory model, e.g. 'demo')")
    if cfg.log_level.lower() not in {"debug", "info", "warning", "error"}:
        raise _fail("log_level", f"{cfg.log_level!r} is not debug, info, warning or error")
    return cfg


_SCALARS = {f.name for f in fields(ServeConfig)} - {"memory", "backend_options"}


def _coerce(cfg: ServeConfig, name: str, value: Any, where: str) -> Any:
    """A value from a file or flag, as the field's type."""
    current = getattr(cfg, name)
    if name in ("ranks", "prefill"):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()] if name == "ranks" else [value]
        if not isinstance(value, list | tuple):
            raise _fail(f"{where} {name}", f"{value!r} is not a list")
        try:
            return tuple(int(v) for v in value) if name == "ranks" else tuple(str(v) for v in value)
        except ValueError:
            raise _fail(f"{where} {name}", f"{value!r} is not a list of TP ranks") from None
    return _typed(value, current, f"{where} {name}")


def _typed(value: Any, current: Any, where: str) -> Any:
    """``value`` if it has the type of ``current`` (str for None); an int is a float, a bool no int."""
    expected: type = type(current) if current is not None else str
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise _fail(where, f"must be {expected.__name__}, got {value!r}")
    return value


def _memory(cfg: ServeConfig, data: object, where: str) -> MemorySettings:
    if not isinstance(data, Mapping):
        raise _fail(f"{where} memory", "must be a mapping (model: demo, layers: ..., ...)")
    known = [f.name for f in fields(MemorySettings)]
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k not in known:
            raise _fail(f"{where} memory.{k}", f"unknown (known: {', '.join(known)})")
        out[k] = _typed(v, getattr(MemorySettings(), k), f"{where} memory.{k}")
    return replace(cfg.memory, **out)


def _apply(cfg: ServeConfig, data: Mapping[str, Any], where: str) -> ServeConfig:
    changes: dict[str, Any] = {}
    for k, v in data.items():
        key = k.replace("-", "_")
        if key == "memory":
            changes["memory"] = _memory(cfg, v, where)
        elif key == "backend_options":
            if not isinstance(v, Mapping):
                raise _fail(f"{where} backend_options", "must be a mapping of option: value")
            changes["backend_options"] = {**cfg.backend_options, **{str(a): b for a, b in v.items()}}
        elif key in _SCALARS:
            changes[key] = _coerce(cfg, key, v, where)
        else:
            raise _fail(
                f"{where} {k}",
                f"unknown setting (known: {', '.join(sorted(_SCALARS | {'memory', 'backend_options'}))})",
            )
    return replace(cfg, **changes)


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise _fail(str(p), f"cannot be read: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise _fail(str(p), "a serve config file is a mapping of setting: value")
    return data


def build_config(
    role: str,
    *,
    file: Mapping[str, Any] | None = None,
    flags: Mapping[str, Any] | None = None,
    backend_option_flags: Sequence[str] = (),
    memory_flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    file_name: str = "config file",
) -> ServeConfig:
    """File, then environment, then flags (only the flags given: None values are skipped)."""
    env = os.environ if environ is None else environ
    file = dict(file or {})
    file_role = file.pop("role", role)
    if file_role != role:
        raise _fail(f"{file_name} role", f"{file_role!r}, but the command serves {role!r}")
    cfg = ServeConfig(role=role, engine_id="")
    cfg = _apply(cfg, file, file_name)
    from_env = {k: env[v] for k, v in ENV.items() if env.get(v)}
    cfg = _apply(cfg, from_env, "environment")
    try:
        env_opts = options_from_env(env)
        flag_opts = parse_pairs(list(backend_option_flags))
    except BackendOptionError as exc:
        raise _fail("backend options", str(exc)) from None
    # as every setting: flags over the environment over the file
    cfg = replace(cfg, backend_options={**cfg.backend_options, **env_opts, **flag_opts})
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    cfg = _apply(cfg, given, "flag")
    if memory_flags:
        cfg = replace(
            cfg, memory=_memory(cfg, {k: v for k, v in memory_flags.items() if v is not None}, "flag")
        )
    return _check(cfg)
