"""The positional layout: each field is one frame, written with its ``encoding:``.

Used for foreign protocols whose frames are fixed positions (SGLang's Mooncake/NIXL/MoRI
control messages). :func:`check_positional` adds the layout's rules to the evolution
checks; :func:`render_positional` builds the view data and renders the ``positional_*``
templates. As in :mod:`.render`, every decision (which ``pdwire.wirecore.frame_encodings``
call encodes a field, what an absent frame decodes to) is made here; templates print.

Per-field keys: ``frame`` (wire index, guard frames included), ``encoding`` (see
:data:`ENCODINGS`), ``fallback``: ``empty`` (an empty frame decodes to the default, as a
parser's ``or default`` does), ``blank`` (the default travels as an empty frame), ``omit``
(the builder leaves this last frame out when it holds the default). Per-message keys:
``backend``, ``min_frames`` (frames from this index on may be missing and then decode to
their defaults; one count or one per version), ``match`` (frame -> ``dec``/``not_dec``
predicates that, with the ``const`` frames, recognise the message), ``checks`` and
``derived`` (functions of the protocol's ``rules`` module: cross-frame problems, and
read-only properties such as a backend's dummy rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import SchemaError, where
from .model import INT_RANGES, Field, Message, Protocol, TypeRef, Version, format_version
from .render import mod_name
from .templating import banner, environment, render_formatted

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
PREDICATES = frozenset({"dec", "not_dec"})
_ARRAY_DTYPE = {
    "native_u64_array": "NATIVE_U64",
    "native_u32_array": "NATIVE_U32",
    "native_i32_array": "NATIVE_I32",
    "le_u32_array": "LE_U32",
}
_LIST_DTYPE = {"i32": "LE_I32", "u32": "LE_U32", "u64": "LE_U64"}
_NP = {"i32": "np.int32", "u32": "np.uint32", "u64": "np.uint64"}
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
    frame: int
    name: str
    const: str | None  # literal text of a const frame
    encoding: str
    py_type: str
    py_default: str | None  # struct default (None: required)
    absent: str | None  # value of a missing trailing frame (None: always present)
    enc: str  # expression over `m`
    dec: str  # expression over `fr`
    strategy: str
    spell: str
    omit_default: str | None  # last frame left out when the value equals this
    doc: str
    since: str
    fast_dec: list[str]  # statements over `fr` setting `f_<name>` (const frames: a check)
    fast_enc: str  # expression over `m`: the common case inline, the checked call otherwise


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
    consts: list[tuple[int, str]]
    match: list[tuple[int, str]]
    checks: list[str]
    derived: list[DerivedView]
    rec: str | None  # recognition beyond frame 0 (other fixed frames, predicates); None: nothing

    @property
    def fields(self) -> list[FrameView]:
        return [f for f in self.frames if f.const is None]


@dataclass(frozen=True)
class VersionView:
    version: Version
    text: str
    module: str
    doc: str
    messages: list[MessageView]
    enums: list[tuple[str, str, list[tuple[str, int]]]]
    # messages and enums identical to an earlier version's: name -> the module defining them
    shared: dict[str, str] = field(default_factory=dict)
    # name -> every version (as tuple literals) whose model is the one defined here
    versions_of: dict[str, list[str]] = field(default_factory=dict)

    @property
    def own_messages(self) -> list[MessageView]:
        return [m for m in self.messages if m.name not in self.shared]

    @property
    def own_enums(self) -> list[tuple[str, str, list[tuple[str, int]]]]:
        return [e for e in self.enums if e[0] not in self.shared]

    @property
    def sources(self) -> list[str]:
        """The earlier modules this one takes shared definitions from."""
        return sorted(set(self.shared.values()))


def _py_type(t: TypeRef) -> str:
    if t.kind == "scalar":
        return "bool" if t.name == "bool" else "int"
    if t.kind in ("str",):
        return "str"
    if t.kind in ("bytes", "blob"):
        return "bytes"
    if t.kind == "array":
        return f"npt.NDArray[{_NP[t.name]}]"
    if t.kind == "enum":
        return t.name
    assert t.elem is not None
    if t.kind == "list":
        return f"list[{_py_type(t.elem)}]"
    return f"{_py_type(t.elem)} | None"


def _literal(p: Protocol, f: Field) -> str:
    """The default as a Python expression (shared read-only empty arrays for arrays)."""
    t, d = f.type, f.default
    if t.kind == "array":
        return f"_EMPTY_{t.name.upper()}"
    if t.kind == "list":
        return "[]"
    if t.kind == "enum":
        return f"{t.name}.{str(d).upper()}"
    if t.kind in ("bytes", "blob"):
        return 'b""'
    return repr(d)


def _struct_default(p: Protocol, f: Field) -> str | None:
    if f.required:
        return None
    if f.type.kind == "array":
        return f"msgspec.field(default_factory=lambda: _EMPTY_{f.type.name.upper()})"
    if f.type.kind == "list":
        return "msgspec.field(default_factory=list)"
    return _literal(p, f)


def _range(t: TypeRef) -> tuple[int, int]:
    name = t.elem.name if t.kind == "optional" and t.elem is not None else t.name
    return INT_RANGES[name]


def _codec(p: Protocol, f: Field, w: str) -> tuple[str, str]:
    """(encode expression over ``m``, decode expression over ``x``) for one field."""
    e, t, v = f.encoding, f.type, f"m.{f.name}"
    x = f"fr[{f.frame}]"
    opt = t.kind == "optional"
    if e == "const":
        lit = str(f.default).encode("ascii")
        return repr(lit), f"_fe.expect_const({x}, {lit!r}, {w})"
    if e in ("ascii", "raw", "ascii_csv"):
        short = {"ascii": "ascii", "raw": "raw", "ascii_csv": "csv"}[e]
        return f"_fe.enc_{short}({v}, {w})", f"_fe.dec_{short}({x}, {w})"
    if e == "utf8":
        s = "_opt" if opt else ""
        return f"_fe.enc_utf8{s}({v}, {w})", f"_fe.dec_utf8{s}({x}, {w})"
    if e == "flag01":
        s = "_opt" if opt else ""
        return f"_fe.enc_flag{s}({v}, {w})", f"_fe.dec_flag{s}({x}, {w})"
    if e == "native_u64":
        return f"_fe.enc_u64_opt({v}, {w})", f"_fe.dec_u64_opt({x}, {w})"
    if e in _ARRAY_DTYPE:
        dt = f"_fe.{_ARRAY_DTYPE[e]}"
        return f"_fe.enc_array({v}, {dt}, {w})", f"_fe.dec_array({x}, {dt}, {w})"
    if e == "le_list_of_lists":
        assert t.elem is not None
        dt = f"_fe.{_LIST_DTYPE[t.elem.name]}"
        return f"_fe.enc_lists({v}, {dt}, {w})", f"_fe.dec_lists({x}, {dt}, {w})"
    if e == "msgpack_blob_list":
        s = "blob_lists" if t.elem is not None and t.elem.kind == "list" else "blobs"
        return f"_fe.enc_{s}({v}, {w})", f"_fe.dec_{s}({x}, {w})"
    assert e == "ascii_int", e
    if t.kind == "enum":
        return f"_fe.enc_enum({v}, {t.name}, {w})", f"_fe.dec_enum({x}, {t.name}, {w})"
    lo, hi = _range(t)
    if opt:
        return f"_fe.enc_int_opt({v}, {lo}, {hi}, {w})", f"_fe.dec_int_opt({x}, {lo}, {hi}, {w})"
    if f.fallback == "empty":
        return f"_fe.enc_int({v}, {lo}, {hi}, {w})", f"_fe.dec_int_or({x}, {lo}, {hi}, {f.default!r}, {w})"
    if f.fallback == "blank":
        return (
            f"_fe.enc_int_blank({v}, {lo}, {hi}, {f.default!r}, {w})",
            f"_fe.dec_int_blank({x}, {lo}, {hi}, {f.default!r}, {w})",
        )
    return f"_fe.enc_int({v}, {lo}, {hi}, {w})", f"_fe.dec_int({x}, {lo}, {hi}, {w})"


# --- fast paths ---------------------------------------------------------------------------------
# The generated decoders and encoders handle the common case inline (straight-line code, no
# per-field calls) and hand anything else to the checked ``_fe`` call of :func:`_codec`, which
# accepts exactly the same values and raises the precise error. Each fast path accepts a subset
# of what its checked call accepts and returns the same value for it.
def _fast_int_dec(x: str, out: str, lo: int, hi: int, slow: str, empty: str | None) -> list[str]:
    """A non-negative canonical decimal (digits only, no leading zero) read with ``int()``;
    anything else (a sign, other spellings, a memoryview frame) goes to ``slow``."""
    width = len(str(hi))
    body = [
        f"if type({x}) is bytes and {x}.isdigit() and len({x}) <= {width}"
        f" and (len({x}) == 1 or {x}[0] != 48):",
        f"    {out} = int({x})",
    ]
    if hi < 10**width - 1:  # the widest texts can exceed hi
        body += [f"    if {out} > {hi}:", f"        {out} = {slow}"]
    body += ["else:", f"    {out} = {slow}"]
    if empty is None:
        return body
    return [f"if not {x}:", f"    {out} = {empty}", "else:", *("    " + line for line in body)]


def _fast_dec(p: Protocol, f: Field, w: str, slow: str) -> list[str]:
    """Statements decoding frame ``f.frame`` of ``fr`` into ``f_<name>`` (``slow``: the checked call)."""
    e, t = f.encoding, f.type
    x, out = f"fr[{f.frame}]", f"f_{f.name}"
    opt = t.kind == "optional"
    if e == "const":
        lit = str(f.default).encode("ascii")
        return [f"if {x} != {lit!r}:", f"    {slow}"]
    if e in ("ascii", "utf8"):
        codec = "ascii" if e == "ascii" else "utf-8"
        expr = f"str({x}, {codec!r}) if {x} else None" if opt else f"str({x}, {codec!r})"
        return ["try:", f"    {out} = {expr}", "except UnicodeDecodeError:", f"    {out} = {slow}"]
    if e == "raw":
        return [f"{out} = bytes({x})"]
    if e == "flag01":
        expr = f'True if {x} == b"1" else False if {x} == b"0" else {slow}'
        if opt:
            expr = f"None if not {x} else {expr}"
        return [f"{out} = {expr}"]
    if e == "ascii_int" and t.kind == "enum":
        return [
            f"{out} = _T_{t.name}.get({x}) if type({x}) is bytes else None",
            f"if {out} is None:",
            f"    {out} = {slow}",
        ]
    if e == "ascii_int":
        lo, hi = _range(t)
        if opt:
            return _fast_int_dec(x, out, lo, hi, slow, "None")
        if f.fallback == "empty":
            return _fast_int_dec(x, out, lo, hi, slow, repr(f.default))
        if f.fallback == "blank":
            lines = _fast_int_dec(x, out, lo, hi, slow, repr(f.default))
            # the default's own text is refused (it travels as b""): the checked call says so
            return [*lines, f"    if {out} == {f.default!r}:", f"        {out} = {slow}"]
        return _fast_int_dec(x, out, lo, hi, slow, None)
    return [f"{out} = {slow}"]


def _fast_enc(p: Protocol, f: Field, w: str, slow: str) -> str:
    """An expression encoding ``m.<name>``: the common case inline, else ``slow``."""
    e, t, v = f.encoding, f.type, f"m.{f.name}"
    opt = t.kind == "optional"
    if e == "const":
        return slow
    if e in ("ascii", "utf8"):
        codec = "ascii" if e == "ascii" else "utf-8"
        cond = f"type({v}) is str and {v}.isascii()"  # O(1) for CPython str; non-ASCII: checked call
        if opt:
            cond += f" and {v}"  # "" is refused (it would read back as None); None is b""
            return f'b"" if {v} is None else {v}.encode({codec!r}) if {cond} else {slow}'
        return f"{v}.encode({codec!r}) if {cond} else {slow}"
    if e == "raw":
        return f"{v} if type({v}) is bytes else {slow}"
    if e == "flag01":
        expr = f'(b"1" if {v} else b"0") if type({v}) is bool else {slow}'
        return f'b"" if {v} is None else {expr}' if opt else expr
    if e == "ascii_int" and t.kind == "enum":
        return f"_E_{t.name}[{v}] if type({v}) is {t.name} else {slow}"
    if e == "ascii_int":
        lo, hi = _range(t)
        cond = f"type({v}) is int and {lo} <= {v} <= {hi}"
        if f.fallback == "blank":
            return f'(b"" if {v} == {f.default!r} else b"%d" % {v}) if {cond} else {slow}'
        expr = f'b"%d" % {v} if {cond} else {slow}'
        return f'b"" if {v} is None else {expr}' if opt else expr
    return slow


def _when_present(f: Field, lines: list[str], absent: str) -> list[str]:
    """``lines`` guarded by the frame being present; ``absent`` otherwise."""
    out = f"f_{f.name} = "
    if len(lines) == 1 and lines[0].startswith(out):
        return [f"{out}({lines[0][len(out) :]}) if n > {f.frame} else {absent}"]
    return [f"if n > {f.frame}:", *("    " + line for line in lines), "else:", f"    {out}{absent}"]


def _is_dec_expr(x: str) -> str:
    """``positional_codec._is_dec`` inline, for a bytes frame."""
    return f"({x}.isdigit() and len({x}) <= 20 and (len({x}) == 1 or {x}[0] != 48))"


def _rec_expr(m: Message, consts: list[tuple[int, str]]) -> str | None:
    """Recognition of a message beyond its frame 0 literal, over bytes frames known to be present."""
    terms = [f"fr[{i}] == {c.encode('ascii')!r}" for i, c in consts if i != 0]
    for i, pred in m.match:
        test = _is_dec_expr(f"fr[{i}]")
        terms.append(test if pred == "dec" else f"not {test}")
    return " and ".join(terms) if terms else None


def _strategy(f: Field) -> str:
    t, e = f.type, f.encoding
    opt = t.kind == "optional"
    base: str
    if e == "const":
        return ""  # not a struct field
    if e in ("ascii",):
        base = "_ascii"
    elif e == "utf8":
        base = "_reason" if opt else "_utf8"
        return base
    elif e == "raw":
        base = "_blob"
    elif e == "ascii_csv":
        base = "_mem_kinds"
    elif e == "flag01":
        base = "st.booleans()"
    elif e == "native_u64":
        base = f"st.integers(0, {2**64 - 1})"
    elif e in _ARRAY_DTYPE:
        base = f"_array({t.name!r})"
    elif e == "le_list_of_lists":
        assert t.elem is not None
        base = f"st.lists(_array({t.elem.name!r}), max_size=4)"
    elif e == "msgpack_blob_list":
        nested = t.elem is not None and t.elem.kind == "list"
        base = (
            "st.lists(st.lists(st.none() | _blob, max_size=3), max_size=3)"
            if nested
            else "st.lists(_blob, max_size=3)"
        )
    elif t.kind == "enum":
        base = f"st.sampled_from(list(_v.{t.name}))"
    else:
        lo, hi = _range(t)
        base = f"st.integers({lo}, {hi})"
    return f"st.none() | {base}" if opt else base


def _message_view(p: Protocol, m: Message, v: Version) -> MessageView:
    low = min_frames_at(m, v)
    assert low is not None and m.backend is not None
    frames = []
    for f in sorted(m.fields_at(v), key=lambda x: x.frame or 0):
        assert f.frame is not None
        w = f"_W_{m.name}[{f.name!r}]"
        enc, dec = _codec(p, f, w)
        fast_dec = _fast_dec(p, f, w, dec)
        fast_enc = _fast_enc(p, f, w, enc)
        absent = _literal(p, f) if f.frame >= low else None
        if absent is not None:
            dec = f"({dec} if n > {f.frame} else {absent})"
            fast_dec = _when_present(f, fast_dec, absent)
        frames.append(
            FrameView(
                frame=f.frame,
                name=f.name,
                const=str(f.default) if f.encoding == "const" else None,
                encoding=f.encoding or "",
                py_type=_py_type(f.type),
                py_default=_struct_default(p, f),
                absent=absent,
                enc=enc,
                dec=dec,
                strategy=_strategy(f),
                spell=f.type.spell(),
                omit_default=_literal(p, f) if f.fallback == "omit" else None,
                doc=f.doc,
                since=format_version(f.since),
                fast_dec=fast_dec,
                fast_enc=fast_enc,
            )
        )
    derived = []
    for prop, spec in m.derived:
        match = _DERIVED_RE.match(spec)
        assert match is not None
        derived.append(DerivedView(prop, match.group(1), match.group(2).strip()))
    consts = [(fv.frame, fv.const) for fv in frames if fv.const is not None]
    return MessageView(
        name=m.name,
        backend=m.backend,
        doc=m.doc,
        frames=frames,
        min_frames=low,
        consts=consts,
        match=list(m.match),
        checks=list(m.checks),
        derived=derived,
        rec=_rec_expr(m, consts),
    )


def version_views(p: Protocol) -> list[VersionView]:
    out: list[VersionView] = []
    for info in p.versions:
        v = info.version
        enums = [(e.name, e.doc, [(x.name.upper(), x.number) for x in e.values_at(v)]) for e in p.enums_at(v)]
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
            key = (e[0], repr(e))
            if key in home:
                vv.shared[e[0]] = home[key].module
            else:
                home[key] = vv
            home[key].versions_of.setdefault(e[0], []).append(repr(vv.version))
        for m in vv.messages:
            key = (m.name, repr(m))
            fields = p.messages[m.name].fields_at(vv.version)
            used = {t.name for f in fields for t in f.type.walk() if t.kind == "enum"}
            if key in home and all(home[key].module == vv.shared.get(e) for e in used):
                vv.shared[m.name] = home[key].module
            else:
                home[key] = vv
            home[key].versions_of.setdefault(m.name, []).append(repr(vv.version))


def _imports(rules: str, uses_rules: bool) -> list[str]:
    """The runtime imports of a version module, in the order ruff's isort wants them
    (the rules module only where a message names a check or a derived property)."""
    pkg, _, mod = rules.rpartition(".")
    lines = {
        "from pdwire.wirecore import frame_encodings as _fe",
        "from pdwire.wirecore import positional_codec as _pc",
    }
    if uses_rules:
        lines.add(f"from {pkg} import {mod} as _rules")
    return sorted(lines, key=lambda x: (x.split(" import ")[0], x.split(" import ")[1]))


def render_positional(p: Protocol, source: str) -> dict[str, str]:
    """Every generated file of one positional protocol: relative path -> text."""
    env = environment()
    versions = version_views(p)
    ctx = {
        "p": p,
        "banner": banner(source),
        "md_banner": banner(source, "<!--").replace("\n", " -->\n") + " -->",
        "versions": versions,
        "newest": versions[-1],
        "backends": sorted({m.backend for v in versions for m in v.messages}),
        "imports": _imports(p.rules or "", any(m.checks or m.derived for m in p.messages.values())),
    }
    files: dict[str, str] = {}
    for vv in versions:
        name = f"{vv.module}.py"
        files[name] = render_formatted(env, "positional_version.py.j2", name, ctx, v=vv)
    for name in ("codec.py", "strategies.py", "__init__.py"):
        files[name] = render_formatted(env, f"positional_{name.replace('__init__', 'init')}.j2", name, ctx)
    files["REFERENCE.md"] = env.get_template("positional_reference.md.j2").render(ctx)
    files["py.typed"] = ""
    return files
