"""Frozen golden frames of every released version decode with the current code, in both directions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pdwire.wire as w
import pytest

from tests.golden.freeze import to_json
from tests.wire.compat import is_newer_enum_value

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


def test_every_released_version_has_every_message() -> None:
    for v in w.VERSIONS:
        names = {p.stem for p in (GOLDEN / f"{v[0]}.{v[1]}").glob("*.json")}
        assert names == set(w.REGISTRY.codecs[v][tid].name for tid in w.REGISTRY.codecs[v]), v


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}-{p.stem}" for p in CASES])
def test_golden_decodes_with_current_code(path: Path) -> None:
    twin, frames = _load(path)
    version = _version(twin["version"])
    module = getattr(w, f"v{version[0]}_{version[1]}")
    exact = module.decode(frames)
    assert to_json(exact) == twin["value"]
    # the current codec reads it (upgrading an older minor) and writes the same bytes back at that version
    newest, sent = w.decode_versioned(frames)
    assert sent == version
    assert [bytes(f) for f in w.encode(newest, version)] == frames
    # every older generated decoder of the same major reads it, skipping what it does not know
    for older in w.VERSIONS:
        if older[0] == version[0] and older < version:
            old_module = getattr(w, f"v{older[0]}_{older[1]}")
            if twin["type_id"] not in w.REGISTRY.codecs[older]:
                # a message new in a later minor: the older reader refuses it by type, never guesses
                with pytest.raises(w.UnknownMessageType, match=f"type {twin['type_id']}"):
                    old_module.decode(frames)
                continue
            try:
                old_view = old_module.decode(frames)
            except w.BadEnumValue as e:  # an enum value the older minor lacks (tests/wire/compat.py)
                assert is_newer_enum_value(e, version, older), str(e)
                continue
            assert type(old_view).__name__ == twin["message"]
            _assert_known_part_equal(to_json(old_view), twin["value"], twin["message"])


def _assert_known_part_equal(old: Any, new: Any, where: str) -> None:
    """What an older reader decodes equals the newer value, nested messages included, on the
    fields the older reader knows (it skips the newer positions)."""
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
