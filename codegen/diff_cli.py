"""`pdwire schema diff OLD NEW`: classify schema changes; exit 1 on a breaking change within a major.

OLD and NEW are schema folders or git revisions (the schema folder is then read from that
revision's tree at the same path as the other side's folder, default ``schema``). A
revision whose tree has no schema yet means nothing to compare: exit 0 with a note.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

from .diff import diff_protocols
from .errors import SchemaError
from .loader import load_dir, load_texts
from .model import Protocol


class NoSchema(Exception):
    """The revision has no schema files."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("schema", help="schema tools")
    sub = p.add_subparsers(dest="schema_command", metavar="SUBCOMMAND", required=True)
    d = sub.add_parser("diff", help="classify every change between two schemas as compatible or breaking")
    d.add_argument("old", help="schema folder or git revision")
    d.add_argument("new", help="schema folder or git revision")
    d.add_argument(
        "--path", default=None, help="schema folder inside a git revision (default: NEW's path or 'schema')"
    )
    d.set_defaults(func=run)


def _git(args: list[str], cwd: Path) -> str:
    res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SchemaError(f"git {' '.join(args)}", res.stderr.strip() or "failed")
    return res.stdout


def load_revision(rev: str, path: str, cwd: Path) -> list[Protocol]:
    root = Path(_git(["rev-parse", "--show-toplevel"], cwd).strip())
    _git(["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], root)
    names = [
        n
        for n in _git(["ls-tree", "-r", "--name-only", rev, "--", path.rstrip("/") + "/"], root).splitlines()
        if n.endswith(".yaml") and "/" not in n[len(path.rstrip("/")) + 1 :]
    ]
    if not names:
        raise NoSchema(f"{rev} has no {path}/*.yaml")
    texts = {f"{rev}:{n}": _git(["show", f"{rev}:{n}"], root) for n in names}
    return load_texts(texts)


def _load(spec: str, path: str) -> list[Protocol]:
    p = Path(spec)
    if p.is_dir():
        return load_dir(p)
    return load_revision(spec, path, Path.cwd())


def _repo_relative(spec: str) -> str | None:
    p = Path(spec)
    if not p.is_dir():
        return None
    try:
        top = Path(_git(["rev-parse", "--show-toplevel"], Path.cwd()).strip())
        return str(p.resolve().relative_to(top.resolve()))
    except (SchemaError, ValueError):
        return None


def run(args: argparse.Namespace) -> int:
    path = args.path or _repo_relative(args.new) or _repo_relative(args.old) or "schema"
    try:
        old = _load(args.old, path)
    except NoSchema as exc:
        print(f"pdwire schema diff: nothing to compare ({exc})")
        return 0
    except SchemaError as exc:
        print(f"pdwire schema diff: cannot load OLD: {exc}", file=sys.stderr)
        return 2
    try:
        new = _load(args.new, path)
    except (SchemaError, NoSchema) as exc:
        print(f"pdwire schema diff: cannot load NEW: {exc}", file=sys.stderr)
        return 2
    failed = False
    old_by_name = {p.name: p for p in old}
    for proto in new:
        base = old_by_name.get(proto.name)
        if base is None:
            print(f"{proto.name}: new protocol, nothing to compare")
            continue
        result = diff_protocols(base, proto)
        for change in result.changes:
            print(change)
        if result.breaking and result.major_bump:
            print(f"{proto.name}: {len(result.breaking)} breaking change(s) allowed by the new major version")
        elif result.failed:
            print(f"{proto.name}: {len(result.breaking)} breaking change(s) within a major", file=sys.stderr)
            failed = True
        else:
            print(f"{proto.name}: compatible ({len(result.changes)} change(s))")
    for name in old_by_name.keys() - {p.name for p in new}:
        print(f"BREAKING: protocol {name} removed", file=sys.stderr)
        failed = True
    return 1 if failed else 0
