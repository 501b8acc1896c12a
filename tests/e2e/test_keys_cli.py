"""`pdwire keys`, the operator's key workflow, through the installed console command: a new
deployment keypair in a directory made for it (secret file 0600, directory 0700), never replaced
without --force, and `keys show` printing what a rank would load from it (ControlAuth's own
reading), or refusing a directory it cannot use by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdwire.runtime.control_auth import ENV_KEYS, ControlAuth

PDWIRE = Path(sys.executable).parent / "pdwire"


def pdwire(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDWIRE_")}
    cmd = [str(PDWIRE) if PDWIRE.exists() else sys.executable, *([] if PDWIRE.exists() else ["-m", "pdwire"])]
    return subprocess.run(
        [*cmd, *map(str, args)], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def test_generate_writes_one_deployment_keypair_for_every_rank(tmp_path: Path) -> None:
    keys = tmp_path / "home" / ".pdwire" / "keys"  # parents created too, as the quick starts need
    out = pdwire("keys", "generate", keys)
    assert out.returncode == 0, out.stderr
    assert f"{ENV_KEYS}={keys}" in out.stdout
    assert sorted(p.name for p in keys.iterdir()) == ["control.key", "control.key_secret"]
    assert (keys / "control.key_secret").stat().st_mode & 0o777 == 0o600
    assert keys.stat().st_mode & 0o077 == 0
    auth = ControlAuth.from_directory(keys)
    assert auth.server_key == auth.public_key and auth.authorized == {auth.public_key}

    shown = pdwire("keys", "show", keys)
    assert shown.returncode == 0, shown.stderr
    assert f"public key: {auth.public_key.decode()}" in shown.stdout
    assert f"authorized: {auth.public_key.decode()}" in shown.stdout


def test_an_existing_keypair_is_replaced_only_with_force(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert pdwire("keys", "generate", keys).returncode == 0
    first = ControlAuth.from_directory(keys).public_key
    again = pdwire("keys", "generate", keys)
    assert again.returncode == 1 and "--force" in again.stderr
    assert ControlAuth.from_directory(keys).public_key == first  # untouched
    assert pdwire("keys", "generate", "--force", keys).returncode == 0
    assert ControlAuth.from_directory(keys).public_key != first


def test_show_refuses_a_directory_a_rank_could_not_use_by_name(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = pdwire("keys", "show", empty)
    assert out.returncode == 1 and f"pdwire keys generate {empty}" in out.stderr
    keys = tmp_path / "keys"
    assert pdwire("keys", "generate", keys).returncode == 0
    (keys / "control.key_secret").chmod(0o644)
    out = pdwire("keys", "show", keys)
    assert out.returncode == 1 and "chmod 600" in out.stderr
