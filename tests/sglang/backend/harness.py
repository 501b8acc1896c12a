"""SGLang ranks for the backend tests: SGLang's own pools, KVArgs and scheduler call order.

Each rank publishes its own SGLang runtime context (``create_context`` with the rank's
``ServerArgs`` and launcher ranks) and builds, on the CPU, the memory pools an SGLang hybrid
model has: ``SWAKVPool`` (full-attention KV + sliding-window KV), a ``HybridReqToTokenPool``
holding the Mamba state (Mamba2 conv with x|B|C sub-blocks, temporal), and
``MetadataBuffers`` (aux); or, for a Mamba + full-attention hybrid, a ``HybridLinearKVPool``
over the request pool's Mamba state (:data:`LINEAR_HYBRID`). A rank of a PP stage builds them
for its own layers only, as SGLang's ``layer_info`` slices them (global layer ids,
``start_layer``). The ``KVArgs`` and the manager come from SGLang's own
``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue._init_kv_manager``, run on
a stand-in for the scheduler that carries the pools (the only part that is not SGLang's).

Every prefill rank's buffers are shards of one model-wide tensor per layer, generated from
the request (numpy only, independently of pdwire), so each decode rank's expected bytes are
its own shard of the same tensors.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

KV_HEADS = 4
HEAD_DIM = 8
PAGE = 4
WINDOW = 8  # SWA window in tokens
# Mamba2: conv channels x | B | C = intermediate | n_groups*state | n_groups*state
INTERMEDIATE, N_GROUPS, STATE, M_HEADS, M_HEAD_DIM, KERNEL = 32, 4, 4, 4, 8, 4
CONV_GROUPS = [INTERMEDIATE, N_GROUPS * STATE, N_GROUPS * STATE]
POOL_TOKENS = 512
MAMBA_SLOTS = 4
AUX_ITEMS = 8


@dataclass(frozen=True)
class Model:
    """Which of the model's layers (global ids) hold what, and the pools SGLang builds for it."""

    pools: str  # "swa": SWAKVPool + Mamba in the request pool; "linear": HybridLinearKVPool
    num_layers: int
    mamba: tuple[int, ...]
    full: tuple[int, ...]
    swa: tuple[int, ...] = ()

    def stage(self, pp: int, pp_rank: int) -> tuple[int, int]:
        """[start, end) of a PP stage (an even split, as SGLang's ``make_layers`` does here)."""
        per = self.num_layers // pp
        return pp_rank * per, self.num_layers if pp_rank == pp - 1 else (pp_rank + 1) * per


# a hybrid with sliding-window and full attention and Mamba2: SWAKVPool, the Mamba state in a
# HybridReqToTokenPool (SGLang's KVArgs carry no layer ids for either)
SWA_HYBRID = Model("swa", 6, mamba=(0, 3), full=(2, 5), swa=(1, 4))
# Mamba2 + full attention in a HybridLinearKVPool (Nemotron-H's, Qwen3-Next's pools): SGLang's
# KVArgs carry the Mamba layer ids and a full-attention-relative prefill start layer
LINEAR_HYBRID = Model("linear", 6, mamba=(0, 1, 3), full=(2, 4, 5))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Rank:
    role: str
    tp_size: int
    tp_rank: int
    kv_pool: Any
    req_pool: Any
    metadata: Any
    manager: Any
    context: Any
    next_page: int = 1  # page 0 is SGLang's padding page
    next_slot: int = 1
    next_aux: int = 0
    rooms: dict[int, dict[str, Any]] = field(default_factory=dict)
    pp_size: int = 1
    pp_rank: int = 0
    # the layers this rank holds (global ids, in the order of its pools' buffers)
    full_layers: list[int] = field(default_factory=list)
    swa_layers: list[int] = field(default_factory=list)
    mamba_layers: list[int] = field(default_factory=list)
    dp_size: int = 1  # DP attention: the rank's DP group
    dp_rank: int = 0

    # ---------------------------------------------------------------- memory views

    def k_layer(self, pool: Any, layer_local: int) -> torch.Tensor:
        return pool.k_buffer[layer_local]  # [tokens, heads, head_dim]

    def alloc_pages(self, n: int) -> np.ndarray:
        pages = np.arange(self.next_page, self.next_page + n, dtype=np.int32)
        # not contiguous across requests: skip a page so runs break
        self.next_page += n + 1
        assert self.next_page * PAGE <= POOL_TOKENS // 2, "test pool too small"
        return pages

    def alloc_slot(self) -> int:
        slot = self.next_slot
        self.next_slot += 1
        assert slot <= MAMBA_SLOTS
        return slot

    def alloc_aux(self) -> int:
        idx = self.next_aux
        self.next_aux += 1
        return idx


