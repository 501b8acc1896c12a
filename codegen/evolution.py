"""Rules a single schema must satisfy on its own.

Comparing two schemas (type changes, ids swapped between revisions) is :mod:`.diff`'s job;
these are the rules visible in one file: unique and contiguous ids, reserved ids and names
never reused, versions ordered, fields added after x.0 carry defaults, types that exist
when the field appears.
"""

from __future__ import annotations

import itertools

from .errors import SchemaError, where
from .model import Field, Message, Protocol, TypeRef, Version, format_version

LAYOUTS = frozenset({"envelope", "positional"})


def check_protocol(p: Protocol) -> None:
    f = p.source
    if not p.name or not p.name.isidentifier():
        raise SchemaError(where(f), f"protocol name {p.name!r} is not an identifier")
    if not 0 < p.protocol_id < 2**16:
        raise SchemaError(where(f), f"protocol_id {p.protocol_id} must fit in u16 and be > 0")
    if p.layout not in LAYOUTS:
        raise SchemaError(where(f), f"unknown layout {p.layout!r} (known: {sorted(LAYOUTS)})")
    vs = p.version_list
    for a, b in itertools.pairwise(vs):
        if not a < b:
            raise SchemaError(
                where(f), f"versions must increase: {format_version(a)} then {format_version(b)}"
            )
    for v in vs:
        if v[1] > 0 and (v[0], v[1] - 1) not in vs:
            raise SchemaError(where(f), f"version {format_version(v)} has no predecessor {v[0]}.{v[1] - 1}")
    for info in p.versions:
        for name in info.migrate:
            if name not in p.messages:
                raise SchemaError(
                    where(f), f"version {format_version(info.version)} migrates unknown message {name}"
                )
        if info.migrate and p.migrations is None:
            raise SchemaError(
                where(f), "versions list migrations but the protocol names no migrations module"
            )
    promised: dict[str, Version] = {}
    for info in p.versions:
        for name, _ in info.promises:
            loc = where(f) + f", version {format_version(info.version)}, promise {name}"
            if not name.isidentifier() or name != name.lower():
                raise SchemaError(loc, "promise names are lower_snake_case")
            if name in promised:
                raise SchemaError(loc, f"already promised from {format_version(promised[name])}")
            promised[name] = info.version
    _check_enums(p)
    type_ids = {tid: f"reserved type {name}" for tid, name in p.reserved_types}
    for m in p.messages.values():
        loc = where(f, m.name)
        if m.since not in vs:
            raise SchemaError(loc, f"since {format_version(m.since)} is not a listed version")
        if m.type_id is not None:
            if not 0 < m.type_id < 2**16:
                raise SchemaError(loc, f"type_id {m.type_id} must fit in u16 and be > 0")
            if m.type_id in type_ids:
                raise SchemaError(loc, f"type_id {m.type_id} already used by {type_ids[m.type_id]}")
            type_ids[m.type_id] = f"message {m.name}"
        _check_message(p, m)
    if p.layout == "positional":
        from .positional import check_positional

        check_positional(p)


def _check_enums(p: Protocol) -> None:
    for e in p.enums.values():
        loc = f"{where(p.source)}: enum {e.name}"
        if e.since not in p.version_list:
            raise SchemaError(loc, f"since {format_version(e.since)} is not a listed version")
        seen: dict[int, str] = {}
        for v in e.values:
            if not 0 <= v.number < 2**31:
                raise SchemaError(f"{loc}, value {v.name}", f"number {v.number} must be in [0, 2**31)")
            if v.number in seen:
                raise SchemaError(
                    f"{loc}, value {v.name}", f"number {v.number} already used by {seen[v.number]}"
                )
            if v.number in e.reserved:
                raise SchemaError(f"{loc}, value {v.name}", f"number {v.number} is reserved")
            if v.since < e.since or v.since not in p.version_list:
                raise SchemaError(f"{loc}, value {v.name}", f"since {format_version(v.since)} is not valid")
            seen[v.number] = v.name


def _check_message(p: Protocol, m: Message) -> None:
    f = p.source
    ids: dict[int, str] = {}
    names: dict[str, int] = {}
    for r in m.reserved:
        loc = where(f, m.name, f"reserved {r.name} (id {r.id})")
        if r.id in ids or r.name in names:
            raise SchemaError(loc, "reserved twice")
        ids[r.id] = f"reserved {r.name}"
        names[r.name] = r.id
    for fld in m.fields:
        loc = where(f, m.name, f"{fld.name} (id {fld.id})")
        if fld.id in ids:
            raise SchemaError(loc, f"id {fld.id} already used by {ids[fld.id]}")
        if fld.name in names:
            raise SchemaError(loc, f"name {fld.name!r} already used by id {names[fld.name]}")
        ids[fld.id] = f"field {fld.name}"
        names[fld.name] = fld.id
        _check_field(p, m, fld, loc)
    missing = sorted(set(range(len(ids))) - set(ids))
    if missing:
        raise SchemaError(where(f, m.name), f"field ids must be contiguous from 0; missing {missing}")
    # ids grow with time: a field never takes a position before one that existed earlier
    for a in m.fields:
        for b in m.fields:
            if a.id < b.id and a.since > b.since:
                raise SchemaError(
                    where(f, m.name, f"{a.name} (id {a.id})"),
                    f"added in {format_version(a.since)} but has a lower id than {b.name} "
                    f"(id {b.id}, added in {format_version(b.since)}); new fields take new, higher ids",
                )


def _check_field(p: Protocol, m: Message, fld: Field, loc: str) -> None:
    vs = p.version_list
    if fld.since not in vs:
        raise SchemaError(loc, f"since {format_version(fld.since)} is not a listed version")
    if fld.since < m.since:
        raise SchemaError(
            loc, f"since {format_version(fld.since)} is before its message ({format_version(m.since)})"
        )
    if fld.removed is not None:
        if fld.removed not in vs or fld.removed <= fld.since:
            raise SchemaError(
                loc, f"removed {format_version(fld.removed)} must be a listed version after since"
            )
        if fld.removed[0] == fld.since[0] and fld.required:
            raise SchemaError(
                loc, "a field removed within its major needs a default (older readers receive it)"
            )
    if fld.since > m.since and fld.since[1] > 0 and fld.required:
        raise SchemaError(
            loc, f"added in minor {format_version(fld.since)} without a default; older writers never send it"
        )
    for t in fld.type.walk():
        _check_type_exists(p, t, fld.since, loc)
    # (positional layouts carry nested lists as one encoded frame; see codegen/positional.py)
    if (
        p.layout == "envelope"
        and fld.type.kind == "list"
        and fld.type.elem is not None
        and fld.type.elem.kind == "list"
    ):
        inner = fld.type.elem.elem
        if inner is None or inner.kind not in ("blob", "bytes", "str", "scalar", "enum"):
            raise SchemaError(
                loc, "lists of lists are supported only for plain values; use list<T[]> for index lists"
            )


def _check_type_exists(p: Protocol, t: TypeRef, since: Version, loc: str) -> None:
    if t.kind == "message":
        target = p.messages[t.name]
        if target.since > since:
            raise SchemaError(
                loc, f"uses message {t.name}, which appears only in {format_version(target.since)}"
            )
        if target.type_id is not None:
            raise SchemaError(loc, f"nests top-level message {t.name}; nest only messages without a type_id")
    elif t.kind == "enum":
        e = p.enums[t.name]
        if e.since > since:
            raise SchemaError(loc, f"uses enum {t.name}, which appears only in {format_version(e.since)}")
