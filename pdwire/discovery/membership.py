"""Who is registered: a pure machine from registry events to membership changes.

The I/O edge (etcd, a static file) turns what it reads into :data:`RegistryEvent` values;
:meth:`Membership.apply` returns what changed (:data:`Change`) and keeps the current view. No
sockets, no clocks, no threads: the tests drive it with hypothesis. Rules:

* a refused value is one :class:`Rejected` change (once per distinct value), never a member,
  and it removes the valid entry it overwrote (:class:`Left` first);
* the same key with another ``incarnation`` is a :class:`Restarted` rank; the same incarnation
  with other fields is :class:`Updated`; an equal value changes nothing;
* events below the revision already applied are ignored (a resumed watch may repeat some);
  events *at* it are applied, since one revision can carry several events (a revoked lease
  deletes every key it held at once); a snapshot replaces the view;
* losing the registry keeps the last view (the ranks' own connections tell whether they are
  alive) and is reported once (:class:`RegistryLost`), as is its return (:class:`RegistryBack`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdwire import wire
from pdwire.discovery.entry import (
    DEFAULT_PREFIX,
    ROLES,
    Geometry,
    RankEntry,
    RegistryEntryError,
    check_prefix,
    decode_entry,
    rank_name,
    role_name,
    role_prefix,
)

# ---------------------------------------------------------------------------- events in


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every (key, value) under the watched prefix at ``revision``."""

    items: tuple[tuple[str, bytes], ...]
    revision: int


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    revision: int


@dataclass(frozen=True, slots=True)
class Delete:
    """The key is gone: deleted, its lease revoked (a clean stop) or expired (a dead rank)."""

    key: str
    revision: int


@dataclass(frozen=True, slots=True)
class RegistryLost:
    reason: str


@dataclass(frozen=True, slots=True)
class RegistryBack:
    pass


# reachability goes in as an event and comes out, once per transition, as the same value
Unreachable = RegistryLost
Reachable = RegistryBack
RegistryEvent = Snapshot | Put | Delete | RegistryLost | RegistryBack

# ---------------------------------------------------------------------------- changes out


@dataclass(frozen=True, slots=True)
class Joined:
    key: str
    entry: RankEntry


@dataclass(frozen=True, slots=True)
class Left:
    key: str
    entry: RankEntry
    why: str


@dataclass(frozen=True, slots=True)
class Restarted:
    key: str
    old: RankEntry
    new: RankEntry


@dataclass(frozen=True, slots=True)
class Updated:
    key: str
    old: RankEntry
    new: RankEntry


@dataclass(frozen=True, slots=True)
class Rejected:
    key: str
    error: RegistryEntryError


Change = Joined | Left | Restarted | Updated | Rejected | RegistryLost | RegistryBack


def describe(change: Change) -> str:
    """One log line for a change."""
    match change:
        case Joined(entry=e):
            where = f" at {e.control}" if e.control else ""
            return f"{e.label} joined{where} ({e.backend or 'backend not stated'})"
        case Left(entry=e, why=why):
            return f"{e.label} left ({why})"
        case Restarted(old=o, new=n):
            return f"{n.label} restarted: incarnation {o.incarnation} -> {n.incarnation}"
        case Updated(new=n):
            return f"{n.label} updated its entry"
        case Rejected(error=err):
            return f"refused {err}"
        case RegistryLost(reason=r):
            return f"registry unreachable: {r} (keeping the last view; retrying)"
        case RegistryBack():
            return "registry reachable again"
    raise AssertionError(change)  # pragma: no cover


# ---------------------------------------------------------------------------- the view


@dataclass(frozen=True)
class EngineGroup:
    """The registered ranks of one engine (all ranks of one role sharing an engine id)."""

    role: wire.Role
    engine_id: str
    geometry: Geometry  # sizes from the ranks (their rank fields are meaningless here)
    ranks: dict[str, RankEntry]  # rank_name -> entry
    problems: tuple[str, ...]  # disagreements among the ranks: such a group is never used

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(n for n in _expected_ranks(self.geometry) if n not in self.ranks)

    @property
    def complete(self) -> bool:
        return not self.problems and not self.missing

    @property
    def backend(self) -> str:
        return next(iter(self.ranks.values())).backend

    def control_endpoints(self, *, pp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0) -> list[str]:
        """The control endpoints of one TP group, indexed by TP rank; KeyError names a missing rank."""
        g = self.geometry
        out = []
        for t in range(g.tp_size):
            name = rank_name(
                Geometry(g.tp_size, t, g.pp_size, pp_rank, g.cp_size, cp_rank, g.dp_size, dp_rank)
            )
            if name not in self.ranks:
                raise KeyError(f"{role_name(self.role)} {self.engine_id}: rank {name} is not registered")
            out.append(self.ranks[name].control)
        return out