def _server_args(
    role: str, tp: int, bootstrap_port: int, http_port: int, pp: int = 1, dp: int = 1,
    replicas: bool = False, **extra: Any,
) -> Any:  # fmt: skip
    """An engine's arguments; with ``dp`` > 1, DP attention: ``dp`` groups of ``tp`` attention
    ranks (SGLang's TP size is then ``tp * dp``), or with ``replicas`` a DP controller's ``dp``
    replicas of TP ``tp``."""
    from sglang.srt.server_args import ServerArgs

    if dp > 1:
        extra.update(dp_size=dp, enable_dp_attention=not replicas)
    extra.setdefault("host", "127.0.0.1")
    return ServerArgs(
        model_path="dummy",  # like SGLang's own test topologies: no model is loaded
        tp_size=tp if replicas else tp * dp,
        pp_size=pp,
        **extra,
        disaggregation_mode=role,
        disaggregation_transfer_backend="pdwire",
        disaggregation_bootstrap_port=bootstrap_port,
        port=http_port,
        device="cpu",
    )


def _pools(model: Model, tp: int, start: int, end: int) -> tuple[Any, Any, Any, Any]:
    """The pools SGLang builds for the layers [start, end) of one PP stage: its own layers with
    their global ids (``layer_info``), ``start_layer`` where the pool takes one."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    def own(ids: tuple[int, ...]) -> list[int]:
        return [i for i in ids if start <= i < end]

    shape = Mamba2StateShape.create(
        tp_world_size=tp, intermediate_size=INTERMEDIATE, n_groups=N_GROUPS, num_heads=M_HEADS,
        head_dim=M_HEAD_DIM, state_size=STATE, conv_kernel=KERNEL, conv_shard_groups=CONV_GROUPS,
    )  # fmt: skip
    params = Mamba2CacheParams(
        shape=shape,
        layers=list(model.mamba),
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
    )
    req_pool = HybridReqToTokenPool(
        size=MAMBA_SLOTS, mamba_size=MAMBA_SLOTS, mamba_spec_state_size=0, max_context_len=POOL_TOKENS,
        device="cpu", enable_memory_saver=False, cache_params=params, mamba_layer_ids=own(model.mamba),
        enable_mamba_extra_buffer=False, enable_overlap_schedule=False, start_layer=start,
    )  # fmt: skip
    if model.pools == "swa":
        kv_pool = SWAKVPool(
            size=POOL_TOKENS, size_swa=POOL_TOKENS // 2, page_size=PAGE, dtype=torch.bfloat16,
            head_num=KV_HEADS // tp, head_dim=HEAD_DIM, swa_attention_layer_ids=own(model.swa),
            full_attention_layer_ids=own(model.full), device="cpu",
        )  # fmt: skip
    else:
        kv_pool = HybridLinearKVPool(
            size=POOL_TOKENS, dtype=torch.bfloat16, page_size=PAGE, head_num=KV_HEADS // tp,
            head_dim=HEAD_DIM, full_attention_layer_ids=own(model.full), device="cpu",
            mamba_pool=req_pool.mamba_pool, start_layer=start,
        )  # fmt: skip
    metadata = MetadataBuffers(
        AUX_ITEMS, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
    )
    layers = SimpleNamespace(full=own(model.full), swa=own(model.swa), mamba=own(model.mamba))
    return kv_pool, req_pool, metadata, layers


def _scheduler_stand_in(
    model: Model, tp_rank: int, pp_rank: int, kv_pool: Any, req_pool: Any, metadata: Any, sa: Any
) -> Any:
    """The attributes SGLang's ``_init_kv_manager`` reads from its queue and scheduler."""
    from sglang.srt.disaggregation.utils import TransferBackend

    model_config = SimpleNamespace(
        num_hidden_layers=model.num_layers,
        get_total_num_kv_heads=lambda: KV_HEADS,
        # model-wide, as SGLang's ModelConfig has them (hf_text_config: a linear hybrid's)
        hf_text_config=SimpleNamespace(full_attention_layer_ids=list(model.full)),
        full_attention_layer_ids=list(model.full) if model.swa else None,
        swa_attention_layer_ids=list(model.swa) if model.swa else None,
    )
    scheduler = SimpleNamespace(
        rust_server=None, server_args=sa, model_config=model_config, req_to_token_pool=req_pool,
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16")),
        enable_hisparse=False,
    )  # fmt: skip
    return SimpleNamespace(
        token_to_kv_pool=kv_pool, draft_token_to_kv_pool=None, metadata_buffers=metadata, tp_rank=tp_rank,
        pp_rank=pp_rank, scheduler=scheduler, transfer_backend=TransferBackend("pdwire"),
        is_mla_backend=False, req_to_token_pool=req_pool, enable_staging=False,
    )  # fmt: skip


