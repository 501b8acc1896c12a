"""``PdwireConnector``: vLLM's KV connector API over pdwire's engine-facing runtime.

Push mode, like ``NixlPushConnector``: the prefill engine writes a finished prompt's KV pages
and Mamba state straight into the blocks the decode engine allocated for it. Prefill keeps a
finished request's blocks, names its room (:func:`pdwire.runtime.engine.room_for_request`)
and returns :class:`~.params.PrefillHandle` parameters, which the proxy copies into the decode
request; decode connects to the prefill ranks and starts the room with its blocks. A failed
room is reported as a failed receive only once pdwire says its slots are fenced (no write of
the room is in flight). Hybrid models (Mamba + attention) need ``SupportsHMA``; as with vLLM's
own connectors, prefill then computes all but the last prompt token. docs/vllm.md tells the
flow call by call.

Every call vLLM makes runs on vLLM's threads; pdwire's worker runs on its own thread
(``WorkerThread``) and its callbacks hand results back under a lock.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import pdwire.runtime.engine as pd
from pdwire.integrations.vllm import params as tp
from pdwire.integrations.vllm.memory import (
    AttentionGroup,
    Described,
    MambaGroup,
    MlaGroup,
    WindowGroup,
    describe_vllm,
    kv_window,
    vllm_groups,
)
from pdwire.integrations.vllm.stats import REFUSED, IntervalCounts, PdwireKVConnectorStats, PdwirePromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# kv_connector_extra_config keys (documented in docs/vllm.md)
DEFAULTS: dict[str, Any] = {
    "pdwire_backend": None,  # registry name; None: NIXL when it imports
    "pdwire_backend_options": {},
    "pdwire_host": "127.0.0.1",  # where a prefill rank's control socket binds
    # what decode connects to, when the bind address is not it: one host, or one per rank of the
    # engine (PP stage major) for ranks on several nodes; PDWIRE_ADVERTISE_HOST in a rank's
    # environment wins (each node's own address)
    "pdwire_advertise_host": None,
    "pdwire_room_timeout_s": 120.0,  # also the lease: prefill frees blocks no decode asked for or renewed
    "pdwire_transfer_timeout_s": 60.0,
    "pdwire_handshake_timeout_s": 120.0,
    "pdwire_peer_timeout_s": 10.0,  # decode: a prefill rank silent this long (heartbeats) is lost
    "pdwire_model_name": None,  # default: the model folder's name
    "pdwire_model_revision": None,  # default: vLLM's revision, else a hash of the model config
    "pdwire_versions": [],  # protocol versions offered; empty: all this build speaks
    "pdwire_control_keys": None,  # the control plane's key directory; None: PDWIRE_CONTROL_KEYS
}


def extra_config(vllm_config: VllmConfig) -> dict[str, Any]:
    kv = vllm_config.kv_transfer_config
    assert kv is not None
    given = dict(kv.kv_connector_extra_config or {})
    unknown = sorted(k for k in given if k.startswith("pdwire_") and k not in DEFAULTS)
    if unknown:
        raise ValueError(
            f"PdwireConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(DEFAULTS)}"
        )
    return {k: given.get(k, v) for k, v in DEFAULTS.items()}


def advertised_host(value: Any, rank_index: int, ranks: int) -> str | None:
    """The host a prefill rank advertises: ``PDWIRE_ADVERTISE_HOST`` in its environment, else
    ``pdwire_advertise_host`` (one host, or a list of one per rank, PP stage major), else None
    (the bind address)."""
    own = os.environ.get("PDWIRE_ADVERTISE_HOST")
    if own:
        return own
    if value is None or isinstance(value, str):
        return value
    hosts = value if isinstance(value, list | tuple) else ()
    if len(hosts) != ranks or not all(isinstance(v, str) for v in hosts):
        raise ValueError(
            f"PdwireConnector: pdwire_advertise_host must be a host or a list of {ranks} hosts (one per "
            f"rank, PP stage major), got {value!r}"
        )
    return str(hosts[rank_index])


def model_fingerprint(
    vllm_config: VllmConfig, described: Described, extra: Mapping[str, Any]
) -> pd.ModelFingerprint:
    """The served model's identity, compared at pdwire's Hello. It names the model, its revision
    (or a hash of its config, without the transformers version, so an engine upgrade does not
    change it), the KV dtype and the layer counts."""
    mc = vllm_config.model_config
    name = extra["pdwire_model_name"] or os.path.basename(str(mc.model).rstrip("/")) or str(mc.model)
    revision = extra["pdwire_model_revision"] or mc.revision
    if not revision:
        cfg = mc.hf_config.to_dict()
        for volatile in ("transformers_version", "_name_or_path", "_commit_hash"):
            cfg.pop(volatile, None)
        blob = json.dumps(cfg, sort_keys=True, default=str).encode()
        revision = "config-sha256:" + hashlib.sha256(blob).hexdigest()[:16]
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = str(mc.dtype).removeprefix("torch.") if cache_dtype == "auto" else str(cache_dtype)
    kv = described.memory.kv
    kv_layers = 0 if kv is None else kv.num_layers
    state_layers = sum(c.num_layers for c in described.memory.state)
    if described.memory.position.pp_size > 1:  # a stage's KV is a run of a dense model's layers
        kv_layers = int(mc.get_total_num_hidden_layers())
    return pd.ModelFingerprint(
        model_name=name,
        revision=str(revision),
        dtype=dtype,
        num_layers=kv_layers + state_layers,
        num_attention_layers=kv_layers,
        num_state_layers=state_layers,
    )


# ---------------------------------------------------------------------- scheduler -> worker


@dataclass
class SendReq:
    """Prefill: a finished request whose pages and state slots wait for decode."""

    request_id: str
    room: int
    kv_pages: list[int]
    state: list[list[int]]


@dataclass
class RecvReq:
    """Decode: a request whose blocks are allocated and whose room should start."""

    request_id: str
    room: int
    prefill_engine_id: str
    endpoints: tuple[str, ...]
    pp_size: int
    kv_pages: list[int]
    state: list[list[int]]
    decode_prefix_len: int


@dataclass
class LeaseReq:
    """Decode: a queued request's room on its prefill engine, held (renewed while the request
    waits for memory) or released (it will never be asked for: prefill frees it now)."""

    request_id: str
    room: int
    prefill_engine_id: str
    endpoints: tuple[str, ...]
    pp_size: int
    why: str = ""  # a release's cause, in prefill's log

    @classmethod
    def of(cls, request_id: str, handle: tp.PrefillHandle, why: str = "") -> LeaseReq:
        return cls(request_id, handle.room, handle.engine_id, handle.endpoints, handle.pp_size, why)


@dataclass
class PdwireConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    sends: list[SendReq] = field(default_factory=list)
    recvs: list[RecvReq] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # decode: requests gone while their room is live
    holds: list[LeaseReq] = field(default_factory=list)  # decode: rooms of newly queued requests
    releases: list[LeaseReq] = field(default_factory=list)  # decode: rooms never to be asked for


@dataclass
class PdwireHandshakeMetadata(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a prefill worker tells its scheduler: where decode ranks reach it."""

    endpoint: str


