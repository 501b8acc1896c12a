"""Schema loading errors, evolution rules, `pdwire schema diff` rules and `pdwire codegen --check`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdwire.codegen.diff import diff_protocols
from pdwire.codegen.errors import SchemaError
from pdwire.codegen.loader import load_text

REPO = Path(__file__).resolve().parents[2]
BASE = (REPO / "schema" / "pdwire.yaml").read_text()
ABORT = """  Abort:
    type_id: 6
    doc: Decode -> prefill; abandon a room.
    fields:
      - {id: 0, name: room, type: u64}
      - {id: 1, name: sender, type: str}
      - {id: 2, name: reason, type: str, default: ""}
"""
assert ABORT in BASE


def _with_abort(fields: str, extra_versions: str = "", reserved: str = "") -> str:
    text = BASE.replace(ABORT, "  Abort:\n    type_id: 6\n    fields:\n" + fields + reserved)
    if extra_versions:  # appended after the schema's last version
        assert "\n\nenums:\n" in text
        text = text.replace("\n\nenums:\n", "\n" + extra_versions + "\nenums:\n", 1)
    return text


_LAST = load_text(BASE, "schema/pdwire.yaml").versions[-1].version
NEXT = f"{_LAST[0]}.{_LAST[1] + 1}"  # the minor after the schema's newest, for evolution tests
V_NEXT = f'  - version: "{NEXT}"\n'
CODE = f'      - {{id: 3, name: code, type: u32, default: 0, since: "{NEXT}"}}\n'
CODE_REQUIRED = CODE.replace("default: 0, ", "")
V20 = '  - version: "2.0"\n'
ROOM = "      - {id: 0, name: room, type: u64}\n"
SENDER = "      - {id: 1, name: sender, type: str}\n"
REASON = '      - {id: 2, name: reason, type: str, default: ""}\n'


def _load(text: str) -> object:
    return load_text(text, "schema/test.yaml")


# --- loading and evolution: each error names file, message and field -------------------------
@pytest.mark.parametrize(
    ("fields", "extra", "pattern"),
    [
        (
            ROOM + SENDER + "      - {id: 2, name: reason, type: strr}\n",
            "",
            r"message Abort, field reason \(id 2\): unknown type 'strr'",
        ),
        (
            ROOM + SENDER + "      - {id: 1, name: reason, type: str}\n",
            "",
            r"field reason \(id 1\): id 1 already used by field sender",
        ),
        (
            ROOM + SENDER + "      - {id: 3, name: reason, type: str}\n",
            "",
            r"message Abort: field ids must be contiguous from 0; missing \[2\]",
        ),
        (
            ROOM + SENDER + REASON + CODE_REQUIRED,
            V_NEXT,
            rf"field code \(id 3\): added in minor {re.escape(NEXT)} without a default",
        ),
        (
            ROOM + SENDER + "      - {id: 2, name: reason, type: u8, default: 300}\n",
            "",
            r"field reason \(id 2\): default 300 does not fit type u8",
        ),
        (
            ROOM + SENDER + '      - {id: 2, name: reason, type: str, removed: "1.1"}\n',
            "",
            r"field reason \(id 2\): a field removed within its major needs a default",
        ),
        (
            ROOM + SENDER + "      - {id: 2, name: reason, type: str, colour: red}\n",
            "",
            r"message Abort, field #2 \(reason\): Object contains unknown field `colour`",
        ),
    ],
)
def test_bad_schemas_name_file_message_and_field(fields: str, extra: str, pattern: str) -> None:
    with pytest.raises(SchemaError, match=r"^schema/test\.yaml: " + ".*" + pattern):
        _load(_with_abort(fields, extra))


def test_reserved_ids_and_names_are_never_reused() -> None:
    reserved = "    reserved:\n      - {id: 2, name: reason}\n"
    with pytest.raises(SchemaError, match=r"field why \(id 2\): id 2 already used by reserved reason"):
        _load(_with_abort(ROOM + SENDER + "      - {id: 2, name: why, type: str}\n", reserved=reserved))
    with pytest.raises(SchemaError, match=r"field reason \(id 3\): name 'reason' already used by id 2"):
        _load(
            _with_abort(
                ROOM + SENDER + '      - {id: 3, name: reason, type: str, default: ""}\n', reserved=reserved
            )
        )
    with pytest.raises(SchemaError, match=r"type_id 6 already used by message (Abort|TransferStatus)"):
        _load(BASE.replace("  TransferStatus:\n    type_id: 4", "  TransferStatus:\n    type_id: 6"))


# --- schema diff: every rule fires ----------------------------------------------------------
def _diff(old: str, new: str) -> list[str]:
    result = diff_protocols(load_text(old, "old.yaml"), load_text(new, "new.yaml"))  # type: ignore[arg-type]
    return [str(c) for c in result.breaking] if result.failed else []


def test_unchanged_and_compatible_changes_pass() -> None:
    assert _diff(BASE, BASE) == []
    added = _with_abort(ROOM + SENDER + REASON + CODE, V_NEXT)
    assert _diff(BASE, added) == []
    reserved = _with_abort(ROOM + SENDER + REASON.replace("}", f', removed: "{NEXT}"}}'), V_NEXT)
    assert _diff(BASE, reserved) == []


@pytest.mark.parametrize(
    ("new", "pattern"),
    [
        (
            _with_abort(ROOM + "      - {id: 1, name: sender, type: bytes}\n" + REASON),
            "field sender (id 1): type changed str -> bytes",
        ),
        (_with_abort(ROOM + SENDER), "field reason (id 2): removed without reserving its id and name"),
        (
            _with_abort(
                ROOM + SENDER + REASON + CODE,
                V_NEXT,
            ).replace("default: 0, since", "since"),
            None,
        ),
        (
            BASE.replace("{failed: 0, bootstrapping: 1,", "{failed: 5, bootstrapping: 1,"),
            "enum Status, value failed (0): renumbered 0 -> 5",
        ),
        (
            BASE.replace("  AbortAck:\n    type_id: 7", "  AbortAck:\n    type_id: 70").replace(
                "  Abort:\n    type_id: 6", "  Abort:\n    type_id: 7"
            ),
            "message Abort: type id changed 6 -> 7",
        ),
        (
            _with_abort(
                "      - {id: 0, name: room, type: str}\n      - {id: 1, name: sender, type: u64}\n" + REASON
            ),
            "field room (id 0): type changed u64 -> str",
        ),
        (
            _with_abort(
                "      - {id: 0, name: sender, type: str}\n      - {id: 1, name: room, type: str}\n" + REASON
            ),
            "ids swapped",
        ),
    ],
)
def test_breaking_changes_are_refused_within_a_major(new: str, pattern: str | None) -> None:
    if pattern is None:  # a required field added in a minor: the evolution check refuses it first
        with pytest.raises(SchemaError, match="without a default"):
            load_text(new, "new.yaml")
        return
    breaking = _diff(BASE, new)
    assert any(pattern in b for b in breaking), breaking


def test_required_field_added_in_a_minor_is_breaking_in_the_diff() -> None:
    from dataclasses import replace

    old = load_text(BASE, "old.yaml")
    new = load_text(
        _with_abort(ROOM + SENDER + REASON + CODE, V_NEXT),
        "new.yaml",
    )
    abort = new.messages["Abort"]
    from pdwire.codegen.model import UNSET

    required = replace(abort, fields=(*abort.fields[:3], replace(abort.fields[3], default=UNSET)))
    new_msgs = {**new.messages, "Abort": required}
    result = diff_protocols(old, replace(new, messages=new_msgs))
    assert any(f"required field added in minor {NEXT}" in str(c) for c in result.breaking)
    assert result.failed


def test_reserved_id_reused_after_dropping_the_reservation_is_breaking() -> None:
    reserved = "    reserved:\n      - {id: 2, name: reason}\n"
    old = _with_abort(ROOM + SENDER, reserved=reserved)
    new = _with_abort(ROOM + SENDER + '      - {id: 2, name: why, type: str, default: ""}\n')
    breaking = _diff(old, new)
    assert any("field why (id 2): reuses reserved id 2 (was reason)" in b for b in breaking), breaking
    assert any("reserved reason (id 2): reservation dropped" in b for b in breaking), breaking
    # reserving it while the versions that carry it are still listed changes their wire
    assert any("field reason (id 2): position missing from released 1.0-" in b for b in _diff(BASE, old))


def test_a_type_id_taken_by_another_message_is_judged_by_its_wire() -> None:
    # same type id, new name: a rename (readers dispatch on the type id), judged as the same
    # message; a different body under that id alters every released version
    renamed = BASE.replace(ABORT, ABORT.replace("  Abort:", "  Cancel:"))
    assert _diff(BASE, renamed) == []
    result = diff_protocols(load_text(BASE, "old.yaml"), load_text(renamed, "new.yaml"))
    assert any(c.rule == "MESSAGE_RENAMED" and "renamed to Cancel" in str(c) for c in result.changes)
    reused = renamed.replace(
        "      - {id: 1, name: sender, type: str}\n", "      - {id: 1, name: epoch, type: u32}\n", 1
    )
    assert any(
        "message Abort, field sender (id 1): type changed str -> u32 in released 1.0-" in b
        for b in _diff(BASE, reused)
    ), _diff(BASE, reused)


def test_a_new_major_does_not_excuse_rewriting_the_released_versions_it_still_lists() -> None:
    new = _with_abort(ROOM + "      - {id: 1, name: sender, type: bytes}\n" + REASON, V20)
    result = diff_protocols(load_text(BASE, "old.yaml"), load_text(new, "new.yaml"))
    assert result.failed
    assert any("type changed str -> bytes in released 1.0-" in str(c) for c in result.breaking), (
        result.changes
    )


# --- the commands -----------------------------------------------------------------------------
def _pdwire(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdwire", *args], cwd=cwd, capture_output=True, text=True, check=False
    )


def test_schema_diff_command_exit_codes(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "pdwire.yaml").write_text(BASE)
    (new / "pdwire.yaml").write_text(_with_abort(ROOM + SENDER))
    res = _pdwire("schema", "diff", str(old), str(new))
    assert res.returncode == 1 and "BREAKING" in res.stdout and "removed without reserving" in res.stdout
    assert _pdwire("schema", "diff", str(old), str(old)).returncode == 0
    root = subprocess.run(
        ["git", "rev-list", "--max-parents=0", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    first = root.stdout.split()[0]
    res = _pdwire("schema", "diff", first, "schema")  # a revision without a schema checks nothing
    assert res.returncode == 2 and "nothing to compare" in res.stderr
    res = _pdwire("schema", "diff", "HEAD", "schema", "--path", "nosuch")
    assert res.returncode == 2 and "nothing to compare" in res.stderr


def test_codegen_check_reports_stale_output(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    schema = tmp_path / "schema"
    schema.mkdir()
    (schema / "pdwire.yaml").write_text(BASE)
    assert _pdwire("codegen", "--schema", str(schema), "--out", str(out)).returncode == 0
    assert _pdwire("codegen", "--check", "--schema", str(schema), "--out", str(out)).returncode == 0
    (schema / "pdwire.yaml").write_text(
        BASE.replace("doc: Decode -> prefill; abandon a room.", "doc: Abandon a room.")
    )
    res = _pdwire("codegen", "--check", "--schema", str(schema), "--out", str(out))
    assert res.returncode == 1
    assert '-    """Decode -> prefill; abandon a room."""' in res.stdout
    generated = (out / "v1.py").read_text()
    assert (
        generated.startswith("# Generated by `pdwire codegen` from ")
        and "DO NOT EDIT" in generated.splitlines()[0]
    )


# --- the feature table: when each part appeared, and promises --------------------------------
def test_the_generated_feature_table_matches_the_schema() -> None:
    from pdwire.wire import features

    proto = load_text(BASE, "schema/pdwire.yaml")
    assert tuple(proto.version_list) == features.VERSIONS
    for m in proto.messages.values():
        assert features.message_since(m.name) == m.since
        for f in m.fields:
            assert features.field_since(m.name, f.name) == f.since
    assert features.message_since("RegisterAck") == (1, 2)
    assert features.field_since("StateComponent", "mem_descs") == (1, 1)
    assert features.enum_value_since("StateType", "nsa") == (1, 3)
    assert features.promise_since("fenced_failures") == (1, 3)
    with pytest.raises(KeyError, match="no promise 'telepathy'"):
        features.promise_since("telepathy")


@pytest.mark.parametrize(
    ("promises", "pattern"),
    [
        ("    promises: {Fenced: text}\n", "promise Fenced: promise names are lower_snake_case"),
        ("    promises: {fenced_failures: again}\n", "promise fenced_failures: already promised from 1.3"),
    ],
)
def test_bad_promises_are_refused_by_name(promises: str, pattern: str) -> None:
    with pytest.raises(SchemaError, match=pattern):
        _load(_with_abort(ROOM + SENDER + REASON, V_NEXT + promises))
