"""MoRI adapter: drives MoRI's IO engine API through pdwire's backend contract.

MoRI addresses memory as *descriptor + offset*: ``register_memory`` returns a
``MemoryDesc`` per region, peers exchange packed descriptors (``region_descs`` of
:class:`~.values.PeerMetadata`, the wire's per-component memory-descriptor blobs), and
``batch_write(local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids)``
moves rows given as offsets relative to each descriptor's base. The adapter turns a
DescriptorTable into that shape with ``src_region`` / ``dst_region``: rows are grouped by
(src region, dst region), offsets are ``addr - desc.data``, each group (cut into chunks
of at most ``max_rows``) gets its own transfer uid, and the transfer is DONE when every
returned status ``Succeeded()``; any ``Failed()`` makes it FAILED with MoRI's message, once
no status of the transfer is still in progress. MoRI cannot cancel a posted write: a
cancelled transfer is reported FAILED once every status left ``InProgress()`` (its bytes
may have landed; its notification is not sent).

MoRI has no completion notification (SGLang sends its own status over ZMQ), so the
adapter delivers the notification itself after every status succeeded, through a
same-host inbox directory (:mod:`.shm`). With real MoRI across hosts that hook would be
replaced by the control plane.

MoRI itself cannot be installed on this project's machines, so the adapter is exercised
here over an in-process fake of MoRI's IO engine (``mori-fake``, in the demo package:
:mod:`pdwire.demo.mori_fake`), never registered as a production backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from pdwire.runtime.backends import shm
from pdwire.runtime.backends.contract import Backend, batches
from pdwire.runtime.backends.errors import PeerError, RegistrationError, TransferError
from pdwire.runtime.backends.metadata import decode_envelope, encode_envelope, pid_alive
from pdwire.runtime.backends.values import (
    DONE,
    PENDING,
    EngineNotification,
    HostBuffer,
    Peer,
    PeerMetadata,
    PollResult,
    TransferHandle,
    failed,
)
from pdwire.runtime.descriptors import DescriptorTable, MemoryKind, Region


@dataclass
class _Remote:
    engine_desc: Any
    mem_descs: list[Any]
    inbox: str


@dataclass
class _Xfer:
    statuses: list[Any]
    notification: bytes
    status: PollResult = field(default=PENDING)
    cancelled: bool = False


class MoriBackend(Backend):
    """The adapter; ``api`` is the module providing MoRI's names (``mori.io`` or the fake)."""

    name = "mori"
    OPTION_DOCS: ClassVar[dict[str, str]] = {
        "host": "the address MoRI's IO engine listens on and advertises to peers",
        "port": "its port (0: any free one)",
        "max_rows": "rows per MoRI batch_write (larger groups are split)",
        "allocator": "(Python API only) where allocate() takes memory from",
    }
    peers_keyed_by_name = True

    def __init__(
        self,
        api: Any,
        agent_name: str | None = None,
        transfer_timeout_s: float = 30.0,
        max_rows: int = 4096,
        allocator: Callable[[str, int], HostBuffer] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(agent_name, transfer_timeout_s)
        self._api = api
        self.max_rows = max_rows
        # MoRI's engine listens on (host, port) and advertises them in its engine descriptor
        self._engine = api.IOEngine(self.agent_name, api.IOEngineConfig(host, port))
        self._engine.create_backend(api.BackendType.RDMA)
        self._mem_descs: list[Any] = []
        self._allocator = allocator
        self._inbox = shm.Inbox.create(f"{shm.make_stem(os.urandom(4).hex())}.inbox")

    def _allocate(self, name: str, nbytes: int) -> HostBuffer:
        if self._allocator is None:
            raise RegistrationError("this MoRI backend has no allocator: register your own tensors' memory")
        return self._allocator(name, nbytes)

    def _register(self, regions: list[Region]) -> None:
        api = self._api
        for r in regions:
            loc = api.MemoryLocationType.GPU if r.kind is MemoryKind.VRAM else api.MemoryLocationType.CPU
            dev = r.device_id if r.kind is MemoryKind.VRAM else -1
            try:
                self._mem_descs.append(self._engine.register_memory(r.base, r.length, dev, loc))
            except Exception as exc:
                raise RegistrationError(f"MoRI register_memory refused region {r.name!r}: {exc}") from None

    def _local_metadata(self, window: list[int] | None) -> PeerMetadata:
        # MoRI addresses memory by descriptor: no windows (``window`` is all zeros here, since
        # no region lies in memory from the base allocator), so revoke() reports ineffective.
        engine = self._engine.get_engine_desc().pack()
        env = encode_envelope(self.name, self.agent_name, self.regions, engine, {"inbox": self._inbox.path})
        return PeerMetadata(self.agent_name, env, tuple(d.pack() for d in self._mem_descs))

    def _add_peer(self, metadata: PeerMetadata) -> Peer:
        md = decode_envelope(self.name, metadata)
        api = self._api
        try:
            edesc = api.EngineDesc.unpack(md.engine)
            mdescs = [api.MemoryDesc.unpack(b) for b in metadata.region_descs]
        except Exception as exc:
            raise PeerError(f"peer {md.agent_name!r}: undecodable MoRI descriptors: {exc}") from None
        if len(mdescs) > len(md.regions) or (md.regions and not mdescs):
            raise PeerError(
                f"peer {md.agent_name!r} sent {len(mdescs)} memory descriptors for {len(md.regions)} regions"
            )
        # Fewer descriptors than regions: the peer describes its first regions only (a decode
        # rank at protocol 1.3 leaves out its receive staging buffer): the rest is not writable.
        regions = md.regions[: len(mdescs)]
        for i, (d, r) in enumerate(zip(mdescs, regions, strict=True)):
            if d.data != r.base or d.size != r.length:
                raise PeerError(
                    f"peer {md.agent_name!r}: memory descriptor {i} does not describe region {r.name!r}"
                )
        inbox = md.extra.get("inbox", "")
        problem = shm.inbox_problem(inbox, md.pid)  # notifications are files written into it
        if problem is not None:
            raise PeerError(f"peer {md.agent_name!r}: inbox {inbox!r}: {problem}")
        self._engine.register_remote_engine(edesc)
        return Peer(md.agent_name, regions, md.pid, _Remote(edesc, mdescs, str(inbox)))

    def _remove_peer(self, peer: Peer) -> None:
        if peer.agent_name in self._peers:
            # Replaced by a newer peer of the same name while its transfers were stopping:
            # MoRI keys remote engines by name, so the entry is the newer peer's now.
            return
        rem: _Remote = peer.private
        self._engine.deregister_remote_engine(rem.engine_desc)

    def _post(self, handle: TransferHandle, table: DescriptorTable, notification: bytes) -> None:
        rem: _Remote = handle.peer.private
        if len(rem.mem_descs) < len(handle.peer.regions):
            raise PeerError(f"peer {handle.peer.agent_name!r} has no memory descriptor for some regions")
        # One batch_write entry per (src region, dst region) group and chunk; offsets are
        # relative to the registered descriptors, never absolute addresses.
        pair = table.src_region.astype(np.uint64) << np.uint64(32) | table.dst_region.astype(np.uint64)
        order = np.argsort(pair, kind="stable")
        keys, starts = np.unique(pair[order], return_index=True)
        bounds = [*starts.tolist(), len(order)]
        lds, los, rds, ros, szs, uids = [], [], [], [], [], []
        for k, key in enumerate(keys.tolist()):
            rows = order[bounds[k] : bounds[k + 1]]
            ld, rd = self._mem_descs[key >> 32], rem.mem_descs[key & 0xFFFFFFFF]
            loff = (table.src_addr[rows] - np.uint64(ld.data)).tolist()
            roff = (table.dst_addr[rows] - np.uint64(rd.data)).tolist()
            size = table.length[rows].tolist()
            for a, b in batches(len(rows), self.max_rows):
                lds.append(ld)
                rds.append(rd)
                los.append(loff[a:b])
                ros.append(roff[a:b])
                szs.append(size[a:b])
                uids.append(self._engine.allocate_transfer_uid())
        try:
            statuses = self._engine.batch_write(lds, los, rds, ros, szs, uids)
        except Exception as exc:
            raise TransferError(f"MoRI batch_write to {handle.peer.agent_name!r} raised: {exc}") from None
        handle.private = _Xfer(list(statuses), notification)

    def _poll(self, handle: TransferHandle) -> PollResult:
        x: _Xfer = handle.private
        if x.status.finished:
            return x.status
        # Even after a failure, other writes of the transfer may still be landing: final only
        # once none is in progress.
        if any(st.InProgress() for st in x.statuses):
            return PENDING
        x.status = self._finish(handle, x)
        return x.status

    def _finish(self, handle: TransferHandle, x: _Xfer) -> PollResult:
        """The final state of a transfer none of whose writes is in progress; delivers its
        notification when every write succeeded."""
        bad = next((st for st in x.statuses if st.Failed()), None)
        if bad is not None:
            return failed(f"MoRI status {bad.Code()!r}: {bad.Message()}")
        if x.cancelled:
            return failed("cancelled")  # every byte landed, but the peer is not told
        peer = handle.peer
        if not pid_alive(peer.pid):
            return failed(f"peer {peer.agent_name!r} (pid {peer.pid}) is gone")
        try:
            shm.send(peer.private.inbox, self.agent_name, x.notification)
        except OSError as exc:
            return failed(f"peer {peer.agent_name!r} inbox unavailable: {exc}")
        return DONE

    def _cancel(self, handle: TransferHandle) -> None:
        x: _Xfer = handle.private
        x.cancelled = True  # MoRI cannot stop a posted write: _poll waits until none is in progress

    def _release(self, handle: TransferHandle) -> None:
        handle.private = None

    def _receive_notifications(self) -> list[EngineNotification]:
        return [EngineNotification(s, p) for s, p in self._inbox.receive()]

    def _close(self) -> None:
        for d in self._mem_descs:
            self._engine.deregister_memory(d)
        self._mem_descs.clear()
        shutdown = getattr(self._engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self._inbox.close()
