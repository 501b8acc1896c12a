"""`pdwire inspect` on pdwire's own frames, several messages per capture, and its refusals."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from pdwire import wire
from pdwire.cli import main
from pdwire.runtime.session.registration import register_info
from tests.session.memories import hybrid

GOLDEN = json.loads((Path(__file__).parents[1] / "golden" / "sglang" / "frames.json").read_text("utf-8"))


def _abort() -> list[bytes]:
    return [bytes(f) for f in wire.encode(wire.Abort(room=7, sender="tcp://d:1", reason="gone"), (1, 4))]


def _register() -> list[bytes]:
    info = register_info(
        hybrid(1, 0),
        endpoint="tcp://d:2",
        engine_id="dec",
        agent_name="agent-7",
        agent_metadata=b"\x00\xffMD",
    )
    return [bytes(f) for f in wire.encode(info, (1, 4))]


def _hex(path: Path, *messages: list[bytes], sep: str = "") -> Path:
    """One hex frame per line; ``sep`` (if any) after each message."""
    lines: list[str] = []
    for m in messages:
        lines += [f.hex() or "-" for f in m] + ([sep] if sep else [])
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_pdwire_frames_are_read_header_version_message_and_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # two pdwire messages back to back, no separator: the headers delimit them
    capture = _hex(tmp_path / "c.hex", _abort(), _register())
    code, out, err = _run(capsys, "--json", str(capture))
    assert code == 0, err
    first, second = json.loads(out)["messages"]
    assert (first["profile"], first["version"], first["message"]) == ("pdwire", "1.4", "Abort")
    assert first["header"] == {"protocol_id": first["header"]["protocol_id"], "version": "1.4",
                               "type_id": first["header"]["type_id"], "side_frames": 0}  # fmt: skip
    assert first["fields"] == {"room": 7, "sender": "tcp://d:1", "reason": "gone"}  # a field map
    assert second["message"] == "RegisterInfo" and second["frames"] == len(_register())
    fields = second["fields"]
    assert fields["agent_metadata"] == {"bytes": 4, "hex": "00ff4d44"}  # a blob is bytes
    assert all(isinstance(a, str) and a.startswith("0x") for a in fields["k_base_addrs"])  # pointers in hex
    assert fields["state_components"][0]["base_addrs"][0].startswith("0x")
    code, table, _ = _run(capsys, str(capture))
    assert code == 0
    assert "pdwire 1.4 Abort: 2 frames" in table and "pdwire 1.4 RegisterInfo" in table
    assert "<4 bytes> 00ff4d44" in table and "k_base_addrs" in table and "[0x" in table


def test_several_sglang_messages_per_capture_in_hex_and_lp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [c for c in GOLDEN if c["version"] == "2.0"][:3]
    messages = [[bytes.fromhex(h) for h in c["frames"]] for c in cases]
    code, out, err = _run(capsys, "--json", str(_hex(tmp_path / "c.hex", *messages, sep="--")))
    assert code == 0, err
    got = [(m["backend"], m["message"]) for m in json.loads(out)["messages"]]
    assert got == [(c["backend"], c["message"]) for c in cases]
    lp = tmp_path / "c.bin"
    sep = struct.pack("<I", 0xFFFFFFFF)
    lp.write_bytes(sep.join(b"".join(struct.pack("<I", len(f)) + f for f in m) for m in messages))
    code, out, _ = _run(capsys, "--json", str(lp))
    assert code == 0 and [(m["backend"], m["message"]) for m in json.loads(out)["messages"]] == got


def test_a_capture_of_the_other_profile_version_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = next(c for c in GOLDEN if c["version"] == "1.0" and c["message"] == "NixlTransferInfo")
    capture = _hex(tmp_path / "old.hex", [bytes.fromhex(h) for h in old["frames"]])
    code, out, err = _run(capsys, str(capture))  # the default is the newest version, 2.0
    assert code == 1 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("pdwire inspect: sglang 2.0: ") and line.endswith("try --profile-version 1.0")
    assert _run(capsys, "--profile-version", "1.0", str(capture))[0] == 0


def test_one_bad_message_fails_the_capture_but_the_others_are_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    abort = _abort()
    broken = [abort[0], abort[1][:-2]]  # a truncated body
    code, out, err = _run(capsys, "--json", str(_hex(tmp_path / "c.hex", _abort(), broken, sep="--")))
    assert code == 1
    ok, bad = json.loads(out)["messages"]
    assert ok["message"] == "Abort" and "error" in bad
    assert "message 2 (frames 2..3): pdwire 1.4 message type" in err


@pytest.mark.parametrize(
    ("content", "argv", "want"),
    [
        ("00\nzz\n", [], "hex line 2: not hex digits: 'zz'"),  # auto mode names the hex line
        ("abc\n", ["--format", "hex"], "hex line 1: an odd number of hex digits: 'abc'"),
        ("", [], "the capture holds no frames"),
        ("00\n", ["--profile-version", "2"], "--profile-version '2' is not MAJOR.MINOR"),
        (
            "00\n",
            ["--profile-version", "9.9"],
            "--profile-version 9.9: sglang has no such version (known: 1.0, 2.0)",
        ),
    ],
)
def test_unreadable_captures_are_one_line_and_exit_2(
    content: str, argv: list[str], want: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capture = tmp_path / "c.hex"
    capture.write_text(content)
    code, out, err = _run(capsys, *argv, str(capture))
    assert code == 2 and out == "" and err.strip() == f"pdwire inspect: {want}"


def test_a_missing_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, str(tmp_path / "none.hex"))
    assert code == 2 and err.strip() == f"pdwire inspect: {tmp_path / 'none.hex'}: No such file or directory"
