"""Build per-layout view data from the model and render the jinja2 templates.

All decisions (type spellings, defaults, encode/decode expressions, which classes a newer
version shares with the older one) are made here in Python; the templates only loop and
print. A *layout* is a set of templates plus the view builder feeding them: the envelope
layout is the only one today; a positional layout (SGLang frames) would add its own
builder and templates keyed by the schema's ``layout:`` and each field's ``encoding:``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from .model import ARRAY_DTYPES, INT_RANGES, Enum, Field, Message, Protocol, TypeRef, Version, format_version

TEMPLATES = Path(__file__).parent / "templates"
_NP = {"i32": "np.int32", "u32": "np.uint32", "u64": "np.uint64"}
_DT = {"i32": "I32", "u32": "U32", "u64": "U64"}


def mod_name(v: Version) -> str:
    return f"v{v[0]}_{v[1]}"


def const(name: str) -> str:
    return name.upper()


# --- signatures: a class is shared by consecutive versions when nothing it reaches changed --
def enum_sig(e: Enum, v: Version) -> tuple[object, ...]:
    return ("enum", e.name, tuple((x.name, x.number) for x in e.values_at(v)))


def message_sig(p: Protocol, m: Message, v: Version) -> tuple[object, ...]:
    parts: list[object] = ["msg", m.name]
    for s in m.slots_at(v):
        f = s.field
        if f is None:
            parts.append((s.id, None))
            continue
        parts.append((s.id, f.name, f.type.spell(), repr(f.default), s.live))
        for t in f.type.walk():
            if t.kind == "enum":
                parts.append(enum_sig(p.enums[t.name], v))
            elif t.kind == "message":
                parts.append(message_sig(p, p.messages[t.name], v))
    return tuple(parts)


# --- type spellings -------------------------------------------------------------------------
def py_type(t: TypeRef) -> str:
    if t.kind == "scalar":
        return "bool" if t.name == "bool" else "int"
    if t.kind == "str":
        return "str"
    if t.kind in ("bytes", "blob"):
        return "bytes"
    if t.kind == "array":
        return f"npt.NDArray[{_NP[t.name]}]"
    assert t.elem is not None or t.kind in ("enum", "message")
    if t.kind == "list":
        assert t.elem is not None
        return f"list[{py_type(t.elem)}]"
    if t.kind == "optional":
        assert t.elem is not None
        return f"{py_type(t.elem)} | None"
    return t.name


def wire_type(t: TypeRef) -> str:
    if t.kind == "scalar":
        return "bool" if t.name == "bool" else f"_t.{t.name.upper()}"
    if t.kind == "array":
        return "_t.ArrayRef"
    if t.kind == "list":
        assert t.elem is not None
        return f"list[{wire_type(t.elem)}]"
    if t.kind == "optional":
        assert t.elem is not None
        return f"{wire_type(t.elem)} | None"
    if t.kind == "message":
        return f"_W_{t.name}"
    return py_type(t)


def enum_member(p: Protocol, enum: str, value: object) -> str:
    return f"{enum}.{const(str(value))}"


def py_default(p: Protocol, f: Field) -> str | None:
    if f.required:
        return None
    t, d = f.type, f.default
    if t.kind == "array":
        return f"msgspec.field(default_factory=_a.empty_{t.name})"
    if t.kind == "list":
        return "msgspec.field(default_factory=list)"
    if t.kind == "enum":
        return enum_member(p, t.name, d)
    if t.kind in ("bytes", "blob"):
        return 'b""'
    return repr(d)


def wire_default(p: Protocol, f: Field) -> str | None:
    if f.type.kind == "array" and not f.required:
        return 'b""'
    return py_default(p, f)


def wire_literal(p: Protocol, f: Field | None) -> str:
    """The default of a removed field as it goes on the wire (what older readers expect)."""
    if f is None:
        return "None"
    t, d = f.type, f.default
    if t.kind in ("array", "bytes", "blob"):
        return 'b""'
    if t.kind == "list":
        return "[]"
    if t.kind == "enum":
        return str(next(v.number for v in p.enums[t.name].values if v.name == d))
    return repr(d)


def needs_conv(t: TypeRef) -> bool:
    return any(x.kind in ("array", "message") for x in t.walk())


def _bind(var: str, tmp: str) -> tuple[str, str]:
    """``(first use, later uses)`` of ``var``: an attribute read once through a walrus temporary."""
    if var.isidentifier():
        return var, var
    return f"{tmp} := {var}", tmp  # only ever a call argument: type(x := m.f)


def enc_expr(t: TypeRef, var: str, where: str, tag: str = "", depth: int = 0) -> str:
    if t.kind == "array":
        # Inline fast path for a 1-D ndarray of exactly the wire dtype: a small one is copied
        # by tobytes() (cheaper than a memoryview, and C order whatever its strides), a large
        # one becomes a side frame in _big; anything else goes through _pack, which coerces
        # or raises EncodeError naming the field.
        dt = f"_{_DT[t.name]}"
        first, x = _bind(var, f"x{tag}")
        return (
            f"(({x}.tobytes() if {x}.nbytes < _SIDE_MIN else _big({x}, {dt}, side, {where!r}))"
            f" if type({first}) is _nd and {x}.dtype is {dt} and {x}.ndim == 1"
            f" else _pack({x}, {dt}, side, {where!r}))"
        )
    if t.kind == "message":
        return f"_enc_{t.name}({var}, side)"
    if t.kind in ("list", "optional") and t.elem is not None and needs_conv(t.elem):
        e = f"e{depth}"
        inner = enc_expr(
            t.elem,
            e if t.kind == "list" else var,
            where + ("[]" if t.kind == "list" else ""),
            f"{tag}_{depth}",
            depth + 1,
        )
        if t.kind == "list":
            return f"[{inner} for {e} in {var}]"
        return f"(None if {var} is None else {inner})"
    return var


def dec_expr(t: TypeRef, var: str, where: str, depth: int = 0) -> str:
    """The checked decoder: every array through the cursor, raising errors that name the field."""
    if t.kind == "array":
        return f"_view({var}, _{_DT[t.name]}, {ARRAY_DTYPES[t.name][1]}, c, {where!r})"
    if t.kind == "message":
        return f"_dec_{t.name}({var}, c)"
    if t.kind in ("list", "optional") and t.elem is not None and needs_conv(t.elem):
        e = f"e{depth}"
        inner = dec_expr(
            t.elem, e if t.kind == "list" else var, where + ("[]" if t.kind == "list" else ""), depth + 1
        )
        if t.kind == "list":
            return f"[{inner} for {e} in {var}]"
        return f"(None if {var} is None else {inner})"
    return var


def fast_dec_expr(t: TypeRef, var: str, tag: str = "", depth: int = 0) -> str:
    """The fast decoder: no per-array checks of its own.

    Inline bytes become ``np.frombuffer`` views (which refuse a length that is not a whole
    number of items), empty ones the shared read-only empty array; a side-frame index must
    be the next one of the counter ``k`` (so the references are exactly 2, 3, ... in order)
    and ``f[index]`` must exist. Anything else raises, and the caller then takes the
    checked decoder for the classified error.
    """
    if t.kind == "array":
        dt = f"_{_DT[t.name]}"
        first, x = _bind(var, f"x{tag}")
        return (
            f"((_fb({x}, {dt}) if {x} else _E{dt}) if type({first}) is bytes"
            f" else _fb(f[{x}], {dt}) if {x} == _next(k) else _bail())"
        )
    if t.kind == "message":
        return f"_fdec_{t.name}({var}, f, k)"
    if t.kind in ("list", "optional") and t.elem is not None and needs_conv(t.elem):
        e = f"e{depth}"
        inner = fast_dec_expr(t.elem, e if t.kind == "list" else var, f"{tag}_{depth}", depth + 1)
        if t.kind == "list":
            return f"[{inner} for {e} in {var}]"
        return f"(None if {var} is None else {inner})"
    return var


# --- hypothesis strategies ----------------------------------------------------------------
def strategy_expr(p: Protocol, t: TypeRef, mod: str) -> str:
    if t.kind == "scalar":
        if t.name == "bool":
            return "st.booleans()"
        lo, hi = INT_RANGES[t.name]
        return f"st.integers({lo}, {hi})"
    if t.kind == "str":
        return "_text"
    if t.kind in ("bytes", "blob"):
        return "_blob"
    if t.kind == "array":
        return f"_array(_a.{_DT[t.name]})"
    if t.kind == "enum":
        return f"st.sampled_from({mod}.{t.name})"
    if t.kind == "message":
        return f"{mod}_{t.name}()"
    assert t.elem is not None
    inner = strategy_expr(p, t.elem, mod)
    if t.kind == "list":
        return f"st.lists({inner}, max_size=4)"
    return f"st.none() | {inner}"


# --- views ----------------------------------------------------------------------------------
@dataclass
class FieldView:
    id: int
    name: str
    py_type: str
    py_default: str | None
    wire_type: str
    wire_default: str | None
    enc: str
    dec: str
    fdec: str
    doc: str
    strategy: str
    type_spell: str
    since: str
    deprecated: str | None


@dataclass
class SlotView:
    id: int
    name: str
    live: bool
    wire_type: str
    wire_default: str | None
    enc: str
    note: str


@dataclass
class MessageView:
    name: str
    doc: str
    type_id: int | None
    shared: bool  # same class as the previous version's
    fields: list[FieldView]
    slots: list[SlotView]
    slot_names: tuple[str, ...]
    has_required: bool


@dataclass
class EnumView:
    name: str
    doc: str
    shared: bool
    values: list[tuple[str, int]]


@dataclass
class VersionView:
    version: Version
    text: str
    module: str
    prev_module: str | None
    doc: str
    enums: list[EnumView] = field(default_factory=list)
    messages: list[MessageView] = field(default_factory=list)

    @property
    def top_level(self) -> list[MessageView]:
        return sorted((m for m in self.messages if m.type_id is not None), key=lambda m: m.type_id or 0)


def _order_messages(p: Protocol, v: Version) -> list[Message]:
    """Messages at ``v``, nested ones before the messages that use them."""
    done: list[Message] = []
    seen: set[str] = set()

    def visit(m: Message) -> None:
        if m.name in seen:
            return
        seen.add(m.name)
        for f in m.fields:
            if f.slot_in(v):
                for t in f.type.walk():
                    if t.kind == "message":
                        visit(p.messages[t.name])
        done.append(m)

    for m in p.messages_at(v):
        visit(m)
    return done


def version_view(p: Protocol, idx: int) -> VersionView:
    info = p.versions[idx]
    v = info.version
    prev = p.versions[idx - 1].version if idx > 0 else None
    mod = mod_name(v)
    view = VersionView(v, format_version(v), mod, mod_name(prev) if prev else None, info.doc)
    for e in p.enums_at(v):
        shared = prev is not None and e.since <= prev and enum_sig(e, prev) == enum_sig(e, v)
        view.enums.append(
            EnumView(e.name, e.doc, shared, [(const(x.name), x.number) for x in e.values_at(v)])
        )
    for m in _order_messages(p, v):
        shared = prev is not None and m.since <= prev and message_sig(p, m, prev) == message_sig(p, m, v)
        fields = [
            FieldView(
                id=f.id,
                name=f.name,
                py_type=py_type(f.type),
                py_default=py_default(p, f),
                wire_type=wire_type(f.type),
                wire_default=wire_default(p, f),
                enc=enc_expr(f.type, f"m.{f.name}", f"{m.name}.{f.name}", str(f.id)),
                dec=dec_expr(f.type, f"w.{f.name}", f.name),
                fdec=fast_dec_expr(f.type, f"w.{f.name}", str(f.id)),
                doc=f.doc,
                strategy=strategy_expr(p, f.type, mod),
                type_spell=f.type.spell(),
                since=format_version(f.since),
                deprecated=f.deprecated,
            )
            for f in m.fields_at(v)
        ]
        by_name = {fv.name: fv for fv in fields}
        slots = []
        for s in m.slots_at(v):
            if s.live and s.field is not None:
                fv = by_name[s.field.name]
                slots.append(SlotView(s.id, fv.name, True, fv.wire_type, fv.wire_default, fv.enc, ""))
            else:
                name = (
                    s.field.name if s.field is not None else next(r.name for r in m.reserved if r.id == s.id)
                )
                removed = s.field.removed if s.field is not None else None
                note = f"removed in {format_version(removed)}" if removed else "reserved"
                slots.append(
                    SlotView(
                        s.id,
                        f"reserved_{s.id}",
                        False,
                        "msgspec.Raw",
                        "msgspec.field(default_factory=msgspec.Raw)",
                        wire_literal(p, s.field),
                        f"{name}: {note}; older readers get the old default",
                    )
                )
        view.messages.append(
            MessageView(
                name=m.name,
                doc=m.doc,
                type_id=m.type_id,
                shared=shared,
                fields=fields,
                slots=slots,
                slot_names=tuple(s.name for s in slots),
                has_required=any(f.py_default is None for f in fields),
            )
        )
    return view


# --- conversions between consecutive versions ----------------------------------------------
@dataclass
class StepView:
    """One generated conversion function between adjacent versions."""

    func: str
    name: str
    direction: str  # "up" or "down"
    src_mod: str
    dst_mod: str
    target: str  # target version text
    target_tuple: Version
    args: list[tuple[str, str]]
    hook: str | None


def conv_expr(
    p: Protocol, t: TypeRef, var: str, changed: set[str], direction: str, dst: str, where: str, depth: int = 0
) -> str:
    if t.kind == "message" and t.name in changed:
        return f"_{direction}_{dst}_{t.name}({var})"
    if t.kind == "enum" and t.name in changed:
        if direction == "up":
            return f"_{dst}.{t.name}(int({var}))"
        return f"_enum_down(_{dst}.{t.name}, {var}, {where!r})"
    if t.kind in ("list", "optional") and t.elem is not None:
        if not any(x.name in changed for x in t.elem.walk() if x.kind in ("message", "enum")):
            return var
        e = f"e{depth}"
        inner = conv_expr(
            p, t.elem, e if t.kind == "list" else var, changed, direction, dst, where, depth + 1
        )
        if t.kind == "list":
            return f"[{inner} for {e} in {var}]"
        return f"(None if {var} is None else {inner})"
    return var


def step_views(p: Protocol) -> list[StepView]:
    out: list[StepView] = []
    for i in range(1, len(p.versions)):
        a, b = p.versions[i - 1].version, p.versions[i].version
        migrate = set(p.versions[i].migrate)
        changed_enums = {e.name for e in p.enums_at(a) if enum_sig(e, a) != enum_sig(e, b)}
        changed_msgs = {m.name for m in p.messages_at(a) if message_sig(p, m, a) != message_sig(p, m, b)}
        changed = changed_enums | changed_msgs
        for m in p.messages_at(a):
            if m.name not in changed_msgs:
                continue
            common = [f for f in m.fields if f.present_in(a) and f.present_in(b)]
            for direction, src, dst, tgt in (("up", a, b, b), ("down", b, a, a)):
                args = [
                    (
                        f.name,
                        conv_expr(
                            p, f.type, f"m.{f.name}", changed, direction, mod_name(dst), f"{m.name}.{f.name}"
                        ),
                    )
                    for f in common
                ]
                hook = None
                if m.name in migrate:
                    hook = (
                        f"_mig.{'upgrade' if direction == 'up' else 'downgrade'}_{m.name}_{tgt[0]}_{tgt[1]}"
                    )
                out.append(
                    StepView(
                        func=f"_{direction}_{mod_name(dst)}_{m.name}",
                        name=m.name,
                        direction=direction,
                        src_mod=mod_name(src),
                        dst_mod=mod_name(dst),
                        target=format_version(tgt),
                        target_tuple=tgt,
                        args=args,
                        hook=hook,
                    )
                )
    return out


# --- rendering ------------------------------------------------------------------------------
def docstring(text: str, indent: int = 4) -> str:
    """Text safe inside a triple-quoted Python string, wrapped to fit the line length."""
    safe = text.replace("\\", "\\\\").replace('"', '\\"')
    lines = textwrap.wrap(safe, width=100 - indent) or [""]
    if len(lines) == 1 and len(lines[0]) + indent + 6 <= 110:
        return lines[0]
    pad = " " * indent
    return "\n".join([lines[0], *(pad + x for x in lines[1:])]) + "\n" + pad


def all_sorted(names: list[str]) -> list[str]:
    """Names in the order ruff's isort-style ``__all__`` sorting expects."""
    return sorted(set(names), key=lambda n: (0 if n.isupper() else 1 if n[:1].isupper() else 2, n))


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["pydoc"] = docstring
    env.filters["all_sorted"] = all_sorted
    return env


