"""The compatibility gate: every breaking-change kind is refused with a message naming file,
message, field and the released versions it alters; every compatible kind passes.

Mutations are applied to a released fixture schema (``fixtures/gate_released.yaml``), each
one a plain text edit like the one a person evolving the schema would make.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from pdwire.codegen.diff import ID_LIFETIME, DiffResult, diff_protocols
from pdwire.codegen.errors import SchemaError
from pdwire.codegen.loader import load_text

HERE = Path(__file__).resolve().parent
RELEASED = (HERE / "fixtures" / "gate_released.yaml").read_text()
PRODUCT = (HERE.parents[1] / "schema" / "pdwire.yaml").read_text()
FILE = "schema/fixture.yaml"


def edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
    return text.replace(old, new)


def version(text: str, v: str) -> str:
    """``text`` with version ``v`` listed after the others."""
    return edit(text, "\nenums:\n", f'  - version: "{v}"\n\nenums:\n')


def minor(text: str) -> str:
    return version(text, "1.2")


def gate(new: str, old: str = RELEASED) -> DiffResult:
    return diff_protocols(load_text(old, FILE), load_text(new, FILE))


def refused(new: str, old: str = RELEASED) -> list[str]:
    """The gate's breaking lines, or the schema rule the new text breaks (the gate reports
    a schema that does not load as refused, like a breaking change)."""
    try:
        result = gate(new, old)
    except SchemaError as exc:
        return [f"SCHEMA_RULE {exc}"]
    return [f"{c.rule} {c}" for c in result.breaking]


Mutation = Callable[[str], str]

# kind -> (mutation of the released text, rule id, text the message must contain)
BREAKING: dict[str, tuple[Mutation, str, str]] = {
    "reuse a reserved id": (
        lambda t: minor(
            edit(
                t,
                '      - {id: 1, name: reason, type: str, default: ""}\n'
                "    reserved:\n      - {id: 2, name: legacy}\n",
                '      - {id: 1, name: reason, type: str, default: ""}\n'
                '      - {id: 2, name: epoch, type: u32, default: 0, since: "1.2"}\n',
            )
        ),
        "RESERVED_REUSED",
        "message Ack, field epoch (id 2): reuses reserved id 2 (was legacy)",
    ),
    "retype": (
        lambda t: edit(
            t,
            "{id: 0, name: room, type: u64}\n      - {id: 1, name: sender",
            "{id: 0, name: room, type: u32}\n      - {id: 1, name: sender",
        ),
        "FIELD_TYPE",
        "message Request, field room (id 0): type changed u64 -> u32 in released 1.0-1.1",
    ),
    "swap": (
        lambda t: edit(
            t,
            "{id: 0, name: size, type: u32, default: 1}\n      - {id: 1, name: rank, type: u32, default: 0}",
            "{id: 0, name: rank, type: u32, default: 1}\n      - {id: 1, name: size, type: u32, default: 0}",
        ),
        "FIELD_SWAPPED",
        "message Geometry, field size (id 0): id now belongs to rank while size moved to id 1 (ids swapped)",
    ),
    "remove without reserve": (
        lambda t: edit(
            t, '      - {id: 5, name: limit, type: optional<u32>, default: null, since: "1.1"}\n', ""
        ),
        "FIELD_UNRESERVED",
        "message Request, field limit (id 5): removed without reserving its id and name",
    ),
    "remove: the position leaves released versions": (
        lambda t: edit(
            t, '      - {id: 5, name: limit, type: optional<u32>, default: null, since: "1.1"}\n', ""
        ),
        "FIELD_MISSING",
        "message Request, field limit (id 5): position missing from released 1.1",
    ),
    "reserve a required field": (
        lambda t: minor(
            edit(
                t,
                "      - {id: 1, name: sender, type: str}\n      - {id: 2, name: items",
                "      - {id: 2, name: items",
            ).replace("  Ack:\n", "    reserved:\n      - {id: 1, name: sender}\n\n  Ack:\n", 1)
        ),
        "FIELD_RESERVED",
        "message Request, field sender (id 1): released 1.0-1.1 carry it (str, required); the new "
        "schema reserves the position, so their readers reject every Request",
    ),
    "required field in a minor": (
        lambda t: minor(
            edit(
                t,
                '      - {id: 5, name: limit, type: optional<u32>, default: null, since: "1.1"}\n',
                '      - {id: 5, name: limit, type: optional<u32>, default: null, since: "1.1"}\n'
                '      - {id: 6, name: epoch, type: u32, since: "1.2"}\n',
            )
        ),
        "SCHEMA_RULE",
        "message Request, field epoch (id 6): added in minor 1.2 without a default",
    ),
    "new field without a minor": (
        lambda t: edit(
            t,
            '      - {id: 1, name: reason, type: str, default: ""}\n',
            '      - {id: 1, name: reason, type: str, default: ""}\n'
            "      - {id: 3, name: epoch, type: u32, default: 0}\n",
        ),
        "FIELD_ADDED",
        "message Ack, field epoch (id 3): appears in released 1.0-1.1: their writers never send it "
        'and their readers drop it; a field added after a release needs since: "1.2"',
    ),
    "new value without a minor": (
        lambda t: minor(
            edit(t, "{plain: 0, paged: 1, sliced: 2}", "{plain: 0, paged: 1, sliced: 2, striped: 3}")
        ),
        "ENUM_VALUE_ADDED",
        "enum Kind, value striped (3): appears in released 1.0-1.1, whose readers refuse it "
        "(BadEnumValue) and whose writers never send it; a "
        'value added after a release needs value_since: "1.2"',
    ),
    "enum renumber": (
        lambda t: edit(t, "{prefill: 1, decode: 2}", "{prefill: 1, decode: 3}"),
        "ENUM_NUMBER",
        "enum Role, value decode (2): renumbered 2 -> 3",
    ),
    "enum number reuses a reserved one": (
        lambda t: minor(
            edit(t, "{plain: 0, paged: 1, sliced: 2}", "{plain: 0, paged: 1, sliced: 2, striped: 7}")
            .replace("    reserved: [7]\n", "", 1)
            .replace('value_since: {sliced: "1.1"}', 'value_since: {sliced: "1.1", striped: "1.2"}')
        ),
        "ENUM_NUMBER",
        "enum Kind, value striped (7): reuses reserved number 7",
    ),
    "type id reuse": (
        lambda t: minor(
            edit(
                t,
                "\nreserved_types:\n  - {type_id: 9, name: Gone}\n",
                '\n  Cancel:\n    type_id: 9\n    since: "1.2"\n'
                "    fields:\n      - {id: 0, name: room, type: u64}\n",
            )
        ),
        "TYPE_ID_REUSED",
        "message Cancel: type id 9 reused (was reserved Gone)",
    ),
    "message removed": (
        lambda t: edit(
            t,
            "  Ack:\n    type_id: 3\n    fields:\n      - {id: 0, name: room, type: u64}\n"
            '      - {id: 1, name: reason, type: str, default: ""}\n'
            "    reserved:\n      - {id: 2, name: legacy}\n",
            "",
        ),
        "MESSAGE_MISSING",
        "message Ack: missing from released 1.0-1.1",
    ),
    "message removed without reserving its type id": (
        lambda t: edit(
            t,
            "  Ack:\n    type_id: 3\n    fields:\n      - {id: 0, name: room, type: u64}\n"
            '      - {id: 1, name: reason, type: str, default: ""}\n'
            "    reserved:\n      - {id: 2, name: legacy}\n",
            "",
        ),
        "TYPE_ID_UNRESERVED",
        "message Ack: removed without reserving type id 3",
    ),
    "default changed": (
        lambda t: edit(
            t,
            '{id: 4, name: count, type: u32, default: 0, since: "1.1"}',
            '{id: 4, name: count, type: u32, default: 5, since: "1.1"}',
        ),
        "FIELD_DEFAULT",
        "message Request, field count (id 4): default changed 0 -> 5 in released 1.1",
    ),
    "since moved earlier": (
        lambda t: edit(
            t,
            '{id: 4, name: count, type: u32, default: 0, since: "1.1"}',
            "{id: 4, name: count, type: u32, default: 0}",
        ),
        "FIELD_ADDED",
        "message Request, field count (id 4): appears in released 1.0",
    ),
    "nested required field": (
        lambda t: minor(
            edit(
                t,
                "      - {id: 1, name: rank, type: u32, default: 0}\n",
                "      - {id: 1, name: rank, type: u32, default: 0}\n"
                '      - {id: 2, name: stage, type: u32, since: "1.2"}\n',
            )
        ),
        "SCHEMA_RULE",
        "message Geometry, field stage (id 2): added in minor 1.2 without a default",
    ),
    "nested field made required": (
        lambda t: edit(t, "{id: 0, name: size, type: u32, default: 1}", "{id: 0, name: size, type: u32}"),
        "FIELD_DEFAULT",
        "message Geometry, field size (id 0): default changed 1 -> required in released 1.0-1.1",
    ),
    "optional to plain": (
        lambda t: edit(
            t,
            "{id: 5, name: limit, type: optional<u32>, default: null,",
            "{id: 5, name: limit, type: u32, default: 0,",
        ),
        "FIELD_TYPE",
        "message Request, field limit (id 5): type changed optional<u32> -> u32 in released 1.1",
    ),
    "Hello leading field under a new major": (
        lambda t: version(t, "2.0").replace(
            "{id: 2, name: role, type: Role}", "{id: 2, name: role, type: u8}"
        ),
        "HANDSHAKE_FROZEN",
        "message Hello, field role (id 2): Hello's leading fields are frozen across majors: Role, "
        "required in 1.0, u8, required in 2.0",
    ),
    "old-version rewrite under a new major": (
        lambda t: version(t, "2.0").replace(
            "{id: 0, name: room, type: u64}\n      - {id: 1, name: sender",
            "{id: 0, name: room, type: u32}\n      - {id: 1, name: sender",
        ),
        "FIELD_TYPE",
        "message Request, field room (id 0): type changed u64 -> u32 in released 1.0-1.1",
    ),
    "removed in a released version": (
        lambda t: edit(
            t,
            "{id: 2, name: items, type: list<Item>, default: []}",
            '{id: 2, name: items, type: list<Item>, default: [], removed: "1.1"}',
        ),
        "FIELD_RESERVED",
        "message Request, field items (id 2): released 1.1 carry it (list<Item>, default []); the new "
        "schema removes the position, so their readers lose it",
    ),
    "a removed field restored": (
        lambda t: edit(
            t,
            '{id: 3, name: legacy_flag, type: bool, default: false, removed: "1.1"}',
            "{id: 3, name: legacy_flag, type: bool, default: false}",
        ),
        "FIELD_RESTORED",
        "message Request, field legacy_flag (id 3): a placeholder of released 1.1 becomes a live field there",
    ),
    "reuse a reserved name": (
        lambda t: minor(
            edit(
                t,
                '      - {id: 1, name: reason, type: str, default: ""}\n'
                "    reserved:\n      - {id: 2, name: legacy}\n",
                '      - {id: 1, name: reason, type: str, default: ""}\n'
                '      - {id: 3, name: legacy, type: u32, default: 0, since: "1.2"}\n'
                "    reserved:\n      - {id: 2, name: gone}\n",
            )
        ),
        "RESERVED_REUSED",
        "message Ack, field legacy (id 3): reuses reserved name legacy",
    ),
    "a reservation dropped": (
        lambda t: edit(t, "    reserved:\n      - {id: 2, name: legacy}\n", ""),
        "RESERVATION_DROPPED",
        "message Ack, reserved legacy (id 2): reservation dropped",
    ),
    "type id changed": (
        lambda t: edit(t, "  Ack:\n    type_id: 3\n", "  Ack:\n    type_id: 4\n"),
        "TYPE_ID",
        "message Ack: type id changed 3 -> 4 in released 1.0-1.1",
    ),
    "reserved type id released": (
        lambda t: edit(t, "\nreserved_types:\n  - {type_id: 9, name: Gone}\n", ""),
        "TYPE_ID_UNRESERVED",
        "reserved type Gone: reserved type id 9 no longer reserved",
    ),
    "enum value removed without reserving its number": (
        lambda t: edit(t, "{prefill: 1, decode: 2}", "{prefill: 1}"),
        "ENUM_NUMBER",
        "enum Role, value decode (2): removed without reserving its number; alters released 1.0-1.1",
    ),
    "enum numbers swapped": (
        lambda t: edit(t, "{prefill: 1, decode: 2}", "{prefill: 2, decode: 1}"),
        "ENUM_NUMBER",
        "enum Role, value prefill (1): renumbered 1 -> 2; alters released 1.0-1.1",
    ),
    "enum value_since moved later": (
        lambda t: minor(edit(t, 'value_since: {sliced: "1.1"}', 'value_since: {sliced: "1.2"}')),
        "ENUM_VALUE_MISSING",
        "enum Kind, value sliced (2): no longer exists in released 1.1",
    ),
    "message since moved later": (
        lambda t: minor(edit(t, "  Ack:\n    type_id: 3\n", '  Ack:\n    type_id: 3\n    since: "1.2"\n')),
        "MESSAGE_MISSING",
        "message Ack: missing from released 1.0-1.1",
    ),
    "a promise withdrawn": (
        lambda t: edit(
            t,
            "    promises: {acks_are_fences: an Ack is sent once none of the room's writes is in flight}\n",
            "",
        ),
        "PROMISE_WITHDRAWN",
        "promise acks_are_fences: made in 1.1, withdrawn: peers of released 1.1 rely on it",
    ),
    "a promise moved later": (
        lambda t: edit(
            minor(t),
            "    promises: {acks_are_fences: an Ack is sent once none of the room's writes is in flight}\n"
            '  - version: "1.2"\n',
            '  - version: "1.2"\n    promises: {acks_are_fences: later}\n',
        ),
        "PROMISE_WITHDRAWN",
        "promise acks_are_fences: made in 1.1, moved to 1.2: peers of released 1.1 rely on it",
    ),
    "protocol id changed": (
        lambda t: edit(t, "protocol_id: 9\n", "protocol_id: 10\n"),
        "PROTOCOL_ID",
        "protocol_id changed 9 -> 10; alters released 1.0-1.1",
    ),
}


@pytest.mark.parametrize("kind", list(BREAKING))
def test_every_breaking_kind_is_refused_with_its_message(kind: str) -> None:
    mutate, rule, message = BREAKING[kind]
    new = mutate(RELEASED)
    assert new != RELEASED
    lines = refused(new)
    assert any(line.startswith(rule + " ") and message in line for line in lines), lines
    assert all(FILE in line for line in lines), lines  # every message names the file
    # every refusal names the released versions it alters (the ids' lifetime alters none by itself)
    assert all(
        re.search(r"(released|in) (version\(s\) )?\d\.\d", line)
        for line in lines
        if line.split()[0] not in ID_LIFETIME | {"SCHEMA_RULE"}
    ), lines


# kind -> mutation that must pass (a breaking-free diff, the new schema valid)
COMPATIBLE: dict[str, Mutation] = {
    "field added in a new minor with a default": lambda t: minor(
        edit(
            t,
            '      - {id: 1, name: reason, type: str, default: ""}\n',
            '      - {id: 1, name: reason, type: str, default: ""}\n'
            '      - {id: 3, name: epoch, type: u32, default: 0, since: "1.2"}\n',
        )
    ),
    "nested field added in a new minor": lambda t: minor(
        edit(
            t,
            "      - {id: 1, name: rank, type: u32, default: 0}\n",
            "      - {id: 1, name: rank, type: u32, default: 0}\n"
            '      - {id: 2, name: stage, type: u32, default: 0, since: "1.2"}\n',
        )
    ),
    "enum value added with value_since": lambda t: minor(
        edit(
            t,
            '{plain: 0, paged: 1, sliced: 2}\n    value_since: {sliced: "1.1"}',
            '{plain: 0, paged: 1, sliced: 2, striped: 3}\n    value_since: {sliced: "1.1", striped: "1.2"}',
        )
    ),
    "message added in a new minor": lambda t: minor(
        edit(
            t,
            "\nreserved_types:",
            '\n  Cancel:\n    type_id: 4\n    since: "1.2"\n    fields:\n'
            "      - {id: 0, name: room, type: u64}\n\nreserved_types:",
        )
    ),
    "field removed in a new minor, position kept": lambda t: minor(
        edit(
            t,
            '{id: 5, name: limit, type: optional<u32>, default: null, since: "1.1"}',
            '{id: 5, name: limit, type: optional<u32>, default: null, since: "1.1", removed: "1.2"}',
        )
    ),
    "field renamed": lambda t: edit(
        t, "{id: 1, name: sender, type: str}", "{id: 1, name: origin, type: str}"
    ),
    "field deprecated and documented": lambda t: edit(
        t,
        "{id: 1, name: sender, type: str}",
        '{id: 1, name: sender, type: str, deprecated: "use origin", doc: who sent it}',
    ),
    "a new minor": minor,
    "message renamed, type id kept": lambda t: edit(
        t, "  Ack:\n    type_id: 3\n", "  Reply:\n    type_id: 3\n"
    ),
    "enum value renamed": lambda t: edit(t, "{prefill: 1, decode: 2}", "{prefill: 1, consumer: 2}"),
    "promise added in a new minor": lambda t: edit(
        minor(t),
        '  - version: "1.2"\n',
        '  - version: "1.2"\n    promises: {acks_name_the_room: every Ack names its room}\n',
    ),
    "a new major next to the released one": lambda t: version(t, "2.0").replace(
        '      - {id: 5, name: limit, type: optional<u32>, default: null, since: "1.1"}\n',
        '      - {id: 5, name: limit, type: optional<u32>, default: null, since: "1.1"}\n'
        '      - {id: 6, name: epoch, type: u64, since: "2.0"}\n',
    ),
}


@pytest.mark.parametrize("kind", list(COMPATIBLE))
def test_every_compatible_kind_passes(kind: str) -> None:
    new = COMPATIBLE[kind](RELEASED)
    assert new != RELEASED
    assert refused(new) == []


# --- a new major that drops the old one: only the handshake stays frozen ------------------------
HANDSHAKE_ONLY = """protocol: fixture
protocol_id: 9
versions:
  - version: "1.0"
