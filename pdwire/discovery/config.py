"""Discovery from one spec string (a flag or ``PDWIRE_DISCOVERY``):
``etcd://HOST[:PORT][,...][/PREFIX][?ttl=S]`` or ``static:PATH`` (docs/deployment.md's table).
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs

from pdwire import wire
from pdwire.discovery.base import Discovery, DiscoveryError
from pdwire.discovery.entry import DEFAULT_PREFIX, ROLES, RankEntry, check_prefix
from pdwire.discovery.etcd import DEFAULT_TTL_S, EtcdDiscovery
from pdwire.discovery.static import StaticDiscovery
from pdwire.runtime.endpoints import EndpointError, parse_host_port

ENV = "PDWIRE_DISCOVERY"


def open_discovery(
    spec: str | None = None,
    *,
    roles: tuple[wire.Role, ...] = ROLES,
    static: list[RankEntry] | None = None,
) -> Discovery:
    """The discovery ``spec`` names (default: ``$PDWIRE_DISCOVERY``; with neither, ``static``'s entries)."""
    spec = spec if spec is not None else os.environ.get(ENV, "")
    if not spec:
        return StaticDiscovery(static or [], roles=roles)
    if spec.startswith("static:"):
        path = spec[len("static:") :]
        if not path:
            raise DiscoveryError("static: needs a file path (static:/etc/pdwire/ranks.yaml)")
        return StaticDiscovery(static or [], path=path, roles=roles)
    if spec.startswith("etcd://"):
        rest = spec[len("etcd://") :]
        rest, _, query = rest.partition("?")
        hosts, slash, prefix = rest.partition("/")
        prefix = f"/{prefix}" if slash and prefix else DEFAULT_PREFIX
        try:
            check_prefix(prefix)
            endpoints = [str(parse_host_port(h, default_port=2379)) for h in hosts.split(",") if h]
        except (ValueError, EndpointError) as exc:
            raise DiscoveryError(f"discovery {spec!r}: {exc}") from None
        if not endpoints:
            raise DiscoveryError(f"discovery {spec!r}: no etcd endpoint")
        params = parse_qs(query, strict_parsing=False)
        unknown = set(params) - {"ttl"}
        if unknown:
            raise DiscoveryError(f"discovery {spec!r}: unknown options {sorted(unknown)} (known: ttl)")
        ttl_text = params.get("ttl", [str(DEFAULT_TTL_S)])[-1]
        if not ttl_text.isdigit() or int(ttl_text) < 2:
            raise DiscoveryError(f"discovery {spec!r}: ttl must be a whole number of seconds >= 2")
        return EtcdDiscovery(endpoints, prefix=prefix, roles=roles, ttl_s=int(ttl_text))
    raise DiscoveryError(f"discovery {spec!r}: expected etcd://host:port[/prefix] or static:PATH")
