"""``nixl``: NIXL agents over UCX (DRAM here; VRAM wherever a GPU is present).

Mapping onto NIXL
-----------------
* ``register`` -> ``register_memory(Nx3 [addr, len, dev], "DRAM" | "VRAM")``, one call per
  memory kind (from ``Region.kind``; the device id comes from ``Region.device_id``).
* ``local_metadata`` wraps ``get_agent_metadata()`` (taken *after* the last register, as
  NIXL's metadata carries the registrations); ``add_peer`` -> ``add_remote_agent``.
* ``post`` -> one ``initialize_xfer("WRITE", ...)`` + ``transfer`` per batch. Rows are
  grouped by (src kind, dst kind) because a NIXL descriptor list has one memory type,
  and each group is cut into batches of at most ``max_descs_per_xfer`` rows. When the
  whole table is one batch the notification rides on that WRITE (NIXL delivers it after
  the data). Otherwise the batches go without one and, once every batch reports DONE
  (remote completion under UCX), ``send_notif`` delivers it: still after all bytes.
* Every batch's request is created before the first is started, so a refused ``post``
  has moved nothing. ``poll`` -> ``check_xfer_state``; "ERR" of any batch stops the
  others, and the transfer is FAILED once none is still active.
* ``cancel`` does not release active requests: NIXL 1.5.1 accepts ``release()`` of an
  active request (UCX thread-pool engine) while its bytes and its notification still land
  afterwards, so a successful release confirms nothing. A cancelled transfer sends no
  ``send_notif``; its requests are polled with ``check_xfer_state`` until each is DONE or
  ERR, and only then is the transfer final (FAILED, or DONE if its notification rode on
  a WRITE that completed) and its requests released.
* Repeated grids: :meth:`NixlBackend.post_prepped` takes a table whose every row is one
  fixed-size slot of a region (e.g. a KV page grid); it builds both sides' prepped dlists
  once per (peer, region pair, slot size) with ``prep_xfer_dlist`` and then posts with
  ``make_prepped_xfer`` by slot index, which skips per-request descriptor preparation.

Progress thread: NIXL's Python wrapper starts it with a zero delay, i.e. spinning on a whole
core per agent; this backend builds the agent with ``progress_delay_us`` (default 1000) so the
thread sleeps in poll() on UCX's event fd between events (see ``_progress_delay``).

Set ``UCX_NET_DEVICES=lo`` on a single host and ``NIXL_LOG_LEVEL=WARN`` to quiet logs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from pdwire.runtime.backends.base import (
    DONE,
    PENDING,
    Backend,
    DescriptorError,
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
from pdwire.runtime.descriptors import DescriptorTable, MemoryKind, Region


def _skip_verbs_modules_without_rdma_devices() -> None:
    """Keep UCX from loading its InfiniBand/RDMA-CM modules on a host with no RDMA device.

    NIXL's wheel bundles its own libnl-route; UCX's ib module also pulls in the system
    libibverbs (installed for Mooncake), which loads the system libnl-route. With both
    copies mapped, the process segfaults in libnl's destructor at exit
    (``rtnl_tc_unregister`` from ``_dl_fini``) once a peer has connected. Without an RDMA
    device those modules have nothing to drive, so skipping them loses nothing; on a host
    with one (``/sys/class/infiniband`` not empty) UCX is left alone. An operator's own
    ``UCX_MODULES`` always wins. Must run before UCX is first loaded.
    """
    ib = "/sys/class/infiniband"
    if os.path.isdir(ib) and os.listdir(ib):
        return
    os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")


# The NIXL Python wrapper builds its agent with ``pthrDelay = 0``: the UCX progress thread
# then never sleeps and burns a whole core per agent, even when idle (measured: 0.73-1.0 CPU
# seconds per second on an idle agent; 0.02 with a delay). On a host shared by several
# ranks that spinning starves everything else. A positive delay makes the thread block in
# poll() on the UCX worker's event fd (woken by every arriving event) with the delay only
# as a fallback wake-up period. ``progress_delay_us`` (or PDWIRE_NIXL_PROGRESS_DELAY_US)
# overrides it; 0 restores NIXL's spinning thread.
DEFAULT_PROGRESS_DELAY_US = 1000


# UCX engine parameters this backend passes unless the caller's ``ucx_params`` names them.
# ``num_threads`` makes NIXL use its thread-pool UCX engine: a posted request is split over
# that many extra worker threads, so ``transfer()`` returns at once instead of copying the
# whole request inline on the caller's thread (on one host UCX writes with cma, i.e.
# process_vm_writev, which completes synchronously), and many small descriptors go about
# 1.7x faster on 2 cores (4 KiB scattered rows; large rows unchanged). Error handling stays
# "peer" (dead peers must fail transfers); "none" measured no faster here, since puts use
# cma either way and only the notification path changes.
DEFAULT_UCX_PARAMS: dict[str, str] = {"num_threads": "2"}


@contextlib.contextmanager
def _progress_delay(api: Any, delay_us: int) -> Iterator[None]:
    """Make ``nixl_agent(...)`` built inside this block use ``pthrDelay = delay_us``.

    The wrapper offers no option for it, so its config class is swapped for a subclass whose
    ``pthrDelay`` setter stores ``delay_us`` instead. Left untouched (the wrapper's own 0)
    when the binding does not look as expected.
    """
    bind: Any = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    prop = getattr(base, "pthrDelay", None) if base is not None else None
    if not isinstance(base, type) or not isinstance(prop, property) or prop.fset is None:
        yield
        return

    def _set(self: Any, _value: int) -> None:
        assert prop is not None and prop.fset is not None
        prop.fset(self, delay_us)

    patched = type("nixlAgentConfig", (base,), {"pthrDelay": property(prop.fget, _set)})
    bind.nixlAgentConfig = patched
    try:
        yield
    finally:
        bind.nixlAgentConfig = base


@dataclass(frozen=True, eq=False)
class _RegionInfo:
    """Per-region columns a post needs, built once per region list instead of per post."""

    regions: Sequence[Region]
    n: int
    vram: npt.NDArray[np.bool_]
    dev: npt.NDArray[np.uint64]
    any_vram: bool
    any_dev: bool

    @classmethod
    def of(cls, regions: Sequence[Region]) -> _RegionInfo:
        n = len(regions)
        vram = np.fromiter((r.kind is MemoryKind.VRAM for r in regions), dtype=bool, count=n)
        dev = np.fromiter((r.device_id for r in regions), dtype=np.uint64, count=n)
        return cls(regions, n, vram, dev, bool(vram.any()), bool(dev.any()))


# What this backend knows of one NIXL request (one batch of a transfer).
_NEW = "NEW"  # created, not started
_PROC = "PROC"  # started and not seen to end: NIXL may be moving its bytes
_DONE = "DONE"
_ERR = "ERR"
_GONE = "GONE"  # never started (a batch before it was refused): released at once


@dataclass
class _Xfer:
    reqs: list[Any]  # nixl_xfer_handle per batch
    notification: bytes
    notify_after: bool  # send_notif once every batch is DONE
    states: list[str] = field(default_factory=list)
    error: str = ""  # the first engine failure; reported once no request is active
    stopping: bool = False  # cancelled: no send_notif any more
    status: TransferStatus = field(default=PENDING)

    def __post_init__(self) -> None:
        self.states = [_NEW] * len(self.reqs)

    @property
    def active(self) -> bool:
        return _PROC in self.states

    def record(self, i: int, state: str, call: str, peer: str) -> None:
        """Request ``i``'s state as NIXL's ``call`` reported it; the first error explains the
        transfer (its text is built only then: this runs on every poll)."""
        if state.startswith(_ERR):
            self.states[i] = _ERR
            self.error = self.error or f"NIXL {call} {state} for a WRITE to {peer!r}"
        else:
            self.states[i] = _DONE if state == _DONE else _PROC


class NixlBackend(Backend):
    name = "nixl"
    supports_vram = True
    peers_keyed_by_name = True

    def __init__(
        self,
        agent_name: str | None = None,
        transfer_timeout_s: float = 30.0,
        max_descs_per_xfer: int = 32768,
        ucx_params: dict[str, str] | None = None,
        progress_delay_us: int | None = None,
    ) -> None:
        super().__init__(agent_name, transfer_timeout_s)
        _skip_verbs_modules_without_rdma_devices()
        import nixl._api as nixl_api
        from nixl._api import nixl_agent, nixl_agent_config

        if max_descs_per_xfer <= 0:
            raise TransferError(f"max_descs_per_xfer must be positive, got {max_descs_per_xfer}")
        self.max_descs = max_descs_per_xfer
        # The progress thread is required: without it a WRITE between agents never completes.
        cfg = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[])
        if progress_delay_us is None:
            env = os.environ.get("PDWIRE_NIXL_PROGRESS_DELAY_US", "")
            progress_delay_us = int(env) if env.strip() else DEFAULT_PROGRESS_DELAY_US
        if progress_delay_us < 0:
            raise TransferError(f"progress_delay_us must be >= 0, got {progress_delay_us}")
        # nixl._api re-exports the CUDA-flavoured module's names; patch where the class lives.
        impl = sys.modules.get(nixl_agent.__module__, nixl_api)
        with _progress_delay(impl, progress_delay_us):
            self._agent = nixl_agent(self.agent_name, cfg)
        self._agent.create_backend("UCX", {**DEFAULT_UCX_PARAMS, **(ucx_params or {})})
        self._reg_descs: list[Any] = []
        self._buffers: list[HostBuffer] = []
        # (peer, src region, dst region, slot size) -> prepped dlists; keyed by the Peer object,
        # not its name, so a peer replaced under the same name never reuses stale dlists
        self._prepped: dict[tuple[Peer, int, int, int], tuple[Any, Any]] = {}
        self._orphans: list[Any] = []  # request handles NIXL could not release yet
        self._local_cols: _RegionInfo | None = None

    # ---- memory
    def _allocate(self, name: str, nbytes: int) -> HostBuffer:
        buf = HostBuffer(name, aligned_zeros(nbytes))
        self._buffers.append(buf)
        return buf

    def _register(self, regions: list[Region]) -> None:
        for kind in MemoryKind:
            rows = [(r.base, r.length, r.device_id) for r in regions if r.kind is kind]
            if not rows:
                continue
            try:
                descs = self._agent.register_memory(np.array(rows, dtype=np.uint64), kind.value)
            except Exception as exc:
                raise RegistrationError(
                    f"NIXL refused to register {len(rows)} {kind.value} regions: {exc}"
                ) from None
            self._reg_descs.append(descs)

    def _local_metadata(self) -> PeerMetadata:
        engine = bytes(self._agent.get_agent_metadata())
        return PeerMetadata(
            self.agent_name, encode_envelope(self.name, self.agent_name, self.regions, engine)
        )

    # ---- peers
    def _add_peer(self, metadata: PeerMetadata) -> Peer:
        md = decode_envelope(self.name, metadata)
        try:
            name = self._agent.add_remote_agent(md.engine)
        except Exception as exc:
            raise PeerError(f"NIXL rejected the metadata of {md.agent_name!r}: {exc}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != md.agent_name:
            raise PeerError(f"NIXL metadata names agent {name!r}, envelope says {md.agent_name!r}")
        return Peer(md.agent_name, md.regions, md.pid)

    def _remove_peer(self, peer: Peer) -> None:
        for key in [k for k in self._prepped if k[0] is peer]:
            for h in self._prepped.pop(key):
                self._safe_release(h)
        if peer.agent_name in self._peers:
            # Replaced by a newer peer of the same name while its transfers were stopping:
            # NIXL's entry for the name is the newer peer's now.
            return
        # A dead peer may already be disconnected; the name is forgotten either way.
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(peer.agent_name)

    # ---- transfers
    def _local_info(self) -> _RegionInfo:
        # Regions are only ever appended, so the count identifies the list's state.
        if self._local_cols is None or self._local_cols.n != len(self.regions):
            self._local_cols = _RegionInfo.of(self.regions)
        return self._local_cols

    @staticmethod
    def _peer_info(peer: Peer) -> _RegionInfo:
        info = peer.engine
        if not isinstance(info, _RegionInfo) or info.regions is not peer.regions:
            info = peer.engine = _RegionInfo.of(peer.regions)
        return info

    def _group_rows(
        self, table: DescriptorTable, src: _RegionInfo, dst: _RegionInfo
    ) -> list[tuple[str, str, npt.NDArray[np.intp] | None]]:
        """(src kind, dst kind, row indices) per memory-kind pair; ``None`` means every row."""
        if not src.any_vram and not dst.any_vram:
            return [("DRAM", "DRAM", None)]
        code = src.vram[table.src_region].astype(np.uint8) * 2 + dst.vram[table.dst_region].astype(np.uint8)
        groups: list[tuple[str, str, npt.NDArray[np.intp] | None]] = []
        for c in np.unique(code):
            rows = np.flatnonzero(code == c)
            groups.append(("VRAM" if c & 2 else "DRAM", "VRAM" if c & 1 else "DRAM", rows))
        return groups

    @staticmethod
    def _rows3(
        addr: npt.NDArray[np.uint64],
        table: DescriptorTable,
        region: npt.NDArray[np.uint32],
        info: _RegionInfo,
    ) -> npt.NDArray[np.uint64]:
        out = np.empty((len(addr), 3), dtype=np.uint64)
        out[:, 0] = addr
        out[:, 1] = table.length
        out[:, 2] = info.dev[region] if info.any_dev else 0
        return out

    def _post(self, handle: TransferHandle, table: DescriptorTable, notification: bytes) -> None:
        peer = handle.peer
        linfo, pinfo = self._local_info(), self._peer_info(peer)
        src3 = self._rows3(table.src_addr, table, table.src_region, linfo)
        dst3 = self._rows3(table.dst_addr, table, table.dst_region, pinfo)
        plan: list[tuple[str, str, npt.NDArray[np.uint64], npt.NDArray[np.uint64]]] = []
        for sk, dk, rows in self._group_rows(table, linfo, pinfo):
            s3, d3 = (src3, dst3) if rows is None else (src3[rows], dst3[rows])
            plan.extend((sk, dk, s3[a:b], d3[a:b]) for a, b in batches(len(s3), self.max_descs))
        single = len(plan) == 1
        reqs: list[Any] = []
        try:
            for sk, dk, s3, d3 in plan:
                src = self._agent.get_xfer_descs(s3, sk)
                dst = self._agent.get_xfer_descs(d3, dk)
                note = notification if single else b""
                reqs.append(self._agent.initialize_xfer("WRITE", src, dst, peer.agent_name, note))
        except Exception as exc:
            for req in reqs:  # none was started: nothing moved
                self._safe_release(req)
            raise TransferError(f"NIXL could not create a WRITE to {peer.agent_name!r}: {exc}") from None
        handle.engine = x = _Xfer(reqs, notification, notify_after=not single)
        self._start(x, peer.agent_name)

    def _start(self, x: _Xfer, peer_name: str) -> None:
        """Start every request; after the first refusal the rest are not started (the
        transfer is FAILED once the started ones ended)."""
        for i, req in enumerate(x.reqs):
            if x.error:
                x.states[i] = _GONE
                self._safe_release(req)
                continue
            try:
                state = self._agent.transfer(req)
            except Exception as exc:
                state = f"ERR (transfer() raised: {exc})"
            x.record(i, state, "transfer() returned", peer_name)

    def post_prepped(
        self, peer: Peer, table: DescriptorTable, notification: bytes, slot_bytes: int
    ) -> TransferHandle:
        """Post a table whose rows are whole ``slot_bytes`` slots of one src and one dst region.

        The prepped dlists (every slot of the src region locally, of the dst region on the
        peer) are built once and reused by every later call with the same key, which is
        what pays off for a fixed KV page grid. Rows must be slot-aligned, else
        DescriptorError.
        """
        h = self._admit(peer, table, notification)
        if slot_bytes <= 0:
            raise DescriptorError(f"post_prepped: slot size must be positive, got {slot_bytes}")
        sreg, dreg = int(table.src_region[0]), int(table.dst_region[0])
        if (table.src_region != sreg).any() or (table.dst_region != dreg).any():
            raise DescriptorError("post_prepped: every row must use the same src and dst region")
        if (table.length != slot_bytes).any():
            raise DescriptorError(f"post_prepped: every row must be exactly {slot_bytes} bytes")
        sr, dr = self.regions[sreg], peer.regions[dreg]
        s_off = table.src_addr - np.uint64(sr.base)
        d_off = table.dst_addr - np.uint64(dr.base)
        if (s_off % np.uint64(slot_bytes)).any() or (d_off % np.uint64(slot_bytes)).any():
            raise DescriptorError(f"post_prepped: rows are not aligned to {slot_bytes}-byte slots")
        key = (peer, sreg, dreg, slot_bytes)
        if key not in self._prepped:
            self._prepped[key] = (
                self._prep(sr, slot_bytes, "NIXL_INIT_AGENT"),
                self._prep(dr, slot_bytes, peer.agent_name),
            )
        lh, rh = self._prepped[key]
        s_idx = (s_off // np.uint64(slot_bytes)).astype(np.int32)
        d_idx = (d_off // np.uint64(slot_bytes)).astype(np.int32)
        try:
            req = self._agent.make_prepped_xfer("WRITE", lh, s_idx, rh, d_idx, bytes(notification))
        except Exception as exc:
            raise TransferError(f"NIXL make_prepped_xfer to {peer.agent_name!r} failed: {exc}") from None
        h.engine = x = _Xfer([req], notification, notify_after=False)
        self._start(x, peer.agent_name)
        self._handles[h.id] = h
        return h

    def _prep(self, r: Region, slot: int, agent: str) -> Any:
        n = r.length // slot
        rows = np.empty((n, 3), dtype=np.uint64)
        rows[:, 0] = np.uint64(r.base) + np.arange(n, dtype=np.uint64) * np.uint64(slot)
        rows[:, 1] = slot
        rows[:, 2] = r.device_id
        return self._agent.prep_xfer_dlist(agent, rows, r.kind.value)

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        x: _Xfer = handle.engine
        if x.status.finished:
            return x.status
        for i, req in enumerate(x.reqs):
            if x.states[i] != _PROC:
                continue
            try:
                state = self._agent.check_xfer_state(req)
            except Exception as exc:
                state = f"ERR ({exc})"
            x.record(i, state, "reported", handle.peer.agent_name)
        if x.active:
            return PENDING  # after an error or a cancel too: final only once no batch is active
        if x.error:
            x.status = failed(x.error)
        elif x.notify_after and x.stopping:
            x.status = failed("cancelled")  # every batch landed, but the peer is not told
        elif x.notify_after:
            try:
                self._agent.send_notif(handle.peer.agent_name, x.notification)
                x.status = DONE
            except Exception as exc:
                x.status = failed(f"NIXL send_notif to {handle.peer.agent_name!r} failed: {exc}")
        else:
            x.status = DONE  # the notification rode on the WRITE, which completed
        return x.status

    def _safe_release(self, h: Any) -> None:
        try:
            h.release()
        except Exception:
            self._orphans.append(h)  # NIXL would not free it: retry at close

    def _cancel(self, handle: TransferHandle) -> None:
        # Nothing more is sent for this transfer; its active requests are waited out, not
        # released (see the module notes: a released active request keeps writing).
        x: _Xfer = handle.engine
        x.stopping = True

    def _release(self, handle: TransferHandle) -> None:
        x: _Xfer = handle.engine
        for req, state in zip(x.reqs, x.states, strict=True):
            if state != _GONE:
                self._safe_release(req)
        handle.engine = None

    def _receive_notifications(self) -> list[Notification]:
        got = self._agent.get_new_notifs()
        return [Notification(str(peer), bytes(m)) for peer, msgs in got.items() for m in msgs]

    def _close(self) -> None:
        for hs in self._prepped.values():
            for h in hs:
                self._safe_release(h)
        self._prepped.clear()
        for h in self._orphans:
            # NIXL frees leaked handles itself when the agent is destroyed.
            with contextlib.suppress(Exception):
                h.release()
        self._orphans.clear()
        for descs in self._reg_descs:
            # The agent below is dropped anyway; nothing more can be done on failure.
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(descs)
        self._reg_descs.clear()
        self._buffers.clear()
        del self._agent
