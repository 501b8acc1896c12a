"""The local backend's proof of possession (``runtime/backends/possession.py``): the checks of the
token file and of the proof, and the refusal at ``add_peer``. The cross-process impostor is
``tests/e2e/test_local_possession.py``."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdwire.runtime.backends import possession
from pdwire.runtime.backends.errors import PeerError
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.backends.values import PeerMetadata
from pdwire.wire import backend_metadata as bm

UID = os.getuid()


@pytest.fixture
def inbox(tmp_path: Path) -> Iterator[tuple[str, bytes]]:
    """An owner-only directory with a token made as a backend makes it."""
    d = tmp_path / "inbox"
    d.mkdir(0o700)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        token = possession.create_token(fd)
    finally:
        os.close(fd)
    yield str(d), token


def problem(path: str, token: bytes, uid: int = UID, claimed: bytes | None = None) -> str | None:
    made = possession.proof(token, "agent", 42, path) if claimed is None else claimed
    return possession.proof_problem(path, uid, "agent", 42, made)


def test_a_token_made_by_create_token_proves(inbox: tuple[str, bytes]) -> None:
    path, token = inbox
    st = os.lstat(f"{path}/{possession.TOKEN_NAME}")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == possession.TOKEN_BYTES
    assert possession.read_token(path, UID) == token
    assert problem(path, token) is None


def test_the_proof_binds_token_agent_pid_and_inbox() -> None:
    t, other = b"t" * 32, b"u" * 32
    base = possession.proof(t, "a", 1, "/dev/shm/x")
    assert len(base) == possession.PROOF_BYTES
    assert base == possession.proof(t, "a", 1, "/dev/shm/x")
    for changed in (
        possession.proof(other, "a", 1, "/dev/shm/x"),
        possession.proof(t, "b", 1, "/dev/shm/x"),
        possession.proof(t, "a", 2, "/dev/shm/x"),
        possession.proof(t, "a", 1, "/dev/shm/y"),
        possession.proof(t, "a1", 1, "/dev/shm/x"[1:]),  # fields are length-prefixed
    ):
        assert changed != base


def test_a_wrong_token_is_refused(inbox: tuple[str, bytes]) -> None:
    path, _token = inbox
    assert "does not match the token" in str(problem(path, os.urandom(32)))


def test_no_proof_and_a_proof_of_the_wrong_size_are_refused(inbox: tuple[str, bytes]) -> None:
    path, token = inbox
    assert "carries no proof of possession" in str(problem(path, token, claimed=b""))
    assert "is 5 bytes" in str(problem(path, token, claimed=b"short"))


def test_a_missing_token_is_refused(inbox: tuple[str, bytes]) -> None:
    path, token = inbox
    os.unlink(f"{path}/{possession.TOKEN_NAME}")
    assert "cannot be read: No such file" in str(problem(path, token))


def test_a_symlinked_token_or_inbox_is_not_followed(inbox: tuple[str, bytes], tmp_path: Path) -> None:
    path, token = inbox
    real = tmp_path / "elsewhere"
    real.write_bytes(token)
    real.chmod(0o600)
    os.unlink(f"{path}/{possession.TOKEN_NAME}")
    os.symlink(real, f"{path}/{possession.TOKEN_NAME}")
    assert "cannot be read" in str(problem(path, token))  # ELOOP: O_NOFOLLOW
    link = tmp_path / "inbox-link"
    os.symlink(path, link)
    assert "cannot be read" in str(problem(str(link), token))  # the directory is not followed either


def test_a_token_of_another_owner_is_refused(inbox: tuple[str, bytes]) -> None:
    path, token = inbox
    assert f"owned by uid {UID}, the peer runs as uid {UID + 1}" in str(problem(path, token, uid=UID + 1))


@pytest.mark.parametrize(
    ("what", "needle"),
    [
        ("size", f"not {possession.TOKEN_BYTES}"),
        ("mode", "others could read it"),
        ("hard link", "2 links"),
        ("fifo", "not a regular file"),
        ("directory", "not a regular file"),
    ],
)
def test_a_token_file_that_is_not_what_a_backend_makes_is_refused(
    inbox: tuple[str, bytes], what: str, needle: str
) -> None:
    path, token = inbox
    file = f"{path}/{possession.TOKEN_NAME}"
    if what == "size":
        with open(file, "ab") as f:
            f.write(b"x")
    elif what == "mode":
        os.chmod(file, 0o644)
    elif what == "hard link":
        os.link(file, f"{path}/another-name")
    else:
        os.unlink(file)
        os.mkfifo(file, 0o600) if what == "fifo" else os.mkdir(file, 0o700)
    assert needle in str(problem(path, token))


# --------------------------------------------------------------------------- add_peer


@pytest.fixture
def pair() -> Iterator[tuple[LocalBackend, LocalBackend]]:
    target, writer = LocalBackend(agent_name="target"), LocalBackend(agent_name="writer")
    target.register([target.allocate("kv", 1 << 16).region()])
    yield target, writer
    target.close()
    writer.close()


def with_proof(md: PeerMetadata, proof: bytes) -> PeerMetadata:
    env = bm.decode_bytes(md.agent_metadata)
    return PeerMetadata(md.agent_name, bm.encode_bytes(msgspec.structs.replace(env, proof=proof)))


def test_the_local_backend_publishes_a_proof_and_add_peer_checks_it(pair: Any) -> None:
    target, writer = pair
    md = target.local_metadata()
    env = bm.decode_bytes(md.agent_metadata)
    assert isinstance(env, bm.AgentMetadata)
    assert env.proof == possession.proof(target._token, "target", os.getpid(), target._inbox.path)
    writer.remove_peer(writer.add_peer(md))
    forged = possession.proof(os.urandom(32), "target", os.getpid(), target._inbox.path)
    with pytest.raises(possession.NotPossessed, match="does not match the token"):
        writer.add_peer(with_proof(md, forged))
    with pytest.raises(PeerError, match="carries no proof of possession"):
        writer.add_peer(with_proof(md, b""))
    assert "target" not in writer.peers


def test_a_proof_made_for_another_agent_name_is_refused(pair: Any) -> None:
    """A proof seen in one backend's metadata proves nothing under another name."""
    target, writer = pair
    md = target.local_metadata()
    env = bm.decode_bytes(md.agent_metadata)
    assert isinstance(env, bm.AgentMetadata)
    renamed = msgspec.structs.replace(env, agent_name="someone-else")
    with pytest.raises(possession.NotPossessed):
        writer.add_peer(PeerMetadata("someone-else", bm.encode_bytes(renamed)))


def test_a_1_0_envelope_without_the_field_is_refused_by_name(pair: Any) -> None:
    """Backend metadata 1.0 has no proof: the local backend (one host, upgraded together) refuses it."""
    target, writer = pair
    md = target.local_metadata()
    env = bm.decode_bytes(md.agent_metadata)
    old = bm.encode_bytes(msgspec.structs.replace(env, proof=b""), (1, 0))
    assert old[6:8] == bytes([1, 0])  # major 1, minor 0 in the header
    with pytest.raises(PeerError, match=r"backend metadata 1\.0"):
        writer.add_peer(PeerMetadata(md.agent_name, old))
