"""The envelope layout: typed view objects built from the model, rendered by the templates.

The views say *what* there is (a field, its type, default, the minor it appeared in, how an
older minor treats it); the templates in ``templates/envelope/`` say *how* it becomes code,
one macro per type kind (``macros.j2``). Output is formatted with ruff (:mod:`.format`).

One model per major: a major's structs are its newest minor's, and every older minor is
described by small declarations instead of copies: the body length per minor, what an
older minor cannot carry (``at``: hooks of ``migrate:``, fields dropped with
``downgrade: drop``, everything else refused), and, only for minors whose body still holds
fields removed later, a legacy layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pdwire.wirecore.envelope.negotiate import newest_minors

from .model import ARRAY_DTYPES, INT_RANGES, Enum, Field, Message, Protocol, TypeRef, Version, format_version
from .templating import banners, environment, render_formatted, render_package


def mod_name(v: Version) -> str:
    return f"v{v[0]}_{v[1]}"


def major_module(major: int) -> str:
    return f"v{major}"


def const(name: str) -> str:
    return name.upper()


# --- types -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TypeView:
    """A field type as the templates see it (``kind`` picks the macro)."""

    kind: str  # scalar, str, bytes, array, list, optional, enum, message
    name: str  # scalar name, array element, enum or message name
    elem: TypeView | None
    spell: str

    @property
    def dtype(self) -> str:
        """The array dtype constant (``U64``)."""
        return self.name.upper()

    @property
    def itemsize(self) -> int:
        return ARRAY_DTYPES[self.name][1]

    @property
    def lo(self) -> int:
        return INT_RANGES[self.name][0]

    @property
    def hi(self) -> int:
        return INT_RANGES[self.name][1]

    @property
    def converts(self) -> bool:
        """Whether values need conversion between the model and the wire (arrays, messages)."""
        return self.kind in ("array", "message") or (self.elem is not None and self.elem.converts)

    @property
    def reads_inline(self) -> bool:
        """An array or an optional array: the fast decoder reads it in one expression."""
        inner = self.elem if self.kind == "optional" else self
        return inner is not None and inner.kind == "array"

    def walk(self) -> list[TypeView]:
        return [self] + (self.elem.walk() if self.elem is not None else [])

    @property
    def messages(self) -> list[str]:
        return [t.name for t in self.walk() if t.kind == "message"]

    @property
    def enums(self) -> list[str]:
        return [t.name for t in self.walk() if t.kind == "enum"]


def type_view(t: TypeRef) -> TypeView:
    return TypeView(t.kind, t.name, type_view(t.elem) if t.elem is not None else None, t.spell())


# --- fields, slots, messages ---------------------------------------------------------------------
def _loops(t: TypeView) -> bool:
    """A list whose items need converting (arrays, messages): built by a loop."""
    return t.kind == "list" and t.elem is not None and t.elem.converts


@dataclass(frozen=True)
class FieldView:
    id: int
    name: str
    type: TypeView
    required: bool
    default: str  # the default as a Python literal of the model (enum member, [], b"", 0...)
    wire_value: str  # the default as it goes on the wire (what a placeholder carries)
    doc: str
    since: int  # minor of this major it appeared in (0 when it came with an earlier major)
    deprecated: str | None
    downgrade: str  # refuse, drop or hook: what an older minor does with a non-default value
    removed: str | None  # version text, for placeholders and legacy fields

    @property
    def where(self) -> str:
        return self.name

    @property
    def local(self) -> str:
        """The encoder's local variable holding the value (bound while it is checked)."""
        return f"x{self.id}"


@dataclass(frozen=True)
class SlotView:
    id: int
    field: FieldView | None  # None: a reserved id
    live: bool
    name: str  # field name (live), reserved_<id> (placeholder)
    note: str  # placeholders: why the position is kept


@dataclass(frozen=True)
class StepView:
    """What an older minor than ``minor`` cannot carry of one message."""

    minor: int
    hook: str | None  # migrations function called below this minor
    refused: list[FieldView]  # fields added at this minor: a non-default value is refused
    reset: list[FieldView]  # fields added at this minor that are dropped (by the hook or `drop`)
    enum_fields: list[tuple[FieldView, str]]  # (field, enum) whose enum gained values at this minor


