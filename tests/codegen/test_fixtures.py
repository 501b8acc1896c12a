"""The generator on its fixture cases: each case's output is exactly its committed golden
files (``tests/codegen/<case>/expected/``; regenerate with ``python -m tests.codegen.regen``),
and the generated packages import and round-trip a message.

The golden files are part of the repository, so ``ruff check .`` lints them like any code:
generated code that does not pass it fails CI here, on small schemas, before the product's.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tests.codegen.cases import CASES, expected, render_case


def test_every_feature_has_a_case() -> None:
    assert set(CASES) >= {"scalars", "arrays", "enums", "nested", "minors", "majors", "positional"}


@pytest.mark.parametrize("case", CASES)
def test_generated_output_is_the_golden_output(case: str) -> None:
    got, want = render_case(case), expected(case)
    assert sorted(got) == sorted(want), "files differ; run `python -m tests.codegen.regen` if intended"
    for name, text in got.items():
        assert text == want[name], f"{case}/{name} differs; run `python -m tests.codegen.regen` if intended"


def _package(case: str) -> object:
    return importlib.import_module(f"tests.codegen.{case}.expected")


def test_the_scalars_case_round_trips_and_checks_ranges_at_the_sender() -> None:
    w = _package("scalars")
    msg = w.Sample(flag=True, count=3, room=2**64 - 1, delta=-5, raw=b"\x00", opaque=b"x")
    assert w.decode(w.encode(msg)) == msg
    with pytest.raises(w.EncodeError, match=r"Sample.*count"):
        w.encode(w.Sample(flag=True, count=-1, room=0))


def test_the_minors_case_writes_each_minor_and_refuses_what_an_older_one_lacks() -> None:
    w = _package("minors")
    msg = w.Request(room=7, ids=np.array([1, 2], dtype=np.uint32), hint="h", limit=0)
    old = w.decode(w.encode(msg, (1, 1)))
    assert old.hint == "" and list(old.ids) == [1, 2]  # hint is dropped for 1.1 (downgrade: drop)
    with pytest.raises(w.DowngradeError, match="limit"):
        w.encode(w.Request(room=7, limit=3), (1, 1))
    with pytest.raises(w.DowngradeError):
        w.encode(w.Ack(room=1), (1, 0))


def test_the_positional_case_recognises_and_round_trips() -> None:
    w = _package("positional")
    v2 = importlib.import_module("tests.codegen.positional.expected.v2_0")
    msg = v2.Status(room=5, status=v2.Poll.SUCCESS, reason=None)
    frames = w.encode(msg)
    assert frames == [b"5", b"2"]
    assert w.decode(frames, "demo") == msg


def test_unchanged_positional_messages_are_one_class_for_every_version() -> None:
    v1 = importlib.import_module("tests.codegen.positional.expected.v1_0")
    v2 = importlib.import_module("tests.codegen.positional.expected.v2_0")
    assert v2.Status is v1.Status and v2.Poll is v1.Poll
    assert v1.Status.VERSIONS == ((1, 0), (2, 0))
    assert v2.Register is not v1.Register and v2.Register.VERSIONS == ((2, 0),)
    w = _package("positional")
    msg = v1.Status(room=1, status=v1.Poll.FAILED, reason="gone")
    for version in ((1, 0), (2, 0)):
        assert w.decode(w.encode(msg), "demo", version=version) == msg
