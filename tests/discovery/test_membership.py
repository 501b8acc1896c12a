"""The pure membership machine: registry events in, changes and a view out."""

from __future__ import annotations

import contextlib

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pdwire import wire
from pdwire.discovery import Geometry, Joined, Left, Membership, RankEntry, decode_entry, encode_entry
from pdwire.discovery.membership import (
    Change,
    Delete,
    Put,
    Reachable,
    RegistryBack,
    RegistryEvent,
    RegistryLost,
    Rejected,
    Restarted,
    Snapshot,
    Unreachable,
    Updated,
    describe,
)


def entry(
    role: wire.Role = wire.Role.PREFILL, engine: str = "p", tp: tuple[int, int] = (2, 0), inc: str = "i1"
) -> RankEntry:
    return RankEntry(
        role=role,
        engine_id=engine,
        geometry=Geometry(tp[0], tp[1]),
        control=f"tcp://10.0.0.1:{17000 + tp[1]}",
        incarnation=inc,
        backend="nixl",
    )


def put(e: RankEntry, rev: int) -> Put:
    key, value = encode_entry(e)
    return Put(key, value, rev)


def key(e: RankEntry) -> str:
    return encode_entry(e)[0]


def test_join_restart_update_leave() -> None:
    m = Membership()
    a = entry()
    assert m.apply(put(a, 1)) == [Joined(key(a), a)]
    assert m.apply(put(a, 2)) == []  # the same value again: nothing changed
    a2 = msgspec.structs.replace(a, incarnation="i2")
    assert m.apply(put(a2, 3)) == [Restarted(key(a), a, a2)]
    a3 = msgspec.structs.replace(a2, control="tcp://10.0.0.9:1")
    assert m.apply(put(a3, 4)) == [Updated(key(a), a2, a3)]
    [left] = m.apply(Delete(key(a), 5))
    assert isinstance(left, Left) and left.entry == a3
    assert m.entries() == {}


def test_stale_and_repeated_events_are_ignored() -> None:
    m = Membership()
    a = entry()
    m.apply(put(a, 5))
    assert m.apply(put(a, 5)) == []  # a resumed watch repeating revision 5
    assert m.apply(Delete(key(a), 3)) == []
    assert key(a) in m.entries()


def test_several_events_of_one_revision_all_apply() -> None:
    m = Membership()
    a, b = entry(tp=(2, 0)), entry(tp=(2, 1))
    m.apply_all([put(a, 1), put(b, 2)])
    # a revoked lease deletes both keys in one revision
    changes = m.apply_all([Delete(key(a), 3), Delete(key(b), 3)])
    assert sorted(c.key for c in changes if isinstance(c, Left)) == sorted([key(a), key(b)])


def test_a_refused_value_is_reported_once_and_removes_what_it_overwrote() -> None:
    m = Membership()
    a = entry()
    m.apply(put(a, 1))
    changes = m.apply(Put(key(a), b'{"role": "prefill"}', 2))
    assert [type(c) for c in changes] == [Left, Rejected]
    assert isinstance(changes[1], Rejected) and "RankEntry" in str(changes[1].error)
    assert m.apply(Snapshot(((key(a), b'{"role": "prefill"}'),), 3)) == []  # same bad value: said already
    assert m.entries() == {}
    assert m.apply(put(a, 4)) == [Joined(key(a), a)]


def test_keys_outside_the_watched_roles_are_not_members() -> None:
    m = Membership(roles=(wire.Role.PREFILL,))
    d = entry(role=wire.Role.DECODE, engine="d")
    assert m.apply(put(d, 1)) == []
    junk = Put("/pdwire/prefill/p/nonsense", b"{}", 2)
    [rejected] = m.apply(junk)
    assert isinstance(rejected, Rejected)
    assert Membership(prefix="/other").apply(put(entry(), 3)) == []


def test_a_snapshot_replaces_the_view() -> None:
    m = Membership()
    a, b = entry(tp=(2, 0)), entry(tp=(2, 1))
    m.apply_all([put(a, 1), put(b, 2)])
    changes = m.apply(Snapshot((encode_entry(b),), 10))
    assert [type(c) for c in changes] == [Left]
    assert list(m.entries()) == [key(b)]
    assert m.revision == 10
    assert m.apply(Delete(key(b), 9)) == []  # older than the snapshot


def test_registry_reachability_is_reported_per_transition_and_keeps_the_view() -> None:
    m = Membership()
    m.apply(put(entry(), 1))
    assert m.apply(Unreachable("timeout")) == [RegistryLost("timeout")]
    assert m.apply(Unreachable("timeout again")) == []
    assert len(m.entries()) == 1
    assert m.apply(Reachable()) == [RegistryBack()]
    assert m.apply(Reachable()) == []


