"""`pdwire codegen`: regenerate generated/ from schema/, or check that it is current."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .errors import SchemaError
from .generate import render_all, stale, write

REPO = Path(__file__).resolve().parent.parent


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("codegen", help="generate the wire codecs from the YAML schema")
    p.add_argument(
        "--check", action="store_true", help="exit 1 and print the difference if generated/ is stale"
    )
    p.add_argument(
        "--schema", type=Path, default=REPO / "schema", help="schema folder (default: %(default)s)"
    )
    p.add_argument(
        "--out", type=Path, default=REPO / "generated", help="output folder (default: %(default)s)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        out = render_all(args.schema, REPO)
    except SchemaError as exc:
        print(f"pdwire codegen: {exc}", file=sys.stderr)
        return 2
    if args.check:
        problems = stale(out, args.out)
        for p in problems:
            print(p)
        if problems:
            print(f"pdwire codegen: {args.out} is stale; run `pdwire codegen`", file=sys.stderr)
            return 1
        print(f"{args.out}: {len(out.files)} generated files are current")
        return 0
    written = write(out, args.out)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"{args.out}: already current")
    return 0