def make_rank(
    role: str, tp: int, tp_rank: int, bootstrap_port: int, http_port: int,
    model: Model = SWA_HYBRID, pp: int = 1, pp_rank: int = 0, dp: int = 1, dp_rank: int = 0,
    replicas: bool = False, **server_args: Any,
) -> Rank:  # fmt: skip
    """One scheduler rank: attention TP rank ``tp_rank`` of DP group ``dp_rank`` in PP stage
    ``pp_rank`` (SGLang's launcher places it at world rank ``tp * dp * pp_rank + tp * dp_rank +
    tp_rank``), holding the stage's own layers; with ``replicas``, TP rank ``tp_rank`` of the DP
    controller's replica ``dp_rank`` (world rank ``tp * pp_rank + tp_rank`` of its own world)."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.runtime_context import SpawnRanks, create_context, use_context

    start, end = model.stage(pp, pp_rank)
    sa = _server_args(role, tp, bootstrap_port, http_port, pp=pp, dp=dp, replicas=replicas, **server_args)
    if replicas:
        engine_tp_rank = tp_rank
        spawn = SpawnRanks(world_rank=tp * pp_rank + tp_rank, dp_rank=dp_rank)
    else:
        engine_tp_rank = tp * dp_rank + tp_rank
        spawn = SpawnRanks(world_rank=tp * dp * pp_rank + engine_tp_rank)
    ctx = create_context(sa, role="scheduler", ranks=spawn)
    with use_context(ctx):
        kv_pool, req_pool, metadata, layers = _pools(model, tp, start, end)
        stand_in = _scheduler_stand_in(model, engine_tp_rank, pp_rank, kv_pool, req_pool, metadata, sa)
        init = (
            PrefillBootstrapQueue._init_kv_manager
            if role == "prefill"
            else DecodePreallocQueue._init_kv_manager
        )
        manager = init(stand_in)
    return Rank(
        role, tp, tp_rank, kv_pool, req_pool, metadata, manager, ctx, pp_size=pp, pp_rank=pp_rank,
        full_layers=layers.full, swa_layers=layers.swa, mamba_layers=layers.mamba, dp_size=dp,
        dp_rank=dp_rank,
    )  # fmt: skip


# ---------------------------------------------------------------- model-wide content


def _rng(room: int, what: str) -> np.random.Generator:
    # a stable seed: prefill and decode may be different processes (str hashes are salted per process)
    return np.random.default_rng(zlib.crc32(f"{room}/{what}".encode()))


def full_kv(room: int, what: str, tokens: int) -> np.ndarray:
    """[tokens, KV_HEADS, HEAD_DIM] bf16 bit patterns of one layer's K or V."""
    return _rng(room, what).integers(0, 1 << 16, size=(tokens, KV_HEADS, HEAD_DIM), dtype=np.uint16)


