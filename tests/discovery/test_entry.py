"""Registry entries are untrusted input: strict types, every rule named, nothing else escapes."""

from __future__ import annotations

import contextlib
import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdwire import wire
from pdwire.discovery import Geometry, RankEntry, RegistryEntryError, decode_entry, encode_entry
from pdwire.discovery.entry import entry_from_dict, rank_name
from pdwire.runtime.endpoints import EndpointError, HostPort, check_advertisable, parse_host_port

ENTRY = RankEntry(
    role=wire.Role.PREFILL,
    engine_id="prefill-a",
    geometry=Geometry(tp_size=2, tp_rank=1),
    control="tcp://10.0.0.1:17001",
    incarnation="host-a:1234:1",
    backend="nixl",
    protocol=("1.3",),
    model="tiny@rev1 bf16",
)


def _as_json(entry: RankEntry = ENTRY) -> dict[str, object]:
    data: dict[str, object] = json.loads(encode_entry(entry)[1])
    return data


def _decode(data: object, key: str = "/pdwire/prefill/prefill-a/tp1.pp0") -> RankEntry:
    return decode_entry(key, json.dumps(data).encode())


def test_round_trip_and_key() -> None:
    key, value = encode_entry(ENTRY)
    assert key == "/pdwire/prefill/prefill-a/tp1.pp0"
    assert decode_entry(key, value) == ENTRY
    key2, _ = encode_entry(ENTRY, prefix="/dc1/pd")
    assert key2 == "/dc1/pd/prefill/prefill-a/tp1.pp0"


def test_rank_names_only_mention_axes_in_use() -> None:
    assert rank_name(Geometry(4, 3)) == "tp3.pp0"
    assert rank_name(Geometry(4, 3, pp_size=2, pp_rank=1, cp_size=2, cp_rank=1)) == "tp3.pp1.cp1"
    assert rank_name(Geometry(1, 0, dp_size=4, dp_rank=2)) == "tp0.pp0.dp2"


def test_unknown_fields_are_ignored_so_a_later_writer_may_add_some() -> None:
    data = {**_as_json(), "zone": "eu-1"}
    assert _decode(data) == ENTRY


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"geometry": {"tp_size": "2", "tp_rank": 1}}, "$.geometry.tp_size"),  # no coercion
        ({"role": "router"}, "$.role"),
        ({"control": 17001}, "$.control"),
        ({"protocol": "1.3"}, "$.protocol"),
        ({"geometry": {"tp_size": 2, "tp_rank": 2}}, "geometry.tp_rank"),
        ({"geometry": {"tp_size": 0, "tp_rank": 0}}, "geometry.tp_size"),
        ({"geometry": {"tp_size": 2, "tp_rank": 1, "pp_size": 2, "pp_rank": -1}}, "geometry.pp_rank"),
        ({"control": "tcp://0.0.0.0:17001"}, "wildcard"),
        ({"control": "tcp://10.0.0.1:0"}, "port 0"),
        ({"control": "10.0.0.1:17001"}, "tcp://host:port"),
        ({"control": "tcp://10.0.0.1:99999"}, "outside 0..65535"),
        ({"control": "tcp://bad_host!:1"}, "neither an IP address nor a host name"),
        ({"engine_id": "a/b"}, "RankEntry.engine_id"),
        ({"incarnation": ""}, "RankEntry.incarnation"),
        ({"protocol": ["1.x"]}, "RankEntry.protocol"),
        ({"format": 2}, "format 2"),
        ({"pid": -1}, "RankEntry.pid"),
    ],
)
def test_each_rule_is_refused_by_name(change: dict[str, object], named: str) -> None:
    with pytest.raises(RegistryEntryError) as info:
        _decode({**_as_json(), **change})
    assert named in str(info.value)
    assert info.value.key == "/pdwire/prefill/prefill-a/tp1.pp0"


def test_only_prefill_ranks_must_advertise_a_control_endpoint() -> None:
    with pytest.raises(RegistryEntryError, match=r"RankEntry\.control"):
        _decode({**_as_json(), "control": ""})
    dec = {**_as_json(), "role": "decode", "control": ""}
    assert _decode(dec, key="/pdwire/decode/prefill-a/tp1.pp0").control == ""


def test_a_key_that_disagrees_with_its_entry_is_refused() -> None:
    with pytest.raises(RegistryEntryError, match="key and entry disagree"):
        _decode(_as_json(), key="/pdwire/prefill/prefill-a/tp0.pp0")
    with pytest.raises(RegistryEntryError, match="key and entry disagree"):
        _decode(_as_json(), key="/pdwire/decode/prefill-a/tp1.pp0")


def test_oversized_and_non_json_values_are_refused() -> None:
    with pytest.raises(RegistryEntryError, match="bytes"):
        decode_entry("/pdwire/prefill/x/tp0.pp0", b" " * 20000)
    with pytest.raises(RegistryEntryError, match="not a JSON object"):
        decode_entry("/pdwire/prefill/x/tp0.pp0", b"\xff{")
    with pytest.raises(RegistryEntryError, match="RankEntry"):
        decode_entry("/pdwire/prefill/x/tp0.pp0", b"[1, 2]")


def test_this_rank_never_writes_what_peers_refuse() -> None:
    bad = msgspec.structs.replace(ENTRY, control="tcp://0.0.0.0:1")
    with pytest.raises(RegistryEntryError, match="wildcard"):
        encode_entry(bad)
    with pytest.raises(ValueError, match="prefix"):
        encode_entry(ENTRY, prefix="pdwire/")


def test_entries_from_parsed_data_get_the_same_checks() -> None:
    assert entry_from_dict(_as_json(), "ranks[0]") == ENTRY
    with pytest.raises(RegistryEntryError, match=r"ranks\[0\].*geometry.tp_rank"):
        entry_from_dict({**_as_json(), "geometry": {"tp_size": 1, "tp_rank": 1}}, "ranks[0]")


@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_registry_entry_errors(value: bytes) -> None:
    with contextlib.suppress(RegistryEntryError):
        decode_entry("/pdwire/prefill/prefill-a/tp1.pp0", value)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@given(st.sampled_from(sorted(_as_json())), _json)
def test_any_field_replaced_by_any_json_raises_only_registry_entry_errors(field: str, value: object) -> None:
    with contextlib.suppress(RegistryEntryError):
        _decode({**_as_json(), field: value})


def test_addresses() -> None:
    assert parse_host_port("10.0.0.1:80") == HostPort("10.0.0.1", 80)
    assert parse_host_port("[fd00::1]:80") == HostPort("fd00::1", 80)
    assert str(HostPort("fd00::1", 80)) == "[fd00::1]:80"
    assert HostPort("fd00::1", 80).zmq == "tcp://[fd00::1]:80"
    assert parse_host_port("etcd-0.svc", default_port=2379) == HostPort("etcd-0.svc", 2379)
    assert parse_host_port("0.0.0.0:0").is_wildcard
    for bad in ["", "host", "h:x", "h:080", "fd00::1:80", "[fd00::1", "[h]:1", "a b:1"]:
        with pytest.raises(EndpointError):
            parse_host_port(bad)
    with pytest.raises(EndpointError, match="wildcard"):
        check_advertisable(parse_host_port("[::]:5"), "control endpoint")
