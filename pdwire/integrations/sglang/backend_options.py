"""A pdwire SGLang rank's backend options, derived from SGLang's own flags and environment.

SGLang's Mooncake and NIXL backends find the rank's address and NICs themselves; pdwire's
backends take them as options (``pdwire.runtime.backends.options``). What is derived, from what
(docs/sglang.md, "Across hosts"):

* **The rank's host** (where its pdwire control socket binds and what it advertises, and
  Mooncake's ``hostname``): ``SGLANG_HOST_IP`` / ``HOST_IP`` when set (SGLang's own override
  for every backend); else ``--host`` when it is one IP address (not a wildcard, not loopback:
  those say where the HTTP server listens, not where peers reach this host); else the address
  SGLang's ``get_local_ip_auto`` finds, as SGLang's own backends use. ``--dist-init-addr`` is
  not used: it is the first node's address, not this rank's on the other nodes.
* **Mooncake**: ``protocol`` rdma when ``--disaggregation-ib-device`` names devices, else tcp
  (``MOONCAKE_PROTOCOL`` when it is set, and tcp under ``MC_FORCE_TCP=1``, as in SGLang);
  ``device_name`` those devices (for rdma only).
* **NIXL**: ``net_devices`` (UCX_NET_DEVICES) those devices, an RDMA device on port 1 unless a
  port is named (as NIXL's own device list does), a network interface as named; unless
  ``UCX_NET_DEVICES`` is set, which wins as it does for SGLang's NIXL backend (the flag is
  still checked).
* The devices of the rank's GPU are read with SGLang's own ``get_ib_devices_for_gpu`` (a list,
  or a per-GPU JSON mapping or file). Each must exist on this host: an RDMA device under
  ``/sys/class/infiniband``, a network interface in this network namespace; another is refused
  at start-up by name.
* ``PDWIRE_BACKEND_OPTIONS`` (the operator's explicit options) wins over everything derived.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdwire.runtime.backends.options import declared_options, options_from_env

logger = logging.getLogger(__name__)

SYS_CLASS = Path("/sys/class")
FLAG = "--disaggregation-ib-device"


class BackendFlagError(ValueError):
    """A flag or variable the rank's backend options are derived from names something unusable."""


def advertised_host(serving_host: str | None, local_ip: Callable[[], str], environ: Mapping[str, str]) -> str:
    """The address this rank's peers reach it at (see the module notes)."""
    explicit = environ.get("SGLANG_HOST_IP") or environ.get("HOST_IP")
    if explicit:
        return explicit
    if serving_host:
        try:
            ip = ipaddress.ip_address(serving_host.strip("[]"))
        except ValueError:
            ip = None  # a host name: SGLang's own address finding
        if ip is not None and not ip.is_unspecified and not ip.is_loopback:
            return str(ip)
    return local_ip()


def _rdma_devices(sys_class: Path) -> set[str]:
    try:
        return set(os.listdir(sys_class / "infiniband"))
    except OSError:  # no RDMA stack: no RDMA devices
        return set()


def _interfaces() -> set[str]:
    return {name for _, name in socket.if_nameindex()}


def _refuse(name: str, why: str, rdma: set[str], nets: set[str] | None) -> BackendFlagError:
    have = f"RDMA devices: {', '.join(sorted(rdma)) or 'none'}"
    if nets is not None:
        have += f"; network interfaces: {', '.join(sorted(nets))}"
    return BackendFlagError(f"pdwire: {FLAG} names {name!r}, {why} ({have})")


def ucx_devices(names: list[str], sys_class: Path = SYS_CLASS) -> str:
    """``names`` as UCX_NET_DEVICES: an RDMA device with its port (1 unless named), a network
    interface as it is; a name that is neither on this host is refused."""
    rdma, nets = _rdma_devices(sys_class), _interfaces()
    out = []
    for name in names:
        base, sep, _ = name.partition(":")
        if base in rdma:
            out.append(name if sep else f"{base}:1")
        elif base in nets and not sep:
            out.append(name)
        else:
            why = "which is neither an RDMA device nor a network interface of this host"
            raise _refuse(name, why, rdma, nets)
    return ",".join(out)


