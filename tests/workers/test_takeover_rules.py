"""The rules behind takeover refusals and Abort authority, without sockets: per-rank key
bindings (:class:`ControlAuth`, the identities file, ``pdwire keys bind``), a local backend's
proof that a peer's process exited (:meth:`LocalBackend.peer_gone`), and who may abort a room
(:meth:`PrefillSession.abort_refusal`)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdwire.runtime.backends import PeerMetadata
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.control_auth import (
    IDENTITIES_FILE,
    ControlAuth,
    KeyFileError,
    bind_rank,
    generate_directory,
)
from pdwire.runtime.session.actions import PeerRef
from pdwire.runtime.session.prefill_room import Destination, Target
from pdwire.runtime.session.prefill_session import PrefillSession
from pdwire.runtime.session.status import Status

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def deployment(tmp_path: Path) -> Path:
    generate_directory(tmp_path / "keys")
    return tmp_path / "keys"


def test_a_bound_identity_takes_only_its_key_and_a_bound_key_only_its_identities(
    deployment: Path, tmp_path: Path
) -> None:
    k0 = bind_rank(deployment, "dec", "0", tmp_path / "dec-0")
    kall = bind_rank(deployment, "big", "*", tmp_path / "big")
    auth = ControlAuth.from_directory(deployment)
    shared = auth.public_key
    assert {k0, kall} <= auth.authorized  # bound keys are admitted at the socket
    assert auth.identity_refusal("dec", 0, k0) is None
    assert auth.identity_refusal("big", 7, kall) is None  # "*": every rank of the engine
    assert "dec/0 is bound to its own key" in str(auth.identity_refusal("dec", 0, shared))
    assert "dec/0 is bound to its own key" in str(auth.identity_refusal("dec", 0, kall))
    assert "no CURVE key" in str(auth.identity_refusal("dec", 0, None))
    assert "is bound to dec/0" in str(auth.identity_refusal("dec", 1, k0))  # another rank
    assert "is bound to dec/0" in str(auth.identity_refusal("other", 0, k0))
    # identities and keys nobody bound: the admitted keys alone decide, as without the file
    assert auth.identity_refusal("dec", 1, shared) is None
    assert ControlAuth.generate().identity_refusal("dec", 0, None) is None
    # the rank's own directory: its key, expecting the prefill ranks' key
    rank = ControlAuth.from_directory(tmp_path / "dec-0")
    assert (rank.public_key, rank.server_key) == (k0, shared)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("decode dec 0", "want `decode ENGINE_ID RANK KEY`, got 3 fields"),
        ("prefill pre 0 {key}", "only decode ranks are bound"),
        ("decode dec one {key}", "rank 'one' is not an engine-wide rank or *"),
        ("decode dec 0 short", "must be a 40-character Z85 CURVE key"),
    ],
)
def test_a_malformed_identities_line_is_refused_naming_file_and_line(
    deployment: Path, line: str, why: str
) -> None:
    key = ControlAuth.from_directory(deployment).public_key.decode()
    (deployment / IDENTITIES_FILE).write_text(f"# bindings\n\n{line.format(key=key)}\n")
    with pytest.raises(KeyFileError, match="identities:3") as err:
        ControlAuth.from_directory(deployment)
    assert why in str(err.value)


def test_keys_bind_cli_writes_the_rank_directory_and_the_binding(deployment: Path, tmp_path: Path) -> None:
    cli = [str(Path(sys.executable).with_name("pdwire")), "keys"]
    run = subprocess.run([*cli, "bind", str(deployment), "dec", "3", str(tmp_path / "r3")], cwd=ROOT,
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    key = ControlAuth.from_directory(tmp_path / "r3").public_key.decode()
    assert (deployment / IDENTITIES_FILE).read_text() == f"decode dec 3 {key}\n"
    shown = subprocess.run(
        [*cli, "show", str(deployment)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert f"bound: decode dec 3 {key}" in shown.stdout
    bad = subprocess.run([*cli, "bind", str(deployment), "dec", "x", str(tmp_path / "rx")], cwd=ROOT,
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert bad.returncode == 1 and "rank 'x'" in bad.stderr and not (tmp_path / "rx").exists()


def test_the_local_backend_proves_a_peer_process_dead_by_its_pidfd() -> None:
    target = subprocess.Popen(
        [sys.executable, "-m", "tests.backends.target", "local", "4096"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    writer = LocalBackend(agent_name="writer")
    try:
        assert target.stdout is not None
        hello = json.loads(target.stdout.readline())
        md = PeerMetadata(hello["agent"], base64.b64decode(hello["md"]))
        peer = writer.add_peer(md)
        assert not writer.peer_gone(peer)  # alive
        target.kill()
        target.wait(10)
        assert writer.peer_gone(peer)
    finally:
        if target.poll() is None:
            target.kill()
        writer.close()


def _target(peer: PeerRef) -> Target:
    dst = Destination(np.arange(2, dtype=np.int32), (), 0, 0, None)
    return Target.of(peer, False, False, dst)


def test_only_a_requester_aborts_a_requested_room_and_any_registered_rank_declines_an_unasked_one() -> None:
    s = PrefillSession(30.0)
    victim, other = PeerRef("dec", 0), PeerRef("evil", 0)
    assert s.abort_refusal(1, other) is None  # nobody asked: a registered rank may decline it
    s.on_request(2, _target(victim), 1, 0.0)
    refusal = s.abort_refusal(2, other)
    assert refusal is not None and "asked for by dec/0" in refusal
    assert s.abort_refusal(2, victim) is None
    s.on_abort(2, other)  # answered, the room untouched
    assert s.status(2) is Status.WAITING_FOR_INPUT
    s.on_abort(2, victim)
    assert s.status(2) is Status.FAILED
