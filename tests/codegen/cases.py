"""The generator's fixture cases: ``tests/codegen/<case>/schema.yaml`` and the files
``pdwire codegen`` makes of it, committed under ``tests/codegen/<case>/expected/``.

Each case is one feature of the schema language on a small protocol of its own, independent
of the product schemas, so a change to the templates shows up as a reviewable diff of
generated code. Regenerate after an intended change of the generator::

    .venv/bin/python -m tests.codegen.regen
"""

from __future__ import annotations

from pathlib import Path

from pdwire.codegen.generate import render_one
from pdwire.codegen.loader import load_text

HERE = Path(__file__).resolve().parent
CASES = sorted(p.parent.name for p in HERE.glob("*/schema.yaml"))


def render_case(case: str) -> dict[str, str]:
    """Every file the generator makes of ``case``: path relative to ``expected/`` -> text."""
    label = f"tests/codegen/{case}/schema.yaml"
    proto = load_text((HERE / case / "schema.yaml").read_text(encoding="utf-8"), label)
    return render_one(proto, label)


def is_generated(rel: Path) -> bool:
    """Whether a path under ``expected/`` is one the generator writes (Python modules, the
    reference page, the PEP 561 marker), not bytecode the tests' imports leave next to them
    (``__pycache__/``) or another stray file."""
    if "__pycache__" in rel.parts:
        return False
    return rel.suffix in (".py", ".md") or rel.name == "py.typed"


def expected(case: str) -> dict[str, str]:
    root = HERE / case / "expected"
    return {
        str(p.relative_to(root)): p.read_text(encoding="utf-8")
        for p in sorted(root.rglob("*"))
        if p.is_file() and is_generated(p.relative_to(root))
    }