@dataclass(frozen=True)
class LegacyView:
    """The body of an older minor that still carries fields the model has lost."""

    minor: int
    slots: list[SlotView]
    old: list[FieldView]  # the fields live here and removed later in the major
    hook_minor: int  # the minor whose hooks convert (the first after this one that removes them)


@dataclass
class MessageView:
    name: str
    doc: str
    type_id: int | None
    since: int
    fields: list[FieldView]
    slots: list[SlotView]
    lengths: list[int]  # body length at each minor of the major (0 when the message is absent)
    steps: list[StepView]
    nested_at: list[tuple[FieldView, int]]  # nested fields whose messages change below a minor
    nested_trim: list[tuple[SlotView, list[str]]]  # positions holding messages that need trimming
    legacy: list[LegacyView] = field(default_factory=list)
    # never a field of another message: its encoder runs only under the registry, whose slow
    # path names the field of an int that msgpack itself refuses (below -2**63, above 2**64 - 1)
    top_only: bool = False

    @property
    def scalars(self) -> list[FieldView]:
        """Fields checked on encode: ints, bools, enums and strings, optional or not."""
        out = []
        for f in self.fields:
            t = f.type.elem if f.type.kind == "optional" else f.type
            if t is not None and t.kind in ("scalar", "enum", "str"):
                out.append(f)
        return out

    @property
    def staged(self) -> list[SlotView]:
        """Live positions converted before the body list is built, in body order (so side
        frames keep their order): every converting one, when one of them is a list of
        converting items, which a loop builds (cheaper than a comprehension in CPython 3.11
        for the few items these lists hold)."""
        conv = [s for s in self.slots if s.live and s.field is not None and s.field.type.converts]
        return conv if any(s.field is not None and _loops(s.field.type) for s in conv) else []

    @property
    def has_at(self) -> bool:
        return bool(self.steps or self.nested_at)

    @property
    def last_change(self) -> int:
        """The newest minor below which ``at`` changes anything (0: never)."""
        return max([s.minor for s in self.steps] + [m for _, m in self.nested_at] + [0])

    @property
    def needs_trim(self) -> bool:
        newest = self.lengths[-1]
        return any(0 < n < newest for n in self.lengths) or bool(self.nested_trim)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)


@dataclass(frozen=True)
class EnumView:
    name: str
    doc: str
    values: list[tuple[str, int, int]]  # (CONST, number, minor it appeared in)

    @property
    def later(self) -> list[tuple[str, int, int]]:
        return [x for x in self.values if x[2] > 0]


@dataclass
class MajorView:
    major: int
    minors: list[int]
    module: str
    versions: list[tuple[Version, str]]  # (version, doc) of the minors
    enums: list[EnumView]
    messages: list[MessageView]  # nested first
    migrations: str | None

    @property
    def newest(self) -> int:
        return self.minors[-1]

    def _types(self) -> list[TypeView]:
        fields = [f for m in self.messages for f in m.fields]
        fields += [f for m in self.messages for lg in m.legacy for f in lg.old]
        fields += [s.field for m in self.messages for s in m.slots if s.field is not None]
        return [t for f in fields for t in f.type.walk()]

    @cached_property
    def uses_arrays(self) -> bool:
        """Whether any field holds a packed array (the module imports ``numpy.typing``)."""
        return any(t.kind == "array" for t in self._types())

    @cached_property
    def uses_wire_types(self) -> bool:
        """Whether any wire position has a range-checked type of ``pdwire.wirecore.types``."""
        return any(t.kind == "array" or (t.kind == "scalar" and t.name != "bool") for t in self._types())

    @property
    def top_level(self) -> list[MessageView]:
        return sorted((m for m in self.messages if m.type_id is not None), key=lambda m: m.type_id or 0)

    @property
    def text(self) -> str:
        return (
            f"{self.major}.{self.minors[0]}-{self.major}.{self.newest}"
            if len(self.minors) > 1
            else f"{self.major}.0"
        )


def literal(f: Field) -> str | None:
    """The default as a Python literal of the model (arrays: ``[]``, the templates print the
    module's shared read-only empty array); None when the field is required."""
    t, d = f.type, f.default
    if f.required:
        return None
    if t.kind in ("array", "list"):
        return "[]"
    if t.kind == "enum":
        return f"{t.name}.{const(str(d))}"
    if t.kind in ("bytes", "blob"):
        return 'b""'
    return repr(d)


