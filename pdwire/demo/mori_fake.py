"""An in-process fake of MoRI's IO engine API (``mori.io``), for hosts without MoRI: backend ``mori-fake``.

MoRI cannot be installed on this project's machines, so the MoRI adapter
(:mod:`pdwire.runtime.backends.mori`) is tested against this fake, registered by
:func:`pdwire.demo.register_mori_fake`. It mirrors the calls the adapter makes with their
shapes and semantics: ``batch_write`` offsets are relative to each descriptor's base and
completion comes through statuses the caller waits on; ``EngineDesc.pack()`` and
``MemoryDesc.pack()`` are msgpack arrays.

What differs: writes execute as ``memmove`` on a worker thread, into the peer's memory mapped
through ``/dev/shm`` (so registered memory must live in a ``/dev/shm`` mapping, and
``ipcHandle`` carries that file's path and offset instead of a GPU IPC handle). A remote
engine whose process is gone makes its writes fail. CPU memory only; inbound-status popping is
not faked.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Self

import msgspec
import numpy as np

from pdwire.runtime.backends import shm
from pdwire.runtime.backends.jobs import Job, JobThread
from pdwire.runtime.backends.metadata import pid_alive
from pdwire.runtime.backends.mori import MoriBackend
from pdwire.runtime.backends.values import DONE, HostBuffer, PollResult


class MemoryLocationType(IntEnum):
    CPU = 0
    GPU = 1


class BackendType(IntEnum):
    RDMA = 0
    TCP = 1


class StatusCode(IntEnum):
    INIT = 0
    IN_PROGRESS = 1
    SUCCESS = 2
    ERR_INVALID_ARGS = 3
    ERR_NOT_FOUND = 4
    ERR_BAD_STATE = 5


@dataclass
class IOEngineConfig:
    host: str = "127.0.0.1"
    port: int = 0


class _Packed(msgspec.Struct, frozen=True, array_like=True):
    """A descriptor that packs as a msgpack array of its fields, in order, as MoRI's do."""

    def pack(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def unpack(cls, blob: bytes) -> Self:
        return msgspec.msgpack.decode(blob, type=cls)


class EngineDesc(_Packed, frozen=True):
    key: str
    hostname: str
    host: str
    port: int
    pid: int


class MemoryDesc(_Packed, frozen=True):
    engine_key: str
    id: int
    device_id: int
    data: int
    size: int
    loc: MemoryLocationType
    ipc_handle: bytes


class TransferStatus:
    def __init__(self) -> None:
        self._code = StatusCode.INIT
        self._message = ""
        self._done = threading.Event()

    def Code(self) -> StatusCode:
        return self._code

    def Message(self) -> str:
        return self._message

    def InProgress(self) -> bool:
        return self._code in (StatusCode.INIT, StatusCode.IN_PROGRESS)

    def Succeeded(self) -> bool:
        return self._code is StatusCode.SUCCESS

    def Failed(self) -> bool:
        return not self.InProgress() and not self.Succeeded()

    def Wait(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def _finish(self, code: StatusCode, message: str = "") -> None:
        self._code, self._message = code, message
        self._done.set()


def _shm_location(ptr: int, size: int) -> tuple[str, int]:
    """(path, file offset) of the /dev/shm mapping holding [ptr, ptr+size) in this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip()
            if lo <= ptr and ptr + size <= hi and path.startswith(shm.SHM_DIR + "/"):
                return path, int(parts[2], 16) + (ptr - lo)
    raise ValueError(f"[{ptr:#x}, +{size}) is not inside one /dev/shm mapping (the fake needs shared memory)")


class IOEngine:
    def __init__(self, key: str, config: IOEngineConfig) -> None:
        self._desc = EngineDesc(key, socket.gethostname(), config.host, config.port, os.getpid())
        self._backends: set[BackendType] = set()
        self._remotes: dict[str, EngineDesc] = {}
        self._mems: dict[int, MemoryDesc] = {}
        self._maps: dict[str, shm.Mapping] = {}
        self._ids = itertools.count(1)
        self._uids = itertools.count(1)
        self._lock = threading.Lock()
        self._worker = JobThread(f"mori-fake-{key}")

    def get_engine_desc(self) -> EngineDesc:
        return self._desc

    def create_backend(self, type: BackendType, config: object = None) -> None:
        self._backends.add(type)

    def register_remote_engine(self, desc: EngineDesc) -> None:
        self._remotes[desc.key] = desc

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        self._remotes.pop(desc.key, None)

    def register_memory(self, ptr: int, size: int, device_id: int, loc: MemoryLocationType) -> MemoryDesc:
        if loc is not MemoryLocationType.CPU:
            raise ValueError("the MoRI fake handles CPU memory only")
        path, off = _shm_location(ptr, size)
        ipc = msgspec.msgpack.encode([path, off])
        desc = MemoryDesc(self._desc.key, next(self._ids), device_id, ptr, size, loc, ipc)
        self._mems[desc.id] = desc
        return desc

    def deregister_memory(self, desc: MemoryDesc) -> None:
        self._mems.pop(desc.id, None)

    def allocate_transfer_uid(self) -> int:
        return next(self._uids)

    def _remote_address(self, desc: MemoryDesc) -> int:
        path, off = msgspec.msgpack.decode(desc.ipc_handle)
        with self._lock:
            m = self._maps.get(path)
            if m is None:
                # The whole file: several descriptors (one per region) share one mapping, and
                # the first one seen need not be the one reaching furthest into it.
                m = self._maps[path] = shm.Mapping(path, os.stat(path).st_size, create=False)
        if m.nbytes < off + desc.size:
            raise ValueError(f"{path} is smaller than the descriptor claims")
        return m.address + int(off)

    def batch_write(
        self,
        local_descs: list[MemoryDesc],
        local_offsets: list[list[int]],
        remote_descs: list[MemoryDesc],
        remote_offsets: list[list[int]],
        sizes: list[list[int]],
        uids: list[int],
    ) -> list[TransferStatus]:
        n = len(local_descs)
        if not n == len(local_offsets) == len(remote_descs) == len(remote_offsets) == len(sizes) == len(uids):
            raise ValueError("batch_write: every argument list must have one entry per descriptor pair")
        statuses = []
        for i in range(n):
            st = TransferStatus()
            statuses.append(st)
            err = self._check(local_descs[i], local_offsets[i], remote_descs[i], remote_offsets[i], sizes[i])
            if err:
                st._finish(StatusCode.ERR_INVALID_ARGS, err)
                continue
            st._code = StatusCode.IN_PROGRESS
            self._worker.submit(
                self._writer(
                    st, local_descs[i], local_offsets[i], remote_descs[i], remote_offsets[i], sizes[i]
                )
            )
        return statuses

    def _check(self, ld: MemoryDesc, lo: list[int], rd: MemoryDesc, ro: list[int], sz: list[int]) -> str:
        if ld.id not in self._mems or ld.engine_key != self._desc.key:
            return f"local memory descriptor {ld.id} is not registered with engine {self._desc.key!r}"
        if rd.engine_key not in self._remotes:
            return f"remote engine {rd.engine_key!r} is not registered"
        if not len(lo) == len(ro) == len(sz):
            return "offset and size lists differ in length"
        for a, b, s in zip(lo, ro, sz, strict=True):
            if a < 0 or b < 0 or s <= 0 or a + s > ld.size or b + s > rd.size:
                return f"offsets ({a}, {b}) size {s} exceed descriptors of {ld.size} / {rd.size} bytes"
        return ""

    def _writer(
        self, st: TransferStatus, ld: MemoryDesc, lo: list[int], rd: MemoryDesc, ro: list[int], sz: list[int]
    ) -> Callable[[Job], PollResult]:
        remote = self._remotes[rd.engine_key]

        def run(job: Job) -> PollResult:
            # The worker's own status is irrelevant here: the MoRI status object is the result.
            if not pid_alive(remote.pid):
                st._finish(StatusCode.ERR_BAD_STATE, f"remote engine {remote.key!r} is gone")
                return DONE
            try:
                dst_base = self._remote_address(rd)
            except (OSError, ValueError) as exc:
                st._finish(StatusCode.ERR_NOT_FOUND, f"cannot reach remote memory {rd.id}: {exc}")
                return DONE
            for a, b, s in zip(lo, ro, sz, strict=True):
                ctypes.memmove(dst_base + b, ld.data + a, s)
            if not pid_alive(remote.pid):
                st._finish(StatusCode.ERR_BAD_STATE, f"remote engine {remote.key!r} died during the write")
            else:
                st._finish(StatusCode.SUCCESS)
            return DONE

        return run

    def shutdown(self) -> None:
        """Not in MoRI (its engine is freed by the destructor); the fake stops its thread here."""
        self._worker.stop()
        with self._lock:
            for m in self._maps.values():
                m.close()
            self._maps.clear()


class MoriFakeBackend(MoriBackend):
    """The MoRI adapter over this fake engine, with /dev/shm memory so processes can share it."""

    name = "mori-fake"

    def __init__(
        self,
        agent_name: str | None = None,
        transfer_timeout_s: float = 30.0,
        max_rows: int = 4096,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        shm.reap_dead()
        self._stem = shm.make_stem(os.urandom(4).hex())
        self._maps: list[shm.Mapping] = []
        self._bufs: list[HostBuffer] = []
        engine_api = sys.modules[__name__]  # this module is the fake of ``mori.io``
        super().__init__(
            engine_api,
            agent_name,
            transfer_timeout_s,
            max_rows,
            allocator=self._shm_allocate,
            host=host,
            port=port,
        )

    def _shm_allocate(self, name: str, nbytes: int) -> HostBuffer:
        m = shm.Mapping(f"{self._stem}-{len(self._maps)}-{shm.safe_token(name)}", nbytes, create=True)
        assert m.array is not None
        buf = HostBuffer(name, m.array)
        self._maps.append(m)
        self._bufs.append(buf)
        return buf

    def _close(self) -> None:
        super()._close()
        for m, buf in zip(self._maps, self._bufs, strict=True):
            shm.remove_path(m.path)
            buf.array = np.zeros(0, dtype=np.uint8)
            m.close()
        self._maps.clear()
        self._bufs.clear()
