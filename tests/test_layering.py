"""Arrows point one way: every package imports only the packages its row of ``ALLOWED`` names.

A static check of every import statement in every ``.py`` file of the folders pyproject maps into
the ``pdwire`` namespace (``pdwire/``, ``runtime/``, ``generated/``, ``codegen/``, ``schema/``),
so an import hidden in a function body, behind ``TYPE_CHECKING`` or in a module no test imports
is caught too. The table itself must have no cycle, and every module must belong to a row.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The leaf package of hand-written hooks the generated code calls (migrations, rules): below the
# wire, importing only wirecore.
HOOKS = "pdwire.wirehooks"

# unit -> the modules it is made of: "name" is that module, "name.*" a package and all inside it
UNITS: dict[str, tuple[str, ...]] = {
    "root": ("pdwire",),  # pdwire/__init__.py: the version, nothing else
    "schema": ("pdwire.schema.*",),
    "wirecore": ("pdwire.wirecore.*",),
    "hooks": (f"{HOOKS}.*",),
    "wire": ("pdwire.wire.*",),
    "codegen": ("pdwire.codegen.*",),
    "protocols": ("pdwire.protocols.*",),  # convert, inspect
    # the runtime's shared value types and helpers, used by every runtime layer
    "runtime base": (
        "pdwire.runtime",
        "pdwire.runtime.config",
        "pdwire.runtime.control_auth",
        "pdwire.runtime.descriptors",
        "pdwire.runtime.endpoints",
        "pdwire.runtime.indices",
        "pdwire.runtime.netif",
    ),
    # runtime core: pure, sans-IO
    "planner": ("pdwire.runtime.planner.*",),
    "staging": ("pdwire.runtime.staging.*",),
    "session": ("pdwire.runtime.session.*",),
    # runtime edge: transfer engines, sockets, threads, torch
    "backends": ("pdwire.runtime.backends.*",),
    "workers": ("pdwire.runtime.workers.*",),
    "engine": ("pdwire.runtime.engine", "pdwire.runtime.torch_memory"),
    # integrations and tools, built on the runtime
    "integrations": ("pdwire.integrations.*",),
    "discovery": ("pdwire.discovery.*",),
    "serve": ("pdwire.serve.*",),
    "demo": ("pdwire.demo.*",),
    "cli": ("pdwire.cli", "pdwire.__main__", "pdwire.serve_command"),
}

WIRE = {"wire", "wirecore"}
BASE = WIRE | {"runtime base"}
CORE = BASE | {"planner", "staging", "session"}
EDGE = CORE | {"backends", "workers", "engine"}
# unit -> the units it may import (besides itself and root). One row per unit; no cycles.
ALLOWED: dict[str, set[str]] = {
    "root": set(),
    "schema": set(),
    "wirecore": set(),
    "hooks": {"wirecore"},
    "wire": {"wirecore", "hooks"},
    "codegen": {"schema", "wirecore"},  # never the wire it generates
    "protocols": WIRE,
    "runtime base": WIRE,
    "planner": BASE,
    "staging": BASE | {"planner"},
    "session": BASE | {"planner"},
    "backends": BASE,
    "workers": CORE | {"backends"},
    "engine": CORE | {"backends", "workers"},
    "integrations": EDGE,
    "discovery": BASE,
    "serve": EDGE | {"discovery"},
    "demo": EDGE | {"serve"},  # `pdwire demo --serve` drives serve; serve knows no model
    "cli": set(UNITS) - {"cli"},  # joins the tools (the demo's model for serve)
}


def package_dir(root: Path = ROOT) -> dict[str, str]:
    """pyproject's import name -> folder map (``pdwire.runtime`` -> ``runtime``, ...)."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = tool["package-dir"]
    return mapping


def _matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def unit_of(module: str, units: Mapping[str, tuple[str, ...]] = UNITS) -> str | None:
    """The unit of ``module``, the most specific pattern winning (None: in no unit)."""
    best: tuple[int, str] | None = None
    for unit, patterns in units.items():
        for p in patterns:
            if _matches(module, p) and (best is None or len(p) > best[0]):
                best = (len(p), unit)
    return best[1] if best else None


