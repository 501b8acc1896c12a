"""`pdwire reference`: a short summary of the wire reference (the full one is generated/REFERENCE.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .loader import load_dir
from .model import Protocol, format_version

REPO = Path(__file__).resolve().parent.parent


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "reference", help="summarise messages, type ids and versions of the wire protocol"
    )
    p.add_argument(
        "--schema", type=Path, default=REPO / "schema", help="schema folder (default: %(default)s)"
    )
    p.set_defaults(func=run)


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
    lines.append("full reference: generated/REFERENCE.md")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    for proto in load_dir(args.schema):
        print(summary(proto))
    return 0
