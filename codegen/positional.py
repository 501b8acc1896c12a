"""The positional layout: each field is one frame, written with its ``encoding:``.

Used for foreign protocols whose frames are fixed positions (SGLang's Mooncake/NIXL/MoRI
control messages). :func:`check_positional` adds the layout's rules to the evolution
checks; :func:`render_positional` builds typed view objects and renders the templates in
``templates/positional/``. As in :mod:`.render`, the views say what a frame is and the
templates (``macros.j2``, one macro per direction, switching on the encoding) how it becomes
code: which ``pdwire.wirecore.positional.encodings`` call reads or writes it, the inline common
case, what an absent frame decodes to.

The schema keys (per field ``frame``, ``encoding`` (see :data:`ENCODINGS`), ``fallback``; per
message ``backend``, ``min_frames``, ``match``, ``checks``, ``derived``) are described in
docs/wire.md ("Positional layout").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdwire.wirecore.positional.codec import PREDICATES

from .errors import SchemaError, where
from .model import INT_RANGES, Field, Message, Protocol, TypeRef, Version, format_version
from .render import TypeView, literal, mod_name, type_view
from .templating import banners, environment, render_formatted, render_package

# encoding -> type spellings it accepts ("int" = any integer scalar, "enum" = any enum)
ENCODINGS: dict[str, frozenset[str]] = {
    "const": frozenset({"str"}),
    "ascii": frozenset({"str"}),
    "utf8": frozenset({"str", "optional<str>"}),
    "ascii_int": frozenset({"int", "optional<int>", "enum"}),
    "flag01": frozenset({"bool", "optional<bool>"}),
    "native_u64": frozenset({"optional<int>"}),  # u64 only (checked below)
    "native_u64_array": frozenset({"u64[]"}),
    "native_u32_array": frozenset({"u32[]"}),
    "native_i32_array": frozenset({"i32[]"}),
    "le_u32_array": frozenset({"u32[]"}),
    "le_list_of_lists": frozenset({"list<i32[]>", "list<u32[]>", "list<u64[]>"}),
    "msgpack_blob_list": frozenset({"list<blob>", "list<list<optional<blob>>>"}),
    "ascii_csv": frozenset({"list<str>"}),
    "raw": frozenset({"blob", "bytes"}),
}
FALLBACKS = frozenset({"empty", "blank", "omit"})
# encodings.read_int* compare a decimal read from digits alone with the upper bound only
assert all(lo <= 0 for lo, _ in INT_RANGES.values()), "an integer type with a positive lower bound"
_DERIVED_RE = re.compile(r"^([a-z_][a-z0-9_]*)\s*->\s*(.+)$")


def type_class(t: TypeRef) -> str:
    """The spelling :data:`ENCODINGS` keys on: integer scalars as ``int``, enums as ``enum``."""
    if t.kind == "scalar" and t.name != "bool":
        return "int"
    if t.kind == "enum":
        return "enum"
    if t.kind == "optional" and t.elem is not None and t.elem.kind == "scalar" and t.elem.name != "bool":
        return "optional<int>"
    return t.spell()


def min_frames_at(m: Message, v: Version) -> int | None:
    best = None
    for since, n in m.min_frames:
        if since <= v:
            best = n
    return best


# --- checks -------------------------------------------------------------------------------------
def check_positional(p: Protocol) -> None:
    f = p.source
    if p.rules is None:
        raise SchemaError(where(f), "a positional protocol names its `rules` module")
    for m in p.messages.values():
        if m.type_id is None:
            raise SchemaError(where(f, m.name), "positional messages are top level (give a type_id)")
        if not m.backend:
            raise SchemaError(where(f, m.name), "positional messages name their backend")
        if not m.min_frames:
            raise SchemaError(where(f, m.name), "positional messages give min_frames")
        for name in m.checks:
            if not name.isidentifier():
                raise SchemaError(where(f, m.name), f"check {name!r} is not a function name")
        for prop, spec in m.derived:
            if not prop.isidentifier() or _DERIVED_RE.match(spec) is None:
                raise SchemaError(where(f, m.name), f"derived {prop}: write it as 'function -> type'")
        for fld in m.fields:
            _check_field(p, m, fld)
        for v in p.version_list:
            if m.since <= v:
                _check_frames(p, m, v)


def _check_field(p: Protocol, m: Message, fld: Field) -> None:
    loc = where(p.source, m.name, f"{fld.name} (id {fld.id})")
    if fld.frame is None or fld.frame < 0:
        raise SchemaError(loc, "positional fields give their frame index (>= 0)")
    if fld.encoding not in ENCODINGS:
        raise SchemaError(loc, f"unknown encoding {fld.encoding!r} (known: {sorted(ENCODINGS)})")
    tc = type_class(fld.type)
    if tc not in ENCODINGS[fld.encoding]:
        allowed = ", ".join(sorted(ENCODINGS[fld.encoding]))
        raise SchemaError(
            loc, f"encoding {fld.encoding} does not carry {fld.type.spell()} (carries {allowed})"
        )
    if fld.encoding == "native_u64" and fld.type.spell() != "optional<u64>":
        raise SchemaError(loc, "encoding native_u64 carries optional<u64> only")
    if fld.encoding == "const" and not isinstance(fld.default, str):
        raise SchemaError(loc, "a const frame gives its text as the default")
    if fld.fallback is not None:
        if fld.fallback not in FALLBACKS:
            raise SchemaError(loc, f"unknown fallback {fld.fallback!r} (known: {sorted(FALLBACKS)})")
        if fld.required:
            raise SchemaError(loc, f"fallback {fld.fallback} needs a default")
        if fld.fallback in ("empty", "blank") and (fld.encoding != "ascii_int" or tc != "int"):
            raise SchemaError(loc, f"fallback {fld.fallback} applies to ascii_int integers only")


def _check_frames(p: Protocol, m: Message, v: Version) -> None:
    loc = where(p.source, m.name) + f" at {format_version(v)}"
    fields = sorted(m.fields_at(v), key=lambda x: x.frame or 0)
    frames = [x.frame for x in fields]
    if frames != list(range(len(frames))):
        raise SchemaError(loc, f"frames must be 0..n-1, each once; got {frames}")
    low = min_frames_at(m, v)
    if low is None or not 1 <= low <= len(fields):
        raise SchemaError(loc, f"min_frames {low} must be in 1..{len(fields)}")
    for x in fields:
        assert x.frame is not None
        if x.frame >= low and x.required:
            raise SchemaError(
                loc + f", field {x.name}",
                f"frame {x.frame} may be missing (min_frames {low}) so the field needs a default",
            )
        if x.fallback == "omit" and (x.frame != len(fields) - 1 or x.frame < low):
            raise SchemaError(loc + f", field {x.name}", "fallback omit is for the last, optional frame")
        if x.encoding == "const" and x.frame >= low:
            raise SchemaError(loc + f", field {x.name}", "const frames are always present")
    for i, pred in m.match:
        if pred not in PREDICATES or not 0 <= i < low:
            raise SchemaError(
                loc, f"match {i}: {pred} needs a predicate {sorted(PREDICATES)} on an always-present frame"
            )


# --- views -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FrameView:
    """One frame of a message at one version: a field, or a fixed (``const``) frame."""

    frame: int
    name: str
    encoding: str
    type: TypeView
    const: str | None  # literal text of a const frame
    default: str | None  # the default as a Python literal of the model; None: required
    fallback: str | None  # empty, blank or omit (module docstring); None: none
    absent: bool  # may be missing (frame >= min_frames): then it decodes to the default
    doc: str
    since: str

    @property
    def optional(self) -> bool:
        return self.type.kind == "optional"

    @property
    def value(self) -> TypeView:
        """The type without ``optional<>``."""
        return self.type.elem if self.type.elem is not None and self.optional else self.type

    @property
    def lo(self) -> int:
        return self.value.lo

    @property
    def hi(self) -> int:
        return self.value.hi

    @property
    def const_bytes(self) -> bytes:
        assert self.const is not None
        return self.const.encode("ascii")

    @property
    def dtype(self) -> str:
        """The ``encodings`` dtype of an array frame or of a list of arrays' items."""
        if self.encoding == "le_list_of_lists":
            assert self.type.elem is not None
            return f"LE_{self.type.elem.name.upper()}"
        return self.encoding.removesuffix("_array").upper()  # native_u64_array: NATIVE_U64

    @property
    def nested(self) -> bool:
        """A list of lists (``msgpack_blob_list`` of ``list<list<optional<blob>>>``)."""
        return self.type.elem is not None and self.type.elem.kind == "list"


