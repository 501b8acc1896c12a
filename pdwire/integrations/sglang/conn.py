"""pdwire's SGLang transfer backend: manager, sender, receiver and bootstrap server.

SGLang's schedulers drive a transfer backend through four classes
(``sglang.srt.disaggregation.base.conn``); these implement them over pdwire's engine-facing
runtime (``pdwire.runtime.engine``) alone. :class:`PdwireKVManager` (one per scheduler rank)
runs a pdwire worker on a ``WorkerThread`` (the scheduler thread only queues calls and reads
statuses, it never waits on a transfer) and meets its peers through SGLang's own bootstrap
server (``PUT``/``GET /route``); :class:`PdwireKVSender` and :class:`PdwireKVReceiver` are
one request each; ``is_abort_release_safe`` is pdwire's fence (a failed room's pages are
reusable once every prefill rank that could write them stopped). docs/sglang.md tells how
each maps onto SGLang, the environment variables and what is refused.

pdwire peers only talk to pdwire peers (ZMQ refuses another backend's socket pairing and the
handshake times out naming the endpoint); the frames today's backends send are read by
pdwire's SGLang profile (``pdwire.wire.sglang``, ``pdwire inspect``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import requests
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    KVTransferError,
    PrefillServerInfo,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

import pdwire.runtime.engine as pd
from pdwire.integrations.sglang.backend_options import advertised_host, rank_backend_options
from pdwire.integrations.sglang.memory import (
    Geometry,
    KVArgsError,
    fill_decode_heads,
    fill_layer_ids,
    missing_pp_layer_ids,
    pool_refusal,
    rank_memory,
    state_kinds,
)

logger = logging.getLogger(__name__)

_POLL = {
    pd.Status.FAILED: KVPoll.Failed,
    pd.Status.BOOTSTRAPPING: KVPoll.Bootstrapping,
    pd.Status.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    pd.Status.TRANSFERRING: KVPoll.Transferring,
    pd.Status.SUCCESS: KVPoll.Success,
}
# state kinds whose request indices SGLang computes from the decode prefix (window or suffix)
_PREFIX_DEPENDENT = {"swa", "dsa", "nsa", "minimax_index_k", "block_scale_swa"}


class PdwireKVBootstrapServer(CommonKVBootstrapServer):  # type: ignore[misc]
    """SGLang's own bootstrap server (``/route``, ``/register_dp_rank``, ``/query_dp_ranks``,
    ``/health``): pdwire prefill ranks register their endpoint there like any backend's."""


def _env_timeout(name: str, default: float) -> float:
    from sglang.srt.environ import envs

    try:
        return float(getattr(envs, name).get())
    except Exception:  # an SGLang build without the variable
        return default


def _memory_kind() -> pd.MemoryKind:
    import torch  # SGLang always has it

    return pd.MemoryKind.VRAM if torch.cuda.is_available() else pd.MemoryKind.DRAM


def _geometry(args: KVArgs, rank: pd.ParallelRank, is_mla: bool) -> Geometry:
    """Where the rank's pools live: device memory of the GPU SGLang placed the rank on
    (``KVArgs.gpu_id``, set by SGLang's ``_init_kv_manager``), or host memory without CUDA."""
    kind = _memory_kind()
    gpu = getattr(args, "gpu_id", None)
    device = int(gpu) if kind is pd.MemoryKind.VRAM and gpu is not None else 0
    if device < 0:
        raise ValueError(f"pdwire: KVArgs.gpu_id must be >= 0, got {gpu}")
    return Geometry(rank, is_mla=is_mla, memory_kind=kind, device_id=device)


def _refuse_staging_buffer() -> None:
    """SGLang's own staging buffer (SGLANG_DISAGG_STAGING_BUFFER) is a protocol of its Mooncake
    and NIXL backends (staging requests and chunk messages between them) that pdwire does not
    speak; pdwire's ranks move another TP size's heads without it. Refused on both sides, before
    SGLang's decode would build its staging handler on a manager that has none."""
    from sglang.srt.environ import envs

    flag = getattr(envs, "SGLANG_DISAGG_STAGING_BUFFER", None)
    if flag is not None and flag.get():
        raise ValueError(
            "pdwire: SGLANG_DISAGG_STAGING_BUFFER (SGLang's staging buffer) is not supported by the "
            "pdwire transfer backend; unset it (pdwire moves heads between TP sizes without it, "
            "see docs/sglang.md)"
        )


class _Driver:
    """Steps the worker on its thread and publishes the statuses the scheduler polls.

    The worker is not thread-safe; after each step the driver copies the status of every room
    a sender watches into a dict the scheduler thread reads without waiting."""

    def __init__(self, worker: Any, watched: dict[int, KVPoll], after_step: Any = None) -> None:
        self.worker = worker
        self.watched = watched
        self.after_step = after_step

    @property
    def poller(self) -> Any:
        return self.worker.poller

    def step(self, timeout_ms: int) -> dict[Any, int]:
        events: dict[Any, int] = self.worker.step(timeout_ms)
        for room in list(self.watched):
            st = self.worker.status(room)
            if st is not None:
                self.watched[room] = _POLL[st]
        if self.after_step is not None:
            self.after_step()
        return events

    def close(self) -> None:
        self.worker.close()


