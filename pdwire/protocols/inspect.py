"""`pdwire inspect`: decode a captured control message, pdwire's own or SGLang's.

Input (a file, or ``-`` for stdin), one of:

* ``hex``: one frame per line as hex digits (spaces allowed); a line ``-`` is an empty frame; a
  line ``--`` ends one message and starts the next; blank lines and ``#`` lines are skipped;
* ``lp``: binary, each frame as a little-endian u32 length followed by its bytes; the length
  ``0xFFFFFFFF`` (no bytes follow) ends one message and starts the next.

``--format auto`` (the default) reads ASCII text whose first frame line is hex as ``hex`` (a bad
line later is then a hex error naming it) and anything else as ``lp``. pdwire's own frames
(``PDWR`` header: protocol, version, message type, side frames) delimit themselves, so several
pdwire messages in a row need no separator. Everything else is read as SGLang's frames,
recognised unless ``--backend``/``--message`` say what it is; ``--profile-version`` picks the
SGLang profile version (its frames carry none), and when a message does not decode at that
version but does at another, the error says which.

Output: per message a line (profile, version, backend, message, frames) and a table of fields
(SGLang: with the frame each comes from); ``--json``: ``{"messages": [...]}``, each with a
``fields`` map. Blobs are shown as bytes (length and hex), pointers and addresses in hex.

Exit status: 0 every message decoded; 1 the capture was read but a message does not decode
(each error names profile, message, field and frame); 2 the capture or an argument cannot be used
(no such file, not hex, a truncated length prefix, a bad ``--profile-version``).
"""

from __future__ import annotations

import argparse
import enum
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdwire.wirecore.envelope.header import HEADER_SIZE, MAGIC, parse_header
from pdwire.wirecore.errors import WireError

_HEX_LINE = re.compile(r"^[0-9a-fA-F\s]+$")
_POINTER = re.compile(r"(addrs?|ptrs?)$")
LP_SEPARATOR = 0xFFFFFFFF
HEX_SEPARATOR = "--"
BLOB_SHOWN = 32  # bytes of a blob the table prints before eliding the rest


class InputError(Exception):
    """The capture cannot be read as frames (exit status 2)."""


class InspectError(Exception):
    """One message of the capture does not decode (exit status 1)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="decode captured control messages (pdwire's own frames or SGLang's)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("capture", help="file with the frames, or - for stdin")
    p.add_argument(
        "--format", choices=["auto", "hex", "lp"], default="auto", help="input format (default: auto)"
    )
    p.add_argument("--backend", help="SGLang: mooncake, nixl or mori (default: recognise)")
    p.add_argument("--message", help="SGLang: message name, e.g. NixlTransferInfo (default: recognise)")
    p.add_argument(
        "--profile-version", default=None, help="SGLang profile version MAJOR.MINOR (default: newest)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


# ---------------------------------------------------------------- reading a capture


def parse_hex(text: str) -> list[list[bytes]]:
    messages: list[list[bytes]] = [[]]
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line == HEX_SEPARATOR:
            messages.append([])
        elif line == "-":
            messages[-1].append(b"")
        elif _HEX_LINE.match(line) is None:
            raise InputError(f"hex line {n}: not hex digits: {line[:40]!r}")
        else:
            try:
                messages[-1].append(bytes.fromhex(line))
            except ValueError:
                raise InputError(f"hex line {n}: an odd number of hex digits: {line[:40]!r}") from None
    return [m for m in messages if m]


def parse_lp(data: bytes) -> list[list[bytes]]:
    messages: list[list[bytes]] = [[]]
    off = 0
    while off < len(data):
        if off + 4 > len(data):
            raise InputError(f"lp offset {off}: truncated length prefix ({len(data) - off} bytes)")
        n = int.from_bytes(data[off : off + 4], "little")
        off += 4
        if n == LP_SEPARATOR:
            messages.append([])
            continue
        if off + n > len(data):
            raise InputError(
                f"lp frame {len(messages[-1])} at offset {off - 4}: length {n} runs past the end "
                f"({len(data) - off} bytes left)"
            )
        messages[-1].append(data[off : off + n])
        off += n
    return [m for m in messages if m]


def _looks_hex(text: str) -> bool:
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            return line in ("-", HEX_SEPARATOR) or _HEX_LINE.match(line) is not None
    return False


def read_messages(data: bytes, fmt: str) -> list[list[bytes]]:
    """The capture's messages (each a list of frames); pdwire messages split on their headers."""
    if fmt == "hex":
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError as exc:
            raise InputError(f"hex input must be ASCII text (byte {exc.start} is not)") from None
        chunks = parse_hex(text)
    elif fmt == "lp":
        chunks = parse_lp(data)
    else:
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            text = ""
        chunks = parse_hex(text) if text and _looks_hex(text) else parse_lp(data)
    if not chunks:
        raise InputError("the capture holds no frames")
    return [m for chunk in chunks for m in split_pdwire(chunk)]