def modules(root: Path, mapping: Mapping[str, str]) -> dict[Path, str]:
    """Every .py file under the mapped folders -> its import name (the deepest folder wins)."""
    found: dict[Path, str] = {}
    by_depth = sorted(mapping.items(), key=lambda kv: len(Path(kv[1]).parts))
    for package, folder in by_depth:  # deeper folders overwrite what a shallower one claimed
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            relative = path.relative_to(base)
            if any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
                continue
            parts = list(relative.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[path] = ".".join([package, *parts])
    return found


def imported(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute name) of every import in ``path``, relative ones resolved; for
    ``from X import y`` both ``X`` and ``X.y`` (``y`` may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module.split(".")
    if path.name != "__init__.py":
        package.pop()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def _unit_of_import(name: str, units: Mapping[str, tuple[str, ...]]) -> str | None:
    # `from pdwire import __version__` names an attribute, not a module: fall back to its package
    while name:
        unit = unit_of(name, units)
        if unit is not None:
            return unit
        name = name.rpartition(".")[0]
    return None


def violations(
    root: Path = ROOT,
    mapping: Mapping[str, str] | None = None,
    units: Mapping[str, tuple[str, ...]] = UNITS,
    allowed: Mapping[str, set[str]] = ALLOWED,
) -> list[str]:
    bad: list[str] = []
    for path, module in modules(root, mapping or package_dir(root)).items():
        where = path.relative_to(root)
        unit = unit_of(module, units)
        if unit is None:
            bad.append(f"{where}: module {module} is in no unit of the layering table")
            continue
        for line, name in imported(path, module):
            if name != "pdwire" and not name.startswith("pdwire."):
                continue
            target = _unit_of_import(name, units)
            if target in (unit, "root"):
                continue
            if target not in allowed.get(unit, set()):
                bad.append(f"{where}:{line} ({unit}) imports {name} ({target})")
    return bad


def cycles(allowed: Mapping[str, set[str]]) -> list[list[str]]:
    """Every cycle of the table, each as the path that closes it (depth-first)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for other in sorted(allowed.get(unit, set())):
            if state.get(other) == 1:
                found.append([*path[path.index(other) :], other])
            elif other not in state:
                visit(other, [*path, other])
        state[unit] = 2

    for unit in sorted(allowed):
        if unit not in state:
            visit(unit, [unit])
    return found


def test_every_import_follows_the_layering_table() -> None:
    bad = violations()
    assert not bad, "imports against the layering table (tests/test_layering.py):\n" + "\n".join(bad)


def test_the_table_has_no_cycle_and_names_only_its_units() -> None:
    assert set(ALLOWED) == set(UNITS)
    assert all(targets <= set(UNITS) for targets in ALLOWED.values())
    assert cycles(ALLOWED) == []
    # the checker of cycles can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_runtime_never_imports_a_tool() -> None:
    tools = {"integrations", "discovery", "serve", "demo", "cli"}
    runtime = {u for u, patterns in UNITS.items() if all(p.startswith("pdwire.runtime") for p in patterns)}
    assert runtime >= {"runtime base", "planner", "staging", "session", "backends", "workers", "engine"}
    for unit in runtime:
        assert not ALLOWED[unit] & tools, unit


PLANTED = {
    # each form of import, each against one row of the table
    "runtime/planner/a.py": "from pdwire.runtime.workers import thread\n",  # core -> edge
    "runtime/session/b.py": "from ..backends import registry\n",  # relative
    "runtime/config.py": "def f():\n    import pdwire.demo.cli\n",  # nested in a function
    "generated/v1.py": "import typing\nif typing.TYPE_CHECKING:\n    from pdwire.protocols import inspect\n",
    "codegen/gen.py": "from pdwire import wire\n",  # the `from package import module` form
    "pdwire/wirecore/e.py": "from pdwire.runtime.planner import model\n",
    "pdwire/serve/d.py": "from .. import demo\n",  # tools: serve must not import the demo
    "pdwire/stray.py": "",  # a module in no unit
    # allowed
    "pdwire/__init__.py": "",
    "pdwire/demo/ok.py": "from pdwire.serve import admin\nfrom pdwire.runtime import engine as pd\n",
    "pdwire/demo/ok2.py": "from . import spec\n",
    "runtime/workers/ok.py": "from pdwire.runtime.session import actions\nfrom pdwire import __version__\n",
    "generated/codec.py": "from pdwire.wirecore import errors\nfrom . import v1\n",
}


def test_the_check_sees_absolute_relative_nested_and_type_checking_imports(tmp_path: Path) -> None:
    # the checker itself must be able to fail: plant each form in a throw-away tree
    for name, text in PLANTED.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    bad = violations(tmp_path, package_dir())
    assert sorted(b.split(" ")[0] for b in bad) == [
        "codegen/gen.py:1",
        "generated/v1.py:3",
        "generated/v1.py:3",
        "pdwire/serve/d.py:1",
        "pdwire/stray.py:",
        "pdwire/wirecore/e.py:1",
        "pdwire/wirecore/e.py:1",
        "runtime/config.py:2",
        "runtime/planner/a.py:1",
        "runtime/planner/a.py:1",
        "runtime/session/b.py:1",
        "runtime/session/b.py:1",
    ]
    assert "(codegen) imports pdwire.wire (wire)" in "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "unit"),
    [
        ("pdwire.runtime", "runtime base"),
        ("pdwire.runtime.engine", "engine"),
        ("pdwire.runtime.planner.model", "planner"),
        ("pdwire.demo.mori_fake", "demo"),
        ("pdwire.wire.sglang.v1_0", "wire"),
        ("pdwire.runtime.newmodule", None),  # a new module is placed in the table, not guessed
    ],
)
def test_units_by_the_most_specific_pattern(module: str, unit: str | None) -> None:
    assert unit_of(module) == unit


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
    # the planner's component memory is StatePool (StateComponent is the wire message's name only),
    # and a rank's place in the grid is one type, the configs' and the memory's alike
    assert pd.StatePool is planner.StatePool and pd.ParallelRank is planner.ParallelRank
    for gone in ("StateComponent", "RankPosition"):
        assert not hasattr(pd, gone) and not hasattr(planner, gone)
