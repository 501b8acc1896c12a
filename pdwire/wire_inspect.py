"""`pdwire inspect`: decode one captured multipart message of a wire profile (SGLang's frames).

Input (a file, or ``-`` for stdin), one of:

* ``hex``: one frame per line as hex digits (spaces allowed); a line ``-`` is an empty frame;
  blank lines and lines starting with ``#`` are skipped;
* ``lp``: binary, each frame as a little-endian u32 length followed by its bytes.

``--format auto`` (the default) reads text made only of hex/``-``/comment lines as ``hex``
and anything else as ``lp``. The message is recognised from its frames unless
``--backend``/``--message`` say what it is; ``--profile-version`` picks the profile
version (SGLang frames carry none). Output: a table of frame, field and value, or
``--json``. Exit status: 0 decoded, 1 no message matches or the frames are malformed
(the error names backend, message, field and frame), 2 unreadable input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from pdwire.wirecore.errors import WireError

_HEX_LINE = re.compile(r"^(?:[0-9a-fA-F\s]*|-|#.*)$")


class InputError(Exception):
    """The capture cannot be read as frames."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("inspect", help="decode a captured SGLang PD control message")
    p.add_argument("capture", help="file with the frames, or - for stdin")
    p.add_argument("--format", choices=["auto", "hex", "lp"], default="auto", help="input format")
    p.add_argument("--backend", help="mooncake, nixl or mori (default: recognise)")
    p.add_argument("--message", help="message name, e.g. NixlTransferInfo (default: recognise)")
    p.add_argument("--profile-version", default=None, help="profile version MAJOR.MINOR (default: newest)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def parse_hex(text: str) -> list[bytes]:
    frames = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line == "-":
            frames.append(b"")
            continue
        try:
            frames.append(bytes.fromhex(line))
        except ValueError:
            raise InputError(f"line {n}: not hex: {line[:40]!r}") from None
    return frames


def parse_lp(data: bytes) -> list[bytes]:
    frames: list[bytes] = []
    off = 0
    while off < len(data):
        if off + 4 > len(data):
            raise InputError(f"offset {off}: truncated length prefix")
        n = int.from_bytes(data[off : off + 4], "little")
        off += 4
        if off + n > len(data):
            raise InputError(
                f"frame {len(frames)}: length {n} runs past the end ({len(data) - off} bytes left)"
            )
        frames.append(data[off : off + n])
        off += n
    return frames


def read_frames(data: bytes, fmt: str) -> list[bytes]:
    if fmt == "lp":
        return parse_lp(data)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        if fmt == "hex":
            raise InputError("hex input must be ASCII text") from None
        return parse_lp(data)
    if fmt == "hex" or all(_HEX_LINE.match(line.strip()) for line in text.splitlines()):
        return parse_hex(text)
    return parse_lp(data)


def _version(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if m is None:
        raise InputError(f"--profile-version {text!r} is not MAJOR.MINOR")
    return int(m.group(1)), int(m.group(2))


def describe(frames: list[bytes], backend: str | None, message: str | None, version: Any) -> dict[str, Any]:
    """Decode and lay out one message: profile, backend, message, version and per-frame rows."""
    from pdwire.wire import sglang

    msg = sglang.decode(frames, backend, version=version, message=message)
    fields = sglang.to_dict(msg)
    spec = sglang.CODEC.spec_of(msg)
    rows = []
    for name, index in sorted(type(msg).FRAMES.items(), key=lambda kv: kv[1]):
        present = index < len(frames)
        value = fields.get(name, frames[index].decode("ascii", "replace") if present else None)
        rows.append({"frame": index, "field": name, "value": value, "present": present})
    return {
        "profile": sglang.PROFILE,
        "version": "{}.{}".format(*msg.VERSION),
        "backend": spec.backend,
        "message": spec.name,
        "frames": len(frames),
        "rows": rows,
        "derived": {name: fields[name] for name in spec.derived},
    }


def render_table(d: dict[str, Any]) -> str:
    head = f"{d['profile']} {d['version']} {d['backend']} {d['message']}: {d['frames']} frames"
    lines = [head, f"{'frame':>5}  {'field':<26} value"]
    for r in d["rows"]:
        value = json.dumps(r["value"], ensure_ascii=False) if r["present"] else "(missing: default "
        if not r["present"]:
            value += json.dumps(r["value"], ensure_ascii=False) + ")"
        lines.append(f"{r['frame']:>5}  {r['field']:<26} {value}")
    for name, value in d["derived"].items():
        lines.append(f"{'':>5}  {name:<26} {json.dumps(value)}  (derived)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        data = sys.stdin.buffer.read() if args.capture == "-" else Path(args.capture).read_bytes()
        frames = read_frames(data, args.format)
        version = _version(args.profile_version)
    except (OSError, InputError) as exc:
        print(f"pdwire inspect: {exc}", file=sys.stderr)
        return 2
    try:
        d = describe(frames, args.backend, args.message, version)
    except WireError as exc:
        print(f"pdwire inspect: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(d, ensure_ascii=False, indent=1) if args.json else render_table(d))
    return 0
