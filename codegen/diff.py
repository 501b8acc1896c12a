"""Compatibility of a schema against a released one: every change, classified.

Two kinds of rule (each has a stable id, listed with its reason in schema/README.md):

* **Per released version** (buf's WIRE rules, judged version by version): the new schema must
  put exactly the same wire on every released version it still lists. Both schemas are
  reduced to :func:`~.wire_shape.shape_at` each such version and compared: a message, a body
  position or an enum value that appears in, disappears from or changes in a released
  version is breaking, whatever the edit that caused it (a field added without ``since``, a
  required field reserved, a type rewritten for a new major while the old one is still
  advertised, a ``since`` or default moved). Versions that were never released are free.
* **History** (the ids' lifetime, independent of versions): a field id or name, a message type
  id or an enum number is never reused or renumbered, a deleted one is reserved, the
  handshake message's leading fields never change in any version of any major (every build
  must read every Hello), and a released minor is never dropped while its major is listed.

A change that is not breaking is reported as ``ok`` (a version, message, field or value added
for an unreleased version, a rename, a deprecation...). There is no exemption for a new major:
a new major's versions are new, so they are free by the first rule, and the released versions
of the old major stay as they were for as long as the schema lists them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from .model import Enum, Message, Protocol, Version, format_version
from .wire_shape import MessageShape, ProtocolShape, SlotShape, shape_at

HANDSHAKE = "Hello"  # the message every build of every major reads (see schema/README.md)
# rules about ids that stay taken forever: they alter no released version's wire by themselves
# (a reused id is new in an unreleased version), so their refusals name no released versions
ID_LIFETIME = frozenset({"RESERVED_REUSED", "RESERVATION_DROPPED", "TYPE_ID_REUSED", "TYPE_ID_UNRESERVED"})


def span(versions: Iterable[Version]) -> str:
    """``1.0-1.3, 2.0``: consecutive minors of a major joined."""
    vs = sorted(set(versions))
    parts: list[str] = []
    i = 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == (vs[j][0], vs[j][1] + 1):
            j += 1
        a, b = format_version(vs[i]), format_version(vs[j])
        parts.append(a if i == j else f"{a}-{b}")
        i = j + 1
    return ", ".join(parts)


@dataclass(frozen=True)
class Change:
    breaking: bool
    rule: str  # stable rule id (schema/README.md, "Compatibility rules")
    file: str  # the new schema's file
    subject: str | None  # "message Abort", "enum Status", None for the protocol
    item: str | None  # "field sender (id 1)", "value nsa", ...
    what: str
    versions: tuple[Version, ...] = ()  # the released versions whose wire the change alters

    @property
    def where(self) -> str:
        out = self.file
        if self.subject:
            out += f": {self.subject}"
        if self.item:
            out += f", {self.item}"
        return out

    def __str__(self) -> str:
        return f"{'BREAKING' if self.breaking else 'ok'}: {self.where}: {self.what}"

    def to_json(self) -> dict[str, object]:
        return {
            "breaking": self.breaking,
            "rule": self.rule,
            "file": self.file,
            "subject": self.subject,
            "item": self.item,
            "versions": [format_version(v) for v in self.versions],
            "text": str(self),
        }


@dataclass(frozen=True)
class DiffResult:
    protocol: str
    changes: list[Change]
    released: tuple[Version, ...]  # the versions judged as released

    @property
    def breaking(self) -> list[Change]:
        return [c for c in self.changes if c.breaking]

    @property
    def failed(self) -> bool:
        return bool(self.breaking)


@dataclass
class _Collector:
    file: str
    changes: list[Change] = field(default_factory=list)
    # per-version findings grouped by what they are about: key -> (rule, subject, item, text, versions)
    grouped: dict[tuple[object, ...], tuple[str, str | None, str | None, str, list[Version]]] = field(
        default_factory=dict
    )

    def bad(
        self, rule: str, subject: str | None, item: str | None, what: str, versions: tuple[Version, ...] = ()
    ) -> None:
        self.changes.append(Change(True, rule, self.file, subject, item, what, versions))

    def ok(self, rule: str, subject: str | None, item: str | None, what: str) -> None:
        self.changes.append(Change(False, rule, self.file, subject, item, what))

    def at(self, v: Version, rule: str, subject: str | None, item: str | None, what: str) -> None:
        key = (rule, subject, item, what)
        entry = self.grouped.setdefault(key, (rule, subject, item, what, []))
        entry[4].append(v)

    def finish(self, hint: str, present: dict[str | None, tuple[Version, ...]] | None = None) -> list[Change]:
        """``present``: subject -> the released versions it exists in (``None``: the protocol);
        a breaking history finding names them, so every refusal says whom it affects."""
        for rule, subject, item, what, versions in self.grouped.values():
            text = what.replace("{released}", span(versions)).replace("{next}", hint)
            self.changes.append(Change(True, rule, self.file, subject, item, text, tuple(versions)))
        for i, c in enumerate(self.changes):
            vs = (present or {}).get(c.subject, ())
            if c.breaking and not c.versions and vs and c.rule not in ID_LIFETIME:
                self.changes[i] = replace(c, what=f"{c.what}; alters released {span(vs)}", versions=vs)
        # an "ok" note about something that also breaks (a field "added" to released versions)
        # would only contradict the breaking entry
        broken = {(c.subject, c.item) for c in self.changes if c.breaking}
        return [c for c in self.changes if c.breaking or (c.subject, c.item) not in broken]


def next_minor(new: Protocol, released: Sequence[Version]) -> str:
    """The version a change to the newest released major belongs in: the first unreleased
    minor of that major the new schema lists, else the one after the newest released."""
    top = max(released)
    for v in new.version_list:
        if v[0] == top[0] and v > top:
            return format_version(v)
    return f"{top[0]}.{top[1] + 1}"


def diff_protocols(old: Protocol, new: Protocol, released: Iterable[Version] | None = None) -> DiffResult:
    """Every change from ``old`` to ``new``; ``released`` (default: every version of ``old``)
    are the versions whose wire must not change."""
    rel = tuple(sorted(set(old.version_list if released is None else released) & set(old.version_list)))
    out = _Collector(new.source)
    new = _undo_renames(old, new, out)
    _protocol_rules(old, new, rel, out)
    listed = [v for v in rel if v in new.version_list]
    values = {e.name: {x.name for x in e.values} for e in new.enums.values()}
    for v in listed:
        _compare_version(shape_at(old, v), shape_at(new, v), v, values, out)
    _history_rules(old, new, out)
    _promise_rule(old, new, rel, out)
    _handshake_rule(old, new, set(listed), out)
    changes = out.finish(next_minor(new, rel) if rel else "a new minor", _present(old, rel))
    return DiffResult(new.name, changes, rel)


# --- protocol level ------------------------------------------------------------------------
def _protocol_rules(old: Protocol, new: Protocol, released: tuple[Version, ...], out: _Collector) -> None:
    if old.protocol_id != new.protocol_id:
        out.bad("PROTOCOL_ID", None, None, f"protocol_id changed {old.protocol_id} -> {new.protocol_id}")
    if old.layout != new.layout:
        out.bad("LAYOUT", None, None, f"layout changed {old.layout} -> {new.layout}")
    new_majors = {v[0] for v in new.version_list}
    newest_major = max(new_majors)
    dropped = [v for v in released if v not in new.version_list]
    within = [v for v in dropped if v[0] in new_majors]
    if within:
        out.bad(
            "VERSION_DROPPED",
            None,
            None,
            f"released version(s) {span(within)} dropped while their major is still listed; "
            "peers that agree on them could no longer talk to this build",
            tuple(within),
        )
    whole = [v for v in dropped if v[0] not in new_majors]
    if whole:
        majors = sorted({v[0] for v in whole})
        if all(m < newest_major for m in majors):
            out.ok(
                "MAJOR_DROPPED",
                None,
                None,
                f"released version(s) {span(whole)} dropped with their major: peers of "
                f"major {', '.join(map(str, majors))} are refused at the handshake",
            )
        else:
            out.bad(
                "VERSION_DROPPED",
                None,
                None,
                f"released version(s) {span(whole)} dropped",
                tuple(whole),
            )
    for v in new.version_list:
        if v not in old.version_list:
            out.ok("VERSION_ADDED", None, None, f"version {format_version(v)} added")


# --- one released version ------------------------------------------------------------------
def _compare_version(
    o: ProtocolShape, n: ProtocolShape, v: Version, values: dict[str, set[str]], out: _Collector
) -> None:
    """``values``: every enum value the new schema defines (at any version)."""
    for name in sorted(o.messages.keys() | n.messages.keys()):
        om, nm = o.messages.get(name), n.messages.get(name)
        subject = f"message {name}"
        if nm is None:
            out.at(
                v,
                "MESSAGE_MISSING",
                subject,
                None,
                "missing from released {released} (removed, or its since moved later); "
                "peers of those versions send and expect it",
            )
            continue
        if om is None:
            out.at(
                v,
                "MESSAGE_ADDED",
                subject,
                None,
                "appears in released {released}, whose readers refuse its type id; a message "
                'added after a release needs since: "{next}"',
            )
            continue
        if om.type_id != nm.type_id:
            out.at(
                v,
                "TYPE_ID",
                subject,
                None,
                f"type id changed {om.type_id} -> {nm.type_id} in released {{released}}",
            )
        if om.framing != nm.framing:
            out.at(
                v,
                "FRAMING",
                subject,
                None,
                "positional framing changed (backend, min_frames or match) in released {released}",
            )
        _compare_slots(om, nm, v, out)
    for name in sorted(o.enums.keys() | n.enums.keys()):
        ov = dict(o.enums[name].values) if name in o.enums else {}
        nv = dict(n.enums[name].values) if name in n.enums else {}
        subject = f"enum {name}"
        for vname, num in nv.items():
            if vname not in ov and num not in ov.values():
                out.at(
                    v,
                    "ENUM_VALUE_ADDED",
                    subject,
                    f"value {vname} ({num})",
                    "appears in released {released}, whose readers refuse it (BadEnumValue) and "
                    'whose writers never send it; a value added after a release needs value_since: "{next}"',
                )
        for vname, num in ov.items():
            # (a value removed or renumbered altogether is a history rule)
            if vname not in nv and num not in nv.values() and vname in values.get(name, set()):
                out.at(
                    v,
                    "ENUM_VALUE_MISSING",
                    subject,
                    f"value {vname} ({num})",
                    "no longer exists in released {released} (its value_since moved later); "
                    "peers of those versions send it",
                )


def _field_label(s: SlotShape) -> str:
    if s.field_id is None:
        return f"reserved {s.name} (id {s.position})"
    if s.encoding != (None, None):
        return f"field {s.name} (frame {s.position})"
    return f"field {s.name} (id {s.field_id})"


def _describe(s: SlotShape) -> str:
    if s.type is None:
        return "a reserved position"
    req = "required" if s.default is None else f"default {s.default}"
    return f"{s.type}, {req}"


def _compare_slots(om: MessageShape, nm: MessageShape, v: Version, out: _Collector) -> None:
    subject = f"message {om.name}"
    positions = sorted({s.position for s in om.slots} | {s.position for s in nm.slots})
    for pos in positions:
        os_, ns = om.slot(pos), nm.slot(pos)
        if ns is None:
            assert os_ is not None
            out.at(
                v,
                "FIELD_MISSING",
                subject,
                _field_label(os_),
                "position missing from released {released} (removed, or its since moved later); "
                "readers of those versions expect it",
            )
            continue
        if os_ is None:
            out.at(
                v,
                "FIELD_ADDED",
                subject,
                _field_label(ns),
                "appears in released {released}: their writers never send it and their readers "
                'drop it; a field added after a release needs since: "{next}" (and a default)',
            )
            continue
        if os_.wire == ns.wire:
            continue
        item = _field_label(os_)
        if os_.live and not ns.live:
            how = "reserves" if ns.type is None else "removes"
            effect = f"reject every {om.name}" if os_.default is None else "lose it"
            fix = (
                " Remove a field within its major with `removed:` (the new minor) and a default; "
                "reserve it only when a new major drops those versions"
                if os_.default is None
                else ""
            )
            out.at(
                v,
                "FIELD_RESERVED",
                subject,
                item,
                f"released {{released}} carry it ({_describe(os_)}); the new schema {how} the "
                f"position, so their readers {effect}." + fix,
            )
            continue
        if not os_.live and ns.live:
            out.at(
                v,
                "FIELD_RESTORED",
                subject,
                _field_label(ns),
                "a placeholder of released {released} becomes a live field there",
            )
            continue
        if os_.type != ns.type:
            out.at(
                v,
                "FIELD_TYPE",
                subject,
                item,
                f"type changed {os_.type} -> {ns.type} in released {{released}}, which still "
                "read and write the old type",
            )
        elif os_.default != ns.default:  # (a new type brings its own default)
            out.at(
                v,
                "FIELD_DEFAULT",
                subject,
                item,
                f"default changed {os_.default or 'required'} -> {ns.default or 'required'} in "
                "released {released} (readers fill it in for older writers)",
            )
        if os_.encoding != ns.encoding:
            out.at(
                v,
                "FIELD_ENCODING",
                subject,
                item,
                f"positional wire format changed: encoding {os_.encoding[0]} -> {ns.encoding[0]}"
                + (
                    f", fallback {os_.encoding[1]} -> {ns.encoding[1]}"
                    if os_.encoding[1] != ns.encoding[1]
                    else ""
                )
                + " in released {released}",
            )


def _undo_renames(old: Protocol, new: Protocol, out: _Collector) -> Protocol:
    """``new`` with every top-level message that kept its type id under a new name given its
    old name back (reported ``ok``: readers dispatch on the type id, names are not on the
    wire), so the comparison judges its wire and history as the same message. Top-level
    messages are never nested, so nothing else refers to the name."""
    old_by_tid = {m.type_id: m.name for m in old.messages.values() if m.type_id is not None}
    renamed: dict[str, str] = {}  # new name -> old name
    for m in new.messages.values():
        was = old_by_tid.get(m.type_id) if m.type_id is not None else None
        if was is not None and was != m.name and was not in new.messages and m.name not in old.messages:
            renamed[m.name] = was
    if not renamed:
        return new
    for now, was in sorted(renamed.items()):
        out.ok("MESSAGE_RENAMED", f"message {was}", None, f"renamed to {now} (type id kept)")
    messages = {
        renamed.get(name, name): replace(m, name=renamed[name]) if name in renamed else m
        for name, m in new.messages.items()
    }
    versions = tuple(
        replace(info, migrate=tuple(renamed.get(n, n) for n in info.migrate)) for info in new.versions
    )
    return replace(new, messages=messages, versions=versions)


def _present(old: Protocol, released: tuple[Version, ...]) -> dict[str | None, tuple[Version, ...]]:
    """Subject -> the released versions of ``old`` it exists in (``None``: the protocol)."""
    out: dict[str | None, list[Version]] = {None: list(released)}
    for v in released:
        for m in old.messages_at(v):
            out.setdefault(f"message {m.name}", []).append(v)
        for e in old.enums_at(v):
            out.setdefault(f"enum {e.name}", []).append(v)
    return {k: tuple(vs) for k, vs in out.items()}


def _promise_rule(old: Protocol, new: Protocol, released: tuple[Version, ...], out: _Collector) -> None:
    """A promise carries no bytes, but peers of a released version rely on it (decode trusts a
    fence only from versions that promise it): it may not be withdrawn or moved later there."""

    def since(p: Protocol) -> dict[str, Version]:
        return {name: info.version for info in p.versions for name, _ in info.promises}

    was, now = since(old), since(new)
    for name, v in sorted(was.items()):
        lost = tuple(r for r in released if r >= v and r[0] == v[0] and (name not in now or now[name] > r))
        if lost:
            how = "withdrawn" if name not in now else f"moved to {format_version(now[name])}"
            out.bad(
                "PROMISE_WITHDRAWN",
                None,
                f"promise {name}",
                f"made in {format_version(v)}, {how}: peers of released {span(lost)} rely on it",
                lost,
            )
        elif name in now and now[name] < v:
            moved = tuple(r for r in released if now[name] <= r < v)
            if moved:
                out.bad(
                    "PROMISE_WITHDRAWN",
                    None,
                    f"promise {name}",
                    f"made in {format_version(v)}, moved to {format_version(now[name])}: released "
                    f"{span(moved)} never kept it",
                    moved,
                )


# --- history ---------------------------------------------------------------------------------
def _history_rules(old: Protocol, new: Protocol, out: _Collector) -> None:
    for name, oe in old.enums.items():
        ne = new.enums.get(name)
        if ne is None:
            out.bad("ENUM_REMOVED", f"enum {name}", None, "enum removed")
            continue
        _enum_history(oe, ne, out)
    for name in sorted(new.enums.keys() - old.enums.keys()):
        out.ok("ENUM_ADDED", f"enum {name}", None, "enum added")
    _message_history(old, new, out)


def _enum_history(oe: Enum, ne: Enum, out: _Collector) -> None:
    subject = f"enum {oe.name}"
    old_by_name = {v.name: v.number for v in oe.values}
    new_by_name = {v.name: v.number for v in ne.values}
    new_by_number = {v.number: v.name for v in ne.values}
    new_since = {v.name: v.since for v in ne.values}
    for vname, num in old_by_name.items():
        if vname in new_by_name:
            if new_by_name[vname] != num:
                out.bad(
                    "ENUM_NUMBER",
                    subject,
                    f"value {vname} ({num})",
                    f"renumbered {num} -> {new_by_name[vname]}",
                )
        elif num in new_by_number and new_by_number[num] not in old_by_name:
            out.ok(
                "ENUM_VALUE_RENAMED",
                subject,
                f"value {vname} ({num})",
                f"renamed to {new_by_number[num]} (numbers are the wire, names are not)",
            )
        elif num in new_by_number:
            out.bad(
                "ENUM_NUMBER",
                subject,
                f"value {vname} ({num})",
                f"number {num} moved to {new_by_number[num]}",
            )
        elif num not in ne.reserved:
            out.bad("ENUM_NUMBER", subject, f"value {vname} ({num})", "removed without reserving its number")
    for vname, num in new_by_name.items():
        if vname in old_by_name or num in old_by_name.values():
            continue
        if num in oe.reserved:
            out.bad("ENUM_NUMBER", subject, f"value {vname} ({num})", f"reuses reserved number {num}")
        else:
            out.ok(
                "ENUM_VALUE",
                subject,
                f"value {vname} ({num})",
                f"added in {format_version(new_since[vname])}",
            )


def _message_history(old: Protocol, new: Protocol, out: _Collector) -> None:
    old_types = {m.type_id: m.name for m in old.messages.values() if m.type_id is not None}
    old_types.update({tid: f"reserved {n}" for tid, n in old.reserved_types})
    new_reserved_types = {tid for tid, _ in new.reserved_types}
    for tid, name in old.reserved_types:
        if tid not in new_reserved_types:
            out.bad(
                "TYPE_ID_UNRESERVED",
                f"reserved type {name}",
                None,
                f"reserved type id {tid} no longer reserved",
            )
    for name, om in old.messages.items():
        subject = f"message {name}"
        nm = new.messages.get(name)
        if nm is None:
            if om.type_id is not None and om.type_id not in new_reserved_types:
                out.bad(
                    "TYPE_ID_UNRESERVED",
                    subject,
                    None,
                    f"removed without reserving type id {om.type_id}",
                )
            else:
                out.ok("MESSAGE_REMOVED", subject, None, "removed (type id reserved)")
            continue
        _field_history(om, nm, out)
    for name, nm in new.messages.items():
        if name in old.messages:
            continue
        subject = f"message {name}"
        if nm.type_id is not None and nm.type_id in old_types:
            out.bad(
                "TYPE_ID_REUSED",
                subject,
                None,
                f"type id {nm.type_id} reused (was {old_types[nm.type_id]})",
            )
        else:
            out.ok("MESSAGE_ADDED", subject, None, f"added in {format_version(nm.since)}")


def _field_history(om: Message, nm: Message, out: _Collector) -> None:
    subject = f"message {om.name}"
    old_by_id = {f.id: f for f in om.fields}
    new_by_id = {f.id: f for f in nm.fields}
    new_by_name = {f.name: f for f in nm.fields}
    old_res = {r.id: r.name for r in om.reserved}
    new_res = {r.id: r.name for r in nm.reserved}
    old_res_names = set(old_res.values())
    for fid, of in old_by_id.items():
        item = f"field {of.name} (id {fid})"
        nf = new_by_id.get(fid)
        if nf is None:
            if new_res.get(fid) == of.name:
                out.ok("FIELD_RESERVED", subject, item, "moved to reserved")
            else:
                out.bad("FIELD_UNRESERVED", subject, item, "removed without reserving its id and name")
            continue
        if nf.name != of.name:
            moved = new_by_name.get(of.name)
            if moved is not None:
                out.bad(
                    "FIELD_SWAPPED",
                    subject,
                    item,
                    f"id now belongs to {nf.name} while {of.name} moved to id {moved.id} (ids swapped)",
                )
            else:
                out.ok("FIELD_RENAMED", subject, item, f"renamed to {nf.name} (names are not on the wire)")
        if of.removed is None and nf.removed is not None:
            out.ok(
                "FIELD_REMOVED",
                subject,
                item,
                f"removed from {format_version(nf.removed)} (position kept)",
            )
        if of.deprecated != nf.deprecated and nf.deprecated:
            out.ok("FIELD_DEPRECATED", subject, item, "deprecated")
    for fid, nf in new_by_id.items():
        if fid in old_by_id:
            continue
        item = f"field {nf.name} (id {fid})"
        if fid in old_res:
            out.bad("RESERVED_REUSED", subject, item, f"reuses reserved id {fid} (was {old_res[fid]})")
        elif nf.name in old_res_names:
            out.bad("RESERVED_REUSED", subject, item, f"reuses reserved name {nf.name}")
        elif nf.required and nf.since[1] > 0 and nf.since > nm.since:
            # the loader refuses this too; kept for models built without it
            out.bad(
                "REQUIRED_IN_MINOR",
                subject,
                item,
                f"required field added in minor {format_version(nf.since)}",
            )
        else:
            out.ok("FIELD_ADDED", subject, item, f"added in {format_version(nf.since)}")
    for rid, rname in old_res.items():
        if new_res.get(rid) != rname:
            out.bad("RESERVATION_DROPPED", subject, f"reserved {rname} (id {rid})", "reservation dropped")


# --- the handshake -------------------------------------------------------------------------------
def _handshake_rule(old: Protocol, new: Protocol, compared: set[Version], out: _Collector) -> None:
    """Hello's fields of the first released version keep their wire in every version of every
    major (nested messages included): any build reads any peer's Hello and refuses it by name.
    Versions in ``compared`` were judged whole already."""
    if HANDSHAKE not in old.messages or old.layout != "envelope":
        return
    if HANDSHAKE not in new.messages:
        out.bad("HANDSHAKE_FROZEN", f"message {HANDSHAKE}", None, "the handshake message is gone")
        return
    first = old.version_list[0]
    frozen = _frozen(old, first)
    for v in new.version_list:
        if v in compared:
            continue
        now = _frozen(new, v)
        for key, (label, shape) in frozen.items():
            got = now.get(key, (label, None))[1]
            if got == shape:
                continue
            out.at(
                v,
                "HANDSHAKE_FROZEN",
                f"message {key[0]}",
                label,
                f"{HANDSHAKE}'s leading fields are frozen across majors: {_describe_frozen(shape)} in "
                f"{format_version(first)}, {_describe_frozen(got)} in {{released}}; every build must "
                "read any peer's Hello to refuse it by name",
            )


_Frozen = dict[tuple[str, int], tuple[str, tuple[object, ...] | None]]


def _frozen(p: Protocol, v: Version) -> _Frozen:
    """(message, position) -> (field label, wire) for the handshake and every message it nests."""
    out: _Frozen = {}
    shape = shape_at(p, v)
    todo, seen = [HANDSHAKE], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in shape.messages:
            continue
        seen.add(name)
        m = p.messages[name]
        for s in shape.messages[name].slots:
            out[(name, s.position)] = (_field_label(s), (s.live, s.type, s.default))
            f = next((x for x in m.fields if x.id == s.field_id), None)
            if f is not None and s.live:
                todo += [t.name for t in f.type.walk() if t.kind == "message"]
    return out


def _describe_frozen(shape: tuple[object, ...] | None) -> str:
    if shape is None:
        return "absent"
    live, ty, default = shape
    if not live:
        return "a placeholder"
    return f"{ty}, {'required' if default is None else 'default ' + str(default)}"