# ---------------------------------------------------------------------- the two sides


class _Groups:
    """Which transfer group is the KV page list and which are state components (both sides
    derive it from the same config, so the scheduler's block lists match the worker's memory)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config
        groups = vllm_groups(vllm_config, kv_cache_config)
        self.kv: int | None = None
        self.state: list[int] = []
        self.block_size = vllm_config.cache_config.block_size
        # sliding-window / chunked-local groups: only their live pages move (see WindowGroup)
        self.windows = {i: g for i, g in enumerate(groups) if isinstance(g, WindowGroup)}
        window_kv = kv_window(groups)
        for i, g in enumerate(groups):
            if isinstance(g, AttentionGroup | MlaGroup) and self.kv is None:
                self.kv, self.block_size = i, g.block_size
            elif isinstance(g, WindowGroup) and i == window_kv:
                self.kv, self.block_size = i, g.attention.block_size
            elif isinstance(g, MambaGroup | WindowGroup):
                self.state.append(i)
        self.spec_blocks = [
            getattr(kv_cache_config.transfer_groups[i].kv_cache_spec, "num_speculative_blocks", 0)
            for i in self.state
        ]
        self.unsupported = [
            f"{i} ({type(kv_cache_config.transfer_groups[i].kv_cache_spec).__name__})"
            for i, g in enumerate(groups)
            if g is None
        ]
        # the hybrid allocator splits many full-attention layers into groups with their own
        # block tables; pdwire's request indices carry one KV page list
        self.extra_full = [
            i for i, g in enumerate(groups) if isinstance(g, AttentionGroup | MlaGroup) and i != self.kv
        ]

    def _live(self, group: int, num_tokens: int) -> range:
        """Positions of a group's blocks that hold what the token after ``num_tokens`` needs."""
        window = self.windows.get(group)
        return window.live_pages(num_tokens) if window else range(math.ceil(num_tokens / self.block_size))

    def first_live_page(self, num_tokens: int) -> float:
        """The first block position a window group still needs (a local prefix reaching past it
        would make decode's page lists shorter than prefill's); inf without window groups."""
        return min((self._live(g, num_tokens).start for g in self.windows), default=math.inf)

    def split(self, block_ids: tuple[list[int], ...], num_tokens: int) -> tuple[list[int], list[list[int]]]:
        """(KV pages holding ``num_tokens`` tokens, one state slot per state component)."""
        ids = self.kv_cache_config.select_transfer_block_ids(block_ids)
        assert self.kv is not None

        def live(g: int) -> list[int]:
            r = self._live(g, num_tokens)
            return list(ids[g][r.start : r.stop])

        pages = live(self.kv)
        state = [
            live(g) if g in self.windows else clip_ssm_state_blocks(list(ids[g]), n)[-1:]
            for g, n in zip(self.state, self.spec_blocks, strict=True)
        ]
        return pages, state

    def problem(self, pages: list[int], state: list[list[int]], num_tokens: int) -> str | None:
        """What is wrong with a request's split block lists, or None: a list shorter than its
        live range, a Mamba slot missing, or vLLM's null block (id 0) where a live block belongs."""
        assert self.kv is not None
        for g, got in ((self.kv, pages), *zip(self.state, state, strict=True)):
            want = len(self._live(g, num_tokens)) if g in self.windows or g == self.kv else 1
            if len(got) != want or (g in self.windows and 0 in got):
                return f"group {g} holds blocks {got} where {want} live blocks belong"
        return None


