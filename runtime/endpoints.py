"""Network addresses as pdwire spells them: ``host:port`` and ZMQ's ``tcp://host:port``.

Pure parsing and checks, no sockets. Two kinds of address exist for every listener: the
*bind* address (where the socket listens: a wildcard such as ``0.0.0.0`` or ``[::]`` is
fine, port 0 picks a free port) and the *advertised* address (what peers are told to
connect to: a concrete host and port, never a wildcard). :func:`check_advertisable` is the
rule every address that leaves this process (a registry entry, a Hello, a RegisterInfo)
passes through.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*$"
)
_WILDCARDS = {"*", "0.0.0.0", "::"}


class EndpointError(ValueError):
    """An address that cannot be parsed, or one used where it cannot work (a wildcard advertised)."""


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str  # an IPv4 or IPv6 literal (without brackets) or a DNS name
    port: int  # 0 = pick a free port (bind addresses only)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def zmq(self) -> str:
        """The ZMQ endpoint: ``tcp://host:port`` (IPv6 hosts in brackets)."""
        return f"tcp://{self}"

    @property
    def is_wildcard(self) -> bool:
        return self.host in _WILDCARDS


def _check_host(host: str, text: str) -> str:
    if host in _WILDCARDS:
        return host
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if _HOSTNAME.match(host):
        return host
    raise EndpointError(f"{text!r}: {host!r} is neither an IP address nor a host name")


def parse_host_port(text: str, *, default_port: int | None = None) -> HostPort:
    """``host:port``, ``[v6]:port``, or a bare host when ``default_port`` is given."""
    if not isinstance(text, str) or not text:
        raise EndpointError(f"{text!r}: an address must be a non-empty host:port string")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise EndpointError(f"{text!r}: unclosed '[' in an IPv6 address")
        host, rest = text[1:end], text[end + 1 :]
        if ":" not in host:
            raise EndpointError(f"{text!r}: brackets are for IPv6 addresses only")
        if rest and not rest.startswith(":"):
            raise EndpointError(f"{text!r}: expected ':port' after ']'")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise EndpointError(f"{text!r}: write an IPv6 address with a port as [addr]:port")
    else:
        host, port_text = text, None
    if port_text is None:
        if default_port is None:
            raise EndpointError(f"{text!r}: no port (host:port expected)")
        port = default_port
    else:
        if not port_text.isdigit() or (len(port_text) > 1 and port_text[0] == "0"):
            raise EndpointError(f"{text!r}: port {port_text!r} is not a decimal number")
        port = int(port_text)
    if not 0 <= port <= 65535:
        raise EndpointError(f"{text!r}: port {port} is outside 0..65535")
    return HostPort(_check_host(host, text), port)


def parse_zmq_endpoint(text: str) -> HostPort:
    """``tcp://host:port`` (the only ZMQ transport pdwire peers use between hosts)."""
    if not isinstance(text, str) or not text.startswith("tcp://"):
        raise EndpointError(f"{text!r}: a control endpoint must be tcp://host:port")
    return parse_host_port(text[len("tcp://") :])


def check_advertisable(addr: HostPort, what: str) -> HostPort:
    """``addr`` if a peer can connect to it; otherwise an :class:`EndpointError` naming ``what``."""
    if addr.is_wildcard:
        raise EndpointError(
            f"{what} {addr} is a wildcard: it can be bound, not advertised; "
            "give the address peers reach this host at"
        )
    if addr.port == 0:
        raise EndpointError(f"{what} {addr} has port 0: advertise the port that was bound")
    return addr
