"""A release's generated code, loaded from git into a temporary folder and run there.

:func:`export_release` writes the release commit's ``pdwire/`` and ``generated/`` as an
importable ``pdwire`` package (``generated/`` becomes ``pdwire/wire``, as an install lays it
out); :func:`run_release` runs :data:`DRIVER` in a fresh interpreter with that folder first on
its path, so the released modules, not this checkout's, read and write the frames. The driver
speaks only the public API every release has (``decode``, ``decode_versioned``,
``encode(msg, version)``, ``sglang.decode/encode``), and the per-version modules where a
release has them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from pdwire.codegen.gitrev import export, git, repo_root
from pdwire.codegen.loader import load_texts
from pdwire.codegen.model import Protocol
from pdwire.codegen.releases import RELEASES_FILE, Release, load_releases, resolve

REPO = Path(__file__).resolve().parents[2]

DRIVER = r"""
import sys
import msgspec

root = sys.argv[1]
sys.path.insert(0, root)  # ahead of this checkout's editable install
import pdwire.wire as w
from pdwire.wire import sglang

assert w.__file__.startswith(root) and sglang.__file__.startswith(root), (w.__file__, sglang.__file__)
cases = msgspec.msgpack.decode(sys.stdin.buffer.read())
out = []
for kind, version, name, frames in cases:
    version = tuple(version)
    try:
        if kind == "pdwire":
            msg, sent = w.decode_versioned(frames)
            assert sent == version, f"decoded as sent at {sent}"
            assert type(msg).__name__ == name, type(msg).__name__
            again = [bytes(f) for f in w.encode(msg, version)]
            assert again == frames, "re-encoded at the same version, the bytes differ"
            # a release with one module per minor (wire-1.3; later ones keep one model per major):
            # the reader of exactly that minor, and every older minor's reader, read it too,
            # skipping what they lack; they may refuse only a message type or an enum value
            # their minor does not have
            if hasattr(w, "v%d_%d" % version):
                exact = getattr(w, "v%d_%d" % version).decode(frames)
                assert type(exact).__name__ == name
                for older in w.VERSIONS:
                    if older[0] == version[0] and older < version:
                        try:
                            getattr(w, "v%d_%d" % older).decode(frames)
                        except (w.UnknownMessageType, w.BadEnumValue):
                            pass
        else:
            msg = sglang.decode(frames, version=version)
            assert type(msg).__name__ == name, type(msg).__name__
            assert [bytes(f) for f in sglang.encode(msg)] == frames, "re-encoded, the bytes differ"
        out.append(None)
    except Exception as exc:  # reported per case, with its class
        out.append(f"{type(exc).__name__}: {exc}")
sys.stdout.buffer.write(msgspec.msgpack.encode(out))
"""

Case = tuple[str, tuple[int, int], str, list[bytes]]  # (protocol, version, message name, frames)


RELEASES = [r.name for r in load_releases(REPO / RELEASES_FILE)]  # oldest first


def release(name: str) -> tuple[Release, str]:
    """Release ``name`` of ``schema/releases.toml`` and its commit in this clone."""
    (rel,) = [r for r in load_releases(REPO / RELEASES_FILE) if r.name == name]
    return rel, resolve(rel, repo_root(REPO))


def export_release(commit: str, dest: Path) -> Path:
    """The release's package at ``dest/pdwire`` (``pdwire.wire`` = its ``generated/``)."""
    root = repo_root(REPO)
    export(commit, ["pdwire", "generated"], dest, root)
    (dest / "generated").rename(dest / "pdwire" / "wire")
    return dest


def release_schemas(commit: str) -> dict[str, Protocol]:
    root = repo_root(REPO)
    from pdwire.codegen.gitrev import schema_texts

    return {p.name: p for p in load_texts(schema_texts(commit, "schema", root))}


def release_file(commit: str, path: str) -> bytes:
    return git(["show", f"{commit}:{path}"], repo_root(REPO), binary=True).encode("latin-1")


def release_files(commit: str, folder: str) -> list[str]:
    return git(["ls-tree", "-r", "--name-only", commit, "--", folder], repo_root(REPO)).split()


def run_release(folder: Path, cases: list[Case]) -> list[Any]:
    """Each case decoded and re-encoded by the release build: None, or the error it raised."""
    done = subprocess.run(
        [sys.executable, "-I", "-c", DRIVER, str(folder)],
        cwd=folder,
        input=msgspec.msgpack.encode(cases),
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    result: list[Any] = msgspec.msgpack.decode(done.stdout)
    return result
