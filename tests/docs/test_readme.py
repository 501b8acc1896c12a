"""The README's examples run as written, and its links and contents point at what exists.

Convention: a fenced block opened with ```` ```python run ```` is executed, each in a fresh
interpreter from the repository root (the way a newcomer pastes it into a file); a Python block
that cannot run on its own (a fragment) says ```` ```python norun ````. Blocks that need engines
use the dependency-free ``local`` backend, so the whole file runs in seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```$", re.M | re.S)


def blocks(text: str) -> list[tuple[int, str, str]]:
    """(line, info string, body) of every fenced block."""
    return [(text.count("\n", 0, m.start()) + 1, m["info"].strip(), m["body"]) for m in FENCE.finditer(text)]


def runnable(text: str) -> list[tuple[int, str]]:
    return [(line, body) for line, info, body in blocks(text) if info.split()[:2] == ["python", "run"]]


RUNNABLE = runnable(README.read_text())


def test_every_python_block_says_whether_it_runs() -> None:
    unmarked = [line for line, info, _ in blocks(README.read_text()) if info in ("python", "py")]
    assert not unmarked, f"README.md lines {unmarked}: mark each Python block `python run` or `python norun`"
    assert len(RUNNABLE) >= 3, "the quick starts (zmq, workers, SGLang frames) are runnable blocks"


@pytest.mark.parametrize("line,body", RUNNABLE, ids=[f"line{line}" for line, _ in RUNNABLE])
def test_block_runs(line: int, body: str, tmp_path: Path) -> None:
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(body)
    # as a newcomer runs it: none of the suite's own settings (tests/conftest.py turns the control
    # plane's authentication off for the suite; a README block must work with it on)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDWIRE_")}
    env["UCX_NET_DEVICES"] = os.environ.get("UCX_NET_DEVICES", "lo")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"README.md block at line {line} failed:\n{done.stdout}\n{done.stderr}"


def test_relative_links_exist() -> None:
    text = README.read_text()
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)}
    local = sorted(t for t in targets if t and not re.match(r"[a-z]+:", t))
    missing = [t for t in local if not (ROOT / t).exists()]
    assert local and not missing, f"README.md links to files that do not exist: {missing}"
    guides = {f"docs/{g.name}" for g in (ROOT / "docs").glob("*.md")}
    assert guides <= targets, f"guides the README does not link: {sorted(guides - targets)}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_contents_match_headings() -> None:
    text = README.read_text()
    headings = {anchor(h) for h in re.findall(r"^## (.+)$", text, re.M)}
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\]\(#([^)]+)\)", contents)
    assert listed and set(listed) <= headings, f"contents entries without a heading: {set(listed) - headings}"
    assert headings - {"contents"} <= set(listed), f"headings missing from contents: {headings - set(listed)}"
