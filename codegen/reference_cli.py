"""`pdwire reference`: a short summary of the wire reference; each protocol's summary ends with
the path of its full generated reference (``generated/REFERENCE.md``, SGLang's profile
``generated/sglang/REFERENCE.md``; in an installed pdwire, the files inside the package)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .errors import SchemaError
from .loader import load_dir
from .model import Protocol, format_version
from .render import ROOT_PROTOCOL
from .templating import REPO


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "reference", help="summarise messages, type ids and versions of the wire protocol"
    )
    p.add_argument(
        "--schema", type=Path, default=REPO / "schema", help="schema folder (default: %(default)s)"
    )
    p.set_defaults(func=run)


def reference_file(proto: Protocol, root: Path = REPO) -> str:
    """Where ``proto``'s full reference is: relative to the clone, or the installed file."""
    sub = Path() if proto.name == ROOT_PROTOCOL else Path(proto.name)
    from .cli import in_checkout

    if in_checkout(root):
        return str(Path("generated") / sub / "REFERENCE.md")
    return str(root / "wire" / sub / "REFERENCE.md")


def summary(proto: Protocol) -> str:
    lines = [
        f"protocol {proto.name} (id {proto.protocol_id}), layout {proto.layout}, "
        f"versions {', '.join(format_version(v) for v in proto.version_list)}",
        f"{'type':>4}  {'message':<18} {'since':<6} fields (newest)",
    ]
    newest = proto.newest
    for m in proto.top_level():
        names = ", ".join(f.name for f in m.fields_at(newest))
        lines.append(f"{m.type_id:>4}  {m.name:<18} {format_version(m.since):<6} {names}")
    for info in proto.versions:
        lines.append(f"{format_version(info.version)}: {info.doc}")
    lines.append(f"full reference: {reference_file(proto)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not args.schema.is_dir():
        print(f"pdwire reference: {args.schema}: no such schema folder", file=sys.stderr)
        return 2
    try:
        protocols = load_dir(args.schema)
    except SchemaError as exc:
        print(f"pdwire reference: {exc}", file=sys.stderr)
        return 2
    for proto in protocols:
        print(summary(proto))
    return 0