def _wire_value(p: Protocol, f: Field | None) -> str:
    if f is None or f.required:
        return "None"
    t, d = f.type, f.default
    if t.kind in ("array", "bytes", "blob"):
        return 'b""'
    if t.kind == "list":
        return "[]"
    if t.kind == "enum":
        return str(next(v.number for v in p.enums[t.name].values if v.name == d))
    return repr(d)


def _minor_in(v: Version, major: int) -> int:
    """The minor of ``major`` a version maps to: its own minor, or 0 for an earlier major."""
    return v[1] if v[0] == major else 0


def _field_view(p: Protocol, f: Field, major: int) -> FieldView:
    return FieldView(
        id=f.id,
        name=f.name,
        type=type_view(f.type),
        required=f.required,
        default=literal(f) or "None",
        wire_value=_wire_value(p, f),
        doc=f.doc,
        since=_minor_in(f.since, major),
        deprecated=f.deprecated,
        downgrade=f.downgrade,
        removed=format_version(f.removed) if f.removed else None,
    )


def _slots(p: Protocol, m: Message, v: Version, major: int) -> list[SlotView]:
    out = []
    reserved = {r.id: r.name for r in m.reserved}
    for s in m.slots_at(v):
        if s.live and s.field is not None:
            out.append(SlotView(s.id, _field_view(p, s.field, major), True, s.field.name, ""))
            continue
        name = s.field.name if s.field is not None else reserved.get(s.id, f"#{s.id}")
        removed = s.field.removed if s.field is not None else None
        note = f"{name}: removed in {format_version(removed)}" if removed else f"{name}: reserved"
        fv = _field_view(p, s.field, major) if s.field is not None else None
        out.append(SlotView(s.id, fv, False, f"reserved_{s.id}", note))
    return out


def _enum_gains(e: Enum, major: int, minor: int) -> bool:
    return any(x.since == (major, minor) for x in e.values)


