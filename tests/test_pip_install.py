"""`pip install pdwire` as a user gets it: a wheel built from this tree, installed with its
dependencies into a fresh venv (no torch, no transfer engine), used outside any checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@dataclass
class Installed:
    wheel: Path
    bin: Path
    work: Path  # a folder outside the checkout to run commands in

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        return subprocess.run(
            list(args), cwd=self.work, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )


def _source_copy(dest: Path) -> Path:
    """The tracked files of the checkout (and untracked ones git does not ignore), so the build
    writes nothing into the checkout and sees what a clone has."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    base = tmp_path_factory.mktemp("pip")
    src = _source_copy(base / "src")
    dist = base / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)]
    subprocess.run([*build, str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("pdwire-*.whl")
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True)
    pip = env_dir / "bin" / "pip"
    done = subprocess.run(
        [str(pip), "install", "-q", str(wheel)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    work = base / "elsewhere"
    work.mkdir()
    yield Installed(wheel, env_dir / "bin", work)


def test_the_wheel_carries_the_licence_type_hints_and_no_torch(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as z:
        names = set(z.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(meta_name).decode()
    assert "pdwire/py.typed" in names and "pdwire/wire/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert {n.split("/")[0] for n in names if not n.startswith("pdwire-")} == {"pdwire"}
    assert "License-Expression: Apache-2.0" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    torch = [r for r in requires if r.split()[1].startswith("torch")]
    assert torch and all('extra == "demo"' in r for r in torch), torch
    assert "Provides-Extra: demo" in meta and "Provides-Extra: engines" in meta


def test_the_wire_library_and_the_cli_work_without_torch(installed: Installed) -> None:
    py = str(installed.bin / "python")
    code = (
        "import sys, pdwire.wire as w, pdwire.runtime.engine as pd; "
        "m = w.Abort(room=5, sender='tcp://h:1', reason='r'); "
        "assert w.decode(w.encode(m, (1, 4))) == m; "
        "print('torch' in sys.modules, pd.available_backends())"
    )
    done = installed.run(py, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "['local']"]
    version = installed.run("pdwire", "--version")
    assert version.returncode == 0 and version.stdout.startswith("pdwire 0.1.0 (wire protocol versions 1.0")


def test_codegen_outside_a_checkout_refuses_to_write_into_the_package(installed: Installed) -> None:
    site = next((installed.bin.parent / "lib").glob("python3*/site-packages/pdwire"))
    before = sorted(p.name for p in site.iterdir())
    for args in (("codegen",), ("codegen", "--check")):
        done = installed.run("pdwire", *args)
        assert done.returncode == 2, done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "not in a pdwire checkout" in lines[0] and "--out DIR" in lines[0]
        assert done.stdout == ""
    assert sorted(p.name for p in site.iterdir()) == before  # no stray generated/ folder


def test_a_missing_transfer_engine_names_its_extra(installed: Installed) -> None:
    code = (
        "from pdwire.runtime import engine as pd\n"
        "try:\n    pd.create_backend('nixl', agent_name='a')\n"
        "except pd.BackendError as e:\n    print(e)\n"
    ).replace("pd.BackendError", "__import__('pdwire.runtime.backends', fromlist=['x']).BackendError")
    done = installed.run(str(installed.bin / "python"), "-c", code)
    assert done.returncode == 0, done.stderr
    assert "pip install 'pdwire[engines]'" in done.stdout
