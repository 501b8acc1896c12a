"""Reading schemas (and generated code) out of git revisions, for the compatibility gate.

Every failure is a :class:`GitError` with one line saying what is missing and, where it
helps, how to get it (a shallow clone lacks old commits; a clone may lack tags).
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from collections.abc import Sequence
from pathlib import Path


class GitError(Exception):
    """A git command failed, or a revision or path it needs is not in this clone."""


def git(args: Sequence[str], cwd: Path, binary: bool = False) -> str:
    res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False)
    if res.returncode != 0:
        err = res.stderr.decode("utf-8", "replace").strip().splitlines()
        raise GitError(f"git {' '.join(args)}: {err[-1] if err else 'failed'}")
    return res.stdout.decode("utf-8") if not binary else res.stdout.decode("latin-1")


def repo_root(cwd: Path) -> Path:
    try:
        return Path(git(["rev-parse", "--show-toplevel"], cwd).strip())
    except (GitError, OSError) as exc:
        raise GitError(f"{cwd} is not inside a git work tree ({exc})") from None


def commit_of(rev: str, root: Path) -> str | None:
    """The full commit id ``rev`` names, or None when this clone does not have it."""
    res = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        cwd=root,
        capture_output=True,
        check=False,
    )
    return res.stdout.decode().strip() if res.returncode == 0 else None


def schema_texts(rev: str, path: str, root: Path) -> dict[str, str]:
    """``{"<rev>:<path>/<name>.yaml": text}`` for every schema file directly in ``path`` at ``rev``."""
    folder = path.strip("/")
    listing = git(["ls-tree", "--name-only", f"{rev}:{folder}" if folder else rev], root)
    names = [n for n in listing.splitlines() if n.endswith(".yaml")]
    out = {}
    for n in names:
        rel = f"{folder}/{n}" if folder else n
        out[f"{rev}:{rel}"] = git(["show", f"{rev}:{rel}"], root)
    return out


def export(commit: str, paths: Sequence[str], dest: Path, root: Path) -> None:
    """Write the files under ``paths`` at ``commit`` into ``dest`` (keeping their paths)."""
    res = subprocess.run(
        ["git", "archive", "--format=tar", commit, "--", *paths], cwd=root, capture_output=True
    )
    if res.returncode != 0:
        raise GitError(f"git archive {commit} {' '.join(paths)}: {res.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(res.stdout)) as tar:
        tar.extractall(dest, filter="data")
