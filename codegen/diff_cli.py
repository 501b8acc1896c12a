"""`pdwire schema diff OLD NEW` and `pdwire schema gate`: the compatibility gate.

* ``diff OLD NEW``: OLD and NEW are schema folders or git revisions (a revision's schema
  folder is read at ``--path``, default: NEW's folder relative to the repository, or
  ``schema``). Every version of OLD counts as released.
* ``gate`` (what CI runs): the working tree's schemas against the newest release of
  ``schema/releases.toml`` (by its recorded commit; a tag, when present, must agree) and
  against the merge base with ``--base`` (default ``main``, else ``origin/main``), whose
  every version counts as released too: what is on main is the contract for a branch.

Exit status: 0 compatible, 1 a breaking change (or NEW breaks a schema rule), 2 nothing to
compare or an input that cannot be read (a missing folder, revision, release or schema).
``--json`` prints one JSON document instead of text.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .diff import Change, DiffResult, diff_protocols, span
from .errors import SchemaError
from .gitrev import GitError, commit_of, git, repo_root, schema_texts
from .loader import load_dir, load_texts
from .model import Protocol
from .releases import RELEASES_FILE, ReleaseError, newest


class NothingToCompare(Exception):
    """A side of the comparison has no schema: the gate would check nothing."""


class Unreadable(Exception):
    """An input cannot be read at all."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("schema", help="schema tools")
    sub = p.add_subparsers(dest="schema_command", metavar="SUBCOMMAND", required=True)
    d = sub.add_parser("diff", help="classify every change between two schemas as compatible or breaking")
    d.add_argument("old", help="schema folder or git revision")
    d.add_argument("new", help="schema folder or git revision")
    d.add_argument(
        "--path", default=None, help="schema folder inside a git revision (default: NEW's path or 'schema')"
    )
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(func=run_diff)
    g = sub.add_parser("gate", help="CI: the schemas against the newest release and the merge base")
    g.add_argument("--schema", type=Path, default=None, help="schema folder (default: <repo>/schema)")
    g.add_argument(
        "--releases", type=Path, default=None, help=f"release list (default: <repo>/{RELEASES_FILE})"
    )
    g.add_argument(
        "--base", default=None, help="branch to take the merge base with (default: main or origin/main)"
    )
    g.add_argument("--json", action="store_true", help="print JSON")
    g.set_defaults(func=run_gate)


# --- loading -------------------------------------------------------------------------------------
def _invalid(exc: SchemaError) -> Change:
    file, _, rest = exc.where.partition(": ")
    return Change(True, "SCHEMA_RULE", file, rest or None, None, exc.problem)


def load_revision(rev: str, path: str, root: Path) -> list[Protocol]:
    if commit_of(rev, root) is None:
        raise Unreadable(f"{rev!r} is neither a schema folder nor a git revision of {root}")
    try:
        texts = schema_texts(rev, path, root)
    except GitError as exc:
        raise NothingToCompare(f"{rev} has no folder {path!r} ({exc})") from None
    if not texts:
        raise NothingToCompare(f"{rev}:{path} holds no *.yaml schema")
    return load_texts(texts)


def load_spec(spec: str, path: str, root: Path | None) -> list[Protocol]:
    p = Path(spec)
    if p.is_dir():
        if not any(p.glob("*.yaml")):
            raise NothingToCompare(f"{p} holds no *.yaml schema")
        return load_dir(p)
    if root is None:
        raise Unreadable(f"{spec!r} is not a folder (and this is not a git work tree)")
    return load_revision(spec, path, root)


def _repo_relative(spec: str, root: Path | None) -> str | None:
    p = Path(spec)
    if root is None or not p.is_dir():
        return None
    try:
        return str(p.resolve().relative_to(root.resolve()))
    except ValueError:
        return None


# --- one comparison --------------------------------------------------------------------------------
@dataclass
class Comparison:
    against: str  # what OLD is: "release wire-1.3 (6c4b694)", "merge base ...", a folder
    results: list[DiffResult] = field(default_factory=list)
    new_protocols: list[str] = field(default_factory=list)
    extra: list[Change] = field(default_factory=list)  # protocol removed, NEW invalid

    @property
    def failed(self) -> bool:
        return any(r.failed for r in self.results) or any(c.breaking for c in self.extra)

    def to_json(self) -> dict[str, Any]:
        return {
            "against": self.against,
            "ok": not self.failed,
            "protocols": [
                {
                    "name": r.protocol,
                    "released": [f"{a}.{b}" for a, b in r.released],
                    "ok": not r.failed,
                    "changes": [c.to_json() for c in r.changes],
                }
                for r in self.results
            ],
            "new_protocols": self.new_protocols,
            "problems": [c.to_json() for c in self.extra],
        }

    def text(self) -> list[str]:
        lines = [f"== against {self.against}"]
        for c in self.extra:
            lines.append(str(c))
        for name in self.new_protocols:
            lines.append(f"{name}: new protocol, nothing released to compare with")
        for r in self.results:
            lines += [str(c) for c in r.changes]
            released = span(r.released)
            if r.failed:
                lines.append(f"{r.protocol}: {len(r.breaking)} breaking change(s) (released: {released})")
            else:
                lines.append(
                    f"{r.protocol}: compatible with released {released} ({len(r.changes)} change(s))"
                )
        return lines


