"""Which network interface holds which address (Linux), for engines that advertise interfaces.

UCX (under NIXL) is told interface names (``UCX_NET_DEVICES``) and advertises their
addresses; operators think in addresses. :func:`interface_of` maps one to the other, and
:func:`addresses_of` the other way, for error messages that name what a peer was told.
Read from ``ip -j addr`` (every address, IPv4 and IPv6) or, without iproute2, from the
``SIOCGIFADDR`` ioctl (each interface's primary IPv4 address).
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import shutil
import socket
import struct
import subprocess

_SIOCGIFADDR = 0x8915


def _from_ip() -> dict[str, list[str]] | None:
    ip = shutil.which("ip")
    if ip is None:
        return None
    try:
        out = subprocess.run(
            [ip, "-j", "addr", "show"], capture_output=True, text=True, timeout=10, check=True
        )
        links = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    table: dict[str, list[str]] = {}
    for link in links:
        name = link.get("ifname")
        if isinstance(name, str):
            table[name] = [str(a["local"]) for a in link.get("addr_info", []) if "local" in a]
    return table


def _from_ioctl() -> dict[str, list[str]]:
    table: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                table[name] = [socket.inet_ntoa(raw[20:24])]
            except OSError:
                table[name] = []
    return table


def interfaces() -> dict[str, list[str]]:
    """Interface name -> its addresses, in this network namespace."""
    found = _from_ip()
    return found if found is not None else _from_ioctl()


def interface_of(address: str) -> str | None:
    """The interface holding ``address`` (an IP literal), or None (a host name, or not local)."""
    try:
        want = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addrs in interfaces().items():
        if any(ipaddress.ip_address(a) == want for a in addrs):
            return name
    return None


def addresses_of(devices: str) -> list[str]:
    """The addresses of a UCX device list (``eth0,mlx5_0:1``; ports after ':' are ignored)."""
    table = interfaces()
    out: list[str] = []
    for dev in filter(None, (d.strip().split(":")[0] for d in devices.split(","))):
        out += table.get(dev, [])
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
