"""The behavioural half of the gate: every release's own generated code, loaded from git,
against this build.

* The release build decodes what this build encodes, at every version both read (pdwire and
  the SGLang profile), and re-encodes it to the same bytes: nothing was lost or misread.
* This build decodes the release's golden frames and writes them back byte for byte.
* The golden files of released versions are unchanged since the release.

Each release of ``schema/releases.toml`` is checked (its recorded commit; a tag must agree), so
a peer still running an older release stays covered after a newer one: a clone without a
release's commit fails here rather than skipping the check.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdwire.wire as w
from pdwire.codegen.model import format_version
from pdwire.wire import sglang
from pdwire.wire import strategies as S
from pdwire.wire.sglang.strategies import STRATEGIES as SG
from tests.wire.release_build import (
    RELEASES,
    REPO,
    Case,
    export_release,
    release,
    release_file,
    release_files,
    release_schemas,
    run_release,
)

EXAMPLES = 8  # per message and version


@pytest.fixture(scope="module", params=RELEASES)
def released(request: pytest.FixtureRequest) -> tuple[str, str, Path]:
    rel, commit = release(request.param)
    return rel.name, commit, REPO


def _draw(strategy: st.SearchStrategy[Any], n: int = EXAMPLES) -> list[Any]:
    out: list[Any] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(x: Any) -> None:
        out.append(x)

    collect()
    return out


def _cases(
    versions: list[tuple[int, int]],
    table: dict[tuple[int, int], dict[str, Callable[[], st.SearchStrategy[Any]]]],
    kind: str,
    encode: Callable[[Any, tuple[int, int]], list[Any]],
    keep: Callable[[Any], bool] = lambda m: True,
) -> list[Case]:
    cases: list[Case] = []
    for v in versions:
        for name, strategy in table[v].items():
            for msg in _draw(strategy().filter(keep)):
                cases.append((kind, v, name, [bytes(f) for f in encode(msg, v)]))
    return cases


def test_the_release_build_reads_what_this_build_writes(
    released: tuple[str, str, Path], tmp_path: Path
) -> None:
    name, commit, _ = released
    schemas = release_schemas(commit)
    pd = [v for v in schemas["pdwire"].version_list if v in w.VERSIONS]
    sg = [v for v in schemas["sglang"].version_list if v in sglang.VERSIONS]
    assert pd and sg, f"release {name} and this build share no version"
    cases = _cases(pd, S.STRATEGIES, "pdwire", w.encode)
    cases += _cases(sg, SG, "sglang", lambda m, v: sglang.encode(m), keep=lambda m: not sglang.problems(m))
    # a case the release must refuse, so a driver that reports nothing cannot pass
    kind, v, msg, frames = cases[0]
    wrong = (kind, (v[0], v[1] + 1), msg, frames)
    *results, refusal = run_release(export_release(commit, tmp_path), [*cases, wrong])
    assert refusal is not None and "decoded as sent at" in refusal
    failures = [
        f"{kind} {format_version(v)} {msg}: {err}"
        for (kind, v, msg, _), err in zip(cases, results, strict=True)
        if err is not None
    ]
    assert not failures, f"release {name} ({commit[:12]}) cannot read this build:\n" + "\n".join(
        failures[:20]
    )
    covered = {(c[0], c[1]) for c in cases}
    assert covered == {("pdwire", v) for v in pd} | {("sglang", v) for v in sg}


def _golden(commit: str) -> list[tuple[str, dict[str, Any], list[bytes]]]:
    out = []
    for path in release_files(commit, "tests/golden/pdwire"):
        if not path.endswith(".json"):
            continue
        twin = json.loads(release_file(commit, path))
        blob = release_file(commit, path[: -len(".json")] + ".bin")
        frames, pos = [], 0
        for n in twin["frames"]:
            frames.append(blob[pos : pos + n])
            pos += n
        assert pos == len(blob), path
        out.append((path, twin, frames))
    return out


def test_this_build_reads_and_rewrites_the_release_goldens(released: tuple[str, str, Path]) -> None:
    name, commit, _ = released
    goldens = _golden(commit)
    assert goldens, f"release {name} has no pdwire goldens"
    for path, twin, frames in goldens:
        msg, sent = w.decode_versioned(frames)
        assert format_version(sent) == twin["version"] and type(msg).__name__ == twin["message"], path
        assert [bytes(f) for f in w.encode(msg, sent)] == frames, path
    cases = json.loads(release_file(commit, "tests/golden/sglang/frames.json"))
    assert cases
    for case in cases:
        frames = [bytes.fromhex(h) for h in case["frames"]]
        major, minor = (int(x) for x in case["version"].split("."))
        msg = sglang.decode(frames, case["backend"], version=(major, minor))
        assert type(msg).__name__ == case["message"], case["name"]
        assert sglang.encode(msg) == frames, case["name"]


def test_released_goldens_are_unchanged(released: tuple[str, str, Path]) -> None:
    name, commit, repo = released
    paths = [p for p in release_files(commit, "tests/golden") if not p.endswith(".py")]  # data, not code
    changed = [
        p for p in paths if not (repo / p).exists() or (repo / p).read_bytes() != release_file(commit, p)
    ]
    assert not changed, f"golden files of release {name} changed or vanished (they are frozen): {changed}"
