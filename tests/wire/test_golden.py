"""Frozen golden frames of every released version decode with the current code, in both directions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import pdwire.wire as w
from tests.golden.freeze import to_json

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "pdwire"
CASES = sorted(GOLDEN.glob("*/*.json"))


def _load(path: Path) -> tuple[dict[str, Any], list[bytes]]:
    twin = json.loads(path.read_text())
    blob = path.with_suffix(".bin").read_bytes()
    frames, pos = [], 0
    for n in twin["frames"]:
        frames.append(blob[pos : pos + n])
        pos += n
    assert pos == len(blob), "frame lengths of the twin do not cover the .bin"
    return twin, frames


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


FREEZE_HINT = (
    "run `python -m tests.golden.freeze` (it writes the missing tests/golden/pdwire/<version>/ files and "
    "never overwrites one) and commit them; see 'Evolving the schema' in schema/README.md"
)


def test_every_released_version_has_every_message() -> None:
    for v in w.VERSIONS:
        version = f"{v[0]}.{v[1]}"
        frozen = {p.stem for p in (GOLDEN / version).glob("*.json")}
        expected = {w.REGISTRY.codecs[v][tid].name for tid in w.REGISTRY.codecs[v]}
        missing, stray = sorted(expected - frozen), sorted(frozen - expected)
        assert not missing, f"version {version} has no golden frames for {', '.join(missing)}: {FREEZE_HINT}"
        assert not stray, f"version {version} has golden frames for messages it lacks: {', '.join(stray)}"


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}-{p.stem}" for p in CASES])
def test_golden_decodes_with_current_code(path: Path) -> None:
    twin, frames = _load(path)
    version = _version(twin["version"])
    # this build reads it into the model of its major and writes the same bytes back at that version
    msg, sent = w.decode_versioned(frames)
    assert sent == version and type(msg).__name__ == twin["message"]
    assert [bytes(f) for f in w.encode(msg, version)] == frames
    assert w.decode(frames) == msg
    # what the minor carried reads back as it was frozen (a field the model no longer has, such
    # as 1.0's flat state, is compared where the migration put it, by the bytes above)
    _assert_known_part_equal(to_json(msg), twin["value"], twin["message"])
    # and nothing of a later minor appears: the fields the minor lacks are at their defaults
    if version != w.NEWEST:
        w.check_sendable(msg, version)


def _assert_known_part_equal(old: Any, new: Any, where: str) -> None:
    """Two decoded values agree on the fields both have, nested messages included."""
    if isinstance(old, dict):
        assert isinstance(new, dict), where
        for name, value in old.items():
            if name in new:
                _assert_known_part_equal(value, new[name], f"{where}.{name}")
    elif isinstance(old, list) and old and isinstance(old[0], dict):
        assert isinstance(new, list) and len(old) == len(new), where
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            _assert_known_part_equal(a, b, f"{where}[{i}]")
    else:
        assert old == new, where
