"""The YAML schema document, as msgspec structs.

The YAML is parsed with ``yaml.safe_load`` and then converted into these structs with
``msgspec.convert``; unknown keys are refused so a typo never passes silently. Semantics
(type names, version order, id rules) are checked later by :mod:`.loader` and
:mod:`.evolution`.
"""

from __future__ import annotations

import msgspec

Scalar = bool | int | str | None
DefaultValue = Scalar | list[Scalar]


class FieldDoc(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    name: str
    type: str
    default: DefaultValue | msgspec.UnsetType = msgspec.UNSET
    since: str | None = None
    removed: str | None = None
    deprecated: bool | str = False
    doc: str = ""
    # what a writer does with a non-default value when sending to a minor older than `since`:
    # "refuse" (DowngradeError, the default) or "drop" (older peers do without it)
    downgrade: str = "refuse"
    # encoding of this field in a positional layout (unused by the envelope layout)
    encoding: str | None = None
    # positional layouts: the frame index (a field's id is its identity, its frame its position,
    # so a later version can put a new field where a removed one was)
    frame: int | None = None
    # positional layouts: how the default travels ("empty", "blank", "omit"; codegen/positional.py)
    fallback: str | None = None


class ReservedDoc(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    name: str
    doc: str = ""


class MessageDoc(msgspec.Struct, forbid_unknown_fields=True):
    fields: list[FieldDoc]
    type_id: int | None = None
    since: str | None = None  # default: the protocol's first version
    doc: str = ""
    reserved: list[ReservedDoc] = []
    # positional layouts (see schema/README.md, "Layouts"): who speaks the message, how many
    # leading frames are always present, frame predicates that recognise it, cross-frame
    # checks and derived properties implemented in the protocol's `rules` module
    backend: str | None = None
    min_frames: int | dict[str, int] | None = None  # one count, or per version
    match: dict[int, str] = {}
    checks: list[str] = []
    derived: dict[str, str] = {}


class EnumDoc(msgspec.Struct, forbid_unknown_fields=True):
    values: dict[str, int]
    doc: str = ""
    since: str | None = None  # default: the protocol's first version
    # value name -> version it appeared in, for values added after the enum itself
    value_since: dict[str, str] = {}
    reserved: list[int] = []


class VersionDoc(msgspec.Struct, forbid_unknown_fields=True):
    version: str
    doc: str = ""
    # messages whose step into this version needs the hand-written migration hooks
    migrate: list[str] = []
    # promises without bytes made from this version on: name -> what peers may rely on
    promises: dict[str, str] = {}


class ReservedTypeDoc(msgspec.Struct, forbid_unknown_fields=True):
    type_id: int
    name: str


class ProtocolDoc(msgspec.Struct, forbid_unknown_fields=True):
    protocol: str
    protocol_id: int
    versions: list[VersionDoc]
    messages: dict[str, MessageDoc]
    layout: str = "envelope"
    enums: dict[str, EnumDoc] = {}
    migrations: str | None = None
    reserved_types: list[ReservedTypeDoc] = []
    # positional layouts: module with the hand-written checks and derived properties
    rules: str | None = None