def is_pdwire_header(frame: bytes) -> bool:
    return len(frame) == HEADER_SIZE and frame[:4] == MAGIC


def split_pdwire(frames: list[bytes]) -> list[list[bytes]]:
    """A run of pdwire messages, each its header, body and the side frames the header announces;
    frames that do not start with a pdwire header stay one (non-pdwire) message."""
    out: list[list[bytes]] = []
    i = 0
    while i < len(frames) and is_pdwire_header(frames[i]):
        side = int.from_bytes(frames[i][10:12], "little")
        end = min(len(frames), i + 2 + side)
        out.append(frames[i:end])
        i = end
    if i < len(frames):
        out.append(frames[i:])
    return out


# ---------------------------------------------------------------- values as a user reads them


@dataclass
class Blob:
    data: bytes


@dataclass
class Pointer:
    value: int


def shown(name: str, value: Any) -> Any:
    """``value`` with bytes as :class:`Blob`, addresses as :class:`Pointer`, enums by name, arrays
    as lists and nested messages as dicts (what :func:`as_json` and :func:`as_text` print)."""
    import msgspec
    import numpy as np

    if isinstance(value, bytes | bytearray | memoryview):
        return Blob(bytes(value))
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, msgspec.Struct):
        return {f: shown(f, getattr(value, f)) for f in value.__struct_fields__}
    if isinstance(value, list | tuple):
        return [shown(name, v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and _POINTER.search(name):
        return Pointer(value)
    return value


def as_json(value: Any) -> Any:
    if isinstance(value, Blob):
        return {"bytes": len(value.data), "hex": value.data.hex()}
    if isinstance(value, Pointer):
        return f"0x{value.value:x}"
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_json(v) for v in value]
    return value


def as_text(value: Any) -> str:
    if isinstance(value, Blob):
        head = value.data[:BLOB_SHOWN].hex()
        more = "..." if len(value.data) > BLOB_SHOWN else ""
        return f"<{len(value.data)} bytes> {head}{more}" if value.data else "<0 bytes>"
    if isinstance(value, Pointer):
        return f"0x{value.value:x}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {as_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(as_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------- decoding one message


@dataclass
class Decoded:
    profile: str
    version: str
    message: str
    frames: int
    fields: dict[str, Any]
    backend: str | None = None
    header: dict[str, Any] | None = None
    frame_of: dict[str, int] = field(default_factory=dict)
    defaulted: list[str] = field(default_factory=list)
    derived: dict[str, Any] = field(default_factory=dict)


def describe_pdwire(frames: list[bytes]) -> Decoded:
    from pdwire import wire

    proto, major, minor, tid, side = parse_header(frames[0])
    try:
        msg, version = wire.decode_versioned(frames)
    except WireError as exc:
        raise InspectError(f"pdwire {major}.{minor} message type {tid}: {exc}") from None
    header = {"protocol_id": proto, "version": f"{major}.{minor}", "type_id": tid, "side_frames": side}
    return Decoded(
        profile="pdwire",
        version="{}.{}".format(*version),
        message=type(msg).__name__,
        frames=len(frames),
        fields={f: shown(f, getattr(msg, f)) for f in msg.__struct_fields__},
        header=header,
    )


def describe_sglang(
    frames: list[bytes], backend: str | None, message: str | None, version: tuple[int, int] | None
) -> Decoded:
    from pdwire.wire import sglang

    try:
        msg = sglang.decode(frames, backend, version=version, message=message)
    except WireError as exc:
        tried = version or sglang.VERSIONS[-1]
        hint = ""
        for other in reversed(sglang.VERSIONS):
            if other == tried:
                continue
            try:
                sglang.decode(frames, backend, version=other, message=message)
            except WireError:
                continue
            v = f"{other[0]}.{other[1]}"
            hint = f"; it decodes as {sglang.PROFILE} {v}: try --profile-version {v}"
            break
        raise InspectError(f"{sglang.PROFILE} {tried[0]}.{tried[1]}: {exc}{hint}") from None
    spec = sglang.CODEC.spec_of(msg)
    derived = sglang.to_dict(msg)
    frame_of = dict(sorted(type(msg).FRAMES.items(), key=lambda kv: kv[1]))
    return Decoded(
        profile=sglang.PROFILE,
        version="{}.{}".format(*(version or sglang.VERSIONS[-1])),
        message=spec.name,
        frames=len(frames),
        fields={name: _sglang_field(msg, name, frames, index) for name, index in frame_of.items()},
        backend=spec.backend,
        frame_of=frame_of,
        defaulted=[name for name, index in frame_of.items() if index >= len(frames)],
        derived={name: shown(name, derived[name]) for name in spec.derived},
    )


def _sglang_field(msg: Any, name: str, frames: list[bytes], index: int) -> Any:
    if hasattr(msg, name):
        return shown(name, getattr(msg, name))
    # a fixed frame (a marker SGLang sends as text): what the capture holds
    return frames[index].decode("ascii", "replace") if index < len(frames) else None


def describe(frames: list[bytes], args: argparse.Namespace, version: tuple[int, int] | None) -> Decoded:
    if is_pdwire_header(frames[0]):
        return describe_pdwire(frames)
    return describe_sglang(frames, args.backend, args.message, version)


def decoded_json(d: Decoded) -> dict[str, Any]:
    out: dict[str, Any] = {"profile": d.profile, "version": d.version}
    if d.backend is not None:
        out["backend"] = d.backend
    out |= {"message": d.message, "frames": d.frames}
    if d.header is not None:
        out["header"] = d.header
    out["fields"] = as_json(d.fields)
    if d.frame_of:
        out["frame_of"] = d.frame_of
        out["defaulted"] = d.defaulted
    if d.derived:
        out["derived"] = as_json(d.derived)
    return out


def render_table(d: Decoded) -> str:
    what = f"{d.profile} {d.version}" + (f" {d.backend}" if d.backend else "")
    lines = [f"{what} {d.message}: {d.frames} frames"]
    if d.header is not None:
        h = d.header
        lines.append(
            f"  header: protocol {h['protocol_id']}, version {h['version']}, type {h['type_id']}, "
            f"{h['side_frames']} side frames"
        )
    if d.frame_of:
        lines.append(f"{'frame':>5}  {'field':<26} value")
        for name, index in d.frame_of.items():
            value = as_text(d.fields[name])
            if name in d.defaulted:
                value = f"(missing: default {value})"
            lines.append(f"{index:>5}  {name:<26} {value}")
        for name, value in d.derived.items():
            lines.append(f"{'':>5}  {name:<26} {as_text(value)}  (derived)")
    else:
        width = max([26, *(len(n) for n in d.fields)])
        lines += [f"  {name:<{width}} {as_text(value)}" for name, value in d.fields.items()]
    return "\n".join(lines)


def _version(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if m is None:
        raise InputError(f"--profile-version {text!r} is not MAJOR.MINOR")
    version = int(m.group(1)), int(m.group(2))
    from pdwire.wire import sglang

    if version not in sglang.VERSIONS:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(sglang.VERSIONS))
        raise InputError(f"--profile-version {text}: {sglang.PROFILE} has no such version (known: {known})")
    return version


def run(args: argparse.Namespace) -> int:
    try:
        version = _version(args.profile_version)
        if args.capture == "-":
            data = sys.stdin.buffer.read()
        else:
            try:
                data = Path(args.capture).read_bytes()
            except OSError as exc:
                raise InputError(f"{args.capture}: {exc.strerror or exc}") from None
        messages = read_messages(data, args.format)
    except InputError as exc:
        print(f"pdwire inspect: {exc}", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    failed = 0
    first = 0
    for n, frames in enumerate(messages):
        where = f"message {n + 1} (frames {first}..{first + len(frames) - 1})" if len(messages) > 1 else ""
        first += len(frames)
        try:
            d = describe(frames, args, version)
        except InspectError as exc:
            failed += 1
            print(f"pdwire inspect: {where + ': ' if where else ''}{exc}", file=sys.stderr)
            results.append({"error": str(exc), "frames": len(frames)})
            continue
        if args.json:
            results.append(decoded_json(d))
        else:
            if n:
                print()
            print(render_table(d))
    if args.json:
        print(json.dumps({"messages": results}, ensure_ascii=False, indent=1))
    return 1 if failed else 0
