"""Backend options: declared by each constructor, documented, converted from text, refused by name."""

from __future__ import annotations

import pytest

from pdwire.runtime.backends import create_backend
from pdwire.runtime.backends.options import (
    BackendOptionError,
    declared_options,
    describe,
    host_defaults,
    options_from_env,
    parse_pairs,
    resolve_options,
)
from pdwire.runtime.backends.registry import known_backends
from pdwire.runtime.netif import addresses_of, interface_of, interfaces, is_loopback


def test_every_option_of_every_backend_is_documented() -> None:
    for name in known_backends():
        for opt in declared_options(name).values():
            assert opt.doc, f"{name} option {opt.name} has no OPTION_DOCS entry"
        assert describe(name)


def test_host_facing_options_exist() -> None:
    assert {"hostname", "protocol", "device_name"} <= set(declared_options("mooncake"))
    assert {"net_devices", "transports"} <= set(declared_options("nixl"))
    assert {"host", "port"} <= set(declared_options("mori-fake"))
    assert declared_options("local") == {}


def test_text_is_converted_by_the_constructors_annotations() -> None:
    assert resolve_options(
        "mooncake", {"hostname": "10.0.0.1", "max_batch": "512", "connect_timeout_s": "2.5"}
    ) == {
        "hostname": "10.0.0.1",
        "max_batch": 512,
        "connect_timeout_s": 2.5,
    }
    assert resolve_options("nixl", {"ucx_params": "num_threads:4; ucx_error_handling_mode:none"}) == {
        "ucx_params": {"num_threads": "4", "ucx_error_handling_mode": "none"}
    }
    assert resolve_options("nixl", {"progress_delay_us": "None", "net_devices": "eth0"}) == {
        "progress_delay_us": None,
        "net_devices": "eth0",
    }
    assert resolve_options("mooncake", {"max_batch": 7}) == {"max_batch": 7}  # values pass as given


@pytest.mark.parametrize(
    ("backend", "options", "named"),
    [
        (
            "mooncake",
            {"hostnme": "x"},
            "has no option 'hostnme' (its options: connect_timeout_s, device_name",
        ),
        ("mooncake", {"max_batch": "lots"}, "option 'max_batch' (int): 'lots' is not an integer"),
        ("mooncake", {"max_batch": True}, "is not an integer"),
        ("mooncake", {"hostname": 5}, "is not a string"),
        ("nixl", {"ucx_params": "a=b"}, "is not key:value"),
        ("local", {"hostname": "x"}, "(its options: none)"),
    ],
)
def test_bad_options_are_refused_by_name(backend: str, options: dict[str, object], named: str) -> None:
    with pytest.raises(BackendOptionError) as info:
        resolve_options(backend, options)
    assert named in str(info.value)


def test_create_backend_checks_options_before_touching_an_engine() -> None:
    with pytest.raises(BackendOptionError, match="backend 'local' has no option 'hostname'"):
        create_backend("local", hostname="10.0.0.1")
    b = create_backend("mori-fake", host="10.0.0.9", port="0", max_rows="16")
    try:
        assert b.max_rows == 16  # type: ignore[attr-defined]
    finally:
        b.close()


def test_pairs_and_environment() -> None:
    assert parse_pairs(["hostname=10.0.0.1", "max_batch=8,protocol=tcp"]) == {
        "hostname": "10.0.0.1",
        "max_batch": "8",
        "protocol": "tcp",
    }
    with pytest.raises(BackendOptionError, match="'hostname' is not name=value"):
        parse_pairs(["hostname"])
    assert options_from_env({"PDWIRE_BACKEND_OPTIONS": "hostname=h, max_batch=4"}) == {
        "hostname": "h",
        "max_batch": "4",
    }
    assert options_from_env({}) == {}


def test_host_defaults_follow_the_advertised_address() -> None:
    assert host_defaults("mooncake", "10.0.0.1") == {"hostname": "10.0.0.1"}
    assert host_defaults("mori-fake", "10.0.0.1") == {"host": "10.0.0.1"}
    assert host_defaults("nixl", "127.0.0.1") == {}  # UCX's own default (or UCX_NET_DEVICES) stands
    assert host_defaults("nixl", "10.254.254.254") == {}  # not an address of this host
    assert host_defaults("local", "10.0.0.1") == {}
    assert host_defaults("mooncake", None) == {}
    own = [
        (dev, a) for dev, addrs in interfaces().items() for a in addrs if not is_loopback(a) and ":" not in a
    ]
    for dev, addr in own[:1]:
        assert host_defaults("nixl", addr) == {"net_devices": dev}


def test_interfaces() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert "127.0.0.1" in addresses_of("lo")
    assert addresses_of("no-such-device") == []
    assert interface_of("not-an-address") is None
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("10.0.0.1")
