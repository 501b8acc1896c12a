"""Arrows point one way: the demo depends on the runtime, never the reverse.

A static check of every import statement under ``runtime/`` (the ``pdwire.runtime`` package),
so an import hidden in a function body, behind ``TYPE_CHECKING`` or in a module no test imports
is caught too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "runtime"
DEMO = "pdwire.runtime.demo"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(RUNTIME).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pdwire", "runtime", *parts])


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def demo_imports_outside_the_demo() -> list[str]:
    bad = []
    for path in sorted(RUNTIME.rglob("*.py")):
        if path.is_relative_to(RUNTIME / "demo"):
            continue
        for line, module in _imported(path):
            if module == DEMO or module.startswith(DEMO + "."):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


def test_no_runtime_module_outside_the_demo_imports_the_demo() -> None:
    bad = demo_imports_outside_the_demo()
    assert not bad, "the runtime must not depend on the demo:\n" + "\n".join(bad)


def test_the_check_sees_absolute_relative_and_nested_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the checker itself must be able to fail: plant each form in a throw-away runtime tree
    fake = tmp_path / "runtime"
    (fake / "serve").mkdir(parents=True)
    (fake / "demo").mkdir()
    (fake / "demo" / "x.py").write_text("from pdwire.runtime.demo import content\n")  # allowed
    (fake / "serve" / "a.py").write_text("from pdwire.runtime.demo.content import fill\n")
    (fake / "serve" / "b.py").write_text("def f():\n    import pdwire.runtime.demo.model\n")
    (fake / "serve" / "c.py").write_text("from ..demo import rank\n")
    (fake / "serve" / "d.py").write_text("from .. import demo\n")
    (fake / "serve" / "ok.py").write_text("from pdwire.runtime import engine\nfrom . import config\n")
    monkeypatch.setattr(sys.modules[__name__], "RUNTIME", fake)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = demo_imports_outside_the_demo()
    assert [b.split(":")[0] for b in bad] == [
        "runtime/serve/a.py",
        "runtime/serve/a.py",
        "runtime/serve/b.py",
        "runtime/serve/c.py",
        "runtime/serve/c.py",
        "runtime/serve/d.py",
    ]


def test_runtime_names_do_not_collide_with_wire_names() -> None:
    # a name both the engine API and the wire export must be the very same object (the wire's
    # Status and FailureKind, whose numbers are the wire's), never a look-alike type
    import pdwire.runtime.engine as pd
    import pdwire.runtime.planner as planner

    from pdwire import wire

    for module in (pd, planner):
        for name in module.__all__:
            if hasattr(wire, name):
                assert getattr(module, name) is getattr(wire, name), (
                    f"{module.__name__}.{name} shadows wire.{name}"
                )
    # the planner's component memory was renamed from the wire message's name; the old name still
    # imports (not exported by a star import)
    assert pd.StateComponent is pd.StatePool is planner.StatePool
    assert "StateComponent" not in pd.__all__ and "StateComponent" not in planner.__all__