@dataclass(frozen=True)
class DerivedView:
    name: str
    func: str
    type: str


@dataclass(frozen=True)
class MessageView:
    name: str
    backend: str
    doc: str
    frames: list[FrameView]
    min_frames: int
    match: list[tuple[int, str]]  # (frame, predicate) that recognise the message
    checks: list[str]
    derived: list[DerivedView]

    @property
    def fields(self) -> list[FrameView]:
        return [f for f in self.frames if f.const is None]

    @property
    def consts(self) -> list[FrameView]:
        return [f for f in self.frames if f.const is not None]

    @property
    def recognised_beyond_head(self) -> bool:
        """Recognition tests more than a frame-0 literal (other fixed frames, predicates)."""
        return bool(self.match) or any(f.frame != 0 for f in self.consts)


@dataclass(frozen=True)
class EnumView:
    name: str
    doc: str
    values: list[tuple[str, int]]  # (CONST, number)


@dataclass(frozen=True)
class ImportView:
    """``from <module> import <name> as <alias>``."""

    module: str
    name: str
    alias: str


@dataclass(frozen=True)
class VersionView:
    version: Version
    text: str
    module: str
    doc: str
    messages: list[MessageView]
    enums: list[EnumView]
    # messages and enums identical to an earlier version's: name -> the module defining them
    shared: dict[str, str] = field(default_factory=dict)
    # name -> every version whose model is the one defined here
    versions_of: dict[str, list[Version]] = field(default_factory=dict)

    @property
    def own_messages(self) -> list[MessageView]:
        return [m for m in self.messages if m.name not in self.shared]

    @property
    def own_enums(self) -> list[EnumView]:
        return [e for e in self.enums if e.name not in self.shared]

    @property
    def shared_enums(self) -> list[EnumView]:
        return [e for e in self.enums if e.name in self.shared]

    @property
    def shared_messages(self) -> list[MessageView]:
        return [m for m in self.messages if m.name in self.shared]

    @property
    def sources(self) -> list[str]:
        """The earlier modules this one takes shared definitions from."""
        return sorted(set(self.shared.values()))

    @property
    def names(self) -> list[str]:
        """The enums and messages of this version."""
        return [e.name for e in self.enums] + [m.name for m in self.messages]