messages:
  Hello:
    type_id: 1
    fields:
      - {id: 0, name: protocol, type: str}
      - {id: 1, name: role, type: u8}
  Request:
    type_id: 2
    fields:
      - {id: 0, name: room, type: u64}
      - {id: 1, name: sender, type: str}
"""


def test_a_new_major_may_drop_the_old_one_and_rewrite_everything_but_the_handshake() -> None:
    rewritten = HANDSHAKE_ONLY.replace('"1.0"', '"2.0"').replace(
        "name: room, type: u64", "name: room, type: u32"
    )
    result = gate(rewritten, HANDSHAKE_ONLY)
    assert not result.failed, result.changes
    assert any(
        c.rule == "MAJOR_DROPPED" and "released version(s) 1.0 dropped" in str(c) for c in result.changes
    )
    hello = rewritten.replace("name: role, type: u8", "name: role, type: u16")
    lines = refused(hello, HANDSHAKE_ONLY)
    assert any(
        "HANDSHAKE_FROZEN" in line and "field role (id 1)" in line and "u8, required in 1.0" in line
        for line in lines
    ), lines
    gone = rewritten.replace(
        "      - {id: 1, name: role, type: u8}\n", "    reserved:\n      - {id: 1, name: role}\n"
    )
    assert any(
        "HANDSHAKE_FROZEN" in line and "absent in 2.0" in line for line in refused(gone, HANDSHAKE_ONLY)
    )


def test_a_released_minor_may_not_be_dropped() -> None:
    lines = refused(RELEASED, minor(RELEASED))
    assert any(
        line.startswith("VERSION_DROPPED")
        and f"{FILE}: released version(s) 1.2 dropped while their major is still listed" in line
        for line in lines
    ), lines
    dropped = gate(RELEASED, minor(RELEASED)).breaking
    assert [c.versions for c in dropped if c.rule == "VERSION_DROPPED"] == [((1, 2),)]


def test_dropping_the_only_major_without_a_newer_one_is_breaking() -> None:
    older = HANDSHAKE_ONLY.replace('"1.0"', '"0.0"')
    assert any(line.startswith("VERSION_DROPPED") for line in refused(older, HANDSHAKE_ONLY))


# --- the five changes the gate used to call compatible (the product schema) -------------------------
def _product(new: str) -> list[str]:
    return refused(new, PRODUCT)


_MINORS = [int(m) for m in re.findall(r'- version: "1\.(\d+)"', PRODUCT)]
NEXT = f"1.{max(_MINORS) + 1}"  # the minor after the product schema's newest
SPAN = f"1.0-1.{max(_MINORS)}"  # what the product schema releases when it is the old side


def _next(text: str, v: str = NEXT) -> str:
    return edit(text, "\n\nenums:\n", f'\n  - version: "{v}"\n\nenums:\n')


def test_moving_a_required_field_to_reserved_in_a_new_minor_is_refused() -> None:
    new = _next(
        edit(
            PRODUCT,
            "      - {id: 1, name: sender, type: str}\n"
            '      - {id: 2, name: reason, type: str, default: ""}\n\n  AbortAck',
            '      - {id: 2, name: reason, type: str, default: ""}\n'
            "    reserved:\n      - {id: 1, name: sender}\n\n  AbortAck",
        )
    )
    lines = _product(new)
    assert any(
        "FIELD_RESERVED" in line
        and f"message Abort, field sender (id 1): released {SPAN} carry it (str, required)" in line
        and "their readers reject every Abort" in line
        for line in lines
    ), lines


def test_a_field_added_without_declaring_a_minor_is_refused() -> None:
    new = edit(
        PRODUCT,
        "      - {id: 1, name: sender_rank, type: u32, default: 0}\n\n  RegisterAck",
        "      - {id: 1, name: sender_rank, type: u32, default: 0}\n"
        "      - {id: 2, name: epoch, type: u32, default: 0}\n\n  RegisterAck",
    )
    lines = _product(new)
    assert any(
        "FIELD_ADDED" in line and f"message AbortAck, field epoch (id 2): appears in released {SPAN}" in line
        for line in lines
    ), lines


def test_an_enum_value_added_without_value_since_is_refused() -> None:
    new = _next(
        edit(
            PRODUCT,
            "values: {kv: 0, state: 1, aux: 2}",
            "values: {kv: 0, state: 1, aux: 2, gdn: 3}",
        )
    )
    lines = _product(new)
    assert any(
        "ENUM_VALUE_ADDED" in line
        and f"enum NotificationKind, value gdn (3): appears in released {SPAN}" in line
        and f'value_since: "{NEXT}"' in line
        for line in lines
    ), lines


def test_a_retype_under_a_major_bump_may_not_rewrite_the_advertised_1_x_models() -> None:
    new = _next(
        edit(
            PRODUCT,
            "      - {id: 0, name: room, type: u64}\n"
            "      - {id: 1, name: sender, type: str, doc: the decode",
            "      - {id: 0, name: room, type: u32}\n"
            "      - {id: 1, name: sender, type: str, doc: the decode",
        ),
        "2.0",
    )
    lines = _product(new)
    assert any(
        "FIELD_TYPE" in line
        and f"message TransferRequest, field room (id 0): type changed u64 -> u32 in released {SPAN}" in line
        for line in lines
    ), lines


def test_a_leading_hello_field_is_frozen_across_majors() -> None:
    new = _next(edit(PRODUCT, "{id: 2, name: role, type: Role}", "{id: 2, name: role, type: u8}"), "2.0")
    lines = _product(new)
    assert any(
        "HANDSHAKE_FROZEN" in line and "message Hello, field role (id 2)" in line and "in 2.0" in line
        for line in lines
    ), lines
    assert any("FIELD_TYPE" in line and f"in released {SPAN}" in line for line in lines), lines


def test_the_product_schema_is_compatible_with_itself() -> None:
    assert _product(PRODUCT) == []


def test_a_renamed_message_is_judged_as_the_same_message() -> None:
    renamed = edit(RELEASED, "  Ack:\n    type_id: 3\n", "  Reply:\n    type_id: 3\n")
    result = gate(renamed)
    assert [str(c) for c in result.changes if c.rule == "MESSAGE_RENAMED"] == [
        f"ok: {FILE}: message Ack: renamed to Reply (type id kept)"
    ]
    retyped = edit(
        renamed,
        '{id: 1, name: reason, type: str, default: ""}',
        "{id: 1, name: reason, type: u32, default: 0}",
    )
    assert any(
        line.startswith("FIELD_TYPE") and "message Ack, field reason (id 1): type changed str -> u32" in line
        for line in refused(retyped)
    ), refused(retyped)