class PdwireKVManager(BaseKVManager):  # type: ignore[misc]
    """One scheduler rank's pdwire worker (see the module notes)."""

    # pdwire's fence: a failed room's destination slots are reported reusable only once every
    # prefill rank that could write into them stopped (DecodeWorker.on_slots_released).
    supports_deferred_decode_kv_release = True
    supports_host_destination = False

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        from sglang.srt.environ import envs
        from sglang.srt.runtime_context import get_disagg, get_parallel, get_serving

        _refuse_staging_buffer()
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        # SGLang's is_mla_backend is False for a HybridLinearKVPool over MLATokenToKVPool
        # (Kimi-Linear: MLA latents + KDA state); the pool's own flag, in KVArgs, says so
        self.is_hybrid_mla_backend = bool(getattr(args, "is_hybrid_mla_backend", False))
        mla = self.is_mla_backend or self.is_hybrid_mla_backend
        self.kv_cache_dtype_str = getattr(args, "kv_cache_dtype_str", "auto")
        parallel = get_parallel()
        self.attn_tp_size = int(parallel.attn_tp_size)
        self.attn_tp_rank = int(parallel.attn_tp_rank)
        self.attn_cp_size = int(parallel.attn_cp_size)
        self.attn_cp_rank = int(parallel.attn_cp_rank)
        self.attn_dp_size = int(parallel.attn_dp_size)
        self.attn_dp_rank = int(parallel.attn_dp_rank)
        self.system_dp_size = int(parallel.dp_size)
        self.system_dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self.pp_size = int(parallel.pp_size)
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.dist_init_addr = parallel.dist_init_addr
        self.load_balance_method = parallel.load_balance_method
        # DP groups as SGLang's bootstrap server files prefill ranks: attention DP groups, or the
        # replicas of a DP controller (one of the two is 1); each its own identity to its peers
        self.num_dp_ranks = int(
            getattr(parallel, "num_dp_ranks", 0) or self.system_dp_size * self.attn_dp_size
        )
        self.dp_group = self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank
        self.force_query_dp_rank = bool(envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get())
        self.bootstrap_host = get_serving().host
        self.bootstrap_port = int(get_disagg().disaggregation_bootstrap_port)
        self.http_port = int(get_serving().port)
        self.enable_deferred_decode_kv_release = bool(
            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
        )
        self.bootstrap_timeout = _env_timeout("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)
        self.waiting_timeout = _env_timeout("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)
        # what the schedulers read outside the base classes
        self.enable_all_cp_ranks_for_transfer = False
        self.transfer_infos: dict[int, Any] = {}
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        self.defer_decode_allocation = False

        from sglang.srt.utils.network import get_local_ip_auto

        # the address peers reach this rank at (its pdwire socket, and its backend's: Mooncake's
        # hostname): SGLANG_HOST_IP, else --host when it is one address, else SGLang's own finding
        self.local_ip = advertised_host(get_serving().host, get_local_ip_auto, os.environ)
        self.kinds = state_kinds(args)
        refused = pool_refusal(args)
        if refused is not None:
            # KVArgs of these pools do not register the whole KV per layer: refused, never moved
            raise ValueError(refused)
        if disaggregation_mode == DisaggregationMode.DECODE and not mla:
            fill_decode_heads(args)
        fill_layer_ids(args)
        # decode in PP stages: each stage reads the prefill stage of its own rank (equal PP, as
        # SGLang's Mooncake backend; another prefill PP size is refused at the handshake), its
        # start layer from the plugin's hook (SGLang's decode KVArgs carry none)
        decode = disaggregation_mode == DisaggregationMode.DECODE
        ptrs = list(getattr(args, "state_data_ptrs", None) or [])
        empty = [f"state[{ci}]:{k}" for ci, k in enumerate(self.kinds) if ci >= len(ptrs) or not ptrs[ci]]
        if self.pp_size > 1 and empty:
            # SGLang registers the component with no buffers when a stage holds none of its layers
            raise ValueError(
                f"pdwire: PP stage {self.pp_rank} of {self.pp_size} holds no layer of {', '.join(empty)}: "
                "pdwire needs every PP stage to hold at least one layer of each state kind"
            )
        missing = missing_pp_layer_ids(args, decode=decode) if self.pp_size > 1 else []
        if missing:
            # a PP stage holds a slice of the layers: without their ids nothing can be placed
            raise ValueError(
                f"pdwire: PP stage {self.pp_rank} of {self.pp_size} cannot place {', '.join(missing)} on "
                "its peers: SGLang's KVArgs do not name those layers and pdwire cannot read them from "
                "this model's pools (see docs/sglang.md, pipeline parallelism); run it without PP"
            )
        self.rank = pd.ParallelRank(
            tp_size=self.attn_tp_size, tp_rank=self.attn_tp_rank, pp_size=self.pp_size, pp_rank=self.pp_rank,
            cp_size=self.attn_cp_size, cp_rank=self.attn_cp_rank, dp_size=self.num_dp_ranks,
            dp_rank=self.dp_group,
        )  # fmt: skip
        try:
            self.memory = rank_memory(args, _geometry(args, self.rank, mla))
        except KVArgsError as exc:
            raise ValueError(f"pdwire cannot describe this rank's memory: {exc}") from exc
        self.model = pd.ModelFingerprint(
            model_name=str(getattr(server_args, "served_model_name", None) or server_args.model_path),
            revision=str(getattr(server_args, "revision", None) or ""),
            dtype=str(self.kv_cache_dtype_str),
            num_layers=0,  # PP stages hold different layers; the name, revision and dtype identify the model
        )
        if "PDWIRE_SGLANG_ENGINE" in os.environ:  # the old name: ignoring it would pick another backend
            raise ValueError(
                "pdwire: PDWIRE_SGLANG_ENGINE is now PDWIRE_SGLANG_BACKEND (nixl, mooncake, local): rename it"
            )
        self.backend_name = os.environ.get("PDWIRE_SGLANG_BACKEND") or None
        # from SGLang's flags (--host, --disaggregation-ib-device), PDWIRE_BACKEND_OPTIONS over them
        self.backend_options = rank_backend_options(
            self.backend_name or pd.default_backend(), self.local_ip,
            getattr(args, "ib_device", None), int(getattr(args, "gpu_id", 0) or 0),
        )  # fmt: skip
        self._lock = threading.Lock()
        # prefill: room -> status, refreshed by the driver; decode: room -> (status, failure)
        self.watched: dict[int, KVPoll] = {}
        self.outcomes: dict[int, tuple[KVPoll, str | None]] = {}
        # decode rooms whose destination slots may be reused (bounded: a success's release can
        # arrive after the scheduler cleared the receiver)
        self.released: dict[int, None] = {}
        self.failures: dict[int, str] = {}
        self._executor: ThreadPoolExecutor | None = None  # made on first use (decode)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._start_prefill()
        elif disaggregation_mode == DisaggregationMode.DECODE:
            self._start_decode()
        else:
            raise ValueError(f"pdwire: unsupported disaggregation mode {disaggregation_mode}")

    # ------------------------------------------------------------------ set-up

    def _engine_id(self, role: str) -> str:
        if os.environ.get("PDWIRE_ENGINE_ID"):
            return f"{os.environ['PDWIRE_ENGINE_ID']}-{role}"
        host = self.dist_init_addr or f"{self.local_ip}:{self.http_port}"
        return f"sglang-{role}@{host}"

    def _start_prefill(self) -> None:
        config = pd.PrefillConfig(
            engine_id=self._engine_id("prefill"), rank=self.rank, model=self.model, backend=self.backend_name,
            backend_options=self.backend_options,
            bind=f"tcp://{self.local_ip}:0", room_timeout_s=self.waiting_timeout + self.bootstrap_timeout,
        )  # fmt: skip
        self.worker: Any = pd.PrefillWorker(config, self.memory, on_released=self._on_released)
        self.thread = pd.WorkerThread(_Driver(self.worker, self.watched), name="pdwire-prefill").start()
        self.register_to_bootstrap()

    def _start_decode(self) -> None:
        from sglang.srt.runtime_context import get_disagg

        if get_disagg().disaggregation_decode_enable_radix_cache and _PREFIX_DEPENDENT & set(self.kinds):
            # SGLang's prefill computes these index lists from the decode prefix length, which a
            # pdwire prefill rank cannot read back from the runtime (see docs/sglang.md)
            raise ValueError(
                "pdwire: --disaggregation-decode-enable-radix-cache with state kinds "
                f"{sorted(_PREFIX_DEPENDENT & set(self.kinds))} is not supported"
            )
        config = pd.DecodeConfig(
            engine_id=self._engine_id("decode"), rank=self.rank, model=self.model, backend=self.backend_name,
            backend_options=self.backend_options,
            room_timeout_s=self.waiting_timeout,
        )  # fmt: skip
        self.worker = pd.DecodeWorker(
            config,
            self.memory,
            on_finished=self._on_finished,
            on_slots_released=self._on_slots_released,
            on_connected=self._on_connected,
        )
        self._groups: dict[tuple[str, int], Future[Any]] = {}
        # handshakes under way: the DP group asked for, and its future (worker thread only)
        self._connecting: dict[pd.PrefillGroup, tuple[int, Future[Any]]] = {}
        self._endpoints: dict[tuple[str, int], list[dict[str, Any]]] = {}
        # engine ids of prefill engines with ranks that take no new room (lost, or revoked and
        # registering again), published by the worker thread after each step
        self._unready: frozenset[str] = frozenset()
        self._peer_marker: tuple[int, ...] | None = None
        self._rechecked: dict[tuple[str, int], float] = {}
        driver = _Driver(self.worker, self.watched, after_step=self._after_step)
        self.thread = pd.WorkerThread(driver, name="pdwire-decode").start()

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future[Any]:
        return self.thread.submit(fn, *args, **kwargs)

    def abort_room(self, room: int, reason: str) -> None:
        self.submit(self.worker.abort, room, reason)

    # ------------------------------------------------------------------ callbacks (worker thread)

    def _on_released(self, room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        if failure is not None:
            self.failures[room] = failure.reason
        self._on_finished(room, status, failure)

    def _on_finished(self, room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        self.outcomes[room] = (_POLL[status], None if failure is None else failure.reason)

    def _on_connected(self, group: pd.PrefillGroup) -> None:
        dp_rank, fut = self._connecting.pop(group, (0, None))
        if fut is None:
            return
        if group.ready and group.dp_rank != dp_rank:
            # the bootstrap server named these ranks for another DP group than they say they are:
            # a room asked from them would be one they never get
            fut.set_exception(pd.HandshakeError(
                f"the ranks the bootstrap server names for prefill DP group {dp_rank} say they are "
                f"DP group {group.dp_rank} ({group}); a prefill built without DP attention support?"
            ))  # fmt: skip
        elif group.ready:
            fut.set_result(group)
        else:
            fut.set_exception(pd.HandshakeError(group.error or f"connecting to {group} failed"))

    def _connect(self, endpoints: list[str], pp_size: int, dp_rank: int, fut: Future[Any]) -> None:
        """On the worker thread: start the handshake with DP group ``dp_rank`` (it runs in the
        worker's steps, never holding the loop); ``fut`` resolves in :meth:`_on_connected`."""
        try:
            group = self.worker.connect(endpoints, prefill_pp=pp_size)
        except Exception as exc:
            fut.set_exception(exc)
            return
        self._connecting[group] = (dp_rank, fut)

    def _after_step(self) -> None:
        """On the worker thread: publish which prefill engines have ranks out of service (read
        again only after a loss, reconnect or revocation, or while some are)."""
        stats = self.worker.stats
        marker = (stats.peers_lost, stats.reconnects, stats.revocations, stats.unrevocable)
        if marker != self._peer_marker or self._unready:
            self._peer_marker = marker
            self._unready = frozenset(str(p.engine_id) for p in self.worker.unready_peers)

    def _on_slots_released(self, room: int) -> None:
        self.released[room] = None
        while len(self.released) > 65536:
            self.released.pop(next(iter(self.released)))

    # ------------------------------------------------------------------ bootstrap (prefill)

    def _bootstrap_url(self) -> str:
        if self.dist_init_addr:
            host = str(self.dist_init_addr).rsplit(":", 1)[0]
        else:
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bootstrap_host, self.bootstrap_host)
        return f"http://{_bracket(host)}:{self.bootstrap_port}/route"

    def register_to_bootstrap(self) -> None:
        """``PUT /route``: this rank's pdwire endpoint in SGLang's bootstrap server."""
        endpoint = self.worker.endpoint  # tcp://HOST:PORT of the worker's ROUTER
        host, port = endpoint[len("tcp://") :].rsplit(":", 1)
        payload = {
            "attn_tp_size": self.attn_tp_size, "attn_tp_rank": self.attn_tp_rank,
            "attn_cp_size": self.attn_cp_size, "attn_cp_rank": self.attn_cp_rank,
            "attn_dp_size": self.attn_dp_size, "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size, "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size, "system_dp_rank": self.system_dp_rank,
            "rank_ip": host.strip("[]"), "rank_port": int(port),
            "page_size": self.kv_args.page_size, "kv_cache_dtype": self.kv_cache_dtype_str,
            "load_balance_method": self.load_balance_method, "prefill_http_port": self.http_port,
        }  # fmt: skip
        url = self._bootstrap_url()
        delay = 0.2
        for attempt in range(10):  # the bootstrap server may still be starting
            try:
                response = requests.put(url, json=payload, timeout=5)
                if response.status_code == 200:
                    return
                raise RuntimeError(f"{url} answered {response.status_code}: {response.text}")
            except requests.RequestException as exc:
                if attempt == 9:
                    raise RuntimeError(
                        f"pdwire: cannot register with the bootstrap server {url}: {exc}"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    # ------------------------------------------------------------------ bootstrap (decode)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Read the prefill topology once (``GET /route`` with every index -1); False while
        the prefill instance is not fully registered (the scheduler retries)."""
        if bootstrap_addr not in self.prefill_info_table:
            info = self._fetch_info(bootstrap_addr)
            if info is None:
                return False
            self.prefill_info_table[bootstrap_addr] = info
        return True

    def _fetch_info(self, bootstrap_addr: str) -> PrefillServerInfo | None:
        """``GET /route`` with every index -1: the prefill instance's topology, None while it is
        not reachable or not fully registered; RuntimeError if it cannot feed this rank."""
        url = f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        try:
            response = requests.get(url, timeout=5)
        except requests.RequestException as exc:
            logger.debug("pdwire: bootstrap %s not reachable: %s", bootstrap_addr, exc)
            return None
        if response.status_code != 200:
            return None
        data = response.json()
        fields = PrefillServerInfo.__dataclass_fields__
        info = PrefillServerInfo(**{k: v for k, v in data.items() if k in fields})
        for what, theirs, mine in (
            ("page size", info.page_size, self.kv_args.page_size),
            ("KV dtype", info.kv_cache_dtype, self.kv_cache_dtype_str),
        ):
            if theirs is not None and theirs != mine:
                raise RuntimeError(
                    f"pdwire: prefill {bootstrap_addr} uses {what} {theirs}, this decode {mine}"
                )
        return info

    def _rank_endpoints(
        self, bootstrap_addr: str, dp_rank: int, info: PrefillServerInfo
    ) -> list[dict[str, Any]]:
        out = []
        for pp in range(info.pp_size):
            for tp in range(info.attn_tp_size):
                url = (
                    f"http://{bootstrap_addr}/route?prefill_dp_rank={dp_rank}&prefill_cp_rank=0"
                    f"&target_tp_rank={tp}&target_pp_rank={pp}"
                )
                response = requests.get(url, timeout=5)
                if response.status_code != 200:
                    raise RuntimeError(
                        f"bootstrap {bootstrap_addr}: no prefill rank tp {tp}, pp {pp}: {response.text}"
                    )
                out.append(dict(response.json(), tp_rank=tp, pp_rank=pp))
        return out

    def _restarted(self, key: tuple[str, int], group: Any) -> list[dict[str, Any]] | None:
        """The endpoints ``key``'s prefill engine registers now, if they are not ``group``'s: it
        was restarted (its ranks bind new ports). Asked only while a rank of ``group`` is out of
        service, once a second at most; None while the bootstrap server names the same ranks
        (the worker reconnects those itself) or cannot be reached (the engine is still down: its
        rooms fail at once, ``peer_gone``)."""
        addr, dp_rank = key
        if not group.ready or group.engine_id not in self._unready:
            return None
        now = time.monotonic()
        if now - self._rechecked.get(key, 0.0) < 1.0:
            return None
        self._rechecked[key] = now
        try:
            info = self._fetch_info(addr)
            if info is None:
                return None
            ranks = self._rank_endpoints(addr, dp_rank, info)
        except (requests.RequestException, RuntimeError, ValueError, TypeError) as exc:
            log = logger.debug if isinstance(exc, requests.RequestException) else logger.warning
            log("pdwire: prefill %s: cannot read its endpoints again: %s", addr, exc)
            return None
        if _tcp_endpoints(ranks) == list(group.endpoints):
            return None
        logger.warning(
            "pdwire: prefill %s (DP group %d) registered new endpoints (restarted): connecting again",
            addr, dp_rank,
        )  # fmt: skip
        self.prefill_info_table[addr] = info
        return ranks

    def group(self, bootstrap_addr: str, dp_rank: int) -> Future[Any]:
        """The handshaken prefill DP group of ``bootstrap_addr`` (connected once, on the worker
        thread; a failed handshake is forgotten so the next request tries again, and a group
        whose engine came back with new endpoints, restarted, is connected again)."""
        key = (bootstrap_addr, dp_rank)
        with self._lock:
            fut = self._groups.get(key)
            ranks: list[dict[str, Any]] | None = None
            if fut is not None and not (fut.done() and fut.exception() is not None):
                ranks = self._restarted(key, fut.result()) if fut.done() else None
                if ranks is None:
                    return fut
            info = self.prefill_info_table[bootstrap_addr]
            if ranks is None:
                try:
                    ranks = self._rank_endpoints(bootstrap_addr, dp_rank, info)
                except (requests.RequestException, RuntimeError) as exc:
                    fut = Future()
                    fut.set_exception(exc)
                    return fut
            self._endpoints[key] = ranks
            endpoints = _tcp_endpoints(ranks)
            fut = Future()  # resolved once the group is ready (or its handshake failed)
            started = self.submit(self._connect, endpoints, info.pp_size, dp_rank, fut)

            def not_started(f: Future[Any]) -> None:  # the worker thread had stopped
                exc = f.exception()
                if exc is not None and not fut.done():
                    fut.set_exception(exc)

            started.add_done_callback(not_started)
            self._groups[key] = fut
            return fut

    # ------------------------------------------------------------------ deferred release (decode)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        return bootstrap_room in self.released

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        self.released.pop(bootstrap_room, None)
        if isinstance(self.worker, pd.DecodeWorker):
            # SGLang's deferred release hands the slots back at its own deadline, fenced or not:
            # pdwire's quarantine lets go of the room too, instead of holding it for good
            self.submit(self._reclaim, bootstrap_room)

    def _reclaim(self, room: int) -> None:
        # a room still live here fails first (a room already over is left alone by abort)
        self.worker.abort(room, "SGLang released the room's slots (deferred release deadline)")
        self.worker.reclaim(room)

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        info = self.prefill_info_table.get(bootstrap_addr)
        return info is None or info.attn_tp_size == self.attn_tp_size

    # ------------------------------------------------------------------ lifecycle

    def _ensure_prefill_recompute_executor(self) -> ThreadPoolExecutor:
        """The decode manager's thread pool, which SGLang's decode loop runs its prefill DP-rank
        queries (``/query_dp_ranks``) on, and :meth:`submit_prefill_recompute` its requests."""
        with self._lock:
            if self._executor is None:
                from sglang.srt.environ import envs

                workers = getattr(envs, "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE", None)
                size = workers.get() if workers is not None else None
                self._executor = ThreadPoolExecutor(
                    max_workers=max(1, int(size or 4)), thread_name_prefix="pdwire-sglang-decode"
                )
            return self._executor

    def submit_prefill_recompute(self, kv_receiver: PdwireKVReceiver, payload: dict[str, Any]) -> None:
        """SGLang's retraction rebootstrap (a weight update retracted the request): the prefill
        engine recomputes its prefix under the new weights when asked on its ``/generate``, at the
        HTTP port its ranks registered, and sends it to every decode rank; so one rank of the
        attention group asks (TP, CP and PP rank 0). A failed ask fails the room with its cause."""
        if self.attn_tp_rank or self.attn_cp_rank or self.pp_rank:
            return
        info = self.prefill_info_table.get(kv_receiver.bootstrap_addr)
        if info is None or info.prefill_http_port is None:
            kv_receiver.recompute_failed(
                f"rebootstrap: prefill {kv_receiver.bootstrap_addr} registered no HTTP port to recompute on"
            )
            return
        host = kv_receiver.bootstrap_addr.rsplit(":", 1)[0]
        url = f"http://{host}:{int(info.prefill_http_port)}/generate"
        self._ensure_prefill_recompute_executor().submit(self._recompute, kv_receiver, url, payload)

    def _recompute(self, kv_receiver: PdwireKVReceiver, url: str, payload: dict[str, Any]) -> None:
        try:
            response = requests.post(url, json=payload, timeout=self.waiting_timeout)
            problem = None if response.status_code < 400 else f"{response.status_code} {response.text[:300]}"
        except requests.RequestException as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            kv_receiver.recompute_failed(f"rebootstrap: {url} (rid {payload.get('rid')}) failed: {problem}")

    def teardown(self) -> None:
        self.thread.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    close = teardown


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _tcp_endpoints(ranks: list[dict[str, Any]]) -> list[str]:
    """pdwire endpoints of the ranks ``GET /route`` named (``rank_ip``/``rank_port``)."""
    return [f"tcp://{_bracket(r['rank_ip'])}:{int(r['rank_port'])}" for r in ranks]


def _flat(indices: Any) -> Any:
    """A torch tensor, list or array of indices as one flat numpy array."""
    return np.asarray(indices.cpu().numpy() if hasattr(indices, "cpu") else indices).reshape(-1)


def _concat(idx: Any) -> Any:
    parts = [_flat(p) for p in idx] if isinstance(idx, list | tuple) else [_flat(idx)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _state_lists(state_indices: list[Any] | None, n: int, what: str) -> list[Any]:
    """SGLang's per-component state payloads as pdwire's index arrays (None: every component
    absent; a None entry: that one)."""
    if state_indices is None:
        return [None] * n
    if len(state_indices) != n:
        raise pd.IndicesError(f"{what}: {len(state_indices)} state index lists for {n} state components")
    return [None if idx is None else _concat(idx) for idx in state_indices]


class _Request:
    """What a sender and a receiver share: the room, its outcome from the manager, its failure."""

    kv_mgr: PdwireKVManager
    bootstrap_room: int
    conclude_state: KVPoll | None
    _failure: str | None

    def _outcome(self) -> KVPoll | None:
        """The room's final state once the worker reported it (None before)."""
        outcome = self.kv_mgr.outcomes.get(self.bootstrap_room)
        if outcome is None:
            return None
        self.conclude_state, reason = outcome
        if reason:
            self._failure = reason
        return self.conclude_state

    def failure_exception(self) -> None:
        self.conclude_state = KVPoll.Failed
        reason = self._failure or self.kv_mgr.failures.get(self.bootstrap_room)
        self.clear()
        raise KVTransferError(
            self.bootstrap_room, reason or "Failed due to an unknown reason from another rank",
            is_from_another_rank=reason is None,
        )  # fmt: skip

    def clear(self) -> None:
        self.kv_mgr.watched.pop(self.bootstrap_room, None)
        self.kv_mgr.outcomes.pop(self.bootstrap_room, None)
        self.kv_mgr.failures.pop(self.bootstrap_room, None)


class PdwireKVSender(_Request, BaseKVSender):  # type: ignore[misc]
    """A prefill request's sender (see the module notes)."""

    def __init__(
        self,
        mgr: PdwireKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self.bootstrap_server_url = bootstrap_addr
        self.conclude_state: KVPoll | None = None
        self.num_kv_indices: int | None = None
        self.aux_index: int | None = None
        self.curr_idx = 0
        self._early_send_wait_event: Any = None  # set by the scheduler under overlap (a CUDA event)
        self._metric = KVTransferMetric()
        self._pages_sent = 0
        self._start: float | None = None
        self._failure: str | None = None
        mgr.watched[self.bootstrap_room] = KVPoll.Bootstrapping
        if mgr.num_dp_ranks > 1 and not req_has_disagg_prefill_dp_rank:
            self._route_dp()
        self.init_time = time.time()  # the bootstrap timeout counts from here, as in SGLang

    def _route_dp(self) -> None:
        """Tell decode which prefill DP group holds the room, as SGLang's backends do: the
        bootstrap server records it (``/register_dp_rank``) unless decode follows the room
        (``room % DP size``, the default); a room that routing sent elsewhere fails now, since
        decode would ask another group for it."""
        mgr, room = self.kv_mgr, self.bootstrap_room
        if mgr.load_balance_method != "follow_bootstrap_room" or mgr.force_query_dp_rank:
            url = f"http://{self.bootstrap_server_url}/register_dp_rank"
            try:
                response = requests.post(
                    url, json={"bootstrap_room": room, "dp_rank": mgr.dp_group}, timeout=5
                )
                problem = None if response.status_code == 200 else f"{response.status_code} {response.text}"
            except requests.RequestException as exc:
                problem = str(exc)
            if problem is not None:
                self._give_up(f"cannot register DP group {mgr.dp_group} of room {room} at {url}: {problem}")
        elif mgr.dp_group != room % mgr.num_dp_ranks:
            self._give_up(
                f"follow_bootstrap_room conflict: room {room} was dispatched to prefill DP group "
                f"{mgr.dp_group}, decode asks DP group {room % mgr.num_dp_ranks} for it (room % "
                f"{mgr.num_dp_ranks}); set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 "
                "for such routing"
            )

    def _give_up(self, reason: str) -> None:
        logger.error("pdwire: %s", reason)
        self._fail(reason)
        self.kv_mgr.failures[self.bootstrap_room] = reason
        self.kv_mgr.abort_room(self.bootstrap_room, reason)  # a decode rank asking is refused

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)

    def pop_decode_prefix_len(self) -> int:
        # pdwire's prefill rank skips the pages each decode rank already holds itself, so the
        # scheduler sends the whole prompt (see docs/sglang.md)
        return 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk

    def get_transfer_metric(self) -> KVTransferMetric:
        mem = self.kv_mgr.memory
        page = (mem.kv.bytes_per_page * (1 if mem.kv.is_mla else 2) * mem.kv.num_layers) if mem.kv else 0
        self._metric.transfer_total_bytes = self._pages_sent * page
        return self._metric

    def _fail(self, reason: str) -> None:
        self._failure = reason
        self.conclude_state = KVPoll.Failed

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        indices_event: Any = None,
    ) -> None:
        if self.conclude_state is not None:
            return
        pages = _flat(kv_indices)
        self.curr_idx += len(pages)
        last = state_indices is not None or (
            self.num_kv_indices is not None and self.curr_idx >= self.num_kv_indices
        )
        try:
            state = _state_lists(state_indices, len(self.kv_mgr.memory.state), "send") if last else None
        except (pd.IndicesError, ValueError) as exc:
            reason = f"bad state indices: {exc}"
            self._fail(reason)
            self.kv_mgr.abort_room(self.bootstrap_room, reason)
            return
        if self._start is None:
            self._start = time.perf_counter()
        wait = self._early_send_wait_event or indices_event
        self._early_send_wait_event = None
        self._pages_sent += len(pages)
        fut = self.kv_mgr.submit(
            _send_chunk, self.kv_mgr.worker, wait, self.bootstrap_room, pages, last,
            state, self.aux_index if last else None,
        )  # fmt: skip
        fut.add_done_callback(self._on_sent)

    def _on_sent(self, fut: Future[Any]) -> None:
        exc = fut.exception()
        if exc is not None:  # refused indices: nothing was recorded; the room is given up
            self._failure = f"{type(exc).__name__}: {exc}"
            self.kv_mgr.failures[self.bootstrap_room] = self._failure
            self.kv_mgr.abort_room(self.bootstrap_room, self._failure)

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        room = self.bootstrap_room
        outcome = self._outcome()
        if outcome is not None:
            if outcome == KVPoll.Success and self._start is not None:
                self._metric.transfer_latency_s = time.perf_counter() - self._start
            return outcome
        if self._failure is not None:
            return KVPoll.Transferring  # the abort is under way; Failed once it drained
        status = self.kv_mgr.watched.get(room, KVPoll.Bootstrapping)
        if status == KVPoll.Bootstrapping and time.time() - self.init_time > self.kv_mgr.bootstrap_timeout:
            reason = (
                f"Request {room} timed out after {self.kv_mgr.bootstrap_timeout:.0f}s in KVPoll.Bootstrapping"
            )
            self._fail(reason)
            self.kv_mgr.abort_room(room, reason)
            return KVPoll.Failed
        if status in (KVPoll.Success, KVPoll.Failed):
            return KVPoll.Transferring  # terminal in the worker; final once on_released ran
        return status

    poll_pp_consensus = poll

    def abort(self) -> None:
        if self.conclude_state != KVPoll.Failed:
            self._fail("Aborted by AbortReq.")
            self.kv_mgr.abort_room(self.bootstrap_room, "aborted by the prefill scheduler")


def _send_chunk(
    worker: Any, wait: Any, room: int, pages: Any, last: bool, state: Any, aux: int | None
) -> None:
    """On the worker thread: wait for the GPU writes the chunk depends on, then hand it over."""
    if wait is not None and hasattr(wait, "synchronize"):
        wait.synchronize()
    worker.send_chunk(room, pages, last=last, state=state, aux_index=aux)


class PdwireKVReceiver(_Request, BaseKVReceiver):  # type: ignore[misc]
    """A decode request's receiver (see the module notes)."""

    supports_host_destination = False

    def __init__(self, mgr: PdwireKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room) if bootstrap_room is not None else 0
        self.conclude_state: KVPoll | None = None
        self.require_staging = False
        self.abort_notified = False
        self.bootstrap_infos: list[dict[str, Any]] | None = None
        self.prefill_info: PrefillServerInfo | None = None
        self.init_time: float | None = None
        self._group: Future[Any] | None = None
        self._started: Future[Any] | None = None
        self._failure: str | None = None
        self._created = time.time()

    def _fail(self, reason: str) -> None:
        self._failure = self._failure or reason
        self.conclude_state = KVPoll.Failed

    def init(self, prefill_dp_rank: int) -> None:
        if self.conclude_state is not None:
            return
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is None:
            self._fail(
                f"prefill {self.bootstrap_addr}: no topology (try_ensure_parallel_info did not succeed)"
            )
            return
        self.prefill_info = info
        self.prefill_dp_rank = int(prefill_dp_rank)
        if not 0 <= self.prefill_dp_rank < max(1, int(info.dp_size or 1)):
            self._fail(
                f"prefill {self.bootstrap_addr} has {info.dp_size} DP groups, the room was routed to "
                f"DP group {self.prefill_dp_rank}"
            )
            return
        self._group = self.kv_mgr.group(self.bootstrap_addr, self.prefill_dp_rank)
        # the topology is read anew when the engine was restarted
        self.prefill_info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr, info)
        self.bootstrap_infos = self.kv_mgr._endpoints.get((self.bootstrap_addr, self.prefill_dp_rank), [])

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices: Any = None,
    ) -> None:
        if self.conclude_state is not None:
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("pdwire: host KV destinations are not supported")
        if self._group is None or not self._group.done() or self._group.exception() is not None:
            self._fail("send_metadata before the prefill group was connected")
            return
        try:
            n = len(self.kv_mgr.memory.state)
            indices = pd.RequestIndices(
                _flat(kv_indices), _state_lists(state_indices if n else None, n, "send_metadata"),
                aux_index=aux_index, decode_prefix_len=int(decode_prefix_len or 0),
            )  # fmt: skip
        except (pd.IndicesError, ValueError) as exc:
            self._fail(f"bad request indices: {exc}")
            return
        self._started = self.kv_mgr.submit(
            self.kv_mgr.worker.start_room, self.bootstrap_room, indices, self._group.result()
        )
        self.init_time = time.time()

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._group is None:
            return KVPoll.Bootstrapping
        if not self._group.done():
            if time.time() - self._created > self.kv_mgr.bootstrap_timeout:
                self._fail(f"no handshake with prefill {self.bootstrap_addr} within the bootstrap timeout")
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        exc = self._group.exception()
        if exc is not None:
            self._fail(f"handshake with prefill {self.bootstrap_addr} failed: {exc}")
            return KVPoll.Failed
        if self._started is None:
            return KVPoll.WaitingForInput
        exc = self._started.exception() if self._started.done() else None
        if exc is not None:
            self._fail(f"{type(exc).__name__}: {exc}")
            return KVPoll.Failed
        outcome = self._outcome()  # KVPoll.Failed is 0: no `or`
        return KVPoll.WaitingForInput if outcome is None else outcome

    def abort(self) -> None:
        if self.conclude_state != KVPoll.Failed:
            self._fail("Aborted by AbortReq.")
        self.ensure_abort_notified()

    def recompute_failed(self, reason: str) -> None:
        """The prefill engine was not told to recompute the room (any thread): it fails with the
        cause, unless its KV arrived already."""
        if self.conclude_state == KVPoll.Success or self._outcome() == KVPoll.Success:
            return
        logger.error("pdwire: room %d: %s", self.bootstrap_room, reason)
        self._failure = self._failure or reason
        self.abort()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tell every prefill rank to stop (once); the room's slots come back on the fence."""
        if self.abort_notified:
            return
        self.abort_notified = True
        if self._started is not None:
            self.kv_mgr.abort_room(self.bootstrap_room, self._failure or "aborted")
        else:  # nothing was asked for: nothing can be written
            self.kv_mgr.released[self.bootstrap_room] = None

    def is_abort_release_safe(self) -> bool:
        return self._started is None or self.bootstrap_room in self.kv_mgr.released


__all__ = [
    "PdwireKVBootstrapServer",
    "PdwireKVManager",
    "PdwireKVReceiver",
    "PdwireKVSender",
]
