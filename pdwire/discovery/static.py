"""Static discovery: the ranks come from a file or from flags, for set-ups without a registry.

The file's two forms are docs/deployment.md's ("Static lists"). Every entry passes the
registry's validation; a bad file at start-up raises :class:`~.base.DiscoveryError`. The file
is read again when its modification time changes (a new snapshot); a file that became
unreadable or invalid is reported as a lost registry and the last good view is kept.
``register`` only checks this rank's entry: a static list is written by the operator.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from pdwire import wire
from pdwire.discovery.base import Discovery, DiscoveryError, log
from pdwire.discovery.entry import (
    DEFAULT_PREFIX,
    ROLES,
    Geometry,
    RankEntry,
    RegistryEntryError,
    encode_entry,
    entry_from_dict,
    role_name,
    role_named,
    validate,
)
from pdwire.discovery.membership import Reachable, RegistryEvent, Snapshot, Unreachable

STATIC_INCARNATION = "static"


def static_entries(
    role: wire.Role, engine_id: str, endpoints: Sequence[str], where: str = ""
) -> list[RankEntry]:
    """One validated entry per TP rank of an engine listed as endpoints in TP rank order (pp = 1)."""
    where = where or f"{role_name(role)} {engine_id}"
    if not endpoints:
        raise RegistryEntryError(where, "no endpoints listed")
    geometry = [Geometry(tp_size=len(endpoints), tp_rank=r) for r in range(len(endpoints))]
    return [
        validate(RankEntry(role, engine_id, g, STATIC_INCARNATION, control=ep), f"{where}[{g.tp_rank}]")
        for g, ep in zip(geometry, endpoints, strict=True)
    ]


def parse_engine_flag(role: wire.Role, text: str) -> list[RankEntry]:
    """``ENGINE=tcp://h:p[,tcp://h:p...]`` (a ``--prefill`` flag) -> its entries."""
    engine_id, sep, rest = text.partition("=")
    if not sep or not rest:
        raise DiscoveryError(f"{text!r}: expected ENGINE=tcp://host:port[,tcp://host:port...]")
    try:
        return static_entries(
            role, engine_id, [ep.strip() for ep in rest.split(",")], f"--{role_name(role)} {text}"
        )
    except RegistryEntryError as exc:
        raise DiscoveryError(str(exc)) from None


def _entries_from_data(data: object, where: str) -> list[RankEntry]:
    if not isinstance(data, dict):
        raise RegistryEntryError(where, "a static list is a mapping with 'engines' and/or 'ranks'")
    unknown = set(data) - {"engines", "ranks", "prefix"}
    if unknown:
        raise RegistryEntryError(where, f"unknown top-level keys {sorted(unknown)}")
    out: list[RankEntry] = []
    engines = data.get("engines") or {}
    if not isinstance(engines, dict):
        raise RegistryEntryError(where, "'engines' must map a role to {engine_id: [endpoints]}")
    for role, by_id in engines.items():
        kind = role_named(role, f"{where}: engines")
        if not isinstance(by_id, dict):
            raise RegistryEntryError(f"{where}: engines.{role}", "must map engine ids to endpoint lists")
        for eid, eps in by_id.items():
            if not isinstance(eps, list) or not eps or not all(isinstance(e, str) for e in eps):
                raise RegistryEntryError(
                    f"{where}: engines.{role}.{eid}", "must be a non-empty list of endpoints"
                )
            out += static_entries(kind, str(eid), eps, f"{where}: engines.{role}.{eid}")
    ranks = data.get("ranks") or []
    if not isinstance(ranks, list):
        raise RegistryEntryError(where, "'ranks' must be a list of entries")
    for i, item in enumerate(ranks):
        if isinstance(item, dict):
            item = {"incarnation": STATIC_INCARNATION, **item}
        out.append(entry_from_dict(item, f"{where}: ranks[{i}]"))
    return out


def read_static_file(path: str | os.PathLike[str]) -> list[RankEntry]:
    """The entries of a static list; RegistryEntryError or OSError on trouble."""
    p = Path(path)
    text = p.read_text()
    where = str(p)
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise RegistryEntryError(
            where, f"not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}"
        ) from None
    prefix = data.get("prefix") if isinstance(data, dict) else None
    if prefix is not None and not isinstance(prefix, str):
        raise RegistryEntryError(where, "'prefix' must be a string")
    return _entries_from_data(data, where)


class StaticDiscovery(Discovery):
    kind = "static"

    def __init__(
        self,
        entries: Sequence[RankEntry] = (),
        *,
        path: str | os.PathLike[str] | None = None,
        prefix: str = DEFAULT_PREFIX,
        roles: tuple[wire.Role, ...] = ROLES,
    ) -> None:
        super().__init__(prefix, roles)
        self._flag_entries = list(entries)
        self._path = Path(path) if path is not None else None
        self._mtime: float | None = None
        self._revision = 0
        self._pending: list[RegistryEvent] = []
        self._down = False
        self._pending.append(self._snapshot(self._read_file(strict=True)))

    def _read_file(self, strict: bool) -> list[RankEntry] | None:
        if self._path is None:
            return []
        try:
            self._mtime = self._path.stat().st_mtime
            entries = read_static_file(self._path)
        except (OSError, RegistryEntryError) as exc:
            if strict:
                raise DiscoveryError(f"static discovery file {self._path}: {exc}") from exc
            self._lost(f"static list {self._path}: {exc}")
            return None
        return entries

    def _snapshot(self, file_entries: list[RankEntry] | None) -> Snapshot:
        self._revision += 1
        items: dict[str, bytes] = {}
        for e in [*self._flag_entries, *(file_entries or [])]:
            try:
                key, value = encode_entry(e, self.prefix)
            except RegistryEntryError as exc:
                raise DiscoveryError(f"static discovery: {exc}") from exc
            if key in items:
                raise DiscoveryError(f"static discovery: {e.label} is listed twice")
            items[key] = value
        return Snapshot(tuple(items.items()), self._revision)

    def _lost(self, reason: str) -> None:
        if not self._down:
            self._down = True
            log.warning("%s; keeping the last view", reason)
        self._pending.append(Unreachable(reason))

    def register(self, entry: RankEntry) -> None:
        key, _ = encode_entry(entry, self.prefix)  # the same checks as a registry would apply
        self.entries[key] = entry
        log.info(
            "static discovery: %s at %s (peers learn it from their own static list)",
            entry.label,
            entry.control,
        )

    def withdraw(self) -> None:
        self.entries.clear()

    def _events(self, timeout_s: float) -> list[RegistryEvent]:
        if self._path is not None and not self._pending:
            try:
                mtime = self._path.stat().st_mtime
            except OSError as exc:
                mtime = None
                self._lost(f"static list {self._path}: {exc}")
            if mtime is not None and mtime != self._mtime:
                entries = self._read_file(strict=False)
                if entries is not None:
                    try:
                        self._pending.append(self._snapshot(entries))
                        if self._down:
                            self._down = False
                            log.info("static list %s readable again", self._path)
                            self._pending.append(Reachable())
                    except DiscoveryError as exc:
                        self._lost(str(exc))
        if not self._pending and timeout_s > 0:
            time.sleep(min(timeout_s, 0.05))  # nothing to wait on but the clock
        out, self._pending = self._pending, []
        return out

    def close(self) -> None:
        self.withdraw()
