"""A hostile peer's backend metadata and files, against the real local backend.

The metadata envelope is the peer's data: a flipped bit, an unknown memory kind, a pid no
process can have, a region row of the wrong shape, an inbox path of someone else's must each
end in a :class:`PeerError` naming it (the worker turns it into a refused registration), never
another exception. The notification inbox is a directory anyone of the user can write: what
is not a message in it is skipped and counted.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdwire.runtime.backends import possession, shm
from pdwire.runtime.backends.errors import BackendError, PeerError
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.backends.values import PeerMetadata
from pdwire.runtime.backends.wakeup import WAKE_NAME


@pytest.fixture(scope="module")
def pair() -> Any:
    target, writer = LocalBackend(agent_name="target"), LocalBackend(agent_name="writer")
    buf = target.allocate("kv", 1 << 16)
    target.register([buf.region()])
    yield target, writer
    target.close()
    writer.close()


HEADER = 12  # the envelope's header (schema/backend_metadata.yaml, single-buffer form)


def envelope(target: LocalBackend) -> list[Any]:
    """The target's real envelope body as plain msgpack values (backend, agent, pid, rows,
    engine, inbox, window, ...), after the header."""
    value = msgspec.msgpack.decode(target.local_metadata().agent_metadata[HEADER:])
    assert isinstance(value, list)
    return value


def add(writer: LocalBackend, env: Any, name: str = "target", header: bytes | None = None) -> Any:
    pristine = writer.local_metadata().agent_metadata[:HEADER] if header is None else header
    return writer.add_peer(PeerMetadata(name, pristine + msgspec.msgpack.encode(env)))


def test_the_real_envelope_is_accepted(pair: Any) -> None:
    target, writer = pair
    peer = add(writer, envelope(target))
    writer.remove_peer(peer)


@pytest.mark.parametrize(
    ("where", "value", "needle"),
    [
        ("pid", 2**63, "pid"),
        ("pid", 2**64 - 1, "pid"),
        ("pid", -1, "pid"),
        ("pid", 0, "pid"),
        ("kind", "HBM", "memory kind"),
        ("length", -1, r"AgentMetadata.regions\[0\]\[1\]"),
        ("length", 2**64 - 1, "u64 range"),
        ("base", 2**64 - 1, "u64 range"),
        ("row", [0, 1], "not a pdwire envelope"),
        ("rows", {"a": 1}, "not a pdwire envelope"),
        ("inbox", "/tmp", "inbox"),
        ("inbox", "/dev/shm/pdwire-1-00000000.inbox", "inbox"),
        ("inbox", "/dev/shm/pdwire-/../../etc", "inbox"),
        ("inbox", 7, "inbox"),
    ],
)
def test_bad_envelope_fields_are_refused_by_name(pair: Any, where: str, value: Any, needle: str) -> None:
    target, writer = pair
    env = envelope(target)
    if where == "pid":
        env[2] = value
    elif where == "kind":
        env[3][0][2] = value
    elif where == "length":
        env[3][0][1] = value
    elif where == "base":
        env[3][0][0] = value
    elif where == "row":
        env[3][0] = value
    elif where == "rows":
        env[3] = value
    else:
        env[5] = value
    with pytest.raises(PeerError, match=needle):
        add(writer, env)


@pytest.mark.parametrize(
    ("protocol_id", "major", "needle"),
    [(3, 2, "version 2.0 is not supported"), (1, 1, "protocol"), (3, 0, "version 0.0")],
)
def test_an_envelope_of_another_major_or_protocol_is_refused_by_name(
    pair: Any, protocol_id: int, major: int, needle: str
) -> None:
    """The header (schema/backend_metadata.yaml) names the protocol and version: a peer whose
    envelope this build cannot read is refused saying so, before any field is looked at."""
    target, writer = pair
    magic, _, _, _minor, type_id, sides = struct.unpack(
        "<4sHBBHH", target.local_metadata().agent_metadata[:HEADER]
    )
    header = struct.pack("<4sHBBHH", magic, protocol_id, major, 0, type_id, sides)
    with pytest.raises(PeerError, match=needle):
        add(writer, envelope(target), header=header)


def test_a_newer_minor_of_the_envelope_is_read() -> None:
    """A peer one minor ahead appends fields: this build reads what it knows."""
    pair_target = LocalBackend(agent_name="target")
    writer = LocalBackend(agent_name="writer")
    try:
        blob = pair_target.local_metadata().agent_metadata
        magic, proto, major, minor, type_id, sides = struct.unpack("<4sHBBHH", blob[:HEADER])
        body = [*msgspec.msgpack.decode(blob[HEADER:]), "a field of 1.1"]
        header = struct.pack("<4sHBBHH", magic, proto, major, minor + 1, type_id, sides)
        writer.remove_peer(add(writer, body, header=header))
    finally:
        pair_target.close()
        writer.close()


def test_another_processes_inbox_is_refused(pair: Any, tmp_path: Any) -> None:
    """A peer naming the inbox of another live process (here: this one's writer) is refused."""
    target, writer = pair
    env = envelope(target)
    env[5] = writer._inbox.path  # same pid here: a symlink instead proves the lstat check
    link = f"{shm.SHM_DIR}/{shm.PREFIX}{os.getpid()}-deadbeef.inbox"
    os.symlink(str(tmp_path), link)
    try:
        env[5] = link
        with pytest.raises(PeerError, match="not a directory"):
            add(writer, env)
    finally:
        os.unlink(link)
    other = envelope(target)
    other[5] = f"{shm.SHM_DIR}/{shm.PREFIX}1-{target._inbox.path[-14:-6]}.inbox"
    with pytest.raises(PeerError, match="pid 1"):
        add(writer, other)


@settings(deadline=None, max_examples=200)
@given(st.data())
def test_any_bit_flip_or_truncation_of_the_metadata_is_refused_or_accepted_never_raised(
    pair: Any, data: st.DataObject
) -> None:
    target, writer = pair
    blob = bytearray(target.local_metadata().agent_metadata)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= 1 << data.draw(st.integers(0, 7))
    blob = blob[: data.draw(st.integers(0, len(blob)))]
    try:
        peer = writer.add_peer(PeerMetadata("target", bytes(blob)))
    except BackendError:
        return
    writer.remove_peer(peer)


def test_garbage_files_and_directories_in_the_inbox_are_skipped_and_counted(pair: Any) -> None:
    target, _writer = pair
    inbox = target._inbox
    before = inbox.skipped
    with open(f"{inbox.path}/00-garbage", "wb") as f:
        f.write(os.urandom(256))
    os.mkdir(f"{inbox.path}/01-a-directory")
    os.mkfifo(f"{inbox.path}/02-a-fifo")
    os.symlink("/etc/passwd", f"{inbox.path}/03-a-link")
    shm.send(inbox.path, "writer", b"a real one")
    assert target.receive_notifications()[-1].payload == b"a real one"  # must not raise
    assert inbox.skipped - before == 4
    # nothing left to trip over on the next receive: only the inbox's own wake-up socket and its
    # proof-of-possession token (dot names, never read as messages) stay
    assert sorted(os.listdir(inbox.path)) == sorted([WAKE_NAME, possession.TOKEN_NAME])
    assert os.path.exists("/etc/passwd")


@pytest.mark.parametrize(
    "inbox", ["/tmp", "/dev/shm/pdwire-1-00000000.inbox", "/dev/shm/pdwire-/../../etc", 7]
)
def test_a_mori_peer_naming_an_inbox_not_its_own_is_refused(backends: Any, inbox: Any) -> None:
    """MoRI's notifications are files this side writes into the inbox the peer names: the same
    rule as the local backend's (only its own, under /dev/shm, a real directory of its user)."""
    target, writer = backends("mori-fake", agent_name="target"), backends("mori-fake", agent_name="writer")
    buf = target.allocate("kv", 1 << 16)
    target.register([buf.region()])
    md = target.local_metadata()
    writer.remove_peer(writer.add_peer(md))  # the real metadata is accepted
    env = msgspec.msgpack.decode(md.agent_metadata[HEADER:])
    env[5] = inbox
    forged = md.agent_metadata[:HEADER] + msgspec.msgpack.encode(env)
    with pytest.raises(PeerError, match="inbox"):
        writer.add_peer(PeerMetadata("target", forged, md.region_descs))
