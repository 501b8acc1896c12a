"""``mooncake``: Mooncake's TransferEngine over TCP with the P2P handshake.

Mapping onto Mooncake (measurements and the reasons: docs/fencing.md)
---------------------------------------------------------------------
* The engine is ``initialize(hostname, "P2PHANDSHAKE", protocol, device_name)``; peers know it
  as ``"<hostname>:<rpc port>"`` (carried in the metadata envelope), so ``hostname`` is the
  address this engine *advertises* (its listeners bind every interface). Adding a peer connects
  to its session and checks that the engine answering there holds the peer's memory, so a wrong
  advertised address fails at the handshake with a :class:`PeerError` naming it.
* ``register`` -> ``register_memory(addr, len)`` per region (DRAM; this wheel has no CUDA).
* ``post`` queues one job on the peer's ``threads_per_peer`` workers (Mooncake's calls block).
  The job writes chunks of at most ``max_batch`` rows with ``batch_transfer_sync_write`` and the
  *last* with ``batch_transfer_sync(..., Write, TransferNotify(agent_name, payload))``, so a
  received notification means every byte landed. The payload crosses as latin-1 text (one code
  point per byte). Mooncake's TCP queue refuses a batch past
  ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` descriptors: the backend raises that default to
  ``threads_per_peer * max_batch`` unless the variable is set.
* ``transfer_timeout_s`` counts from when a worker started the job. Cancelling raises the job's
  flag: a queued job is skipped, a running one stops before its next chunk (Mooncake cannot stop
  a chunk in flight, so a hung peer's transfer is FAILED once that chunk returned).

Mooncake's FAILED does not mean its writes stopped (after a link cut it still wrote into the
target once the link came back): ``final_states_fence`` is False and a target revokes a Mooncake
initiator instead (its TCP server checks each request's address against its registrations, and
a body already being received lands in the remapped junk pages). A ``TransferNotify`` whose send
fails is logged and the batch still reported done: ``notifications_reliable`` is False.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from pdwire.runtime.backends.contract import Backend, batches
from pdwire.runtime.backends.errors import BackendUnavailable, PeerError, RegistrationError, TransferError
from pdwire.runtime.backends.jobs import Job, JobThread, JobTransfers
from pdwire.runtime.backends.metadata import decode_envelope, encode_envelope
from pdwire.runtime.backends.values import (
    DONE,
    EngineNotification,
    Peer,
    PeerMetadata,
    PollResult,
    TransferHandle,
    failed,
)
from pdwire.runtime.backends.wakeup import Waker
from pdwire.runtime.descriptors import DescriptorTable, Region


@dataclass(eq=False)
class _Remote:
    session: str  # "<host>:<rpc port>", Mooncake's name for the peer
    worker: JobThread


class MooncakeBackend(JobTransfers, Backend):
    name = "mooncake"
    final_states_fence = False  # measured: writes land after a FAILED (see the module notes)
    notifications_reliable = False  # a notify it cannot send (link down) is logged, the batch reported done
    wakes_on_completion = True  # batches run on our job threads, which wake the owner (notifications do not)

    OPTION_DOCS: ClassVar[dict[str, str]] = {
        "hostname": "the address peers reach this engine at; Mooncake advertises it (its listeners "
        "bind every interface whatever it says); 127.0.0.1 serves one host only",
        "protocol": "Mooncake transport: tcp (this wheel) or rdma",
        "device_name": "RDMA devices for protocol rdma (e.g. mlx5_0,mlx5_1); empty: Mooncake picks",
        "max_batch": "descriptors per Mooncake batch (1..2048: its TCP queue refuses more)",
        "connect_timeout_s": "how long adding a peer may wait to reach its advertised session",
        "threads_per_peer": "worker threads per peer: transfers to one peer run side by side, "
        "and a stuck peer holds up no other",
    }

    def __init__(
        self,
        agent_name: str | None = None,
        transfer_timeout_s: float = 30.0,
        hostname: str = "127.0.0.1",
        max_batch: int = 1024,
        protocol: str = "tcp",
        device_name: str = "",
        connect_timeout_s: float = 5.0,
        threads_per_peer: int = 2,
    ) -> None:
        super().__init__(agent_name, transfer_timeout_s)
        if not 0 < max_batch <= 2048:
            raise TransferError(f"max_batch must be in 1..2048 (Mooncake's TCP queue limit), got {max_batch}")
        if threads_per_peer < 1:
            raise TransferError(f"threads_per_peer must be at least 1, got {threads_per_peer}")
        # Read by Mooncake's TCP transport when the engine is created: room for every worker's chunk.
        queued = min(65535, threads_per_peer * max_batch)
        os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", str(queued))
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

        self.max_batch = max_batch
        self.threads_per_peer = threads_per_peer
        self._notify_cls = TransferNotify
        self._write_op = TransferOpcode.Write
        self._engine = TransferEngine()
        self.connect_timeout_s = connect_timeout_s
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise BackendUnavailable(
                f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol}, "
                f"{device_name!r}) -> {rc}"
            )
        self.session_name = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._workers: list[JobThread] = []  # every peer's, stopped at close
        self._waker = Waker()
        self._wakers = (self._waker,)

    def _register(self, regions: list[Region]) -> None:
        self._registered.extend(self._register_bases(regions))

    def _register_bases(self, regions: list[Region]) -> list[int]:
        done: list[int] = []
        for r in regions:
            rc = self._engine.register_memory(r.base, r.length)
            if rc != 0:
                for base in done:  # all or nothing
                    self._engine.unregister_memory(base)
                raise RegistrationError(f"Mooncake register_memory({r.name!r}, {r.length} bytes) -> {rc}")
            done.append(r.base)
        return done

    def _register_window(self, regions: list[Region]) -> Any:
        return self._register_bases(regions)

    def _unregister_window(self, token: Any) -> None:
        # From now on Mooncake's server refuses requests naming the window (it checks each
        # request's address when it reads the header); a body it is already receiving lands
        # in the junk pages the window is remapped to next.
        for base in token:
            self._engine.unregister_memory(base)

    def _local_metadata(self, window: list[int] | None) -> PeerMetadata:
        extra = {"window": window} if window else None
        env = encode_envelope(self.name, self.agent_name, self.regions, self.session_name.encode(), extra)
        return PeerMetadata(self.agent_name, env)

    def _add_peer(self, metadata: PeerMetadata) -> Peer:
        md = decode_envelope(self.name, metadata)
        session = md.engine.decode()
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit():
            raise PeerError(f"peer {md.agent_name!r} published Mooncake session {session!r}, not host:port")
        self._check_reachable(md.agent_name, session, host.strip("[]"), int(port), md.regions)
        worker = JobThread(f"pdwire-mooncake-{md.agent_name}"[:60], self.threads_per_peer, self._waker.set)
        self._workers.append(worker)
        return Peer(md.agent_name, md.regions, md.pid, _Remote(session, worker), dst_delta=md.window)

    def _check_reachable(
        self, agent: str, session: str, host: str, port: int, regions: tuple[Region, ...]
    ) -> None:
        """Fail now, naming the address, when the peer's advertised session is not this peer.

        Mooncake accepts any session name and only fails at the first write (rc -1), so adding
        a peer connects to the session and asks its engine for its first buffer: the answer
        must be one of the peer's regions. A session Mooncake advertised as 127.0.0.1 from
        another host is refused, or answered by some other engine, and is caught here.
        """
        why = ""
        try:
            socket.create_connection((host, port), timeout=self.connect_timeout_s).close()
        except OSError as exc:
            why = f"cannot connect ({exc})"
        if not why and regions:
            first = self._first_buffer(session)
            if first is None:
                why = f"its Mooncake engine did not answer within {self.connect_timeout_s:g} s"
            elif first == 0:
                why = "no Mooncake engine answered there"
            elif first not in {r.base for r in regions}:
                why = f"the engine there is another one (its first buffer is at {first:#x})"
        if why:
            raise PeerError(
                f"Mooncake session {session} advertised by {agent!r} is not reachable from this host: "
                f"{why}. The peer must set the mooncake backend option hostname= to an address "
                "this host reaches"
            )

    def _first_buffer(self, session: str) -> int | None:
        """The first buffer address of the engine at ``session``; None when it does not answer
        within ``connect_timeout_s``. Mooncake's call can block for tens of seconds (seen while
        its connections recover after a cut link), and adding a peer runs on the rank's loop,
        which must not stall for every other peer; a call that times out finishes on its own
        thread and its answer is dropped."""
        answer: list[int | BaseException] = []

        def ask() -> None:
            try:
                answer.append(int(self._engine.get_first_buffer_address(session)))
            except BaseException as exc:  # handed to the caller's thread
                answer.append(exc)

        asker = threading.Thread(target=ask, name="pdwire-mooncake-probe", daemon=True)
        asker.start()
        asker.join(self.connect_timeout_s)
        if not answer:
            return None
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]

    def _remove_peer(self, peer: Peer) -> None:
        # None of its transfers can still run (the base class waits for that): the threads are idle.
        remote: _Remote = peer.private
        remote.worker.stop()
        self._workers.remove(remote.worker)

    def _submit(self, handle: TransferHandle, run: Any) -> Job:
        remote: _Remote = handle.peer.private
        return remote.worker.submit(run)

    def _post(self, handle: TransferHandle, table: DescriptorTable, notification: bytes) -> None:
        session = handle.peer.private.session
        dst_addr = handle.peer.engine_dst(table.dst_addr, table.dst_region)
        src, dst, length = table.src_addr.tolist(), dst_addr.tolist(), table.length.tolist()
        chunks = batches(len(src), self.max_batch)
        notify = self._notify_cls(self.agent_name, notification.decode("latin-1"))
        engine, op = self._engine, self._write_op

        def run(job: Job) -> PollResult:
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

        handle.private = self._submit(handle, run)

    def _receive_notifications(self) -> list[EngineNotification]:
        got: list[Any] = self._engine.get_notifies()
        return [EngineNotification(str(n.name), n.msg.encode("latin-1")) for n in got]

    def _close(self) -> None:
        for worker in self._workers:  # a thread still inside an engine call is left to end alone
            worker.stop(timeout_s=1.0)
        self._workers.clear()
        self._waker.close()
        for base in self._registered:
            self._engine.unregister_memory(base)
        self._registered.clear()
        del self._engine
