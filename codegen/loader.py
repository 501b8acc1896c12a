"""YAML text -> :class:`~.schema_doc.ProtocolDoc` -> :class:`~.model.Protocol`.

Every failure raises :class:`~.errors.SchemaError` naming the file, message and field.
Cross-cutting rules (ids, evolution) live in :mod:`.evolution`, which :func:`load_file`
runs after building the model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import msgspec
import yaml

from .errors import SchemaError, where
from .model import (
    ARRAY_DTYPES,
    INT_RANGES,
    SCALARS,
    UNSET,
    Enum,
    EnumValue,
    Field,
    Message,
    Protocol,
    Reserved,
    TypeRef,
    Version,
    VersionInfo,
)
from .schema_doc import FieldDoc, MessageDoc, ProtocolDoc

_VERSION_RE = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_FIELD_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def parse_version(text: str, loc: str) -> Version:
    m = _VERSION_RE.match(str(text))
    if m is None:
        raise SchemaError(loc, f"version {text!r} is not of the form MAJOR.MINOR")
    return int(m.group(1)), int(m.group(2))


def parse_type(text: str, loc: str, enums: Mapping[str, object], messages: Mapping[str, object]) -> TypeRef:
    """Parse a field type: ``u32``, ``i32[]``, ``list<T>``, ``optional<T>``, ``str``, ``blob``, a name."""
    t = text.strip()
    for wrapper in ("list", "optional"):
        if t.startswith(wrapper + "<") and t.endswith(">"):
            inner = parse_type(t[len(wrapper) + 1 : -1], loc, enums, messages)
            if wrapper == "optional" and inner.kind == "optional":
                raise SchemaError(loc, f"type {text!r}: optional<optional<...>> is ambiguous")
            return TypeRef(wrapper, elem=inner)  # type: ignore[arg-type]
    if t.endswith("[]"):
        elem = t[:-2]
        if elem not in ARRAY_DTYPES:
            raise SchemaError(loc, f"type {text!r}: packed arrays exist for {sorted(ARRAY_DTYPES)} only")
        return TypeRef("array", elem)
    if t in SCALARS:
        return TypeRef("scalar", t)
    if t in ("str", "bytes", "blob"):
        return TypeRef(t)  # type: ignore[arg-type]
    if t in enums:
        return TypeRef("enum", t)
    if t in messages:
        return TypeRef("message", t)
    raise SchemaError(loc, f"unknown type {text!r}")


def _check_default(f: FieldDoc, ty: TypeRef, enums: Mapping[str, msgspec.Struct], loc: str) -> object:
    d = f.default
    if d is msgspec.UNSET:
        return UNSET
    bad = f"default {d!r} does not fit type {ty.spell()}"
    if ty.kind == "scalar":
        if ty.name == "bool":
            if not isinstance(d, bool):
                raise SchemaError(loc, bad)
            return d
        lo, hi = INT_RANGES[ty.name]
        if isinstance(d, bool) or not isinstance(d, int) or not lo <= d <= hi:
            raise SchemaError(loc, bad)
        return d
    if ty.kind == "str":
        if not isinstance(d, str):
            raise SchemaError(loc, bad)
        return d
    if ty.kind in ("bytes", "blob"):
        if d != "":
            raise SchemaError(loc, bad + ' (only "" is allowed)')
        return b""
    if ty.kind in ("array", "list"):
        if d != []:
            raise SchemaError(loc, bad + " (only [] is allowed)")
        return []
    if ty.kind == "optional":
        if d is not None:
            raise SchemaError(loc, bad + " (only null is allowed)")
        return None
    if ty.kind == "enum":
        values = getattr(enums[ty.name], "values", {})
        if not isinstance(d, str) or d not in values:
            raise SchemaError(loc, bad + f" (expected one of {sorted(values)})")
        return d
    raise SchemaError(loc, f"fields of message type {ty.name} cannot have a default")


def _build_field(
    fd: FieldDoc, msg_name: str, md: MessageDoc, doc: ProtocolDoc, file: str, first: str
) -> Field:
    loc = where(file, msg_name, f"{fd.name} (id {fd.id})")
    if not _FIELD_NAME_RE.match(fd.name):
        raise SchemaError(loc, "field names are lower_snake_case")
    if fd.id < 0:
        raise SchemaError(loc, "field ids are >= 0")
    ty = parse_type(fd.type, loc, doc.enums, doc.messages)
    since = parse_version(fd.since or md.since or first, loc)
    removed = parse_version(fd.removed, loc) if fd.removed is not None else None
    deprecated = (
        None if fd.deprecated is False else "deprecated" if fd.deprecated is True else str(fd.deprecated)
    )
    return Field(
        id=fd.id,
        name=fd.name,
        type=ty,
        default=_check_default(fd, ty, doc.enums, loc),
        since=since,
        removed=removed,
        deprecated=deprecated,
        doc=fd.doc.strip(),
        encoding=fd.encoding,
        frame=fd.frame,
        fallback=fd.fallback,
        downgrade=_downgrade(fd, loc),
    )


def _downgrade(fd: FieldDoc, loc: str) -> str:
    if fd.downgrade not in ("refuse", "drop"):
        raise SchemaError(loc, f"downgrade {fd.downgrade!r}: refuse (the default) or drop")
    if fd.downgrade == "drop" and fd.default is msgspec.UNSET:
        raise SchemaError(loc, "downgrade: drop needs a default (what older minors read instead)")
    return fd.downgrade


def _min_frames(md: MessageDoc, name: str, file: str, first: str) -> tuple[tuple[Version, int], ...]:
    if md.min_frames is None:
        return ()
    if isinstance(md.min_frames, int):
        return ((parse_version(md.since or first, where(file, name)), md.min_frames),)
    return tuple(sorted((parse_version(k, where(file, name)), n) for k, n in md.min_frames.items()))


def build_protocol(doc: ProtocolDoc, file: str) -> Protocol:
    """Build the model from a decoded document; no evolution rules yet."""
    versions = tuple(
        VersionInfo(
            parse_version(v.version, where(file) + f", version {v.version}"),
            v.doc.strip(),
            tuple(v.migrate),
            tuple((name, " ".join(text.split())) for name, text in v.promises.items()),
        )
        for v in doc.versions
    )
    if not versions:
        raise SchemaError(where(file), "a protocol lists at least one version")
    first = doc.versions[0].version  # what `since` defaults to
    enums: dict[str, Enum] = {}
    for name, ed in doc.enums.items():
        loc = f"{where(file)}: enum {name}"
        if not _NAME_RE.match(name):
            raise SchemaError(loc, "enum names are identifiers")
        since = parse_version(ed.since or first, loc)
        vals = []
        for vname, num in ed.values.items():
            if not _FIELD_NAME_RE.match(vname):
                raise SchemaError(f"{loc}, value {vname}", "enum value names are lower_snake_case")
            vsince = parse_version(ed.value_since.get(vname, ed.since or first), f"{loc}, value {vname}")
            vals.append(EnumValue(vname, num, vsince))
        for vname in ed.value_since:
            if vname not in ed.values:
                raise SchemaError(loc, f"value_since names unknown value {vname!r}")
        enums[name] = Enum(name, ed.doc.strip(), since, tuple(vals), tuple(ed.reserved))
    messages: dict[str, Message] = {}
    for name, md in doc.messages.items():
        if not _NAME_RE.match(name) or not name[0].isupper():
            raise SchemaError(where(file, name), "message names are CapitalisedIdentifiers")
        if name in enums:
            raise SchemaError(where(file, name), "a message and an enum share this name")
        fields = tuple(_build_field(fd, name, md, doc, file, first) for fd in md.fields)
        reserved = tuple(Reserved(r.id, r.name, r.doc) for r in md.reserved)
        messages[name] = Message(
            name=name,
            type_id=md.type_id,
            since=parse_version(md.since or first, where(file, name)),
            doc=md.doc.strip(),
            fields=fields,
            reserved=reserved,
            backend=md.backend,
            min_frames=_min_frames(md, name, file, first),
            match=tuple(sorted(md.match.items())),
            checks=tuple(md.checks),
            derived=tuple(md.derived.items()),
        )
    return Protocol(
        name=doc.protocol,
        protocol_id=doc.protocol_id,
        layout=doc.layout,
        source=file,
        versions=versions,
        enums=enums,
        messages=messages,
        migrations=doc.migrations,
        reserved_types=tuple((r.type_id, r.name) for r in doc.reserved_types),
        rules=doc.rules,
    )


def _locate(raw: object, file: str) -> str:
    """Find which message and field of a document fails to convert (msgspec hides dict keys)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("messages"), dict):
        return where(file)
    for name, body in raw["messages"].items():
        try:
            msgspec.convert(body, MessageDoc)
        except msgspec.ValidationError:
            fields = body.get("fields") if isinstance(body, dict) else None
            for i, fd in enumerate(fields if isinstance(fields, list) else []):
                try:
                    msgspec.convert(fd, FieldDoc)
                except msgspec.ValidationError:
                    label = fd.get("name") if isinstance(fd, dict) else None
                    return where(file, str(name), f"#{i}" + (f" ({label})" if label else ""))
            return where(file, str(name))
    return where(file)


def decode_document(text: str, file: str) -> ProtocolDoc:
    """Parse YAML text into the document structs, naming the file, message and field on failure."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SchemaError(where(file), f"not valid YAML: {exc}") from None
    try:
        return msgspec.convert(raw, ProtocolDoc)
    except msgspec.ValidationError as exc:
        raise SchemaError(_locate(raw, file), str(exc)) from None


def load_text(text: str, file: str) -> Protocol:
    """Load and fully check one protocol from YAML text."""
    from .evolution import check_protocol

    proto = build_protocol(decode_document(text, file), file)
    check_protocol(proto)
    return proto


def load_file(path: Path) -> Protocol:
    return load_text(path.read_text(encoding="utf-8"), str(path))


def load_dir(path: Path) -> list[Protocol]:
    """Every ``*.yaml`` protocol in a schema folder, sorted by file name."""
    files = sorted(path.glob("*.yaml"))
    if not files:
        raise SchemaError(str(path), "no *.yaml schema files")
    return [load_file(f) for f in files]


def load_texts(texts: Mapping[str, str]) -> list[Protocol]:
    """Like :func:`load_dir` for in-memory files (a git revision): name -> text."""
    return [load_text(texts[name], name) for name in sorted(texts)]
