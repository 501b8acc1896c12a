"""``local``: same-host transfers through named shared memory; no engine to install.

Memory must come from :meth:`LocalBackend.allocate` (a ``/dev/shm`` file mapped into
this process) because the writer maps the *peer's* files and copies into them with
``memmove``. ``add_peer`` maps every segment the peer's metadata lists; ``post`` hands
the rows to one worker thread (``ctypes.memmove`` releases the GIL, so the owner thread
keeps running); after the last row the worker checks the peer is alive and drops the
notification into the peer's inbox directory (see :mod:`.shm`). A dead peer makes the
transfer FAILED: its pages stay mapped here, so the copy cannot fault, but nobody will
read it. Unlink policy: see :mod:`.shm`.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pdwire.runtime.backends import shm
from pdwire.runtime.backends.base import (
    DONE,
    Backend,
    HostBuffer,
    Notification,
    Peer,
    PeerError,
    PeerMetadata,
    RegistrationError,
    TransferHandle,
    TransferStatus,
    decode_envelope,
    encode_envelope,
    failed,
    pid_alive,
)
from pdwire.runtime.backends.worker import Job, JobTransfers, JobWorker
from pdwire.runtime.descriptors import DescriptorTable, Region

_CANCEL_CHECK_ROWS = 256  # rows between checks of the cancel flag and the peer's liveness


@dataclass
class _PeerMaps:
    maps: list[shm.Mapping]
    inbox: str
    # per peer region: local address - peer address (mod 2**64), for the region tuple it was made for
    delta_for: tuple[Region, ...] | None = None
    delta: np.ndarray[Any, np.dtype[np.uint64]] = field(default_factory=lambda: np.zeros(0, np.uint64))

    def deltas(self, peer: Peer) -> np.ndarray[Any, np.dtype[np.uint64]]:
        if self.delta_for is not peer.regions:
            delta = np.zeros(len(peer.regions), dtype=np.uint64)
            for i, r in enumerate(peer.regions):
                for m in self.maps:
                    if m.peer_base <= r.base and r.end <= m.peer_base + m.nbytes:
                        delta[i] = np.uint64((m.address - m.peer_base) % (1 << 64))
                        break
                else:
                    raise PeerError(
                        f"peer {peer.agent_name!r} region {i} {r.name!r} lies in no segment it published"
                    )
            self.delta, self.delta_for = delta, peer.regions
        return self.delta


class LocalBackend(JobTransfers, Backend):
    name = "local"

    def __init__(self, agent_name: str | None = None, transfer_timeout_s: float = 30.0) -> None:
        super().__init__(agent_name, transfer_timeout_s)
        shm.reap_dead()
        self._stem = shm.make_stem(os.urandom(4).hex())
        self._buffers: list[tuple[shm.Mapping, HostBuffer]] = []
        self._inbox = shm.Inbox.create(f"{self._stem}.inbox")
        self._worker = JobWorker(f"pdwire-local-{self.agent_name}")

    # ---- memory
    def _allocate(self, name: str, nbytes: int) -> HostBuffer:
        path = f"{self._stem}-{len(self._buffers)}-{shm.safe_token(name)}"
        m = shm.Mapping(path, nbytes, create=True)
        assert m.array is not None
        buf = HostBuffer(name, m.array)
        self._buffers.append((m, buf))
        return buf

    def _segment_of(self, r: Region) -> shm.Mapping:
        for m, _ in self._buffers:
            if m.address <= r.base and r.end <= m.address + m.nbytes:
                return m
        raise RegistrationError(
            f"region {r.name!r} [{r.base:#x}, {r.end:#x}) is not inside memory allocated by this local "
            "backend; the local backend can only share memory from allocate()"
        )

    def _register(self, regions: list[Region]) -> None:
        for r in regions:
            self._segment_of(r)

    def _local_metadata(self) -> PeerMetadata:
        segs = [[m.path, m.address, m.nbytes] for m, _ in self._buffers]
        extra = {"segments": segs, "inbox": self._inbox.path}
        return PeerMetadata(
            self.agent_name, encode_envelope(self.name, self.agent_name, self.regions, b"", extra)
        )

    # ---- peers
    def _add_peer(self, metadata: PeerMetadata) -> Peer:
        md = decode_envelope(self.name, metadata)
        if not pid_alive(md.pid):
            raise PeerError(f"peer {md.agent_name!r} (pid {md.pid}) is not running")
        maps: list[shm.Mapping] = []
        try:
            for path, base, size in md.extra.get("segments", []):
                m = shm.Mapping(str(path), int(size), create=False)
                m.peer_base = int(base)
                maps.append(m)
            peer = Peer(md.agent_name, md.regions, md.pid, _PeerMaps(maps, str(md.extra.get("inbox", ""))))
            peer.engine.deltas(peer)  # fail now, not at the first post, if the metadata is inconsistent
        except (OSError, PeerError) as exc:
            for m in maps:
                m.close()
            if isinstance(exc, PeerError):
                raise
            raise PeerError(f"cannot map memory of peer {md.agent_name!r}: {exc}") from None
        return peer

    def _remove_peer(self, peer: Peer) -> None:
        pm: _PeerMaps = peer.engine
        for m in pm.maps:
            m.close()

    # ---- transfers
    def _post(self, handle: TransferHandle, table: DescriptorTable, notification: bytes) -> None:
        pm: _PeerMaps = handle.peer.engine
        # uint64 arithmetic wraps modulo 2**64, which is exactly the address translation.
        dst_local = table.dst_addr + pm.deltas(handle.peer)[table.dst_region]
        src, dst, length = table.src_addr.tolist(), dst_local.tolist(), table.length.tolist()
        peer = handle.peer
        inbox = pm.inbox

        def run(job: Job) -> TransferStatus:
            if not pid_alive(peer.pid):
                return failed(f"peer {peer.agent_name!r} (pid {peer.pid}) is gone")
            memmove = ctypes.memmove  # releases the GIL while it copies
            for i, (s, d, n) in enumerate(zip(src, dst, length, strict=True)):
                if i % _CANCEL_CHECK_ROWS == _CANCEL_CHECK_ROWS - 1 and job.cancel:
                    return failed("cancelled")
                memmove(d, s, n)
            if job.cancel:
                return failed("cancelled")
            if not pid_alive(peer.pid):
                return failed(f"peer {peer.agent_name!r} (pid {peer.pid}) died before the notification")
            try:
                shm.send(inbox, self.agent_name, notification)
            except OSError as exc:
                return failed(f"peer {peer.agent_name!r} inbox unavailable: {exc}")
            return DONE

        handle.engine = self._worker.submit(run)

    def _receive_notifications(self) -> list[Notification]:
        return [Notification(s, p) for s, p in self._inbox.receive()]

    def _close(self) -> None:
        self._worker.stop()
        shm.remove_path(self._inbox.path)
        for m, buf in self._buffers:
            shm.remove_path(m.path)
            buf.array = np.zeros(0, dtype=np.uint8)  # drop our view so the mmap can close
            m.close()
        self._buffers.clear()
