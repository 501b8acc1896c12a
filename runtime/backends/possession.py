"""Proof that a local backend's metadata comes from the backend whose inbox it names.

The ``/proc`` checks (:mod:`.peer_memory`) prove that a peer's pid, inbox and regions are *some*
live local backend's, not that the sender is that backend. So each backend keeps a random token
(:data:`TOKEN_BYTES`) in the owner-only file :data:`TOKEN_NAME` of its inbox and publishes
:func:`proof`, an HMAC-SHA256 of its agent name, pid and inbox keyed with it (bound to them, so a
proof seen once proves nothing under another name). The writer, which may ptrace the peer and so
runs as its uid or root, reads the token and compares in constant time (:func:`proof_problem`).
The boundary is the uid: why, and every refusal, in docs/hostile-peers.md (check 6).

:func:`proof` and :func:`token_stat_problem` are pure; :func:`create_token` and
:func:`read_token` touch the file.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

from pdwire.runtime.backends.errors import PeerError

TOKEN_NAME = ".token"  # a dot name: Inbox.receive never takes it for a message
TOKEN_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
_CONTEXT = b"pdwire-local-proof-v1"  # domain separation: this key signs nothing else


class NotPossessed(PeerError):
    """A peer's metadata names an inbox (and so a process and its memory) whose token its author
    does not hold: refused at the handshake."""


class PossessionError(Exception):
    """The inbox's token file cannot be used (missing, a link, wrong owner, mode or size)."""


def proof(token: bytes, agent_name: str, pid: int, inbox: str) -> bytes:
    """The HMAC a backend holding ``token`` publishes for (agent, pid, inbox)."""
    fields = (_CONTEXT, agent_name.encode("utf-8", "surrogatepass"), str(pid).encode(), inbox.encode())
    # length-prefixed, so no two field lists read as the same bytes
    message = b"".join(len(f).to_bytes(4, "little") + f for f in fields)
    return hmac.new(token, message, hashlib.sha256).digest()


def token_stat_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a token file with this ``fstat`` is not one a backend running as ``uid`` created."""
    if not stat.S_ISREG(st.st_mode):
        return "its token is not a regular file"
    if st.st_uid != uid:
        return f"its token is owned by uid {st.st_uid}, the peer runs as uid {uid}"
    if st.st_mode & 0o077:
        return f"its token has mode {stat.S_IMODE(st.st_mode):04o}: others could read it"
    if st.st_nlink != 1:
        return f"its token has {st.st_nlink} links"
    if st.st_size != TOKEN_BYTES:
        return f"its token is {st.st_size} bytes, not {TOKEN_BYTES}"
    return None


def create_token(dir_fd: int) -> bytes:
    """Make a fresh token in the inbox directory open as ``dir_fd``; returns it."""
    token = os.urandom(TOKEN_BYTES)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(TOKEN_NAME, flags, 0o600, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask: exactly owner read-write
        view = memoryview(token)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return token


def read_token(inbox: str, uid: int) -> bytes:
    """The token in ``inbox`` (never following a link, nor blocking on a FIFO); raises
    :class:`PossessionError` naming what is wrong, OSError when it cannot be read."""
    dir_fd = os.open(inbox, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(TOKEN_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        problem = token_stat_problem(os.fstat(fd), uid)
        if problem is not None:
            raise PossessionError(problem)
        data = os.read(fd, TOKEN_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != TOKEN_BYTES:
        raise PossessionError(f"its token read {len(data)} bytes, not {TOKEN_BYTES}")
    return data


def proof_problem(inbox: str, uid: int, agent_name: str, pid: int, claimed: bytes) -> str | None:
    """Why ``claimed`` does not prove that the metadata's author holds the token of ``inbox``
    (a backend running as ``uid``); None when it does."""
    if not claimed:
        return (
            "its metadata carries no proof of possession (backend metadata 1.0: a pdwire older "
            "than the one here; upgrade the host's ranks together)"
        )
    if len(claimed) != PROOF_BYTES:
        return f"its proof of possession is {len(claimed)} bytes, not {PROOF_BYTES}"
    try:
        token = read_token(inbox, uid)
    except PossessionError as exc:
        return str(exc)
    except OSError as exc:
        return f"its token cannot be read: {exc.strerror or exc}"
    if not hmac.compare_digest(proof(token, agent_name, pid, inbox), claimed):
        return (
            "its proof of possession does not match the token in that inbox: the metadata was "
            "not made by the local backend that owns the inbox"
        )
    return None
