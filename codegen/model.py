"""The typed intermediate model every later step works on.

A :class:`Protocol` holds versions, enums and messages; a :class:`Field` knows the version
it appeared in and, if any, the version it was removed in, so the generator can produce
one view per version (:meth:`Message.slots_at`). Wire *layouts* are separate from the
model: a layout decides how fields become frames (see :mod:`.render`), the model only
records facts about the schema, plus an optional per-field ``encoding`` hint that
positional layouts consume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdwire.wirecore.types import Version as Version  # the one (major, minor) type, re-exported

TypeKind = Literal["scalar", "str", "bytes", "blob", "array", "list", "optional", "enum", "message"]

# scalar name -> inclusive (min, max); bool has no range
INT_RANGES: dict[str, tuple[int, int]] = {
    "u8": (0, 2**8 - 1),
    "u16": (0, 2**16 - 1),
    "u32": (0, 2**32 - 1),
    "u64": (0, 2**64 - 1),
    "i32": (-(2**31), 2**31 - 1),
    "i64": (-(2**63), 2**63 - 1),
}
SCALARS = frozenset([*INT_RANGES, "bool"])

# packed array element -> (numpy little-endian dtype string, item size)
ARRAY_DTYPES: dict[str, tuple[str, int]] = {
    "i32": ("<i4", 4),
    "u32": ("<u4", 4),
    "u64": ("<u8", 8),
}


def format_version(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


@dataclass(frozen=True)
class TypeRef:
    """A field type. ``name`` is the scalar, array element, enum or message name."""

    kind: TypeKind
    name: str = ""
    elem: TypeRef | None = None

    def spell(self) -> str:
        """The canonical schema spelling (used in diffs and the reference)."""
        if self.kind == "array":
            return f"{self.name}[]"
        if self.kind in ("list", "optional"):
            assert self.elem is not None
            return f"{self.kind}<{self.elem.spell()}>"
        if self.kind in ("str", "bytes", "blob"):
            return self.kind
        return self.name

    def walk(self) -> list[TypeRef]:
        """This type and every type nested in it, outermost first."""
        out = [self]
        if self.elem is not None:
            out.extend(self.elem.walk())
        return out


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


@dataclass(frozen=True)
class Field:
    id: int
    name: str
    type: TypeRef
    default: object  # UNSET when the field is required
    since: Version
    removed: Version | None = None
    deprecated: str | None = None
    doc: str = ""
    encoding: str | None = None
    frame: int | None = None  # positional layouts only
    fallback: str | None = None  # positional layouts only
    downgrade: str = "refuse"  # or "drop": what sending to a minor before `since` does with a value

    @property
    def required(self) -> bool:
        return self.default is UNSET

    def present_in(self, v: Version) -> bool:
        return self.since <= v and (self.removed is None or v < self.removed)

    def slot_in(self, v: Version) -> bool:
        """Whether the body of version ``v`` has a position for this field (present or placeholder)."""
        return self.since <= v


@dataclass(frozen=True)
class Reserved:
    id: int
    name: str
    doc: str = ""


@dataclass(frozen=True)
class Slot:
    """One position of a message body at one version."""

    id: int
    field: Field | None  # None: a reserved id with no recorded type
    live: bool  # False: a placeholder (removed or reserved), written as the old default


@dataclass(frozen=True)
class Message:
    name: str
    type_id: int | None  # None: only ever nested inside other messages
    since: Version
    doc: str
    fields: tuple[Field, ...]
    reserved: tuple[Reserved, ...] = ()
    # positional layouts only (see codegen/positional.py)
    backend: str | None = None
    min_frames: tuple[tuple[Version, int], ...] = ()  # from the version on
    match: tuple[tuple[int, str], ...] = ()
    checks: tuple[str, ...] = ()
    derived: tuple[tuple[str, str], ...] = ()

    def fields_at(self, v: Version) -> list[Field]:
        return [f for f in self.fields if f.present_in(v)]

    def slots_at(self, v: Version) -> list[Slot]:
        """Body positions at ``v``: ids 0..n-1 where n covers every field that exists by ``v``."""
        by_id = {f.id: f for f in self.fields if f.slot_in(v)}
        if not by_id:
            return []
        top = max(by_id)
        reserved_ids = {r.id for r in self.reserved}
        slots: list[Slot] = []
        for i in range(top + 1):
            f = by_id.get(i)
            if f is not None:
                slots.append(Slot(i, f, f.present_in(v)))
            else:
                assert i in reserved_ids or any(x.id == i for x in self.fields), i
                slots.append(Slot(i, None, False))
        return slots


@dataclass(frozen=True)
class EnumValue:
    name: str
    number: int
    since: Version


@dataclass(frozen=True)
class Enum:
    name: str
    doc: str
    since: Version
    values: tuple[EnumValue, ...]
    reserved: tuple[int, ...] = ()

    def values_at(self, v: Version) -> list[EnumValue]:
        return [x for x in self.values if x.since <= v]


@dataclass(frozen=True)
class VersionInfo:
    version: Version
    doc: str
    migrate: tuple[str, ...] = ()
    promises: tuple[tuple[str, str], ...] = ()  # (name, what peers may rely on) made from here on


@dataclass(frozen=True)
class Protocol:
    name: str
    protocol_id: int
    layout: str
    source: str  # file the protocol was loaded from (for messages)
    versions: tuple[VersionInfo, ...]
    enums: dict[str, Enum] = field(default_factory=dict)
    messages: dict[str, Message] = field(default_factory=dict)
    migrations: str | None = None
    reserved_types: tuple[tuple[int, str], ...] = ()
    rules: str | None = None  # positional layouts only

    @property
    def version_list(self) -> list[Version]:
        return [v.version for v in self.versions]

    @property
    def newest(self) -> Version:
        return self.versions[-1].version

    def messages_at(self, v: Version) -> list[Message]:
        return [m for m in self.messages.values() if m.since <= v]

    def enums_at(self, v: Version) -> list[Enum]:
        return [e for e in self.enums.values() if e.since <= v]

    def top_level(self) -> list[Message]:
        return sorted(
            (m for m in self.messages.values() if m.type_id is not None), key=lambda m: m.type_id or 0
        )
