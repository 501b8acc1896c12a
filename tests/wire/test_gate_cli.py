"""`pdwire schema gate` in a repository of its own: against the recorded release (tags or not)
and the merge base, exit codes, ``--json``, and one-line errors for inputs it cannot read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = (Path(__file__).resolve().parent / "fixtures" / "gate_released.yaml").read_text()
ROOM = "{id: 0, name: room, type: u64}\n      - {id: 1, name: sender"


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _releases(commit: str, tag: str = "wire-1.1") -> str:
    return f'[[release]]\nname = "{tag}"\ntag = "{tag}"\ncommit = "{commit}"\n'


def _pdwire(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdwire", *args], cwd=repo, capture_output=True, text=True, check=False
    )


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository whose main holds a released schema (recorded in releases.toml, no tag), and a
    feature branch checked out on top of it."""
    r = tmp_path / "repo"
    (r / "schema").mkdir(parents=True)
    _git(r, "init", "-q", "-b", "main")
    _git(r, "config", "user.email", "t@example.com")
    _git(r, "config", "user.name", "t")
    (r / "schema" / "fixture.yaml").write_text(FIXTURE)
    released = _commit(r, "release")
    (r / "schema" / "releases.toml").write_text(_releases(released))
    _commit(r, "record the release")
    _git(r, "checkout", "-q", "-b", "feature")
    return r


def _edit(repo: Path, old: str, new: str) -> None:
    path = repo / "schema" / "fixture.yaml"
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))


def test_compatible_schema_passes_against_release_and_merge_base(repo: Path) -> None:
    res = _pdwire(repo, "schema", "gate")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "== against release wire-1.1" in res.stdout and "== against merge base with main" in res.stdout
    assert "fixture: compatible with released 1.0-1.1" in res.stdout


def test_a_breaking_commit_stays_refused_after_later_commits(repo: Path) -> None:
    _edit(repo, ROOM, ROOM.replace("u64", "u32"))
    _commit(repo, "retype room")
    (repo / "notes.txt").write_text("later work\n")
    _commit(repo, "unrelated")
    res = _pdwire(repo, "schema", "gate")
    assert res.returncode == 1
    assert "message Request, field room (id 0): type changed u64 -> u32 in released 1.0-1.1" in res.stdout
    # the working tree is what is judged: an uncommitted break is refused too
    _git(repo, "revert", "--no-edit", "HEAD~1")
    assert _pdwire(repo, "schema", "gate").returncode == 0
    _edit(repo, ROOM, ROOM.replace("u64", "u16"))
    assert _pdwire(repo, "schema", "gate").returncode == 1


def test_the_json_report(repo: Path) -> None:
    _edit(repo, ROOM, ROOM.replace("u64", "u32"))
    res = _pdwire(repo, "schema", "gate", "--json")
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and len(doc["comparisons"]) == 2
    (proto,) = doc["comparisons"][0]["protocols"]
    assert proto["name"] == "fixture" and proto["released"] == ["1.0", "1.1"] and proto["ok"] is False
    (change,) = [c for c in proto["changes"] if c["breaking"]]
    assert change["rule"] == "FIELD_TYPE" and change["versions"] == ["1.0", "1.1"]
    assert change["subject"] == "message Request" and change["item"] == "field room (id 0)"


def test_a_tag_must_agree_with_the_recorded_commit(repo: Path) -> None:
    released = _git(repo, "rev-parse", "main~1")
    _git(repo, "tag", "wire-1.1", released)
    assert _pdwire(repo, "schema", "gate").returncode == 0
    _git(repo, "tag", "-f", "wire-1.1", "main")
    res = _pdwire(repo, "schema", "gate")
    assert res.returncode == 2
    assert "tag wire-1.1 points at" in res.stderr and res.stderr.count("\n") == 1


def test_a_release_this_clone_lacks_is_an_error_not_a_pass(repo: Path) -> None:
    (repo / "schema" / "releases.toml").write_text(_releases("0123456789abcdef0123456789abcdef01234567"))
    res = _pdwire(repo, "schema", "gate")
    assert res.returncode == 2 and "is not in this clone" in res.stderr
    (repo / "schema" / "releases.toml").write_text("# nothing released\n")
    res = _pdwire(repo, "schema", "gate")
    assert res.returncode == 2 and "nothing to compare" not in res.stdout
    assert "lists no [[release]]" in res.stderr


def test_the_merge_base_guards_what_main_added_since_the_release(repo: Path) -> None:
    _git(repo, "checkout", "-q", "main")
    _edit(repo, "\n\nenums:\n", '\n  - version: "1.2"\n\nenums:\n')
    _edit(
        repo,
        '      - {id: 1, name: reason, type: str, default: ""}\n',
        '      - {id: 1, name: reason, type: str, default: ""}\n'
        '      - {id: 3, name: epoch, type: u32, default: 0, since: "1.2"}\n',
    )
    _commit(repo, "1.2 on main, not released yet")
    _git(repo, "checkout", "-q", "-b", "next")
    _edit(
        repo,
        '{id: 3, name: epoch, type: u32, default: 0, since: "1.2"}',
        '{id: 3, name: epoch, type: u64, default: 0, since: "1.2"}',
    )
    res = _pdwire(repo, "schema", "gate", "--json")
    assert res.returncode == 1
    release, base = json.loads(res.stdout)["comparisons"]
    assert release["ok"] is True  # 1.2 was never released
    assert base["ok"] is False
    assert any(
        "type changed u32 -> u64 in released 1.2" in c["text"] for c in base["protocols"][0]["changes"]
    )


def test_a_schema_that_breaks_a_rule_is_refused(repo: Path) -> None:
    _edit(repo, "{id: 1, name: sender, type: str}", "{id: 1, name: sender, type: strr}")
    res = _pdwire(repo, "schema", "gate")
    assert res.returncode == 1
    assert (
        "BREAKING: schema/fixture.yaml: message Request, field sender (id 1): unknown type 'strr'"
        in res.stdout
    )


def test_unreadable_inputs_are_one_line_errors(repo: Path, tmp_path: Path) -> None:
    for args in (
        ("schema", "gate", "--schema", "/nonexistent"),
        ("schema", "gate", "--base", "nosuch"),
        ("schema", "diff", "HEAD", "schema", "--path", "nosuch"),
        ("schema", "diff", "/nonexistent", "schema"),
        ("schema", "diff", "HEAD", "/nonexistent"),
        ("codegen", "--schema", "/nonexistent"),
        ("codegen", "--schema", str(repo / "schema"), "--out", "/proc/nope"),
    ):
        res = _pdwire(repo, *args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1, (args, res.stderr)
        assert res.stderr.startswith("pdwire "), (args, res.stderr)