class _Builder:
    def __init__(self, p: Protocol, major: int) -> None:
        self.p = p
        self.major = major
        self.versions = [v for v in p.version_list if v[0] == major]
        self.newest = self.versions[-1]
        self.migrate = {info.version: set(info.migrate) for info in p.versions}
        self.views: dict[str, MessageView] = {}
        # messages that are a field of another, in any version (their encoders keep every bound)
        fields = [f for m in p.messages.values() for f in m.fields]
        self.nested = {t.name for f in fields for t in f.type.walk() if t.kind == "message"}

    def messages(self) -> list[Message]:
        """Messages of the major, nested ones before the messages that use them."""
        done: list[Message] = []
        seen: set[str] = set()

        def visit(m: Message) -> None:
            if m.name in seen:
                return
            seen.add(m.name)
            for f in m.fields:
                if f.slot_in(self.newest):
                    for t in f.type.walk():
                        if t.kind == "message":
                            visit(self.p.messages[t.name])
            done.append(m)

        for m in self.p.messages_at(self.newest):
            visit(m)
        return done

    def message(self, m: Message) -> MessageView:
        p, major, newest = self.p, self.major, self.newest
        fields = [_field_view(p, f, major) for f in m.fields_at(newest)]
        by_name = {f.name: f for f in fields}
        lengths = [len(m.slots_at(v)) if m.since <= v else 0 for v in self.versions]
        steps = []
        for v in self.versions[1:]:
            minor = v[1]
            hook = None
            if m.name in self.migrate.get(v, set()):
                hook = f"downgrade_{m.name}_{major}_{minor - 1}"
            added = [f for f in fields if f.since == minor and m.since < v]
            reset = [f for f in added if hook is not None or f.downgrade == "drop"]
            refused = [f for f in added if f not in reset]
            enums = [
                (f, e)
                for f in fields
                for e in f.type.enums
                if f.since < minor and _enum_gains(p.enums[e], major, minor)
            ]
            if hook or refused or reset or enums:
                steps.append(StepView(minor, hook, refused, reset, enums))
        nested_at = []
        nested_trim = []
        for s in _slots(p, m, newest, major):
            if not s.live or s.field is None:
                continue
            changes = [self.views[n].last_change for n in s.field.type.messages if self.views[n].has_at]
            if changes:
                nested_at.append((by_name[s.name], max(changes)))
            trims = [n for n in s.field.type.messages if self.views[n].needs_trim]
            if trims:
                nested_trim.append((s, trims))
        view = MessageView(
            name=m.name,
            doc=m.doc,
            type_id=m.type_id,
            since=_minor_in(m.since, major),
            fields=fields,
            slots=_slots(p, m, newest, major),
            lengths=lengths,
            steps=sorted(steps, key=lambda s: -s.minor),
            nested_at=nested_at,
            nested_trim=nested_trim,
            top_only=m.type_id is not None and m.name not in self.nested,
        )
        for v in self.versions:
            old = self._legacy_fields(m, v)
            if not old:
                continue
            first_removed = min(f.removed for f in old if f.removed is not None)
            if m.name not in self.migrate.get(first_removed, set()):
                # no hook converts the removed fields: the newest body reads this minor too
                # (their positions are placeholders) and writes their defaults there
                continue
            view.legacy.append(
                LegacyView(
                    minor=v[1],
                    slots=_slots(p, m, v, major),
                    old=[_field_view(p, f, major) for f in old],
                    hook_minor=first_removed[1],
                )
            )
        self.views[m.name] = view
        return view

    def _legacy_fields(self, m: Message, v: Version) -> list[Field]:
        """Fields live at ``v`` that the major's newest minor no longer has."""
        if m.since > v:
            return []
        return [f for f in m.fields if f.present_in(v) and not f.present_in(self.newest)]

    def build(self) -> MajorView:
        p, major = self.p, self.major
        msgs = [self.message(m) for m in self.messages()]
        enums = [
            EnumView(
                e.name,
                e.doc,
                [(const(x.name), x.number, _minor_in(x.since, major)) for x in e.values_at(self.newest)],
            )
            for e in p.enums_at(self.newest)
        ]
        info = {i.version: i.doc for i in p.versions}
        return MajorView(
            major=major,
            minors=[v[1] for v in self.versions],
            module=major_module(major),
            versions=[(v, info[v]) for v in self.versions],
            enums=enums,
            messages=msgs,
            migrations=p.migrations,
        )


def major_views(p: Protocol) -> list[MajorView]:
    return [_Builder(p, major).build() for major in sorted({v[0] for v in p.version_list})]


def supported(p: Protocol) -> list[Version]:
    return sorted(newest_minors(p.version_list).items())


def show_default(f: Field) -> str:
    if f.required:
        return "required"
    d = f.default
    if isinstance(d, bytes):
        return '`""`'
    if isinstance(d, bool):
        return f"`{str(d).lower()}`"
    if d is None:
        return "`null`"
    if isinstance(d, str) and f.type.kind == "str":
        return f'`"{d}"`'
    return f"`{d}`"


def _names(items: Iterable[Any]) -> list[str]:
    return [x.name for x in items]


# the protocol whose generated package is `pdwire.wire` itself; others get a sub-package
ROOT_PROTOCOL = "pdwire"


def package_of(p: Protocol) -> str:
    return "pdwire.wire" if p.name == ROOT_PROTOCOL else f"pdwire.wire.{p.name}"


def render_protocol(p: Protocol, source: str) -> dict[str, str]:
    """Every generated file of one protocol (envelope layout): relative path -> text."""
    env = environment()
    majors = major_views(p)
    newest = majors[-1]
    hello = p.messages.get("Hello")
    ctx: dict[str, Any] = {
        "p": p,
        "package": package_of(p),
        **banners(source),
        "majors": majors,
        "newest": newest,
        "newest_names": sorted(_names(newest.enums) + _names(newest.messages)),
        "supported": supported(p),
        "hello": hello,
        "frozen": [hello.type_id] if hello is not None and hello.type_id is not None else [],
        "fmt": format_version,
        "show_default": show_default,
        "versions": p.version_list,
    }
    files = render_package(env, "envelope", ctx, ("codec.py", "strategies.py", "__init__.py", "features.py"))
    for mv in majors:
        files[f"{mv.module}.py"] = render_formatted(env, "envelope/major.py.j2", f"{mv.module}.py", ctx, m=mv)
    return files
