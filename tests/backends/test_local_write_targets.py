"""Where the local backend may be told to write: a hostile peer's pid, inbox and regions.

``process_vm_writev`` writes any address of any process the writer may ptrace, so the pid and
regions in a peer's metadata must be proven, at the handshake, to be a pdwire local backend's
own: the process holds the inbox it names open, and every destination lies in its
``/memfd:pdwire-*`` mappings (memory from ``Backend.allocate``). A peer naming this process, a
live process it is not (with an inbox it forged), or memory of the named process outside what
its backend allocated (heap, stack, a file mapping, a revoked window, a range running past the
end) is refused with a :class:`PeerError` naming the problem. Cross-process cases use real
processes.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from pdwire.runtime.backends import peer_memory, shm
from pdwire.runtime.backends.errors import PeerError
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.backends.values import PeerMetadata

ROOT = Path(__file__).resolve().parents[2]
HEADER = 12  # the envelope's header (schema/backend_metadata.yaml, single-buffer form)
PID, ROWS, INBOX, WINDOW = 2, 3, 5, 6  # fields of the envelope body
OUTSIDE = "is not inside shared memory its backend allocated"


def body(blob: bytes) -> list[Any]:
    value = msgspec.msgpack.decode(blob[HEADER:])
    assert isinstance(value, list)
    return value


def add(writer: LocalBackend, blob: bytes, env: list[Any], name: str) -> Any:
    return writer.add_peer(PeerMetadata(name, blob[:HEADER] + msgspec.msgpack.encode(env)))


@pytest.fixture
def pair() -> Iterator[tuple[LocalBackend, LocalBackend]]:
    target, writer = LocalBackend(agent_name="target"), LocalBackend(agent_name="writer")
    target.register([target.allocate("kv", 1 << 16).region()])
    writer.register([writer.allocate("src", 1 << 16).region()])
    yield target, writer
    target.close()
    writer.close()


# --------------------------------------------------------------------------- this process


def test_an_in_process_pair_is_served(pair: Any) -> None:
    """Two local backends of one process (the engine API's tests, a one-process deployment)."""
    target, writer = pair
    writer.remove_peer(writer.add_peer(target.local_metadata()))
    writer.remove_peer(writer.add_peer(target.local_metadata(for_peer="writer")))


def test_a_peer_naming_this_backend_itself_is_refused(pair: Any) -> None:
    """Our own pid with our own inbox: the peer would have us write into our own memory."""
    target, writer = pair
    blob = target.local_metadata()
    env = body(blob.agent_metadata)
    env[INBOX] = writer._inbox.path
    env[ROWS][0][0] = writer.regions[0].base  # our own source memory
    with pytest.raises(PeerError, match="names this backend itself"):
        add(writer, blob.agent_metadata, env, "target")


def test_a_peer_naming_this_process_with_a_forged_inbox_is_refused(pair: Any) -> None:
    target, writer = pair
    blob = target.local_metadata()
    env = body(blob.agent_metadata)
    forged = f"{shm.SHM_DIR}/{shm.PREFIX}{os.getpid()}-0badf00d.inbox"
    os.mkdir(forged, 0o700)
    try:
        env[INBOX] = forged
        with pytest.raises(PeerError, match="inbox of no other live local backend"):
            add(writer, blob.agent_metadata, env, "target")
    finally:
        os.rmdir(forged)


def test_a_closed_in_process_backend_is_no_target(pair: Any) -> None:
    _target, writer = pair
    late = LocalBackend(agent_name="late")
    late.register([late.allocate("kv", 4096).region()])
    blob = late.local_metadata().agent_metadata
    late.close()
    with pytest.raises(PeerError, match="no usable inbox"):
        writer.add_peer(PeerMetadata("late", blob))


@pytest.mark.parametrize("where", ["writer's memory", "numpy array", "past the end", "revoked window"])
def test_in_process_destinations_outside_the_named_backends_memory_are_refused(pair: Any, where: str) -> None:
    """The named backend's allocate()d memory and live windows only: not another backend's
    memory of this process (the writer's own), nor ordinary memory, nor a revoked window."""
    target, writer = pair
    engine_memory = np.zeros(1 << 16, np.uint8)
    blob = target.local_metadata(for_peer="writer" if where == "revoked window" else None)
    env = body(blob.agent_metadata)
    row = env[ROWS][0]
    if where == "writer's memory":
        row[0] = writer.regions[0].base
    elif where == "numpy array":
        row[0] = int(engine_memory.ctypes.data)
    elif where == "past the end":
        row[1] += 1
    else:
        target.revoke("writer")
    with pytest.raises(PeerError, match=f"region 0 'kv' .* {OUTSIDE}"):
        add(writer, blob.agent_metadata, env, "target")


def test_regions_given_to_add_peer_are_checked_too(pair: Any) -> None:
    """``add_peer(md, regions=...)`` replaces the metadata's list: the replacement is checked."""
    target, writer = pair
    md = target.local_metadata()
    bad = [writer.regions[0]]
    with pytest.raises(PeerError, match=OUTSIDE):
        writer.add_peer(md, regions=bad)
    assert "target" not in writer.peers
    writer.remove_peer(writer.add_peer(md, regions=target.regions))


# --------------------------------------------------------------------------- other processes


def test_another_live_process_with_a_forged_inbox_is_refused(pair: Any) -> None:
    """Any live same-user process (here ``sleep``) with an inbox made in its name by someone
    else: the process does not hold it open, so it is no local backend."""
    target, writer = pair
    sleeper = subprocess.Popen(["sleep", "60"])
    forged = f"{shm.SHM_DIR}/{shm.PREFIX}{sleeper.pid}-0badf00d.inbox"
    try:
        os.mkdir(forged, 0o700)
        blob = target.local_metadata()
        env = body(blob.agent_metadata)
        env[PID], env[INBOX] = sleeper.pid, forged
        with pytest.raises(PeerError, match=f"pid {sleeper.pid}.*does not hold it open"):
            add(writer, blob.agent_metadata, env, "target")
    finally:
        sleeper.kill()
        sleeper.wait()
        shm.remove_path(forged)
        if os.path.isdir(forged):
            os.rmdir(forged)


CHILD = textwrap.dedent(
    """
    import base64, json, os, sys
    import numpy as np
    from pdwire.runtime.backends.local import LocalBackend

    b = LocalBackend(agent_name=f"child-{os.getpid()}")
    buf = b.allocate("kv", 1 << 16)
    engine_memory = np.ones(1 << 16, np.uint8)  # what an engine might hold: not from allocate()
    b.register([buf.region()])
    enc = lambda md: base64.b64encode(md.agent_metadata).decode()
    plain, window = b.local_metadata(), b.local_metadata(for_peer="w")
    revoked = b.local_metadata(for_peer="r")
    b.revoke("r")
    print(json.dumps({"agent": b.agent_name, "plain": enc(plain), "window": enc(window),
                      "revoked": enc(revoked), "heap": int(engine_memory.ctypes.data)}), flush=True)
    sys.stdin.read()
    b.close()
    """
)


def start_child() -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    hello = json.loads(proc.stdout.readline())
    hello["pid"] = proc.pid
    for k in ("plain", "window", "revoked"):
        hello[k] = base64.b64decode(hello[k])
    return proc, hello


@pytest.fixture(scope="module")
def child() -> Iterator[dict[str, Any]]:
    """A real local backend in its own process: its metadata (plain, windowed, revoked) and the
    address of an ordinary numpy array of it."""
    proc, hello = start_child()
    yield hello
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


@pytest.fixture
def writer() -> Iterator[LocalBackend]:
    w = LocalBackend(agent_name="writer")
    yield w
    w.close()


def test_a_real_peer_process_is_served(child: dict[str, Any], writer: LocalBackend) -> None:
    for k in ("plain", "window"):
        writer.remove_peer(writer.add_peer(PeerMetadata(child["agent"], child[k])))


def _maps(pid: int) -> list[tuple[int, int, str, str]]:
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        f = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in f[0].split("-"))
        out.append((lo, hi, f[1], f[5] if len(f) > 5 else ""))
    return out