def test_groups_complete_only_with_every_rank_and_no_disagreement() -> None:
    m = Membership()
    m.apply(put(entry(tp=(2, 0)), 1))
    g = m.groups(wire.Role.PREFILL)["p"]
    assert not g.complete and g.missing == ("tp1.pp0",)
    m.apply(put(entry(tp=(2, 1)), 2))
    g = m.complete_groups(wire.Role.PREFILL)["p"]
    assert g.control_endpoints() == ["tcp://10.0.0.1:17000", "tcp://10.0.0.1:17001"]
    assert g.backend == "nixl"
    # a rank that says another TP size, or another backend: the group is not used
    m.apply(put(msgspec.structs.replace(entry(tp=(2, 1)), backend="mooncake"), 3))
    assert m.complete_groups(wire.Role.PREFILL) == {}
    assert "backend" in m.groups(wire.Role.PREFILL)["p"].problems[0]
    m.apply(put(entry(tp=(4, 1)), 4))
    assert any("tp_size" in p for p in m.groups(wire.Role.PREFILL)["p"].problems)


def test_every_change_describes_itself() -> None:
    a = entry()
    b = msgspec.structs.replace(a, incarnation="i9")
    for c in [
        Joined("k", a),
        Left("k", a, "gone"),
        Restarted("k", a, b),
        Updated("k", a, b),
        RegistryLost("x"),
        RegistryBack(),
    ]:
        assert describe(c)


# ---------------------------------------------------------------------------- event orders

_ENTRIES = [entry(tp=(2, t), inc=i) for t in (0, 1) for i in ("i1", "i2")] + [
    msgspec.structs.replace(entry(tp=(2, 0), inc="i1"), control="tcp://10.0.0.2:1")
]
_KEYS = sorted({key(e) for e in _ENTRIES})
_VALUES = {k: [encode_entry(e)[1] for e in _ENTRIES if key(e) == k] + [b"{}", b"\x00junk"] for k in _KEYS}

_step = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(_KEYS), st.integers(0, 3)),
    st.tuples(st.just("delete"), st.sampled_from(_KEYS), st.just(0)),
    st.tuples(
        st.just("snapshot"),
        st.lists(st.tuples(st.sampled_from(_KEYS), st.integers(0, 3)), max_size=3),
        st.just(0),
    ),
    st.tuples(st.just("lost"), st.just(""), st.just(0)),
    st.tuples(st.just("back"), st.just(""), st.just(0)),
    st.tuples(st.just("stale"), st.sampled_from(_KEYS), st.integers(0, 3)),
    st.tuples(st.just("repeat"), st.just(""), st.just(0)),
)


@given(st.lists(_step, max_size=30))
def test_any_event_order_keeps_view_and_changes_consistent(steps: list[tuple[str, object, int]]) -> None:
    m = Membership()
    model: dict[str, bytes] = {}  # the last value per key, as the store holds it
    replayed: dict[str, RankEntry] = {}
    rev = 0
    last: RegistryEvent | None = None
    for kind, arg, n in steps:
        event: RegistryEvent
        if kind == "put":
            assert isinstance(arg, str)
            rev += 1
            value = _VALUES[arg][n % len(_VALUES[arg])]
            model[arg] = value
            event = Put(arg, value, rev)
        elif kind == "delete":
            assert isinstance(arg, str)
            rev += 1
            model.pop(arg, None)
            event = Delete(arg, rev)
        elif kind == "snapshot":
            assert isinstance(arg, list)
            rev += 1
            model = {k: _VALUES[k][i % len(_VALUES[k])] for k, i in arg}
            event = Snapshot(tuple(model.items()), rev)
        elif kind == "stale":  # an older revision: must change nothing
            assert isinstance(arg, str)
            event = Put(arg, _VALUES[arg][n % len(_VALUES[arg])], rev - 1)
        elif kind == "repeat":  # the last event again (a resumed watch): must change nothing
            if last is None:
                continue
            assert m.apply(last) == []
            continue
        else:
            event = Unreachable("x") if kind == "lost" else Reachable()
        changes: list[Change] = m.apply(event)
        if not isinstance(event, Unreachable | Reachable):
            last = event
        for c in changes:
            if isinstance(c, Joined):
                assert c.key not in replayed
                replayed[c.key] = c.entry
            elif isinstance(c, Left):
                assert replayed.pop(c.key) == c.entry
            elif isinstance(c, Restarted | Updated):
                assert replayed[c.key] == c.old
                replayed[c.key] = c.new
        valid = {}
        for k, v in model.items():
            with contextlib.suppress(ValueError):
                valid[k] = decode_entry(k, v)
        assert m.entries() == valid
        assert replayed == valid