def compare(against: str, old: list[Protocol], new_loader: Any) -> Comparison:
    out = Comparison(against)
    try:
        new = new_loader()
    except SchemaError as exc:  # NEW breaks a rule of the schema language: refused, like a break
        out.extra.append(_invalid(exc))
        return out
    old_by_name = {p.name: p for p in old}
    for proto in new:
        base = old_by_name.get(proto.name)
        if base is None:
            out.new_protocols.append(proto.name)
        else:
            out.results.append(diff_protocols(base, proto))
    for name in sorted(old_by_name.keys() - {p.name for p in new}):
        src = old_by_name[name].source
        out.extra.append(Change(True, "PROTOCOL_REMOVED", src, None, None, f"protocol {name} removed"))
    return out


def _emit(comparisons: list[Comparison], as_json: bool) -> int:
    failed = any(c.failed for c in comparisons)
    if as_json:
        print(json.dumps({"ok": not failed, "comparisons": [c.to_json() for c in comparisons]}, indent=1))
    else:
        for c in comparisons:
            for line in c.text():
                print(line)
    return 1 if failed else 0


def _fail(command: str, exc: Exception, as_json: bool) -> int:
    kind = "nothing to compare" if isinstance(exc, NothingToCompare) else "cannot read input"
    text = f"pdwire schema {command}: {kind}: {exc}"
    if as_json:
        print(json.dumps({"ok": False, "error": text}))
    print(text, file=sys.stderr)
    return 2


def _root(cwd: Path) -> Path | None:
    try:
        return repo_root(cwd)
    except GitError:
        return None


# --- commands --------------------------------------------------------------------------------------
def run_diff(args: argparse.Namespace) -> int:
    root = _root(Path.cwd())
    path = args.path or _repo_relative(args.new, root) or _repo_relative(args.old, root) or "schema"
    try:
        old = load_spec(args.old, path, root)
        if not Path(args.new).is_dir() and (root is None or commit_of(args.new, root) is None):
            raise Unreadable(f"{args.new!r} is neither a schema folder nor a git revision")
        cmp = compare(f"{args.old} ({path})", old, lambda: load_spec(args.new, path, root))
    except (NothingToCompare, Unreadable, GitError) as exc:
        return _fail("diff", exc, args.json)
    except SchemaError as exc:
        return _fail("diff", Unreadable(f"OLD: {exc}"), args.json)
    return _emit([cmp], args.json)


def _base_ref(root: Path, wanted: str | None) -> str:
    candidates = [wanted] if wanted else ["main", "origin/main"]
    for ref in candidates:
        if commit_of(ref, root) is not None:
            return ref
    raise Unreadable(f"no branch {' or '.join(candidates)} to take the merge base with (use --base REF)")


def run_gate(args: argparse.Namespace) -> int:
    try:
        root = repo_root(Path.cwd() if args.schema is None else args.schema.resolve())
        schema = args.schema or root / "schema"
        if not schema.is_dir():
            raise Unreadable(f"{schema}: no such folder")
        try:
            path = str(schema.resolve().relative_to(root.resolve()))
        except ValueError:
            raise Unreadable(f"{schema} is not inside the repository {root}") from None
        release, commit = newest(root, args.releases)
        base = _base_ref(root, args.base)
        merge_base = git(["merge-base", "HEAD", base], root).strip()
        against = [
            (f"release {release.name} ({commit[:12]})", load_revision(commit, path, root)),
            (f"merge base with {base} ({merge_base[:12]})", load_revision(merge_base, path, root)),
        ]
    except (NothingToCompare, Unreadable, GitError, ReleaseError) as exc:
        return _fail("gate", exc, args.json)
    except SchemaError as exc:
        return _fail("gate", Unreadable(f"released schema: {exc}"), args.json)

    def working_tree() -> list[Protocol]:  # named as in the repository: schema/pdwire.yaml
        return load_texts({f"{path}/{f.name}": f.read_text(encoding="utf-8") for f in schema.glob("*.yaml")})

    return _emit([compare(name, old, working_tree) for name, old in against], args.json)