@pytest.mark.parametrize("where", ["heap array", "stack", "code", "file mapping", "past the end", "window"])
def test_destinations_outside_the_peers_pdwire_memory_are_refused(
    child: dict[str, Any], writer: LocalBackend, where: str
) -> None:
    pid, blob = child["pid"], child["plain"]
    env = body(blob)
    row = env[ROWS][0]
    maps = _maps(pid)
    if where == "heap array":
        row[0] = child["heap"]
    elif where == "stack":
        row[0] = next(lo for lo, _, _, name in maps if name == "[stack]")
    elif where == "code":
        row[0] = next(lo for lo, _, perms, name in maps if "x" in perms and name.startswith("/"))
    elif where == "file mapping":  # an ordinary file the process mapped (a library's data, ...)
        row[0] = next(lo for lo, _, perms, name in maps if perms.startswith("rw") and name.startswith("/usr"))
    elif where == "past the end":  # starts in the memfd, runs into whatever lies beyond it
        span = next(s for s in peer_memory.pdwire_spans(pid) if s[0] <= row[0] < s[1])
        row[0], row[1] = span[1] - 4096, 8192
    else:  # a window offset that points the real region's writes at the heap
        env[WINDOW] = [(child["heap"] - row[0]) % (1 << 64)]
    with pytest.raises(PeerError, match=f"pid {pid}.*region 0 'kv' .* {OUTSIDE}"):
        add(writer, blob, env, child["agent"])


