"""What an engine tells a worker about itself: where the rank sits, how to reach it, its limits.

Pure values, no I/O. :class:`ParallelRank` is the rank's place in the parallel grid, the one
type for it (the worker configs, ``RankMemory.position`` and the session's peers hold one; it
becomes the wire's ``ParallelGeometry`` only in ``session/hello.py``). :class:`PrefillConfig`
and :class:`DecodeConfig` carry the rest (docs/engine-api.md, section 2). Every problem is one
:class:`ConfigError` naming the field.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdwire import wire

if TYPE_CHECKING:
    from pdwire.runtime.control_auth import ControlAuth

ModelFingerprint = wire.ModelFingerprint  # the served model's identity, compared at the handshake


class ConfigError(ValueError):
    """A worker configuration (or the memory given with it) that cannot work; names the field."""


@dataclass(frozen=True, slots=True)
class ParallelRank:
    """One rank's place in the parallel grid. ``tp_*`` is the *attention* TP group (SGLang's
    ``attn_tp``; the whole TP group without attention DP), ``dp_*`` attention data parallelism."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "cp", "dp"):
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            if not isinstance(size, int) or size < 1:
                raise ConfigError(f"ParallelRank.{axis}_size must be an int >= 1, got {size!r}")
            if not isinstance(rank, int) or not 0 <= rank < size:
                raise ConfigError(f"ParallelRank.{axis}_rank must be in [0, {size}), got {rank!r}")

    @property
    def sender_rank(self) -> int:
        """SGLang's ``prefill_unique_rank``, what every prefill rank signs its statuses with:
        unique over TP x PP x CP within one DP group (a request is served by one group)."""
        return self.tp_rank * (self.pp_size * self.cp_size) + self.pp_rank * self.cp_size + self.cp_rank

    @property
    def engine_rank(self) -> int:
        """Unique over the whole engine instance (the DP group, then :attr:`sender_rank`): it
        names the rank to its peers."""
        return self.dp_rank * self.tp_size * self.pp_size * self.cp_size + self.sender_rank

    def __str__(self) -> str:
        parts = [f"tp {self.tp_rank}/{self.tp_size}"]
        parts += [
            f"{axis} {getattr(self, f'{axis}_rank')}/{getattr(self, f'{axis}_size')}"
            for axis in ("pp", "cp", "dp")
            if getattr(self, f"{axis}_size") > 1
        ]
        return ", ".join(parts)


# --------------------------------------------------------------------------- endpoints


