"""`pdwire codegen`: regenerate generated/ from schema/, or check that it is current."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .errors import SchemaError
from .generate import render_all, stale, write
from .templating import REPO


def in_checkout(root: Path = REPO) -> bool:
    """Whether this code runs from a clone (schema/, generated/, pyproject.toml side by side),
    not from an installed package, whose generated codecs are part of the release."""
    return (
        (root / "pyproject.toml").is_file() and (root / "generated").is_dir() and (root / "schema").is_dir()
    )


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("codegen", help="generate the wire codecs from the YAML schema")
    p.add_argument(
        "--check", action="store_true", help="exit 1 and print the difference if generated/ is stale"
    )
    p.add_argument(
        "--schema", type=Path, default=REPO / "schema", help="schema folder (default: %(default)s)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: generated/ of the checkout; an installed pdwire has none and"
        " needs --out: it never writes into its own package)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.out is None:
        if not in_checkout():
            what = "compare" if args.check else "write"
            print(
                f"pdwire codegen: not in a pdwire checkout (this is the installed package {REPO}, whose "
                f"codecs were generated with the release); pass --out DIR to {what} a folder of codecs",
                file=sys.stderr,
            )
            return 2
        args.out = REPO / "generated"
    if not args.schema.is_dir():
        print(f"pdwire codegen: {args.schema}: no such schema folder", file=sys.stderr)
        return 2
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
    try:
        written = write(out, args.out)
    except OSError as exc:
        print(f"pdwire codegen: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"{args.out}: already current")
    return 0
