"""``mooncake``: Mooncake's TransferEngine over TCP with the P2P handshake.

Mapping onto Mooncake
---------------------
* The engine is ``initialize(hostname, "P2PHANDSHAKE", "tcp", "")``; its peers know it
  as ``"<hostname>:<rpc port>"`` (carried in the metadata envelope). Only hand peers
  127.0.0.1 on a single host: Mooncake's listeners bind every interface.
* ``register`` -> ``register_memory(addr, len)`` per region (DRAM; this wheel has no CUDA).
* ``post`` queues one job on a worker thread (Mooncake's calls block: even
  ``get_batch_transfer_status`` waits for the batch here). The job writes the rows in
  chunks of at most ``max_batch`` descriptors — Mooncake's TCP lane rejects batches
  over ~2,048 queued descriptors per peer ("queue-full") — with
  ``batch_transfer_sync_write``, and the *last* chunk with
  ``batch_transfer_sync(..., Write, TransferNotify(agent_name, payload))``: the engine
  hands the notification to the target after that batch's data, and the earlier chunks
  completed before it was issued, so a received notification means every byte landed.
* ``TransferNotify.msg`` is a ``str`` that crosses the wire as UTF-8; arbitrary payload
  bytes are carried losslessly by mapping each byte to one code point (latin-1).
* A dead peer: the write fails fast (connection refused / broken pipe, rc < 0) and the
  transfer is FAILED. A hung peer blocks the worker inside the engine until Mooncake's
  own timeout (``MC_TRANSFER_TIMEOUT``): at pdwire's ``transfer_timeout_s`` the transfer
  is cancelled, but Mooncake cannot stop a chunk in flight, so it is reported FAILED only
  once that chunk returned (later jobs wait behind it).
* Cancelling raises the job's flag and returns: a queued job is skipped, a running one
  stops before its next chunk.
"""

from __future__ import annotations

from typing import Any

from pdwire.runtime.backends.base import (
    DONE,
    Backend,
    BackendUnavailable,
    HostBuffer,
    Notification,
    Peer,
    PeerError,
    PeerMetadata,
    RegistrationError,
    TransferError,
    TransferHandle,
    TransferStatus,
    aligned_zeros,
    batches,
    decode_envelope,
    encode_envelope,
    failed,
)
from pdwire.runtime.backends.worker import Job, JobTransfers, JobWorker
from pdwire.runtime.descriptors import DescriptorTable, Region


def _to_msg(payload: bytes) -> str:
    return payload.decode("latin-1")


def _from_msg(msg: str) -> bytes:
    return msg.encode("latin-1")


class MooncakeBackend(JobTransfers, Backend):
    name = "mooncake"

    def __init__(
        self,
        agent_name: str | None = None,
        transfer_timeout_s: float = 30.0,
        hostname: str = "127.0.0.1",
        max_batch: int = 1024,
    ) -> None:
        super().__init__(agent_name, transfer_timeout_s)
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

        if not 0 < max_batch <= 2048:
            raise TransferError(f"max_batch must be in 1..2048 (Mooncake's TCP queue limit), got {max_batch}")
        self.max_batch = max_batch
        self._notify_cls = TransferNotify
        self._write_op = TransferOpcode.Write
        self._engine = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise BackendUnavailable(
                f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, tcp) -> {rc}"
            )
        self.session_name = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._buffers: list[HostBuffer] = []
        self._worker = JobWorker(f"pdwire-mooncake-{self.agent_name}")

    def _allocate(self, name: str, nbytes: int) -> HostBuffer:
        buf = HostBuffer(name, aligned_zeros(nbytes))
        self._buffers.append(buf)
        return buf

    def _register(self, regions: list[Region]) -> None:
        for r in regions:
            rc = self._engine.register_memory(r.base, r.length)
            if rc != 0:
                raise RegistrationError(f"Mooncake register_memory({r.name!r}, {r.length} bytes) -> {rc}")
            self._registered.append(r.base)

    def _local_metadata(self) -> PeerMetadata:
        env = encode_envelope(self.name, self.agent_name, self.regions, self.session_name.encode())
        return PeerMetadata(self.agent_name, env)

    def _add_peer(self, metadata: PeerMetadata) -> Peer:
        md = decode_envelope(self.name, metadata)
        session = md.engine.decode()
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit():
            raise PeerError(f"peer {md.agent_name!r} published Mooncake session {session!r}, not host:port")
        return Peer(md.agent_name, md.regions, md.pid, session)

    def _remove_peer(self, peer: Peer) -> None:
        pass  # Mooncake keeps no per-peer state we own; its connections are pooled internally

    def _post(self, handle: TransferHandle, table: DescriptorTable, notification: bytes) -> None:
        session: str = handle.peer.engine
        src, dst, length = table.src_addr.tolist(), table.dst_addr.tolist(), table.length.tolist()
        chunks = batches(len(src), self.max_batch)
        notify = self._notify_cls(self.agent_name, _to_msg(notification))
        engine, op = self._engine, self._write_op

        def run(job: Job) -> TransferStatus:
            for k, (a, b) in enumerate(chunks):
                if job.cancel:
                    return failed("cancelled")
                if k < len(chunks) - 1:
                    rc = engine.batch_transfer_sync_write(session, src[a:b], dst[a:b], length[a:b])
                else:
                    rc = engine.batch_transfer_sync(session, src[a:b], dst[a:b], length[a:b], op, notify)
                if rc != 0:
                    return failed(f"Mooncake write of rows [{a}, {b}) to {session} returned {rc}")
            return DONE

        handle.engine = self._worker.submit(run)

    def _receive_notifications(self) -> list[Notification]:
        got: list[Any] = self._engine.get_notifies()
        return [Notification(str(n.name), _from_msg(n.msg)) for n in got]

    def _close(self) -> None:
        self._worker.stop()
        for base in self._registered:
            self._engine.unregister_memory(base)
        self._registered.clear()
        self._buffers.clear()
        del self._engine
