"""The SGLang quick start of docs/sglang.md ("Server flags"), as far as it runs on this CPU machine.

SGLang's server cannot start here (its kernels, ``sgl_kernel``, are not built for this machine),
so the two ``launch_server`` commands are parsed, as written, by SGLang's own
``prepare_server_args`` with the plugin loaded, and what they would start is SGLang's real
bootstrap server and pdwire managers built by SGLang's ``_init_kv_manager`` (the harness of
test_transfer.py). The keys block runs in bash as written with the suite's ``PDWIRE_*``
variables removed from the environment (``HOME`` a temporary folder); the managers then run in
exactly the environment it leaves: one request moves byte for byte, and the prefill rank's
control socket serves CURVE on the generated keys only. Without the keys a rank refuses to
start, naming ``PDWIRE_CONTROL_KEYS``. README.md's SGLang quick start must be the same commands.
"""

from __future__ import annotations

import os
import shlex
import warnings
from pathlib import Path
from typing import Any

import pytest

warnings.filterwarnings("ignore")

from pdwire.runtime.config import ConfigError  # noqa: E402
from pdwire.runtime.control_auth import ENV_KEYS, ControlAuth  # noqa: E402
from tests.sglang.backend import harness as h  # noqa: E402
from tests.sglang.backend import test_transfer as tt  # noqa: E402
from tests.support.quickstart import (  # noqa: E402
    KEYS,
    ROOT,
    assert_curve_on,
    commands,
    doc_blocks,
    environment,
    run_bash,
)

pytest.importorskip("nixl")

sglang = tt.sglang  # SGLang's classes for the pdwire backend, the plugin loaded (a fixture)
DOC = ROOT / "docs" / "sglang.md"
README = ROOT / "README.md"
# what the doc leaves to the operator: a model and the host's address (the parser reads no model)
PLACEHOLDERS = {"MODEL": "dummy", "HOST": "127.0.0.1"}


@pytest.fixture(scope="module")
def blocks() -> list[str]:
    found = doc_blocks(DOC.read_text(), "## Server flags")
    assert len(found) == 2, found  # keys; prefill and decode
    return found


@pytest.fixture
def quickstart_env(blocks: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's environment as the keys block leaves it (run in bash, as written)."""
    env = environment(tmp_path)
    out = run_bash(blocks[0] + f'\necho "{ENV_KEYS}=${ENV_KEYS}"', env)
    keys = out.strip().splitlines()[-1].split("=", 1)[1]
    assert Path(keys) == tmp_path / KEYS and (Path(keys) / "control.key_secret").stat().st_mode & 0o077 == 0
    for name in [k for k in os.environ if k.startswith("PDWIRE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(ENV_KEYS, keys)
    return dict(env, **{ENV_KEYS: keys})


def server_argv(block: str) -> list[list[str]]:
    """Each ``launch_server`` command's arguments, placeholders filled, a trailing ``&`` dropped."""
    out = []
    for command in commands(block):
        argv = [PLACEHOLDERS.get(a, a) for a in shlex.split(command) if a != "&"]
        assert argv[:3] == ["python", "-m", "sglang.launch_server"], command
        out.append(argv[3:])
    return out


def test_readme_runs_the_same_quick_start(blocks: list[str]) -> None:
    readme = README.read_text()
    section = " ".join(commands(readme[readme.index("## SGLang\n") :]))
    for command in commands(blocks[0]) + commands(blocks[1]):
        assert command in section, command


def test_both_server_commands_parse_as_pdwire_prefill_and_decode(sglang: Any, blocks: list[str]) -> None:
    from sglang.srt.server_args import prepare_server_args

    parsed = [prepare_server_args(argv) for argv in server_argv(blocks[1])]
    assert [(a.disaggregation_mode, a.disaggregation_transfer_backend) for a in parsed] == [
        ("prefill", "pdwire"),
        ("decode", "pdwire"),
    ]
    assert parsed[0].disaggregation_bootstrap_port == 8998


def test_the_managers_move_a_request_on_the_generated_keys(
    sglang: Any, quickstart_env: dict[str, str]
) -> None:
    assert "PDWIRE_INSECURE_CONTROL" not in os.environ
    pair = tt.Pair(sglang, 1, 1)
    try:
        rooms = {4242: 13}  # room -> prompt tokens
        pre_out: dict[int, int] = {}
        dec_out: dict[int, int] = {}
        dec = h.EngineThread("decode-scheduler", tt._decode_engine(pair, rooms, dec_out))
        pre = h.EngineThread("prefill-scheduler", tt._prefill_engine(pair, rooms, pre_out, chunk_pages=2))
        dec.start()
        pre.start()
        dec.join(300)
        pre.join(300)
        assert dec.error is None, repr(dec.error)
        assert pre.error is None, repr(pre.error)
        KVPoll = sglang["KVPoll"]
        assert dec_out == {4242: KVPoll.Success} and pre_out == {4242: KVPoll.Success}  # byte for byte
        keys = ControlAuth.from_directory(quickstart_env[ENV_KEYS])
        assert_curve_on(pair.prefill[0].manager.worker.endpoint, keys)
    finally:
        pair.close()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_without_the_keys_a_rank_refuses_to_start_naming_them(
    sglang: Any, role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("PDWIRE_")]:
        monkeypatch.delenv(name)
    with pytest.raises(ConfigError, match=ENV_KEYS):
        h.make_rank(role, 1, 0, h.free_port(), h.free_port(), h.SWA_HYBRID)
