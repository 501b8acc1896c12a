"""The distribution maps every folder into the pdwire namespace and lists every package on disk."""

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


def test_the_packages_list_is_the_packages_on_disk() -> None:
    # setuptools' `find` cannot see through the folder map, so pyproject lists the packages; the
    # expectation is the disk, and a failure prints the list to paste
    tool = _setuptools_config()
    package_dir = tool["package-dir"]
    assert isinstance(package_dir, dict)
    on_disk = sorted(_packages_on_disk(package_dir))
    listing = "".join(f'    "{name}",\n' for name in on_disk)
    assert tool["packages"] == on_disk, f"pyproject's [tool.setuptools] packages should read:\n[\n{listing}]"


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


def test_licence_setuptools_floor_type_hints_and_the_demo_extra() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = config["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    # the SPDX string form of `license` and `license-files` need setuptools 77 (PEP 639)
    (floor,) = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
    assert floor.startswith("setuptools>=") and tuple(map(int, floor.split(">=")[1].split("."))) >= (77,)
    data = config["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["pdwire"] and (ROOT / "pdwire" / "py.typed").is_file()
    # torch only in the demo extra, at the version the CPU constraint file pins
    pins = [
        line.strip()
        for line in (ROOT / "scripts" / "cpu-torch-constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert project["optional-dependencies"]["demo"] == pins == ["torch==2.13.0"]
    assert not any(d.startswith("torch") for d in project["dependencies"])


def _fake_venv(where: Path) -> Path:
    """A venv whose `pdwire` only records that it was found and stops the check script."""
    bin_dir = where / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "pdwire").write_text(f'#!/bin/sh\necho "$0 $*" > {where}/called\nexit 3\n')
    (bin_dir / "pdwire").chmod(0o755)
    return where


def test_the_check_script_finds_the_venv_by_absolute_and_relative_path(tmp_path: Path) -> None:
    import os

    for name, as_given in (("abs", lambda p: str(p)), ("rel", lambda p: os.path.relpath(p, ROOT))):
        fake = _fake_venv(tmp_path / name)
        env = {**os.environ, "PDWIRE_VENV": as_given(fake)}
        done = subprocess.run(
            ["bash", "scripts/check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 3, done.stderr  # the fake pdwire ran (not "command not found")
        called, *args = (fake / "called").read_text().split()
        assert os.path.realpath(called) == str(fake / "bin" / "pdwire") and args == ["codegen", "--check"]
