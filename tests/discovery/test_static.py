"""Static discovery (file or flags) and the discovery spec strings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdwire import wire
from pdwire.discovery import (
    DiscoveryError,
    EtcdDiscovery,
    Joined,
    StaticDiscovery,
    open_discovery,
    parse_engine_flag,
)
from pdwire.discovery.membership import RegistryBack, RegistryLost

SHORT = """
engines:
  prefill:
    prefill-a: [tcp://10.0.0.1:17000, tcp://10.0.0.1:17001]
ranks:
  - {role: prefill, engine_id: prefill-b, geometry: {tp_size: 1, tp_rank: 0},
     control: "tcp://10.0.0.2:17000", backend: mooncake}
"""


def _touch_later(p: Path, text: str) -> None:
    st = p.stat()
    p.write_text(text)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a visibly newer mtime


def test_file_forms(tmp_path: Path) -> None:
    f = tmp_path / "ranks.yaml"
    f.write_text(SHORT)
    disc = open_discovery(f"static:{f}")
    assert isinstance(disc, StaticDiscovery)
    changes = disc.poll()
    assert sorted(c.entry.label for c in changes if isinstance(c, Joined)) == [
        "prefill prefill-a tp0.pp0",
        "prefill prefill-a tp1.pp0",
        "prefill prefill-b tp0.pp0",
    ]
    groups = disc.membership.complete_groups(wire.Role.PREFILL)
    assert groups["prefill-a"].control_endpoints() == ["tcp://10.0.0.1:17000", "tcp://10.0.0.1:17001"]
    assert groups["prefill-b"].backend == "mooncake"
    assert disc.poll() == []


def test_an_edited_file_is_a_new_snapshot_and_a_broken_one_keeps_the_view(tmp_path: Path) -> None:
    f = tmp_path / "ranks.yaml"
    f.write_text(SHORT)
    disc = StaticDiscovery(path=f)
    disc.poll()
    _touch_later(f, "engines: {prefill: {prefill-a: [tcp://10.0.0.1:17000]}}\n")
    changes = disc.poll()
    # prefill-a shrank to TP 1 (its tp0 entry changed, tp1 left), prefill-b is gone
    assert sorted((type(c).__name__, c.key) for c in changes) == [
        ("Left", "/pdwire/prefill/prefill-a/tp1.pp0"),
        ("Left", "/pdwire/prefill/prefill-b/tp0.pp0"),
        ("Updated", "/pdwire/prefill/prefill-a/tp0.pp0"),
    ]
    assert list(disc.membership.complete_groups(wire.Role.PREFILL)) == ["prefill-a"]
    _touch_later(f, "engines: {prefill: {prefill-a: [tcp://0.0.0.0:17000]}}\n")
    [lost] = disc.poll()
    assert isinstance(lost, RegistryLost) and "wildcard" in lost.reason
    assert list(disc.membership.complete_groups(wire.Role.PREFILL)) == ["prefill-a"]
    _touch_later(f, SHORT)
    changes = disc.poll()
    assert isinstance(changes[-1], RegistryBack)
    assert sorted(disc.membership.complete_groups(wire.Role.PREFILL)) == ["prefill-a", "prefill-b"]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("engines: {router: {x: [tcp://a:1]}}", "role 'router'"),
        ("engines: {prefill: {x: []}}", "non-empty list"),
        ("engines: {prefill: {x: [tcp://a:0]}}", "port 0"),
        ("ranks: [{role: prefill}]", "ranks[0]"),
        ("nodes: []", "unknown top-level keys"),
        ("[1, 2", "not valid YAML"),
    ],
)
def test_a_bad_file_at_start_names_file_and_entry(tmp_path: Path, text: str, named: str) -> None:
    f = tmp_path / "ranks.yaml"
    f.write_text(text)
    with pytest.raises(DiscoveryError) as info:
        StaticDiscovery(path=f)
    assert str(f) in str(info.value) and named in str(info.value)


def test_a_rank_listed_twice_is_refused(tmp_path: Path) -> None:
    entries = parse_engine_flag(wire.Role.PREFILL, "a=tcp://h:1")
    with pytest.raises(DiscoveryError, match="listed twice"):
        StaticDiscovery([*entries, *entries])


def test_flags() -> None:
    entries = parse_engine_flag(wire.Role.PREFILL, "prefill-a=tcp://10.0.0.1:1,tcp://10.0.0.1:2")
    assert [(e.geometry.tp_size, e.geometry.tp_rank, e.control) for e in entries] == [
        (2, 0, "tcp://10.0.0.1:1"),
        (2, 1, "tcp://10.0.0.1:2"),
    ]
    for bad in ["prefill-a", "prefill-a=", "prefill-a=tcp://*:1", "a/b=tcp://h:1"]:
        with pytest.raises(DiscoveryError):
            parse_engine_flag(wire.Role.PREFILL, bad)
    disc = open_discovery("", static=entries)
    assert disc.poll() and disc.membership.complete_groups(wire.Role.PREFILL)["prefill-a"]


def test_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    disc = open_discovery("etcd://127.0.0.1:1,127.0.0.2/dc1/pd?ttl=5")
    try:
        assert isinstance(disc, EtcdDiscovery)
        assert [str(e) for e in disc.endpoints] == ["127.0.0.1:1", "127.0.0.2:2379"]
        assert disc.prefix == "/dc1/pd" and disc.ttl_s == 5
    finally:
        disc.close()
    monkeypatch.setenv("PDWIRE_DISCOVERY", "etcd://127.0.0.1:1")
    disc = open_discovery()
    try:
        assert isinstance(disc, EtcdDiscovery) and disc.prefix == "/pdwire"
    finally:
        disc.close()
    for bad, named in [
        ("consul://x", "expected etcd://"),
        ("etcd://", "no etcd endpoint"),
        ("etcd://h:1/a/", "prefix"),
        ("etcd://h:1?ttl=1", "ttl"),
        ("etcd://h:1?lease=1", "unknown options"),
        ("etcd://h:x", "port"),
        ("static:", "file path"),
    ]:
        with pytest.raises(DiscoveryError, match=named):
            open_discovery(bad)
