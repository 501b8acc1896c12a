"""A pdwire SGLang rank's backend options, derived from SGLang's own flags and environment.

The rank's host and the IB devices come from SGLang 0.5.23's real ``ServerArgs`` (its runtime
context, as the manager reads them) and, for the managers, from ``KVArgs`` filled by SGLang's own
``_init_kv_manager``; RDMA devices live under a ``/sys/class`` laid out in a temporary folder
(this machine has none), network interfaces are this namespace's own.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

warnings.filterwarnings("ignore")

from pdwire.integrations.sglang.backend_options import (  # noqa: E402
    BackendFlagError,
    advertised_host,
    derived_options,
    ib_device_names,
    rank_backend_options,
)
from tests.sglang.backend import harness as h  # noqa: E402


@pytest.fixture(scope="module")
def sglang() -> Any:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    return get_kv_class(TransferBackend("pdwire"), KVClassType.BOOTSTRAP_SERVER)


@pytest.fixture
def sys_class(tmp_path: Path) -> Path:
    """A /sys/class with two RDMA devices."""
    for dev in ("mlx5_0", "mlx5_1"):
        (tmp_path / "infiniband" / dev).mkdir(parents=True)
    return tmp_path


@pytest.fixture
def own_ip(monkeypatch: pytest.MonkeyPatch) -> str:
    """The address SGLang's ``get_local_ip_auto`` finds here, without the suite's SGLANG_HOST_IP."""
    from sglang.srt.utils.network import get_local_ip_auto

    monkeypatch.delenv("SGLANG_HOST_IP", raising=False)
    monkeypatch.delenv("HOST_IP", raising=False)
    ip = get_local_ip_auto()
    assert ip and not ip.startswith("127."), f"this host has no non-loopback address ({ip!r})"
    return str(ip)


def _flags(**server_args: Any) -> tuple[str, str | None]:
    """(``--host``, ``--disaggregation-ib-device``) as a scheduler rank's runtime context has them."""
    from sglang.srt.runtime_context import SpawnRanks, create_context, get_disagg, get_serving, use_context

    sa = h._server_args("decode", 1, h.free_port(), h.free_port(), **server_args)
    with use_context(create_context(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))):
        return get_serving().host, get_disagg().disaggregation_ib_device


def _host(env: dict[str, str], **server_args: Any) -> str:
    from sglang.srt.utils.network import get_local_ip_auto

    host, _ = _flags(**server_args)
    return advertised_host(host, lambda: get_local_ip_auto(), env)


def test_the_rank_host_comes_from_sglang_host_ip_then_host_then_sglangs_own_finding(
    sglang: Any, own_ip: str
) -> None:
    nic = own_ip
    assert _host({}, host="10.9.8.7") == "10.9.8.7"  # one address: where peers reach this host
    for where in ("0.0.0.0", "127.0.0.1", "localhost", "::"):  # the HTTP server's, not the host's
        assert _host({}, host=where) == nic, where
    # SGLang's own override wins over --host, as for its own backends
    assert _host({"SGLANG_HOST_IP": "10.1.1.1"}, host="10.9.8.7") == "10.1.1.1"
    assert _host({"HOST_IP": "10.1.1.2"}, host="0.0.0.0") == "10.1.1.2"


def test_mooncake_tcp_without_a_device_rdma_on_the_devices_named(sys_class: Path) -> None:
    def derive(devices: list[str], env: dict[str, str] | None = None, **explicit: str) -> dict[str, Any]:
        return derived_options("mooncake", "10.0.0.5", devices, env or {}, explicit, sys_class)

    assert derive([]) == {"hostname": "10.0.0.5", "protocol": "tcp"}
    assert derive(["mlx5_0", "mlx5_1"]) == {
        "hostname": "10.0.0.5", "protocol": "rdma", "device_name": "mlx5_0,mlx5_1",
    }  # fmt: skip
    # SGLang's own variables: MC_FORCE_TCP=1 (no device), MOONCAKE_PROTOCOL
    assert derive(["mlx5_0"], {"MC_FORCE_TCP": "1"}) == {"hostname": "10.0.0.5", "protocol": "tcp"}
    assert derive([], {"MOONCAKE_PROTOCOL": "efa"})["protocol"] == "efa"
    with pytest.raises(BackendFlagError, match=r"ib-device names 'eth0', which is not an RDMA"):
        derive(["mlx5_0", "eth0"])
    # what the operator gave is not derived (a device it replaces is not checked)
    assert derive(["nosuch"], protocol="tcp") == {"hostname": "10.0.0.5"}
    assert derive(["mlx5_1"], device_name="mlx5_0", hostname="h") == {"protocol": "rdma"}


