"""Compatibility classification of every change between two versions of a schema.

Breaking within a major (buf's WIRE rules adapted to positional msgpack bodies): a field
id reused or retyped, a field removed without reserving it, a required field added in a
minor, a default or `since` changed, two fields' ids swapped, an enum value renumbered or
removed, a message type id reused or changed, a released version dropped. Breaking changes
are allowed only together with a new major.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .model import Enum, Field, Message, Protocol, format_version

_Add = Callable[[bool, str, str], None]


@dataclass(frozen=True)
class Change:
    breaking: bool
    where: str
    what: str

    def __str__(self) -> str:
        return f"{'BREAKING' if self.breaking else 'ok'}: {self.where}: {self.what}"


@dataclass(frozen=True)
class DiffResult:
    changes: list[Change]
    major_bump: bool  # NEW introduces a major OLD did not have: breaking changes are allowed

    @property
    def breaking(self) -> list[Change]:
        return [c for c in self.changes if c.breaking]

    @property
    def failed(self) -> bool:
        return bool(self.breaking) and not self.major_bump


def diff_protocols(old: Protocol, new: Protocol) -> DiffResult:
    out: list[Change] = []
    p = new.name

    def add(breaking: bool, where: str, what: str) -> None:
        out.append(Change(breaking, where, what))

    if old.protocol_id != new.protocol_id:
        add(True, p, f"protocol_id changed {old.protocol_id} -> {new.protocol_id}")
    new_majors = {v[0] for v in new.version_list}
    for v in old.version_list:
        if v not in new.version_list:
            add(v[0] in new_majors, p, f"released version {format_version(v)} dropped")
    for v in new.version_list:
        if v not in old.version_list:
            add(False, p, f"version {format_version(v)} added")
    _diff_enums(old, new, add)
    _diff_messages(old, new, add)
    major_bump = max(v[0] for v in new.version_list) > max(v[0] for v in old.version_list)
    return DiffResult(out, major_bump)


def _diff_enums(old: Protocol, new: Protocol, add: _Add) -> None:
    for name, oe in old.enums.items():
        ne = new.enums.get(name)
        where = f"{new.name}: enum {name}"
        if ne is None:
            add(True, where, "enum removed")
            continue
        _diff_enum_values(oe, ne, where, add)
    for name in new.enums.keys() - old.enums.keys():
        add(False, f"{new.name}: enum {name}", "enum added")


def _diff_enum_values(oe: Enum, ne: Enum, where: str, add: _Add) -> None:
    old_by_name = {v.name: v.number for v in oe.values}
    new_by_name = {v.name: v.number for v in ne.values}
    new_by_number = {v.number: v.name for v in ne.values}
    for vname, num in old_by_name.items():
        if vname in new_by_name:
            if new_by_name[vname] != num:
                add(True, where, f"value {vname} renumbered {num} -> {new_by_name[vname]}")
        elif num in new_by_number:
            add(True, where, f"number {num} moved from {vname} to {new_by_number[num]}")
        elif num not in ne.reserved:
            add(True, where, f"value {vname} ({num}) removed without reserving its number")
    for vname, num in new_by_name.items():
        if vname not in old_by_name and num not in old_by_name.values():
            if num in oe.reserved:
                add(True, where, f"value {vname} reuses reserved number {num}")
            else:
                add(False, where, f"value {vname} ({num}) added")


def _diff_messages(old: Protocol, new: Protocol, add: _Add) -> None:
    old_types = {m.type_id: m.name for m in old.messages.values() if m.type_id is not None}
    old_types.update({tid: f"reserved {n}" for tid, n in old.reserved_types})
    new_reserved_types = {tid for tid, _ in new.reserved_types}
    for name, om in old.messages.items():
        where = f"{new.name}: message {name}"
        nm = new.messages.get(name)
        if nm is None:
            if om.type_id is not None and om.type_id not in new_reserved_types:
                add(True, where, f"message removed without reserving type id {om.type_id}")
            else:
                add(False, where, "message removed (type id reserved)")
            continue
        if om.type_id != nm.type_id:
            add(True, where, f"type id changed {om.type_id} -> {nm.type_id}")
        if om.since != nm.since:
            add(True, where, f"since changed {format_version(om.since)} -> {format_version(nm.since)}")
        if (om.backend, om.min_frames, om.match) != (nm.backend, nm.min_frames, nm.match):
            add(True, where, "positional framing changed (backend, min_frames or match)")
        _diff_fields(om, nm, where, add)
    for name, nm in new.messages.items():
        if name in old.messages:
            continue
        where = f"{new.name}: message {name}"
        if nm.type_id is not None and nm.type_id in old_types:
            add(True, where, f"type id {nm.type_id} reused (was {old_types[nm.type_id]})")
        else:
            add(False, where, "message added")


def _diff_fields(om: Message, nm: Message, where: str, add: _Add) -> None:
    old_by_id = {f.id: f for f in om.fields}
    new_by_id = {f.id: f for f in nm.fields}
    new_by_name = {f.name: f for f in nm.fields}
    old_res = {r.id: r.name for r in om.reserved}
    new_res = {r.id: r.name for r in nm.reserved}
    old_res_names = set(old_res.values())
    for fid, of in old_by_id.items():
        loc = f"{where}, field {of.name} (id {fid})"
        nf = new_by_id.get(fid)
        if nf is None:
            if fid in new_res:
                add(False, loc, "removed and reserved")
            else:
                add(True, loc, "removed without reserving its id and name")
            continue
        if nf.name != of.name:
            moved = new_by_name.get(of.name)
            if moved is not None:
                add(
                    True,
                    loc,
                    f"id now belongs to {nf.name} while {of.name} moved to id {moved.id} (ids swapped)",
                )
            else:
                add(False, loc, f"renamed to {nf.name} (names are not on the wire)")
        _diff_field(of, nf, loc, add)
    for fid, nf in new_by_id.items():
        if fid in old_by_id:
            continue
        loc = f"{where}, field {nf.name} (id {fid})"
        if fid in old_res:
            add(True, loc, f"reuses reserved id {fid} (was {old_res[fid]})")
        elif nf.name in old_res_names:
            add(True, loc, f"reuses reserved name {nf.name}")
        elif nf.required and nf.since[1] > 0:
            add(True, loc, f"required field added in minor {format_version(nf.since)}")
        else:
            add(False, loc, "field added")
    for rid, rname in old_res.items():
        if rid not in new_res:
            add(True, f"{where}, reserved {rname} (id {rid})", "reservation dropped")


def _diff_field(of: Field, nf: Field, loc: str, add: _Add) -> None:
    if of.type != nf.type:
        add(True, loc, f"type changed {of.type.spell()} -> {nf.type.spell()}")
    if of.default != nf.default or of.required != nf.required:
        add(True, loc, f"default changed {of.default!r} -> {nf.default!r}")
    if of.since != nf.since:
        add(True, loc, f"since changed {format_version(of.since)} -> {format_version(nf.since)}")
    # positional layouts: where and how a field travels is its wire format
    if (of.encoding, of.frame, of.fallback) != (nf.encoding, nf.frame, nf.fallback):
        add(
            True,
            loc,
            f"positional wire format changed: encoding {of.encoding} frame {of.frame} -> "
            f"encoding {nf.encoding} frame {nf.frame}"
            + (f", fallback {of.fallback} -> {nf.fallback}" if of.fallback != nf.fallback else ""),
        )
    if of.removed != nf.removed:
        if of.removed is None and nf.removed is not None:
            add(False, loc, f"removed from {format_version(nf.removed)} (position kept)")
        else:
            add(True, loc, "removed version changed")
