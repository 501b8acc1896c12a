"""The released states of the schemas: ``schema/releases.toml``, name -> commit (and tag).

A release is a commit whose schemas (and golden frames) are frozen: the gate compares every
later schema with the newest release, version by version. The file is the record; the tag
is the published name of the same commit. CI clones do not always bring tags along, so the
gate uses the recorded commit and, when the tag is present too, checks that both agree.

Release step (schema/README.md, "Releasing"): freeze the new versions' goldens with
``python -m tests.golden.freeze`` and commit them; append ``[[release]] name, commit, tag``
for that commit here and commit; then ``git tag <tag> <commit>`` and push the tag.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from .gitrev import GitError, commit_of

RELEASES_FILE = "schema/releases.toml"


@dataclass(frozen=True)
class Release:
    name: str
    commit: str  # as recorded (full or abbreviated)
    tag: str
    doc: str = ""


class ReleaseError(Exception):
    """The release list is malformed, or a release cannot be found in this clone."""


def load_releases(path: Path) -> list[Release]:
    """Every release in the file, oldest first."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReleaseError(f"{path}: no such file (the list of released schema commits)") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ReleaseError(f"{path}: {exc}") from None
    items = data.get("release", [])
    if not isinstance(items, list) or not items:
        raise ReleaseError(f"{path}: lists no [[release]] (nothing to compare against)")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or set(item) - {"name", "commit", "tag", "doc"}:
            raise ReleaseError(f"{path}: release #{i + 1}: keys are name, commit, tag, doc")
        try:
            out.append(
                Release(str(item["name"]), str(item["commit"]), str(item["tag"]), str(item.get("doc", "")))
            )
        except KeyError as exc:
            raise ReleaseError(f"{path}: release #{i + 1}: missing {exc.args[0]}") from None
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ReleaseError(f"{path}: release names repeat: {names}")
    return out


def resolve(release: Release, root: Path) -> str:
    """The full commit of ``release`` in this clone; refuses a tag that points elsewhere."""
    commit = commit_of(release.commit, root)
    if commit is None:
        raise ReleaseError(
            f"release {release.name}: commit {release.commit} is not in this clone "
            "(a shallow clone? run `git fetch --unshallow`)"
        )
    tagged = commit_of(f"refs/tags/{release.tag}", root)
    if tagged is not None and tagged != commit:
        raise ReleaseError(
            f"release {release.name}: tag {release.tag} points at {tagged[:12]}, "
            f"but {RELEASES_FILE} records {commit[:12]}"
        )
    return commit


def newest(root: Path, path: Path | None = None) -> tuple[Release, str]:
    """The newest release and its commit."""
    releases = load_releases(path or root / RELEASES_FILE)
    try:
        return releases[-1], resolve(releases[-1], root)
    except GitError as exc:
        raise ReleaseError(str(exc)) from None