def test_nixl_devices_from_the_flag_unless_ucx_net_devices_is_set(sys_class: Path) -> None:
    def derive(devices: list[str], env: dict[str, str] | None = None, **explicit: str) -> dict[str, Any]:
        return derived_options("nixl", "10.0.0.5", devices, env or {}, explicit, sys_class)

    assert derive([]) == {}  # UCX's own choice
    assert derive(["mlx5_0", "lo"]) == {"net_devices": "mlx5_0:1,lo"}  # RDMA on port 1, an interface as named
    assert derive(["mlx5_1:2"]) == {"net_devices": "mlx5_1:2"}
    assert derive(["lo"], {"UCX_NET_DEVICES": "eth0"}) == {}  # SGLang's NIXL ignores the flag then too
    with pytest.raises(BackendFlagError, match="names 'nosuch0'"):
        derive(["nosuch0"], {"UCX_NET_DEVICES": "eth0"})  # but a bad one is refused all the same
    with pytest.raises(BackendFlagError, match=r"'nosuch0', which is neither .*network interfaces: .*lo"):
        derive(["lo", "nosuch0"])
    with pytest.raises(BackendFlagError, match="names 'lo:1'"):
        derive(["lo:1"])  # a port belongs to an RDMA device
    assert derive(["nosuch0"], net_devices="lo") == {}
    assert derived_options("local", "10.0.0.5", ["nosuch0"], {}) == {}  # nothing to derive, nothing checked


def test_devices_of_the_ranks_gpu_from_sglangs_flag_forms(sys_class: Path, tmp_path: Path) -> None:
    assert ib_device_names(None, 0) == [] and ib_device_names(" ", 0) == []
    assert ib_device_names("mlx5_0, mlx5_1", 3) == ["mlx5_0", "mlx5_1"]
    mapping = {"0": "mlx5_0", "1": "mlx5_1, mlx5_0"}
    assert ib_device_names(json.dumps(mapping), 1) == ["mlx5_1", "mlx5_0"]
    path = tmp_path / "ib.json"
    path.write_text(json.dumps(mapping))
    assert ib_device_names(str(path), 0) == ["mlx5_0"]
    with pytest.raises(BackendFlagError, match="No IB devices configured for GPU 2"):
        ib_device_names(json.dumps(mapping), 2)
    env = {"PDWIRE_BACKEND_OPTIONS": "max_batch=64, threads_per_peer=3"}
    got = rank_backend_options("mooncake", "10.0.0.5", json.dumps(mapping), 1, env, sys_class)
    assert got == {
        "hostname": "10.0.0.5", "protocol": "rdma", "device_name": "mlx5_1,mlx5_0",
        "max_batch": "64", "threads_per_peer": "3",
    }  # fmt: skip


def test_real_managers_build_their_backends_from_sglangs_flags(
    sglang: Any, own_ip: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's ``_init_kv_manager`` and ServerArgs: a Mooncake prefill rank with ``--host`` binds,
    registers and advertises that address (its Mooncake session too); a NIXL decode rank with
    ``--disaggregation-ib-device lo`` gets UCX's devices from it; a device that is not on this
    host is refused at start-up by name."""
    nic = own_ip
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.delenv("PDWIRE_BACKEND_OPTIONS", raising=False)
    bport = h.free_port()
    server = sglang(host=nic, port=bport)
    ranks: list[h.Rank] = []
    try:
        monkeypatch.setenv("PDWIRE_SGLANG_BACKEND", "mooncake")
        ranks.append(h.make_rank("prefill", 1, 0, bport, h.free_port(), host=nic))
        mgr = ranks[-1].manager
        assert mgr.backend_options == {"hostname": nic, "protocol": "tcp"}
        assert mgr.worker.endpoint.startswith(f"tcp://{nic}:")
        assert mgr.worker.backend.session_name.startswith(f"{nic}:")
        import requests

        route = requests.get(
            f"http://{nic}:{bport}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
            timeout=5,
        ).json()
        assert route["rank_ip"] == nic
        monkeypatch.setenv("PDWIRE_SGLANG_BACKEND", "nixl")
        monkeypatch.setenv("PDWIRE_BACKEND_OPTIONS", "transports=tcp")
        ranks.append(
            h.make_rank("decode", 1, 0, bport, h.free_port(), host=nic, disaggregation_ib_device="lo")
        )
        assert ranks[-1].manager.backend_options == {"net_devices": "lo", "transports": "tcp"}
        assert ranks[-1].manager.worker.backend.net_devices == "lo"
        with pytest.raises(ValueError, match=r"--disaggregation-ib-device names 'nosuch0'"):
            h.make_rank("decode", 1, 0, bport, h.free_port(), disaggregation_ib_device="nosuch0")
        monkeypatch.setenv("PDWIRE_BACKEND_OPTIONS", "net_devices=lo")  # the operator's own: not checked
        ranks.append(h.make_rank("decode", 1, 0, bport, h.free_port(), disaggregation_ib_device="nosuch0"))
        assert ranks[-1].manager.backend_options == {"net_devices": "lo"}
    finally:
        for rank in ranks:
            rank.manager.teardown()
        server.close()