def mooncake_devices(names: list[str], sys_class: Path = SYS_CLASS) -> str:
    """``names`` as Mooncake's RDMA ``device_name``; a name that is no RDMA device here is refused."""
    rdma = _rdma_devices(sys_class)
    for name in names:
        if name.partition(":")[0] not in rdma:
            why = "which is not an RDMA device of this host (Mooncake's rdma protocol)"
            raise _refuse(name, why, rdma, None)
    return ",".join(names)


def ib_device_names(ib_device: str | None, gpu_id: int) -> list[str]:
    """The devices ``--disaggregation-ib-device`` gives the rank's GPU (SGLang's own parsing: a
    list, a per-GPU JSON mapping or a JSON file); empty when the flag is not given."""
    if not ib_device or not str(ib_device).strip():
        return []
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        get_ib_devices_for_gpu,
    )

    try:
        devices = get_ib_devices_for_gpu(str(ib_device), int(gpu_id))
    except (ValueError, RuntimeError) as exc:
        raise BackendFlagError(f"pdwire: {FLAG} {ib_device!r}: {exc}") from None
    return [d.strip() for d in (devices or "").split(",") if d.strip()]


def mooncake_protocol(devices: list[str], environ: Mapping[str, str]) -> str:
    if environ.get("MC_FORCE_TCP") == "1":
        return "tcp"
    explicit = environ.get("MOONCAKE_PROTOCOL", "").strip()
    if explicit:
        return explicit
    return "rdma" if devices else "tcp"


def derived_options(
    backend: str,
    host: str,
    devices: list[str],
    environ: Mapping[str, str],
    explicit: Mapping[str, Any] | None = None,
    sys_class: Path = SYS_CLASS,
) -> dict[str, Any]:
    """What SGLang's flags imply for backend ``backend``: only options it declares and the
    operator did not give (``explicit``; a device they replace is not checked)."""
    given = dict(explicit or {})
    every = declared_options(backend)
    declared = {k for k in every if k not in given}
    out: dict[str, Any] = {}
    for name in ("hostname", "host"):  # Mooncake's, MoRI's: the address peers are told
        if name in declared:
            out[name] = host
    if {"protocol", "device_name"} <= set(every):  # Mooncake
        protocol = str(given.get("protocol") or mooncake_protocol(devices, environ))
        if "protocol" in declared:
            out["protocol"] = protocol
        if "device_name" in declared and protocol == "rdma" and devices:
            out["device_name"] = mooncake_devices(devices, sys_class)
    if "net_devices" in declared and devices:  # NIXL/UCX
        ucx = ucx_devices(devices, sys_class)  # a bad flag is refused even where it is not applied
        if environ.get("UCX_NET_DEVICES"):
            logger.warning(
                "pdwire: UCX_NET_DEVICES=%s is set; %s %s is not applied to NIXL",
                environ["UCX_NET_DEVICES"], FLAG, ",".join(devices),
            )  # fmt: skip
        else:
            out["net_devices"] = ucx
    return out


def rank_backend_options(
    backend: str,
    host: str,
    ib_device: str | None,
    gpu_id: int,
    environ: Mapping[str, str] | None = None,
    sys_class: Path = SYS_CLASS,
) -> dict[str, Any]:
    """The options a rank's backend is built with: derived from SGLang's flags, then the
    operator's ``PDWIRE_BACKEND_OPTIONS`` over them."""
    env = os.environ if environ is None else environ
    devices = ib_device_names(ib_device, gpu_id)
    explicit = options_from_env(env)
    options = {**derived_options(backend, host, devices, env, explicit, sys_class), **explicit}
    logger.info("pdwire: %s backend options %s", backend, options)
    return options