class _Scheduler:
    def __init__(self, vllm_config: VllmConfig, groups: _Groups, engine_id: str) -> None:
        kv = vllm_config.kv_transfer_config
        assert kv is not None
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.is_producer = bool(kv.is_kv_producer)
        self.groups = groups
        # window groups too: the window of prefill's last token may start one block before the
        # next token's, which vLLM already freed; decode computing that token itself needs only
        # the next token's window
        self.has_state = bool(self.groups.state or self.groups.windows)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.endpoints: tuple[str, ...] = ()
        self._sends: list[SendReq] = []
        self._recvs: list[RecvReq] = []
        self._aborts: list[str] = []
        # blocks pdwire still holds: prefill's sent requests, decode's aborted rooms
        self._outstanding: set[str] = set()
        self._receiving: set[str] = set()  # decode: rooms started, not yet reported
        # decode: queued requests whose room is held on prefill (renewed), not started or released
        self._queued: dict[str, tp.PrefillHandle] = {}
        self._holds: list[LeaseReq] = []
        self._releases: list[LeaseReq] = []

    # -------- both

    def set_handshake_metadata(
        self, metadata: Mapping[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        if not self.is_producer:
            return
        try:
            self.endpoints = tuple(
                metadata[(pp, t)].endpoint  # type: ignore[attr-defined]
                for pp in range(self.pp_size)
                for t in range(self.tp_size)
            )
        except KeyError as exc:
            raise ValueError(f"PdwireConnector: no handshake metadata from worker (pp, tp) = {exc}") from None

    def build_meta(self) -> PdwireConnectorMetadata:
        meta = PdwireConnectorMetadata(self._sends, self._recvs, self._aborts, self._holds, self._releases)
        self._sends, self._recvs, self._aborts, self._holds, self._releases = [], [], [], [], []
        return meta

    def has_pending_push_work(self) -> bool:
        # a release must reach the workers even when the request it ends was the engine's last
        return bool(self._outstanding or self._sends or self._recvs or self._holds or self._releases)

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for rid in out.finished_sending or ():
            self._outstanding.discard(rid)
        for rid in out.finished_recving or ():
            self._receiving.discard(rid)
            self._outstanding.discard(rid)

    # -------- prefill

    def _backoff(self) -> int:
        # Mamba: decode derives h(N) from h(N-1) itself, so prefill stops one token short
        return 1 if self.has_state else 0

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not self.is_producer:
            self._queue(request)
            return
        if not (params and params.get("do_remote_decode")):
            return
        n = self._backoff()
        if not n or params.get("_pdwire_truncated") or request.num_prompt_tokens <= n:
            return
        if request.get_skip_reading_prefix_cache() or request.prompt_token_ids is None:
            return  # decode recomputes the whole prompt of such a request anyway
        # The same truncation vLLM's NIXL connector makes: prefill computes N - 1 tokens.
        del request.prompt_token_ids[-n:]
        del request._all_token_ids[-n:]
        request.num_prompt_tokens -= n
        request.max_tokens = 1
        params["_pdwire_truncated"] = True

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not self.is_producer and request.request_id in self._queued:
            self._release(
                request, f"request {request.request_id} ended in the decode queue ({request.status.name})"
            )
        if not self.is_producer and request.request_id in self._receiving:
            # gone (aborted, or failed by vLLM) while its room may be live: prefill may still write
            # into its blocks, so they stay until the worker reports the request received (at
            # once if it did already, else once the room is aborted and fenced); vLLM frees a
            # finished request's blocks when it is reported received
            self._receiving.discard(request.request_id)
            self._aborts.append(request.request_id)
            self._outstanding.add(request.request_id)
            return True, None
        if not (self.is_producer and params and params.get("do_remote_decode")):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: nothing was handed to pdwire
        if not self.endpoints:
            logger.error(
                "PdwireConnector: request %s finished before the workers reported their endpoints",
                request.request_id,
            )
            return False, None
        tokens = request.num_computed_tokens
        pages, state = self.groups.split(block_ids, tokens)
        problem = self.groups.problem(pages, state, tokens)
        if problem is not None:
            logger.error("PdwireConnector: request %s of %d tokens: %s", request.request_id, tokens, problem)
            return False, None
        room = pd.room_for_request(f"{self.engine_id}:{request.request_id}")
        self._sends.append(SendReq(request.request_id, room, pages, state))
        self._outstanding.add(request.request_id)
        handle = tp.PrefillHandle(
            room, self.engine_id, self.endpoints, self.pp_size, tokens, self.groups.block_size
        )
        return True, handle.to_params()

    # -------- decode

    def _queue(self, request: Request) -> None:
        """A new request whose KV waits on a pdwire prefill: its room is held there (renewed by
        the workers) until the request starts its room or is released."""
        params = request.kv_transfer_params
        if not tp.is_pdwire_prefill(params):
            return
        assert params is not None
        try:
            handle = tp.parse(params)
        except tp.TransferParamsError:
            return  # computed locally (_handle says why); nowhere to renew or release it
        self._queued[request.request_id] = handle
        self._holds.append(LeaseReq.of(request.request_id, handle))

    def _release(self, request: Request, why: str) -> None:
        """The request will never ask for its room: prefill frees its blocks now."""
        handle = self._queued.pop(request.request_id, None)
        if handle is not None:
            self._releases.append(LeaseReq.of(request.request_id, handle, why))

    def _compute_locally(self, request: Request, why: str) -> None:
        params = request.kv_transfer_params
        assert params is not None
        params[tp.STARTED] = True  # never asked for later (a rescheduled request computes too)
        self._release(request, why)

    def _handle(self, request: Request) -> tp.PrefillHandle | None:
        params = request.kv_transfer_params
        if self.is_producer or not tp.is_pdwire_prefill(params):
            return None
        assert params is not None
        try:
            handle = tp.parse(params)
        except tp.TransferParamsError as exc:
            logger.warning("PdwireConnector: request %s is computed locally: %s", request.request_id, exc)
            self._compute_locally(request, "its kv_transfer_params do not parse on decode")
            return None
        want = len(request.prompt_token_ids or ()) - self._backoff()
        if handle.num_tokens != want or handle.block_size != self.groups.block_size:
            logger.warning(
                "PdwireConnector: request %s is computed locally: prefill holds %d tokens in pages of %d, "
                "this engine loads %d tokens in pages of %d",
                request.request_id,
                handle.num_tokens,
                handle.block_size,
                want,
                self.groups.block_size,
            )
            self._compute_locally(request, "decode computes it locally (token count or block size differ)")
            return None
        return handle

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        handle = self._handle(request)
        if handle is None:
            return 0, False
        count = handle.num_tokens - num_computed_tokens
        local_pages = math.ceil(num_computed_tokens / self.groups.block_size)
        if count > 0 and local_pages > self.groups.first_live_page(handle.num_tokens):
            # the local prefix holds blocks of a window prefill sends too: the page lists would
            # differ in length; the prompt's tail is then shorter than the window, decode computes it
            logger.info(
                "PdwireConnector: request %s is computed locally: its local prefix of %d tokens reaches "
                "into the attention window",
                request.request_id,
                num_computed_tokens,
            )
            self._compute_locally(request, "decode computes it locally (its local prefix reaches the window)")
            return 0, False
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        handle = self._handle(request)
        if handle is None:
            return
        if num_external_tokens <= 0:
            # scheduled with nothing to load (a full local prefix hit, prefix reading skipped):
            # it runs now on its local blocks
            self._compute_locally(request, "decode computes it locally (nothing left to load)")
            return
        self._queued.pop(request.request_id, None)  # its room starts: the request holds it now
        params = request.kv_transfer_params
        assert params is not None
        local = handle.num_tokens - num_external_tokens  # tokens decode already holds (prefix cache)
        prefix_pages = local // self.groups.block_size
        pages, state = self.groups.split(blocks.get_block_ids(), handle.num_tokens)
        if self.groups.kv in self.groups.windows:  # the KV list is live pages, all past the prefix
            prefix_pages = 0
        self._recvs.append(
            RecvReq(
                request.request_id,
                handle.room,
                handle.engine_id,
                handle.endpoints,
                handle.pp_size,
                pages[prefix_pages:],
                state,
                prefix_pages * self.groups.block_size,
            )
        )
        self._receiving.add(request.request_id)
        params[tp.STARTED] = True


class _Worker:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, engine_id: str) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        kv = vllm_config.kv_transfer_config
        assert kv is not None
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine_id = engine_id
        self.is_producer = bool(kv.is_kv_producer)
        self.extra = extra_config(vllm_config)
        self.tp_rank = int(get_tensor_model_parallel_rank())
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.pp_rank = int(get_pp_group().rank_in_group)
        self.described: Described | None = None
        self.worker: pd.PrefillWorker | pd.DecodeWorker | None = None
        self.thread: pd.WorkerThread[Any] | None = None
        self.endpoint: str | None = None
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._failed: set[str] = set()
        # worker thread only
        self._room_req: dict[int, str] = {}
        self._room_recv: dict[int, RecvReq] = {}
        self._failed_rooms: dict[int, pd.Failure | None] = {}
        self._aborted: set[int] = set()
        self._reported: dict[str, None] = {}  # requests reported received, oldest first
        self._prefills: dict[tuple[str, tuple[str, ...]], pd.PrefillGroup] = {}
        self.counts = IntervalCounts()  # for vLLM's connector stats; any thread

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.described = describe_vllm(
            self.vllm_config, self.kv_cache_config, kv_caches, self.tp_rank, self.pp_rank
        )
        rank = self.described.memory.position
        common: dict[str, Any] = dict(
            engine_id=self.engine_id,
            rank=rank,
            model=model_fingerprint(self.vllm_config, self.described, self.extra),
            backend=self.extra["pdwire_backend"],
            backend_options=dict(self.extra["pdwire_backend_options"]),
            room_timeout_s=float(self.extra["pdwire_room_timeout_s"]),
            transfer_timeout_s=float(self.extra["pdwire_transfer_timeout_s"]),
            versions=tuple(tuple(v) for v in self.extra["pdwire_versions"]),
        )
        if self.extra["pdwire_control_keys"]:
            common["control_auth"] = pd.ControlAuth.from_directory(self.extra["pdwire_control_keys"])
        memory = self.described.memory
        # caches in device memory are staged there (host memory keeps pdwire's numpy copier)
        on_device = any(t.device.type != "cpu" for t in kv_caches.values())
        copier = pd.TorchCopier(list(kv_caches.values())) if on_device else None
        worker: pd.PrefillWorker | pd.DecodeWorker
        if self.is_producer:
            host = self.extra["pdwire_host"]
            index = self.pp_rank * self.tp_size + self.tp_rank
            adv = advertised_host(self.extra["pdwire_advertise_host"], index, self.tp_size * self.pp_size)
            cfg = pd.PrefillConfig(
                **common, bind=f"tcp://{host}:0", advertise=None if adv is None else f"tcp://{adv}"
            )
            worker = pd.PrefillWorker(cfg, memory, on_released=self._on_released, copier=copier)
            self.endpoint = worker.endpoint
        else:
            dcfg = pd.DecodeConfig(
                **common,
                handshake_timeout_s=float(self.extra["pdwire_handshake_timeout_s"]),
                peer_timeout_s=float(self.extra["pdwire_peer_timeout_s"]),
            )
            worker = pd.DecodeWorker(
                dcfg,
                memory,
                on_finished=self._on_finished,
                on_slots_released=self._on_slots_released,
                copier=copier,
            )
        self.worker = worker
        self.thread = pd.WorkerThread(
            worker, name=f"pdwire-{'prefill' if self.is_producer else 'decode'}{self.tp_rank}"
        ).start()
        logger.info(
            "PdwireConnector %s rank %d/%d: %s, backend %s%s",
            "prefill" if self.is_producer else "decode",
            self.tp_rank,
            self.tp_size,
            memory_summary(self.described),
            worker.backend.name,
            f", listening on {self.endpoint}" if self.endpoint else "",
        )

    # -------- engine thread

    def start(self, meta: PdwireConnectorMetadata) -> None:
        if self.thread is None:
            return
        for h in meta.holds:  # before the recvs: a room held and started in one step starts
            self.thread.submit(self._hold, h)
        for h in meta.releases:
            self.thread.submit(self._release, h)
        for s in meta.sends:
            self.thread.submit(self._send, s)
        for r in meta.recvs:
            self.thread.submit(self._start_room, r)
        for rid in meta.aborts:
            self.thread.submit(self._abort, rid)

    def results(self) -> KVConnectorTransferResults:
        with self._lock:
            out = KVConnectorTransferResults(self._sent, self._received, self._failed)
            self._sent, self._received, self._failed = set(), set(), set()
        return out

    def report(self) -> dict[str, Any]:
        if self.thread is None or self.worker is None:
            return {}
        worker = self.worker

        def snapshot() -> dict[str, Any]:
            out = dict(vars(worker.stats))
            out["failures"] = list(worker.stats.failures)
            if isinstance(worker, pd.PrefillWorker):
                out["spans"] = {str(k): list(v) for k, v in worker.spans.items()}
            out["backend"] = worker.backend.name
            return out

        return self.thread.submit(snapshot).result(10)

    def shutdown(self) -> None:
        if self.thread is not None:
            thread, self.thread = self.thread, None
            thread.close()

    # -------- worker thread

    def _send(self, s: SendReq) -> None:
        assert isinstance(self.worker, pd.PrefillWorker)
        self._room_req[s.room] = s.request_id
        try:
            self.worker.send_chunk(s.room, s.kv_pages, last=True, state=s.state)
        except Exception as exc:  # bad indices: nothing recorded, give the blocks back
            logger.error(
                "PdwireConnector: request %s (room %d) cannot be sent: %s", s.request_id, s.room, exc
            )
            self._room_req.pop(s.room, None)
            self.counts.failed(s.room, REFUSED)
            with self._lock:
                self._sent.add(s.request_id)

    def _on_released(self, room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        rid = self._room_req.pop(room, None)
        if rid is None:
            return
        self._count_released(room, status, failure)  # before the request is reported sent
        if failure is not None:
            logger.warning("PdwireConnector: prefill of request %s (room %d) failed: %s", rid, room, failure)
        with self._lock:
            self._sent.add(rid)

    def _start_room(self, r: RecvReq) -> None:
        assert isinstance(self.worker, pd.DecodeWorker)
        try:
            prefill_tp = len(r.endpoints) // r.pp_size
            if self.described is not None and not self.described.tp_sliceable and prefill_tp != self.tp_size:
                raise pd.ConfigError(
                    f"prefill TP {prefill_tp} -> decode TP {self.tp_size}: vLLM's attention blocks hold each "
                    "head's K and then its V, which this pdwire build's wire (no KV head stride, before "
                    "protocol 1.4) cannot slice by head; use equal TP sizes"
                )
            # a failed handshake is tried again by the next request; connect returns at once, the
            # room waits inside its deadline for the handshake (step())
            group = self._group(r.prefill_engine_id, r.endpoints, r.pp_size, retry=True)
            indices = pd.RequestIndices(r.kv_pages, state=r.state, decode_prefix_len=r.decode_prefix_len)
            self.worker.start_room(r.room, indices, group)
        except Exception as exc:  # refused before anything was written: fail it now
            logger.error(
                "PdwireConnector: request %s (room %d) from prefill %s refused: %s: %s",
                r.request_id,
                r.room,
                r.prefill_engine_id,
                type(exc).__name__,
                exc,
            )
            self.counts.failed(r.room, REFUSED)
            self._report(r.request_id, failed=True)
            if not isinstance(exc, pd.DuplicateRoomError):  # a live room of that id is not ours to end
                why = f"request {r.request_id} refused by decode: {type(exc).__name__}"
                lease = LeaseReq(r.request_id, r.room, r.prefill_engine_id, r.endpoints, r.pp_size, why)
                self._release(lease)
            return
        self._room_recv[r.room] = r
        self.counts.started(r.room)

    def _group(
        self, engine_id: str, endpoints: tuple[str, ...], pp_size: int, *, retry: bool
    ) -> pd.PrefillGroup:
        """The group to a prefill engine, connected on first use (``retry``: again if it failed)."""
        assert isinstance(self.worker, pd.DecodeWorker)
        key = (engine_id, endpoints)
        group = self._prefills.get(key)
        if group is None or (retry and group.failed):
            group = self.worker.connect(list(endpoints), prefill_pp=pp_size)
            self._prefills[key] = group
        return group

    def _hold(self, h: LeaseReq) -> None:
        """A queued request: renew its room on prefill while it waits (connecting early, as
        NixlConnector's heartbeats do; a failed group is not retried for a lease)."""
        assert isinstance(self.worker, pd.DecodeWorker)
        try:
            self.worker.hold(h.room, self._group(h.prefill_engine_id, h.endpoints, h.pp_size, retry=False))
        except Exception as exc:  # bad endpoints: its start_room says so, by name
            logger.debug("PdwireConnector: room %d of request %s not renewed: %s", h.room, h.request_id, exc)

    def _release(self, h: LeaseReq) -> None:
        """A request that never asks for its room: prefill frees the room's blocks now."""
        assert isinstance(self.worker, pd.DecodeWorker)
        try:
            group = self._group(h.prefill_engine_id, h.endpoints, h.pp_size, retry=False)
            self.worker.decline(h.room, group, h.why or f"request {h.request_id} released by decode")
        except Exception as exc:  # the room then waits out its lease on prefill
            logger.debug("PdwireConnector: room %d of request %s not released: %s", h.room, h.request_id, exc)

    def _abort(self, rid: str) -> None:
        """The request is gone: stop its room; it is reported received (which frees its blocks)
        once fenced, or not again if it was reported already."""
        assert isinstance(self.worker, pd.DecodeWorker)
        if rid in self._reported:
            return
        room = next((room for room, r in self._room_recv.items() if r.request_id == rid), None)
        if room is None:  # never started: nothing can write
            self._report(rid, failed=True)
            return
        self._aborted.add(room)
        self.worker.abort(room, f"request {rid} aborted by the decode engine")

    def _report(self, rid: str, *, failed: bool) -> None:
        """Report a started request received (failed or not), exactly once."""
        self._reported[rid] = None
        while len(self._reported) > 100_000:  # an abort arrives within a few steps, if at all
            self._reported.pop(next(iter(self._reported)))
        with self._lock:
            self._received.add(rid)
            if failed:
                self._failed.add(rid)

    def _on_finished(self, room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        r = self._room_recv.get(room)
        if r is None:
            return
        self._count_finished(room, r, status, failure)
        if room in self._aborted:
            self._failed_rooms[room] = failure  # reported as sent once the slots are fenced
            return
        if status == pd.Status.SUCCESS:
            self._room_recv.pop(room)
            self._report(r.request_id, failed=False)
            return
        logger.warning("PdwireConnector: request %s (room %d) failed: %s", r.request_id, room, failure)
        self._failed_rooms[room] = failure

    def _on_slots_released(self, room: int) -> None:
        if room not in self._failed_rooms:
            return
        del self._failed_rooms[room]
        r = self._room_recv.pop(room, None)
        if r is None:
            return
        self.counts.released(_blocks(r))
        self._aborted.discard(room)
        self._report(r.request_id, failed=True)  # only now: no write of this room is in flight

    # -------- connector stats (see stats.py)

    def connector_stats(self) -> PdwireKVConnectorStats | None:
        """The stats since the last call (engine thread): the rooms the callbacks counted, and
        the worker's counters read as one dict copy (atomic under the GIL; no worker-thread call)."""
        worker = self.worker
        return None if worker is None else self.counts.take(dict(vars(worker.stats)))

    def _count_released(self, room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        if status != pd.Status.SUCCESS:
            self.counts.failed(room, _failure_kind(failure))
            return
        span = self.worker.spans.get(room) if isinstance(self.worker, pd.PrefillWorker) else None
        self.counts.done(room, seconds=None if span is None else span[1] - span[0])

    def _count_finished(self, room: int, r: RecvReq, status: pd.Status, failure: pd.Failure | None) -> None:
        if status == pd.Status.SUCCESS and room not in self._aborted:
            self.counts.done(room, blocks=_blocks(r))
        else:  # its blocks are held until the writers fence (_on_slots_released)
            self.counts.failed(room, _failure_kind(failure), quarantined_blocks=_blocks(r))


def _blocks(r: RecvReq) -> int:
    """The KV pages and state slots a decode room writes."""
    return len(r.kv_pages) + sum(len(s) for s in r.state)


def _failure_kind(failure: pd.Failure | None) -> str:
    return "unspecified" if failure is None else failure.kind.name.lower()


def memory_summary(d: Described) -> str:
    kv = d.memory.kv
    parts = []
    if kv is not None:
        parts.append(
            f"KV {kv.num_layers} layers x {kv.kv_heads_per_rank} heads, page {kv.page_size} tokens "
            f"({kv.bytes_per_page} B, stride {kv.stride} B, {kv.layout.value})"
        )
    for c in d.memory.state:
        parts.append(
            f"{c.kind.value} {c.num_layers} layers ("
            + ", ".join(f"{t.name} {t.bytes_per_slot} B @+{t.offset}" for t in c.tensors)
            + ")"
        )
    return "; ".join(parts)


# ---------------------------------------------------------------------- the connector


class PdwireConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector over pdwire (see the module notes and docs/vllm.md)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv = vllm_config.kv_transfer_config
        assert kv is not None and kv.engine_id is not None
        if kv.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(
                f"PdwireConnector: kv_role must be kv_producer or kv_consumer, got {kv.kv_role!r}"
            )
        extra = extra_config(vllm_config)  # refuse unknown keys at start-up, on both sides
        pp = vllm_config.parallel_config.pipeline_parallel_size
        if kv.kv_role == "kv_consumer" and pp > 1:
            raise ValueError(
                f"PdwireConnector: decode with pipeline parallelism (PP {pp}): a prefill rank writes every "
                "layer it holds into one decode rank, so decode runs PP 1 (prefill may run any PP)"
            )
        ranks = pp * vllm_config.parallel_config.tensor_parallel_size
        advertised_host(extra["pdwire_advertise_host"], 0, ranks)  # a bad list, at start-up
        engine_id = str(kv.engine_id)
        self._scheduler: _Scheduler | None = None
        self._worker: _Worker | None = None
        groups = _Groups(vllm_config, kv_cache_config)
        if groups.kv is None:
            raise ValueError("PdwireConnector needs a full-attention KV cache group")
        if groups.unsupported:
            raise ValueError(
                f"PdwireConnector moves full-attention, MLA, sliding-window, chunked-local and Mamba KV "
                f"cache groups; transfer groups {', '.join(groups.unsupported)} of this model are of "
                "another kind"
            )
        if groups.extra_full:
            raise ValueError(
                f"PdwireConnector: KV cache groups {[groups.kv, *groups.extra_full]} are all full attention "
                "with their own block tables (vLLM's hybrid allocator split the model's full-attention "
                "layers); pdwire carries one KV page list per request: serve this model with "
                "--disable-hybrid-kv-cache-manager (window layers then move whole, as full attention)"
            )
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(vllm_config, groups, engine_id)
        else:
            self._worker = _Worker(vllm_config, kv_cache_config, engine_id)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """LBHNC (heads outer inside a block): pdwire plans every block layout vLLM resolves
        (LBHNC and LBNHC), and between TP sizes LBHNC's head slices are one run per head and block
        where LBNHC's are one per token. MLA's latent has no heads: no preference."""
        mc = vllm_config.model_config
        return None if mc is None or mc.use_mla else "LBHNC"

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return False

    @property
    def _sched(self) -> _Scheduler:
        assert self._scheduler is not None, "a scheduler-side call on the worker's connector"
        return self._scheduler

    @property
    def _work(self) -> _Worker:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    # -------- scheduler side

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_meta()

    def on_new_request(self, request: Request) -> None:
        self._sched.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched.set_handshake_metadata(metadata)

    # -------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.endpoint is None:
            return None
        return PdwireHandshakeMetadata(self._worker.endpoint)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdwireConnectorMetadata)
        self._work.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads happen between steps (push): nothing to wait for inside a forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # prefill hands finished requests to pdwire; nothing per layer

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work.results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        # failures are whole requests (failed_recving); vLLM refuses block ids with several groups
        return set()

    def report(self) -> dict[str, Any]:
        """The pdwire worker's counters (messages, posts, bytes, descriptors, failures, spans)."""
        return {} if self._worker is None else self._worker.report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -------- vLLM's connector stats and Prometheus series (stats.py, docs/vllm.md "Metrics")

    def get_kv_connector_stats(self) -> PdwireKVConnectorStats | None:
        return None if self._worker is None else self._worker.connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdwireKVConnectorStats:
        return PdwireKVConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PdwirePromMetrics:
        return PdwirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