def test_a_revoked_window_is_no_destination(child: dict[str, Any], writer: LocalBackend) -> None:
    """Metadata whose windows were revoked (their addresses now junk anonymous pages)."""
    with pytest.raises(PeerError, match=OUTSIDE):
        writer.add_peer(PeerMetadata(child["agent"], child["revoked"]))


def test_a_real_inbox_with_the_pid_of_another_process_is_refused(
    child: dict[str, Any], writer: LocalBackend
) -> None:
    """The peer's real inbox, another live process's pid: the inbox's name says whose it is."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        env = body(child["plain"])
        env[PID] = sleeper.pid
        with pytest.raises(PeerError, match=f"made by pid {child['pid']}"):
            add(writer, child["plain"], env, child["agent"])
    finally:
        sleeper.kill()
        sleeper.wait()


def test_only_pdwire_memfds_count_as_allocated_memory(tmp_path: Path) -> None:
    """A file of /dev/shm named like ours, an ordinary file, a memfd of another name and a
    private mapping of a pdwire memfd are no pdwire memory; a shared one is."""
    import mmap

    def spans_hold(m: mmap.mmap) -> bool:
        a = np.frombuffer(m, np.uint8)
        addr = int(a.ctypes.data)
        del a
        return peer_memory.inside(peer_memory.pdwire_spans(os.getpid()), addr, 4096)

    shm_file = f"{shm.SHM_DIR}/{shm.PREFIX}{os.getpid()}-file"
    fds = [os.open(shm_file, os.O_RDWR | os.O_CREAT, 0o600), os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)]
    os.unlink(shm_file)
    fds += [os.memfd_create("other-name"), os.memfd_create("pdwire-ok")]
    for fd in fds:
        os.ftruncate(fd, 4096)
    maps = [mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED) for fd in fds]
    private = mmap.mmap(fds[3], 4096, flags=mmap.MAP_PRIVATE)
    try:
        assert [spans_hold(m) for m in maps] == [False, False, False, True]
        assert not spans_hold(private)
    finally:
        for m in [*maps, private]:
            m.close()
        for fd in fds:
            os.close(fd)


def test_a_peer_process_that_exited_is_never_written(writer: LocalBackend) -> None:
    """The writer holds the checked process (a pidfd): once it exited, a transfer fails before
    a byte is written, whoever has the pid by then."""
    from pdwire.runtime.backends.values import TransferState
    from pdwire.runtime.descriptors import DescriptorTable

    proc, hello = start_child()
    src = writer.allocate("src", 4096)
    writer.register([src.region()])
    peer = writer.add_peer(PeerMetadata(hello["agent"], hello["plain"]))
    proc.kill()
    proc.wait(timeout=30)
    dst = peer.regions[0].base
    u64, u32 = np.uint64, np.uint32
    one = np.zeros(1, u32)
    addr = np.array([src.address], u64), np.array([dst], u64), np.array([4096], u64)
    table = DescriptorTable(*addr, one, one)
    h = writer.post(peer, table, b"late")
    end = time.monotonic() + 30
    while not (result := writer.poll(h)).finished and time.monotonic() < end:
        time.sleep(0.01)
    assert result.state is TransferState.FAILED and "is gone" in result.reason, result
