"""Wrong argument types across the public API end in a typed WireError naming what is wrong,
and the schema commands refuse bad paths in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdwire import wire
from pdwire.cli import main
from pdwire.wire import sglang

ABORT = wire.Abort(room=5, sender="tcp://d:1", reason="r")
GOLDEN = json.loads((Path(__file__).parents[1] / "golden" / "sglang" / "frames.json").read_text("utf-8"))
SG_FRAMES = [bytes.fromhex(h) for h in GOLDEN[0]["frames"]]


@pytest.mark.parametrize(
    ("call", "error", "text"),
    [
        (lambda: wire.decode(b"PDWR..."), wire.FrameError, "expected a list of frames"),
        (lambda: wire.decode("frames"), wire.FrameError, "expected a list of frames"),
        (lambda: wire.decode([b"PDWR", 5]), wire.FrameError, "frame 1: frame of type int is not a buffer"),
        (lambda: wire.decode_bytes([b"x"]), wire.FrameError, "expected one buffer"),
        (lambda: wire.encode(ABORT, "1.3"), wire.EncodeError, "write (1, 3) for version 1.3"),
        (lambda: wire.encode(ABORT, 1.3), wire.EncodeError, "tuple of ints or a Version"),
        (lambda: wire.encode(ABORT, (1, 99)), wire.EncodeError, "1.99 is not one this build writes"),
        (lambda: wire.encode(None), wire.EncodeError, "NoneType is not a pdwire message"),
        (lambda: wire.encode_bytes(ABORT, "x"), wire.EncodeError, "tuple of ints or a Version"),
        (lambda: wire.check_sendable(1, (1, 4)), wire.EncodeError, "int is not a pdwire message"),
        (lambda: wire.agree(1, 2), wire.NegotiationError, "agree takes two Hello messages; local is int"),
        (lambda: wire.negotiate("1.3", [(1, 0)]), wire.NegotiationError, "must be a list of (major, minor)"),
        (lambda: wire.negotiate([(1, 0)], [(1, "3")]), wire.NegotiationError, "(1, '3') is not a (major"),
        (lambda: sglang.decode(b"x"), sglang.ProfileDecodeError, "expected a sequence of frames"),
        (lambda: sglang.decode([b"x", 1]), sglang.ProfileDecodeError, "frame 1: frame of type int"),
        (lambda: sglang.decode(SG_FRAMES, 3), sglang.UnrecognisedMessage, "unknown backend"),
        (lambda: sglang.encode(1), sglang.ProfileEncodeError, "int is not a message of this profile"),
        (lambda: sglang.to_dict(1), sglang.ProfileEncodeError, "int is not a message of this profile"),
    ],
)
def test_wrong_argument_types_raise_typed_wire_errors(call: Any, error: type[Exception], text: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, wire.WireError) and text in str(info.value)


def test_encode_takes_the_versions_hello_lists() -> None:
    (newest,) = wire.hello_versions()
    assert wire.decode(wire.encode(ABORT, newest)) == ABORT
    assert wire.negotiate(wire.hello_versions(), [(1, 2)]) == (1, 2)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_reference_names_each_protocols_own_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "reference")
    root = Path(__file__).parents[2]
    refs = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("full reference: ")]
    assert code == 0 and sorted(refs) == [
        "generated/REFERENCE.md",
        "generated/backend_metadata/REFERENCE.md",
        "generated/sglang/REFERENCE.md",
    ]
    assert all((root / r).is_file() for r in refs)
    assert "sglang" in (root / "generated/sglang/REFERENCE.md").read_text().lower()


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["reference", "--schema", "/nonexistent"], "pdwire reference: /nonexistent: no such schema folder"),
        (["codegen", "--schema", "/nonexistent"], "pdwire codegen: /nonexistent: no such schema folder"),
        (["codegen", "--out", "/proc/nope"], "pdwire codegen: cannot write /proc/nope: "),
    ],
)
def test_bad_schema_and_output_paths_are_one_line_and_exit_2(
    argv: list[str], want: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(want)


def test_an_empty_schema_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(capsys, "reference", "--schema", str(tmp_path))
    assert code == 2 and err.strip() == f"pdwire reference: {tmp_path}: no *.yaml schema files"


def test_codegen_without_ruff_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After `pip install pdwire` without the dev extra, ruff (which formats generated code) is
    missing: one line naming the extra, exit 2, nothing written."""
    import importlib.util

    real = importlib.util.find_spec
    no_ruff = lambda name, *a: None if name == "ruff" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", no_ruff)
    code, out, err = _cli(capsys, "codegen", "--out", str(tmp_path / "out"))
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("pdwire codegen: ") and "pip install 'pdwire[dev]'" in line, line
    assert not any((tmp_path / "out").rglob("*.py"))