def full_conv(room: int, layer: int) -> np.ndarray:
    """[conv_dim, KERNEL-1] bf16 bit patterns, channels x | B | C unsharded."""
    return _rng(room, f"conv{layer}").integers(
        0, 1 << 16, size=(sum(CONV_GROUPS), KERNEL - 1), dtype=np.uint16
    )


def full_temporal(room: int, layer: int) -> np.ndarray:
    return _rng(room, f"ssm{layer}").integers(0, 1 << 32, size=(M_HEADS, M_HEAD_DIM, STATE), dtype=np.uint32)


def aux_bytes(room: int, nbytes: int) -> np.ndarray:
    return _rng(room, "aux").integers(0, 256, size=nbytes, dtype=np.uint8)


def conv_shard(full: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """A rank's conv channels: its share of each of x, B and C, concatenated."""
    parts, off = [], 0
    for g in CONV_GROUPS:
        share = g // tp
        parts.append(full[off + rank * share : off + (rank + 1) * share])
        off += g
    return np.concatenate(parts)


def _as_u16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _as_u32(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int32).numpy().view(np.uint32)


def swa_window_start(seq_len: int) -> int:
    return max(0, seq_len - WINDOW) // PAGE * PAGE


class Request:
    """One request's pages, SWA window pages, Mamba slot and aux item on one rank, and its
    content there: every region named by its global layer."""

    def __init__(self, rank: Rank, room: int, seq_len: int) -> None:
        self.rank, self.room, self.seq_len = rank, room, seq_len
        n_pages = -(-seq_len // PAGE)
        self.pages = rank.alloc_pages(n_pages)
        w0 = swa_window_start(seq_len)
        # the window's pages in the SWA pool
        self.swa_pages = rank.alloc_pages(n_pages - w0 // PAGE) if rank.swa_layers else None
        self.slot = rank.alloc_slot()
        self.aux = rank.alloc_aux()

    def heads(self) -> slice:
        per = KV_HEADS // self.rank.tp_size
        return slice(self.rank.tp_rank * per, (self.rank.tp_rank + 1) * per)

    def token_rows(self, pages: np.ndarray, n_tokens: int, first_token: int = 0) -> np.ndarray:
        tok = np.arange(first_token, first_token + n_tokens)
        return pages[(tok - first_token) // PAGE] * PAGE + (tok - first_token) % PAGE

    # ------------------------------------------------------------ what the rank holds

    def _kv_rows(self) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
        """(what, the pool's bytes of one layer's K or V, the request's rows there, the rows' content)."""
        out = []
        rows = self.token_rows(self.pages, self.seq_len)
        full_pool = self.rank.kv_pool.full_kv_pool
        for local, layer in enumerate(self.rank.full_layers):
            for kv in ("k", "v"):
                buf = _as_u16(getattr(full_pool, f"{kv}_buffer")[local])
                want = full_kv(self.room, f"full{layer}-{kv}", self.seq_len)[:, self.heads()]
                out.append((f"kv {kv} layer {layer}", buf, rows, want))
        if self.swa_pages is not None:
            w0 = swa_window_start(self.seq_len)
            swa_rows = self.token_rows(self.swa_pages, self.seq_len - w0)
            swa_pool = self.rank.kv_pool.swa_kv_pool
            for local, layer in enumerate(self.rank.swa_layers):
                for kv in ("k", "v"):
                    buf = _as_u16(getattr(swa_pool, f"{kv}_buffer")[local])
                    want = full_kv(self.room, f"swa{layer}-{kv}", self.seq_len)[w0:, self.heads()]
                    out.append((f"swa {kv} layer {layer}", buf, swa_rows, want))
        return out

    def regions(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(what, the rank's bytes now, the bytes it must hold) for every part of the request."""
        out = [(what, buf[rows], want) for what, buf, rows, want in self._kv_rows()]
        mamba = self.rank.req_pool.mamba_pool.mamba_cache
        per = M_HEADS // self.rank.tp_size
        for local, layer in enumerate(self.rank.mamba_layers):
            conv = _as_u16(mamba.conv[0][local, self.slot])
            want = conv_shard(full_conv(self.room, layer), self.rank.tp_size, self.rank.tp_rank)
            out.append((f"conv layer {layer}", conv, want))
            ssm = _as_u32(mamba.temporal[local, self.slot])
            want = full_temporal(self.room, layer)[self.rank.tp_rank * per : (self.rank.tp_rank + 1) * per]
            out.append((f"ssm layer {layer}", ssm, want))
        aux = self._aux_view()
        out.append(("aux", aux, aux_bytes(self.room, aux.size)))
        return out

    def _aux_view(self) -> np.ndarray:
        mb = self.rank.metadata
        return mb.output_ids[self.aux].view(torch.uint8).numpy()

    def fill(self) -> None:
        """Write the request's content into the rank's memory (prefill: the prompt's KV and state)."""
        for _what, now, want in self.regions():
            now[...] = want  # the Mamba slot and the aux item are views
        for _what, buf, rows, want in self._kv_rows():
            buf[rows] = want  # token rows are a fancy index: write through

    def mismatches(self) -> list[str]:
        return [what for what, now, want in self.regions() if not np.array_equal(now, want)]

    # ------------------------------------------------------------ SGLang's index payloads

    def state_indices(self) -> list[Any]:
        """What prefill.py / decode.py compute per state type (``_swa_payload``, ``_mamba_payload``)."""
        out: list[Any] = []
        for t in self.rank.manager.kv_args.state_types:
            if t.value == "swa":
                assert self.swa_pages is not None
                out.append(self.swa_pages.copy())
            elif t.value == "mamba":
                out.append([np.asarray(self.slot, dtype=np.int32)])
            else:
                out.append(None)
        return out


def min_poll(polls: list[int]) -> int:
    """SGLang's all-reduce of polls over a TP group (``_all_reduce_polls``: MIN)."""
    return min(int(p) for p in polls)


class EngineThread(threading.Thread):
    """One engine's scheduler thread: runs ``fn`` and keeps what it raised."""

    def __init__(self, name: str, fn: Any) -> None:
        super().__init__(name=name, daemon=True)
        self.fn = fn
        self.error: BaseException | None = None
        self.result: Any = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:
            self.error = exc


class PrefillProcess:
    """A prefill engine in its own process (``prefill_process.py``: SGLang's bootstrap server and
    ``p`` ranks). Its stdout is read on a thread of its own, so every wait for one of its lines
    has its own timeout (:meth:`next_line`); its stderr goes to ``stderr_path``."""

    def __init__(
        self, p: int, bootstrap_port: int, http_port: int, rooms: dict[int, int], stderr_path: Path,
        stall: bool = False,
    ) -> None:  # fmt: skip
        self.stderr_path = stderr_path
        args = [sys.executable, "-m", "tests.sglang.backend.prefill_process", str(p), str(bootstrap_port),
                str(http_port), json.dumps(rooms), *(["stall"] if stall else [])]  # fmt: skip
        with stderr_path.open("w") as errors:
            self.proc = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=errors, text=True, env=dict(os.environ),
                cwd=Path(__file__).resolve().parents[3],
            )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="prefill-process-stdout", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # EOF: the process closed its stdout (ended)

    def _stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]

    def next_line(self, prefix: str, timeout: float) -> str:
        """The next line starting with ``prefix`` (the engines log to stdout too: NIXL's INFO lines
        are skipped), within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"prefill process: no {prefix!r} line within {timeout}s: {self._stderr()}"
                )
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(
                    f"prefill process ended (rc {self.proc.poll()}) before {prefix!r}: {self._stderr()}"
                )
            if line.startswith(prefix):
                return line.strip()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL (nothing of it runs any more: no teardown, no goodbye), and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
