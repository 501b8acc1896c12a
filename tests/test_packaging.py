"""The distribution maps every folder into the pdwire namespace and lists every sub-package."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict[str, object]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool: dict[str, object] = config["tool"]["setuptools"]
    return tool


def _packages_on_disk(package_dir: dict[str, str]) -> set[str]:
    found: set[str] = set()
    for package, folder in package_dir.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base)
            if any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
                continue
            # a folder that is itself mapped elsewhere (pdwire/wirecore is under pdwire/) counts once
            found.add(".".join([package, *relative.parts]))
    return found


def test_every_subpackage_on_disk_is_listed() -> None:
    tool = _setuptools_config()
    package_dir = tool["package-dir"]
    assert isinstance(package_dir, dict)
    listed = set(tool["packages"])  # type: ignore[call-overload]
    missing = _packages_on_disk(package_dir) - listed
    assert not missing, f"sub-packages on disk but not in pyproject's packages list: {sorted(missing)}"


def test_nothing_is_installed_outside_the_pdwire_namespace() -> None:
    tool = _setuptools_config()
    packages = tool["packages"]
    assert isinstance(packages, list)
    assert all(name == "pdwire" or name.startswith("pdwire.") for name in packages)
    package_dir = tool["package-dir"]
    assert isinstance(package_dir, dict)
    assert set(package_dir) >= {"pdwire.codegen", "pdwire.wire", "pdwire.runtime"}
    assert package_dir["pdwire.wire"] == "generated"
    assert package_dir["pdwire.runtime"] == "runtime"


def test_console_command_prints_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdwire", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "usage: pdwire" in result.stdout


def test_unknown_command_is_refused() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdwire", "no-such-command"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "invalid choice" in result.stderr


def test_top_level_help_lists_every_command_without_importing_any() -> None:
    code = (
        "import sys; from pdwire.cli import COMMANDS, build_parser; "
        "text = build_parser().format_help(); "
        "missing = [c for c in COMMANDS if c not in text]; "
        "loaded = [m for m, _ in COMMANDS.values() if m in sys.modules]; "
        "print(missing, loaded, 'torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[] [] False"