def banner(p: Protocol, source: str, comment: str = "#") -> str:
    return (
        f"{comment} Generated by `pdwire codegen` from {source}. DO NOT EDIT.\n"
        f"{comment} @generated - change the schema (or codegen/templates) and rerun `pdwire codegen`."
    )


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


def supported(p: Protocol) -> list[Version]:
    best: dict[int, int] = {}
    for v in p.version_list:
        best[v[0]] = max(v[1], best.get(v[0], -1))
    return sorted(best.items())


def render_protocol(p: Protocol, source: str) -> dict[str, str]:
    """Every generated file of one protocol (envelope layout): relative path -> text."""
    env = _env()
    versions = [version_view(p, i) for i in range(len(p.versions))]
    hello = p.messages.get("Hello")
    newest_names = [e.name for e in versions[-1].enums] + [m.name for m in versions[-1].messages]
    ctx = {
        "newest_names": sorted(newest_names),
        "p": p,
        "banner": banner(p, source),
        "md_banner": banner(p, source, "<!--").replace("\n", " -->\n") + " -->",
        "versions": versions,
        "newest": versions[-1],
        "steps": step_views(p),
        "supported": supported(p),
        "hello": hello,
        "frozen": [hello.type_id] if hello is not None and hello.type_id is not None else [],
        "fmt": format_version,
        "show_default": show_default,
        "source": source,
    }
    return render_files(env, ctx, versions, template_prefix="")


def render_files(
    env: jinja2.Environment, ctx: dict[str, Any], versions: Sequence[Any], template_prefix: str
) -> dict[str, str]:
    """The files every layout generates from its templates (``<prefix>version.py.j2`` once per
    version, then the codec, strategies, package init and wire reference): path -> text."""
    files: dict[str, str] = {}
    for vv in versions:
        files[f"{vv.module}.py"] = env.get_template(f"{template_prefix}version.py.j2").render(ctx, v=vv)
    for name, template in (
        ("codec.py", "codec.py.j2"),
        ("strategies.py", "strategies.py.j2"),
        ("__init__.py", "init.py.j2"),
        ("REFERENCE.md", "reference.md.j2"),
    ):
        files[name] = env.get_template(template_prefix + template).render(ctx)
    files["py.typed"] = ""
    return files