def _message_view(p: Protocol, m: Message, v: Version) -> MessageView:
    low = min_frames_at(m, v)
    assert low is not None and m.backend is not None
    frames = []
    for f in sorted(m.fields_at(v), key=lambda x: x.frame or 0):
        assert f.frame is not None
        frames.append(
            FrameView(
                frame=f.frame,
                name=f.name,
                encoding=f.encoding or "",
                type=type_view(f.type),
                const=str(f.default) if f.encoding == "const" else None,
                default=literal(f),
                fallback=f.fallback,
                absent=f.frame >= low,
                doc=f.doc,
                since=format_version(f.since),
            )
        )
    derived = []
    for prop, spec in m.derived:
        match = _DERIVED_RE.match(spec)
        assert match is not None
        derived.append(DerivedView(prop, match.group(1), match.group(2).strip()))
    return MessageView(
        name=m.name,
        backend=m.backend,
        doc=m.doc,
        frames=frames,
        min_frames=low,
        match=list(m.match),
        checks=list(m.checks),
        derived=derived,
    )


def version_views(p: Protocol) -> list[VersionView]:
    out: list[VersionView] = []
    for info in p.versions:
        v = info.version
        enums = [
            EnumView(e.name, e.doc, [(x.name.upper(), x.number) for x in e.values_at(v)])
            for e in p.enums_at(v)
        ]
        msgs = [_message_view(p, m, v) for m in p.messages_at(v)]
        out.append(VersionView(v, format_version(v), mod_name(v), info.doc, msgs, enums))
    _share(p, out)
    return out


def _share(p: Protocol, versions: list[VersionView]) -> None:
    """An enum or message whose view is identical to one of an earlier version is defined once,
    in the earliest, and the later modules take it from there: one class per distinct model
    (its ``VERSIONS`` lists where it applies). A message is shared only with every enum it uses."""
    home: dict[tuple[str, object], VersionView] = {}  # (name, view) -> the defining version
    for vv in versions:
        for e in vv.enums:
            key = (e.name, repr(e))
            if key in home:
                vv.shared[e.name] = home[key].module
            else:
                home[key] = vv
            home[key].versions_of.setdefault(e.name, []).append(vv.version)
        for m in vv.messages:
            key = (m.name, repr(m))
            fields = p.messages[m.name].fields_at(vv.version)
            used = {t.name for f in fields for t in f.type.walk() if t.kind == "enum"}
            if key in home and all(home[key].module == vv.shared.get(e) for e in used):
                vv.shared[m.name] = home[key].module
            else:
                home[key] = vv
            home[key].versions_of.setdefault(m.name, []).append(vv.version)


def _imports(rules: str | None, uses_rules: bool) -> list[ImportView]:
    """The runtime imports of a version module, in the order ruff's isort wants them
    (the rules module only where a message names a check or a derived property)."""
    out = [
        ImportView("pdwire", "wirecore", "_wc"),
        ImportView("pdwire.wirecore.positional", "encodings", "_fe"),
        ImportView("pdwire.wirecore.positional", "codec", "_pc"),
        ImportView("pdwire.wirecore.arrays", "values_equal", "_eq"),
        ImportView("pdwire.wirecore.positional.errors", "Where", "_Where"),
    ]
    if uses_rules and rules:
        pkg, _, mod = rules.rpartition(".")
        out.append(ImportView(pkg, mod, "_rules"))
    return sorted(out, key=lambda x: (x.module, x.name))


def render_positional(p: Protocol, source: str) -> dict[str, str]:
    """Every generated file of one positional protocol: relative path -> text."""
    env = environment()
    versions = version_views(p)
    ctx = {
        "p": p,
        **banners(source),
        "versions": versions,
        "newest": versions[-1],
        "backends": sorted({m.backend for v in versions for m in v.messages}),
        "imports": _imports(p.rules, any(m.checks or m.derived for m in p.messages.values())),
    }
    files = render_package(env, "positional", ctx, ("codec.py", "strategies.py", "__init__.py"))
    for vv in versions:
        files[f"{vv.module}.py"] = render_formatted(
            env, "positional/version.py.j2", f"{vv.module}.py", ctx, v=vv
        )
    return files