@dataclass(frozen=True, slots=True)
class TcpEndpoint:
    """``tcp://HOST:PORT``; IPv6 hosts in brackets (``tcp://[::1]:5555``). Port 0 = pick one."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str, what: str, *, port_optional: bool = False) -> TcpEndpoint:
        if not isinstance(text, str) or not text.startswith("tcp://"):
            raise ConfigError(f"{what} must look like tcp://HOST:PORT, got {text!r}")
        rest = text[len("tcp://") :]
        if rest.startswith("["):
            host, sep, tail = rest[1:].partition("]")
            if not sep or (tail and not tail.startswith(":")):
                raise ConfigError(f"{what}: bad IPv6 endpoint {text!r}")
            port_text = tail[1:] if tail else ""
        else:
            host, _, port_text = rest.partition(":")
        if not host:
            raise ConfigError(f"{what}: no host in {text!r}")
        if not port_text:
            if not port_optional:
                raise ConfigError(f"{what}: no port in {text!r} (use :0 to pick a free one)")
            return cls(host, 0)
        if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            raise ConfigError(f"{what}: port must be 0..65535, got {port_text!r} in {text!r}")
        return cls(host, int(port_text))

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    @property
    def is_wildcard(self) -> bool:
        if self.host == "*":
            return True
        try:
            return ipaddress.ip_address(self.host).is_unspecified
        except ValueError:
            return False  # a host name or an interface name

    def with_port(self, port: int) -> TcpEndpoint:
        return TcpEndpoint(self.host, port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if self.is_ipv6 else self.host
        return f"tcp://{host}:{self.port}"


# --------------------------------------------------------------------------- worker configs


def _positive(cfg: object, name: str, *, optional: bool = False) -> None:
    value = getattr(cfg, name)
    if optional and value is None:
        return
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{type(cfg).__name__}.{name} must be a positive number of seconds, got {value!r}")


def _byte_count(cfg: object, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{type(cfg).__name__}.{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What both roles need. ``backend`` is a registry name (``create_backend``; None = NIXL when
    it imports, else ``local``), used only when the engine does not hand the worker a backend;
    ``backend_options`` go to its constructor (``agent_name`` defaults to one built from the
    engine id, role, rank and pid). ``versions`` are the protocol versions offered in the Hello
    (empty: everything this build speaks).

    ``control_auth``: the CURVE keys of the control sockets (:mod:`pdwire.runtime.control_auth`).
    None takes the key directory named by ``PDWIRE_CONTROL_KEYS``; without one the worker
    refuses to start unless the control plane is explicitly unauthenticated:
    ``insecure_control=True`` here, or ``PDWIRE_INSECURE_CONTROL=1`` in the environment."""

    engine_id: str
    rank: ParallelRank
    model: ModelFingerprint
    backend: str | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    room_timeout_s: float = 30.0
    transfer_timeout_s: float = 30.0
    versions: tuple[tuple[int, int], ...] = ()
    control_auth: ControlAuth | None = None
    insecure_control: bool = False

    def __post_init__(self) -> None:
        from pdwire.runtime.control_auth import ControlAuth  # imports this module

        if self.control_auth is not None and not isinstance(self.control_auth, ControlAuth):
            raise ConfigError(
                f"{type(self).__name__}.control_auth must be a ControlAuth, "
                f"got {type(self.control_auth).__name__}"
            )
        if self.control_auth is not None and self.insecure_control:
            raise ConfigError(f"{type(self).__name__}: control_auth and insecure_control exclude each other")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ConfigError(
                f"{type(self).__name__}.engine_id must be a non-empty string, got {self.engine_id!r}"
            )
        if not isinstance(self.rank, ParallelRank):
            raise ConfigError(
                f"{type(self).__name__}.rank must be a ParallelRank, got {type(self.rank).__name__}"
            )
        if self.rank.cp_size > 1:
            # the planner has no model of a sequence split across CP ranks yet
            raise ConfigError(
                f"{type(self).__name__}.rank: context parallelism (cp_size={self.rank.cp_size}) "
                "is not supported"
            )
        if not isinstance(self.model, wire.ModelFingerprint):
            raise ConfigError(f"{type(self).__name__}.model must be a ModelFingerprint")
        _positive(self, "room_timeout_s")
        _positive(self, "transfer_timeout_s")
        for v in self.versions:
            # a version this build does not speak is allowed (it is refused at the handshake, by
            # name): tests offer one to play a peer of another release
            if not (isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, int) and x >= 0 for x in v)):
                raise ConfigError(f"{type(self).__name__}.versions: {v!r} is not a (major, minor) pair")

    def agent_name(self, role: str, pid: int) -> str:
        """The backend agent name used when none is given in ``backend_options``."""
        name = self.backend_options.get("agent_name")
        return str(name) if name else f"{self.engine_id}-{role}{self.rank.engine_rank}-{pid}"


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(WorkerConfig):
    """A prefill rank: its ROUTER binds ``bind`` (``tcp://HOST:PORT``, port 0 = any free port) and
    decode ranks are told ``advertise`` (default: the bound address; a wildcard bind needs one;
    ``tcp://HOST`` without a port takes the bound port). ``staging_bytes``: the bounded staging
    buffer where parts of many small descriptors are gathered and written in few large ones
    (0 turns staging off; ``pdwire.runtime.staging``)."""

    bind: str = "tcp://127.0.0.1:0"
    advertise: str | None = None
    staging_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        super().__post_init__()
        _byte_count(self, "staging_bytes")
        bind = TcpEndpoint.parse(self.bind, "PrefillConfig.bind")
        if self.advertise is not None:
            TcpEndpoint.parse(self.advertise, "PrefillConfig.advertise", port_optional=True)
        elif bind.is_wildcard:
            raise ConfigError(
                f"PrefillConfig.bind {self.bind!r} listens on every interface; give `advertise` "
                "(the address decode ranks connect to)"
            )

    def bind_endpoint(self) -> TcpEndpoint:
        return TcpEndpoint.parse(self.bind, "PrefillConfig.bind")

    def advertised(self, bound_port: int) -> str:
        """The address decode ranks connect to, once the socket is bound to ``bound_port``."""
        if self.advertise is None:
            return str(self.bind_endpoint().with_port(bound_port))
        adv = TcpEndpoint.parse(self.advertise, "PrefillConfig.advertise", port_optional=True)
        return str(adv if adv.port else adv.with_port(bound_port))


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(WorkerConfig):
    """A decode rank: it connects to prefill ranks (no listening socket). ``advertise`` is the name
    it gives itself in RegisterInfo and TransferRequests (default ``decode:<engine>/<rank>``);
    ``fence_timeout_s``: how long past the room's deadline a failed room's slots wait for a silent
    prefill rank before it is revoked (default twice the room timeout); ``peer_timeout_s``: a
    prefill rank whose control connection answers no heartbeat for that long is lost (its rooms
    fail at once and it is revoked; the rank reconnects in the background). ``scatter_bytes``:
    the receive staging buffer (0 turns decode-side scatter off; docs/engine-api.md)."""

    advertise: str | None = None
    handshake_timeout_s: float = 30.0
    fence_timeout_s: float | None = None
    peer_timeout_s: float = 5.0
    scatter_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        super().__post_init__()
        _byte_count(self, "scatter_bytes")
        _positive(self, "handshake_timeout_s")
        _positive(self, "fence_timeout_s", optional=True)
        _positive(self, "peer_timeout_s")

    def advertised(self) -> str:
        return self.advertise or f"decode:{self.engine_id}/{self.rank.engine_rank}"
