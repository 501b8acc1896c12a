"""What one version of a protocol puts on the wire, as comparable values.

:func:`shape_at` reduces a protocol at one version to the facts a reader of that version
depends on: which messages exist and under which type id, every body position (its field,
type, default, and whether it is live or a placeholder that carries the old default), the
enum values and, for positional layouts, the frames and their encodings. Two schemas speak
the same wire at a version exactly when their shapes there are equal; :mod:`.diff` compares
the shapes of every released version, so a change is judged by the bytes each released
version reads and writes, never only by the newest model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import Field, Message, Protocol, Version


@dataclass(frozen=True)
class SlotShape:
    """One body position (envelope) or frame (positional) at one version."""

    position: int  # the field id (envelope) or the frame index (positional)
    field_id: int | None  # None: a reserved id with no recorded field
    name: str  # field name, or the reserved name
    live: bool  # False: a placeholder written with the old default (removed or reserved)
    type: str | None  # canonical type spelling; None for a reserved id (nothing readable)
    default: str | None  # repr of the default; None when required
    encoding: tuple[str | None, str | None] = (None, None)  # positional: (encoding, fallback)

    @property
    def wire(self) -> tuple[object, ...]:
        """Everything a reader of this position depends on (the name is not on the wire)."""
        return (self.position, self.live, self.type, self.default, self.encoding)


@dataclass(frozen=True)
class MessageShape:
    name: str
    type_id: int | None
    slots: tuple[SlotShape, ...]
    framing: tuple[object, ...] = ()  # positional: (backend, min_frames at this version, match)

    def slot(self, position: int) -> SlotShape | None:
        for s in self.slots:
            if s.position == position:
                return s
        return None


@dataclass(frozen=True)
class EnumShape:
    name: str
    values: tuple[tuple[str, int], ...]  # (name, number) of the values that exist at this version


@dataclass(frozen=True)
class ProtocolShape:
    version: Version
    messages: dict[str, MessageShape]
    enums: dict[str, EnumShape]


def _default(f: Field) -> str | None:
    return None if f.required else repr(f.default)


def _slot(f: Field, position: int, live: bool) -> SlotShape:
    return SlotShape(
        position=position,
        field_id=f.id,
        name=f.name,
        live=live,
        type=f.type.spell(),
        default=_default(f),
        encoding=(f.encoding, f.fallback) if f.frame is not None else (None, None),
    )


def message_shape(p: Protocol, m: Message, v: Version) -> MessageShape:
    if p.layout == "positional":
        from .positional import min_frames_at

        fields = sorted(m.fields_at(v), key=lambda f: f.frame or 0)
        slots = tuple(_slot(f, f.frame or 0, True) for f in fields)
        return MessageShape(m.name, m.type_id, slots, (m.backend, min_frames_at(m, v), m.match))
    reserved = {r.id: r.name for r in m.reserved}
    out = []
    for s in m.slots_at(v):
        if s.field is None:
            out.append(SlotShape(s.id, None, reserved.get(s.id, f"#{s.id}"), False, None, None))
        else:
            out.append(_slot(s.field, s.id, s.live))
    return MessageShape(m.name, m.type_id, tuple(out))


def shape_at(p: Protocol, v: Version) -> ProtocolShape:
    """The wire of ``p`` at version ``v``."""
    return ProtocolShape(
        version=v,
        messages={m.name: message_shape(p, m, v) for m in p.messages_at(v)},
        enums={
            e.name: EnumShape(e.name, tuple((x.name, x.number) for x in e.values_at(v)))
            for e in p.enums_at(v)
        },
    )