def _expected_ranks(g: Geometry) -> list[str]:
    return [
        rank_name(Geometry(g.tp_size, t, g.pp_size, p, g.cp_size, c, g.dp_size, d))
        for d in range(g.dp_size)
        for p in range(g.pp_size)
        for c in range(g.cp_size)
        for t in range(g.tp_size)
    ]


def _group(role: wire.Role, engine_id: str, entries: list[RankEntry]) -> EngineGroup:
    problems: list[str] = []
    first = entries[0]
    for e in entries[1:]:
        for name in ("tp_size", "pp_size", "cp_size", "dp_size"):
            mine, theirs = getattr(first.geometry, name), getattr(e.geometry, name)
            if mine != theirs:
                problems.append(f"{name}: {first.rank} says {mine}, {e.rank} says {theirs}")
        for name in ("backend", "protocol", "model"):
            mine, theirs = getattr(first, name), getattr(e, name)
            if mine != theirs:
                problems.append(f"{name}: {first.rank} says {mine!r}, {e.rank} says {theirs!r}")
    g = first.geometry
    sizes_only = Geometry(g.tp_size, 0, g.pp_size, 0, g.cp_size, 0, g.dp_size, 0)
    return EngineGroup(role, engine_id, sizes_only, {e.rank: e for e in entries}, tuple(problems))


@dataclass
class Membership:
    """The registered ranks under ``prefix`` for the watched ``roles``; see the module docstring."""

    prefix: str = DEFAULT_PREFIX
    roles: tuple[wire.Role, ...] = ROLES
    revision: int = 0
    reachable: bool = True
    _entries: dict[str, RankEntry] = field(default_factory=dict)
    _rejected: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_prefix(self.prefix)
        self._scopes = tuple(role_prefix(self.prefix, r) for r in self.roles)

    # ---------------------------------------------------------------- events

    def apply(self, event: RegistryEvent) -> list[Change]:
        match event:
            case Snapshot(items=items, revision=rev):
                return self._snapshot(items, rev)
            case Put(revision=rev) | Delete(revision=rev):
                if rev < self.revision:
                    return []
                self.revision = rev
                if isinstance(event, Put):
                    return self._put(event.key, event.value)
                return self._delete(event.key, "removed from the registry: stopped, or its lease expired")
            case RegistryLost() | RegistryBack():
                back = isinstance(event, RegistryBack)
                if self.reachable == back:
                    return []
                self.reachable = back
                return [event]
        raise TypeError(f"not a registry event: {event!r}")

    def apply_all(self, events: Iterable[RegistryEvent]) -> list[Change]:
        return [c for e in events for c in self.apply(e)]

    def _snapshot(self, items: tuple[tuple[str, bytes], ...], revision: int) -> list[Change]:
        present = {k for k, _ in items}
        changes: list[Change] = []
        for key in [k for k in self._entries if k not in present]:
            changes += self._delete(key, "absent from the registry when it was read again")
        for key in [k for k in self._rejected if k not in present]:
            del self._rejected[key]
        for key, value in items:
            changes += self._put(key, value)
        self.revision = max(self.revision, revision)
        return changes

    def _put(self, key: str, value: bytes) -> list[Change]:
        if not key.startswith(self._scopes):
            return []
        try:
            new = decode_entry(key, value, self.prefix)
        except RegistryEntryError as err:
            if self._rejected.get(key) == value:
                return []
            self._rejected[key] = value
            old = self._entries.pop(key, None)
            left: list[Change] = (
                [] if old is None else [Left(key, old, "its entry was replaced by one refused")]
            )
            return [*left, Rejected(key, err)]
        self._rejected.pop(key, None)
        old = self._entries.get(key)
        self._entries[key] = new
        if old is None:
            return [Joined(key, new)]
        if old.incarnation != new.incarnation:
            return [Restarted(key, old, new)]
        if old != new:
            return [Updated(key, old, new)]
        return []

    def _delete(self, key: str, why: str) -> list[Change]:
        self._rejected.pop(key, None)
        old = self._entries.pop(key, None)
        return [] if old is None else [Left(key, old, why)]

    # ---------------------------------------------------------------- the view

    def entries(self, role: wire.Role | None = None) -> dict[str, RankEntry]:
        return {k: e for k, e in self._entries.items() if role is None or e.role == role}

    def groups(self, role: wire.Role) -> dict[str, EngineGroup]:
        by_engine: dict[str, list[RankEntry]] = {}
        for e in self._entries.values():
            if e.role == role:
                by_engine.setdefault(e.engine_id, []).append(e)
        return {
            eid: _group(role, eid, sorted(es, key=lambda e: e.rank)) for eid, es in sorted(by_engine.items())
        }

    def complete_groups(self, role: wire.Role) -> dict[str, EngineGroup]:
        return {eid: g for eid, g in self.groups(role).items() if g.complete}
