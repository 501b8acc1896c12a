"""The positional layout's schema rules and the schema-diff gate over the SGLang profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdwire.codegen.diff import diff_protocols
from pdwire.codegen.errors import SchemaError
from pdwire.codegen.loader import load_text

SCHEMA = (Path(__file__).parents[2] / "schema" / "sglang.yaml").read_text("utf-8")
STATUS_ROOM = "- {id: 0, name: room, type: u64, encoding: ascii_int, frame: 0}\n      - {id: 1, name: status"


def _load(text: str) -> object:
    return load_text(text, "schema/sglang.yaml")


def test_profile_loads_and_is_unchanged_against_itself() -> None:
    p = load_text(SCHEMA, "a")
    assert not diff_protocols(p, load_text(SCHEMA, "b")).changes


@pytest.mark.parametrize(
    ("old", "new", "what"),
    [
        (
            STATUS_ROOM,
            STATUS_ROOM.replace("ascii_int, frame: 0", "native_u64, frame: 0").replace(
                "u64,", "optional<u64>, default: null,", 1
            ),
            "wire format changed",
        ),
        (
            "{id: 22, name: dcp_size, type: u32, default: 1, fallback: empty,",
            "{id: 22, name: dcp_size, type: u32, default: 1,",
            "fallback empty -> None",
        ),
        ("match: {0: dec, 1: dec, 2: dec}", "match: {0: dec, 1: dec}", "positional framing changed"),
    ],
)
def test_wire_format_changes_are_breaking(old: str, new: str, what: str) -> None:
    assert SCHEMA.count(old) == 1
    before = load_text(SCHEMA, "a")
    result = diff_protocols(before, load_text(SCHEMA.replace(old, new), "b"))
    assert result.failed and any(what in c.what for c in result.breaking), result.changes


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        (
            "encoding: ascii_int, frame: 2}\n      - {id: 3, name: session_id",
            "encoding: ascii_int, frame: 3}\n      - {id: 3, name: session_id",
            "frames must be 0..n-1",
        ),
        (
            "{id: 1, name: local_ip, type: str, encoding: ascii, frame: 1}",
            "{id: 1, name: local_ip, type: str, encoding: base64, frame: 1}",
            "unknown encoding",
        ),
        (
            "{id: 1, name: local_ip, type: str, encoding: ascii, frame: 1}",
            "{id: 1, name: local_ip, type: u32, encoding: ascii, frame: 1}",
            "does not carry u32",
        ),
        ("min_frames: 3\n", "min_frames: 2\n", "needs a default"),
        ("rules: pdwire.wirehooks.sglang_rules\n", "", "names its `rules` module"),
        ("backend: mori\n    min_frames: 5", "min_frames: 5", "name their backend"),
    ],
)
def test_positional_rules_are_enforced(old: str, new: str, error: str) -> None:
    assert old in SCHEMA
    with pytest.raises(SchemaError, match=error) as info:
        _load(SCHEMA.replace(old, new, 1))
    assert "schema/sglang.yaml" in str(info.value)
