"""A hybrid MLA model (Kimi-Linear's pools: MLA latents + KDA linear state) through pdwire's
SGLang backend, between different attention-TP sizes.

SGLang 0.5.23 builds a ``HybridLinearKVPool`` over an ``MLATokenToKVPool`` for the
full-attention layers and a ``HybridReqToTokenPool`` whose Mamba pool holds the KDA state
(``KimiLinearCacheParams``: conv ``[K-1, q|k|v channels]``, recurrent state ``[heads, d, d]``).
SGLang's ``is_mla_backend`` is False for the hybrid pool; its ``KVArgs.is_hybrid_mla_backend``
says the latents are MLA. pdwire carries the latents as its MLA KV pool (replicated: every
decode rank gets the whole latent from one prefill rank) and the KDA state sharded (conv by
its q|k|v sub-blocks on every one of the K-1 rows, the recurrent state by heads).

Real pools on the CPU, ``KVArgs`` and managers from SGLang's own ``_init_kv_manager``, its
bootstrap server, senders and receivers driven in the schedulers' order (``test_transfer``'s
engines), NIXL agents per rank; every decode rank's latents, KDA slot and aux item compared
byte for byte with its share of model-wide content.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

warnings.filterwarnings("ignore")

from tests.sglang.backend import harness as h  # noqa: E402
from tests.sglang.backend import test_transfer as tt  # noqa: E402

pytest.importorskip("nixl")

sglang = tt.sglang  # the module's plugin-loaded SGLang classes

# Kimi-Linear-like: KDA layers 0, 1, 3, 4; MLA layers 2, 5
MODEL = h.Model("linear", 6, mamba=(0, 1, 3, 4), full=(2, 5))
LORA, ROPE = 16, 8  # MLA latent: kv_lora_rank + qk_rope_head_dim
HEADS, HEAD_DIM, KERNEL = 4, 8, 4  # KDA: heads (q, k and v alike), head dim, conv kernel
GROUPS = [HEADS * HEAD_DIM] * 3  # conv channels q | k | v


def _pools(tp: int, start: int = 0, end: int = MODEL.num_layers) -> tuple[Any, Any, Any, Any]:
    """What SGLang's model runner builds for Kimi-Linear on one attention-TP rank of the PP stage
    holding the layers [start, end) (global ids, ``start_layer``)."""
    from sglang.srt.configs.mamba_utils import KimiLinearCacheParams, KimiLinearStateShape, Mamba2StateDType
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    def own(ids: tuple[int, ...]) -> list[int]:
        return [i for i in ids if start <= i < end]

    shape = KimiLinearStateShape.create(
        tp_world_size=tp, num_heads=HEADS, head_dim=HEAD_DIM, conv_kernel_size=KERNEL
    )
    params = KimiLinearCacheParams(
        shape=shape, layers=list(MODEL.mamba),
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
    )  # fmt: skip
    req_pool = HybridReqToTokenPool(
        size=h.MAMBA_SLOTS, mamba_size=h.MAMBA_SLOTS, mamba_spec_state_size=0,
        max_context_len=h.POOL_TOKENS, device="cpu", enable_memory_saver=False, cache_params=params,
        mamba_layer_ids=own(MODEL.mamba), enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False, start_layer=start,
    )  # fmt: skip
    kv_pool = HybridLinearKVPool(
        size=h.POOL_TOKENS, dtype=torch.bfloat16, page_size=h.PAGE, head_num=1, head_dim=LORA + ROPE,
        full_attention_layer_ids=own(MODEL.full), device="cpu", mamba_pool=req_pool.mamba_pool,
        use_mla=True, kv_lora_rank=LORA, qk_rope_head_dim=ROPE, start_layer=start,
    )  # fmt: skip
    metadata = MetadataBuffers(
        h.AUX_ITEMS, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
    )
    return kv_pool, req_pool, metadata, SimpleNamespace(full=own(MODEL.full), mamba=own(MODEL.mamba))


def make_rank(
    role: str, tp: int, tp_rank: int, bootstrap_port: int, http_port: int, pp: int = 1, pp_rank: int = 0
) -> h.Rank:
    """A scheduler rank with Kimi-Linear's pools (PP stage ``pp_rank``'s layers), its manager
    from SGLang's ``_init_kv_manager``."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.runtime_context import SpawnRanks, create_context, use_context

    sa = h._server_args(role, tp, bootstrap_port, http_port, pp=pp)
    ctx = create_context(sa, role="scheduler", ranks=SpawnRanks(world_rank=tp * pp_rank + tp_rank))
    with use_context(ctx):
        kv_pool, req_pool, metadata, layers = _pools(tp, *MODEL.stage(pp, pp_rank))
        # SGLang's own is_mla_backend(pool) for the hybrid pool: False (the stand-in says so)
        stand_in = h._scheduler_stand_in(MODEL, tp_rank, pp_rank, kv_pool, req_pool, metadata, sa)
        init = PrefillBootstrapQueue if role == "prefill" else DecodePreallocQueue
        manager = init._init_kv_manager(stand_in)
    return h.Rank(
        role, tp, tp_rank, kv_pool, req_pool, metadata, manager, ctx, pp_size=pp, pp_rank=pp_rank,
        full_layers=layers.full, mamba_layers=layers.mamba,
    )  # fmt: skip


def latent(room: int, layer: int, tokens: int) -> np.ndarray:
    """[tokens, 1, LORA + ROPE] bf16 bit patterns of one layer's MLA latents (every rank's)."""
    return h._rng(room, f"mla{layer}").integers(0, 1 << 16, size=(tokens, 1, LORA + ROPE), dtype=np.uint16)


def kda_conv(room: int, layer: int) -> np.ndarray:
    """[K-1, q|k|v channels] bf16 bit patterns, unsharded."""
    return h._rng(room, f"kconv{layer}").integers(0, 1 << 16, size=(KERNEL - 1, sum(GROUPS)), dtype=np.uint16)


def kda_state(room: int, layer: int) -> np.ndarray:
    return h._rng(room, f"kssm{layer}").integers(
        0, 1 << 32, size=(HEADS, HEAD_DIM, HEAD_DIM), dtype=np.uint32
    )


def conv_columns(tp: int, rank: int) -> np.ndarray:
    """A rank's conv channels: its share of each of q, k and v."""
    cols, off = [], 0
    for g in GROUPS:
        share = g // tp
        cols.append(np.arange(off + rank * share, off + (rank + 1) * share))
        off += g
    return np.concatenate(cols)


class MlaRequest(h.Request):
    """A request's latent pages, KDA slot and aux item on one rank."""

    def _kv_rows(self) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
        rows = self.token_rows(self.pages, self.seq_len)
        pool = self.rank.kv_pool.full_kv_pool
        return [
            (
                f"latent layer {layer}",
                h._as_u16(pool.kv_buffer[local]),
                rows,
                latent(self.room, layer, self.seq_len),
            )
            for local, layer in enumerate(self.rank.full_layers)
        ]

    def regions(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        out = [(what, buf[rows], want) for what, buf, rows, want in self._kv_rows()]
        cache = self.rank.req_pool.mamba_pool.mamba_cache
        tp, r = self.rank.tp_size, self.rank.tp_rank
        per = HEADS // tp
        for local, layer in enumerate(self.rank.mamba_layers):
            conv = h._as_u16(cache.conv[0][local, self.slot])  # [K-1, this rank's q|k|v]
            out.append((f"kda conv layer {layer}", conv, kda_conv(self.room, layer)[:, conv_columns(tp, r)]))
            ssm = h._as_u32(cache.temporal[local, self.slot])
            out.append(
                (f"kda state layer {layer}", ssm, kda_state(self.room, layer)[r * per : (r + 1) * per])
            )
        aux = self._aux_view()
        out.append(("aux", aux, h.aux_bytes(self.room, aux.size)))
        return out


class MlaPair(tt.Pair):
    """``test_transfer``'s prefill and decode engines, with Kimi-Linear's pools."""

    def __init__(self, sglang: Any, p: int, d: int, pp: int = 1, decode_pp: int = 1) -> None:
        self.sg = sglang
        self.port = h.free_port()
        self.server = sglang["server"](host="127.0.0.1", port=self.port)
        self.addr = f"127.0.0.1:{self.port}"
        http_p, http_d = h.free_port(), h.free_port()
        self.prefill = [
            make_rank("prefill", p, r, self.port, http_p, pp, s) for s in range(pp) for r in range(p)
        ]
        self.decode = [
            make_rank("decode", d, r, self.port, http_d, decode_pp, s)
            for s in range(decode_pp)
            for r in range(d)
        ]


def test_the_hybrid_pool_is_described_as_mla_latents_and_sharded_kda_state(sglang: Any) -> None:
    """What SGLang's KVArgs and pdwire's memory say for the hybrid pool: SGLang's is_mla_backend
    False, its hybrid flag True; pdwire's KV pool MLA with one buffer per full layer, the KDA
    state one Mamba component, conv sharded on its q|k|v sub-blocks under K-1 rows."""
    pair = MlaPair(sglang, 1, 2)
    try:
        for rank in pair.prefill + pair.decode:
            mgr = rank.manager
            assert (mgr.is_mla_backend, mgr.kv_args.is_hybrid_mla_backend) == (False, True)
            kv = mgr.memory.kv
            assert kv is not None and kv.is_mla and kv.num_layers == len(MODEL.full)
            assert kv.bytes_per_page == h.PAGE * (LORA + ROPE) * 2
            (state,) = mgr.memory.state
            assert state.kind.value == "mamba" and state.layer_ids == MODEL.mamba
            conv, ssm = state.tensors
            tp = rank.tp_size
            assert (conv.sharded_axis_size, conv.outer_rows, conv.sub_block_sizes) == (
                sum(GROUPS) // tp, KERNEL - 1, tuple(GROUPS),
            )  # fmt: skip
            assert (ssm.sharded_axis_size, ssm.outer_rows) == (HEADS // tp, 1)
    finally:
        pair.close()


def _run(pair: MlaPair, rooms: dict[int, int], sglang: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h, "Request", MlaRequest)  # test_transfer's engines build h.Request
    pre_out: dict[int, int] = {}
    dec_out: dict[int, int] = {}
    dec = h.EngineThread("decode-scheduler", tt._decode_engine(pair, rooms, dec_out))
    pre = h.EngineThread("prefill-scheduler", tt._prefill_engine(pair, rooms, pre_out, chunk_pages=2))
    dec.start()
    pre.start()
    dec.join(300)
    pre.join(300)
    assert dec.error is None, repr(dec.error)
    assert pre.error is None, repr(pre.error)
    KVPoll = sglang["KVPoll"]
    assert {r: dec_out[r] for r in rooms} == {r: KVPoll.Success for r in rooms}, dec_out
    assert pre_out == {r: KVPoll.Success for r in rooms}


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2)])
def test_hybrid_mla_requests_move_byte_for_byte(
    sglang: Any, monkeypatch: pytest.MonkeyPatch, p: int, d: int
) -> None:
    pair = MlaPair(sglang, p, d)
    try:
        _run(pair, {4001 + 10 * p + d: 22, 5003 + 10 * p + d: 9}, sglang, monkeypatch)
    finally:
        pair.close()


def _plain_rank(sglang: Any, pool_cls: Any) -> Any:
    """A prefill rank whose whole KV pool is ``pool_cls`` (an MLA pool of 2 layers), its manager
    from SGLang's own ``_init_kv_manager`` (what that raised, if anything)."""
    port = h.free_port()
    server = sglang["server"](host="127.0.0.1", port=port)
    # SGLang's server cannot be closed before its thread made its loop (a refusal comes at once)
    tt._wait("the bootstrap server's loop", lambda: getattr(server, "_loop", None) is not None)
    try:
        return _plain_manager(pool_cls, port)
    finally:
        server.close()


def _plain_manager(pool_cls: Any, port: int) -> Any:
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import MetadataBuffers, is_mla_backend
    from sglang.srt.runtime_context import SpawnRanks, create_context, use_context

    sa = h._server_args("prefill", 1, port, h.free_port())
    with use_context(create_context(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))):
        shape = (
            {"kv_lora_rank": 32, "qk_rope_head_dim": 16}
            if "MLA" in pool_cls.__name__
            else {"head_num": 2, "head_dim": 32}
        )
        pool = pool_cls(
            size=h.POOL_TOKENS, page_size=h.PAGE, dtype=torch.bfloat16, layer_num=2, device="cpu",
            enable_memory_saver=False, **shape,
        )  # fmt: skip
        metadata = MetadataBuffers(
            h.AUX_ITEMS, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
        )
        stand_in = h._scheduler_stand_in(MODEL, 0, 0, pool, None, metadata, sa)
        stand_in.is_mla_backend = is_mla_backend(pool)
        return PrefillBootstrapQueue._init_kv_manager(stand_in)


def test_pool_kinds_pdwire_does_not_carry_are_refused_at_start_up_by_name(sglang: Any) -> None:
    """An FP4 MLA pool (its block scales are not in KVArgs: only the packed latents would
    move) is refused by its class name; the plain MLA pool of the same shape is carried. An FP4
    MHA pool and a no-op pool, on which SGLang's own ``_init_kv_manager`` fails with an
    AttributeError naming nothing, are refused by name before it runs."""
    from sglang.srt.mem_cache.memory_pool import (
        MHATokenToKVPoolFP4,
        MLATokenToKVPool,
        MLATokenToKVPoolFP4,
        NoOpMHATokenToKVPool,
    )

    manager = _plain_rank(sglang, MLATokenToKVPool)
    try:
        assert manager.memory.kv is not None and manager.memory.kv.is_mla
    finally:
        manager.teardown()
    with pytest.raises(ValueError, match=r"pdwire: SGLang pool MLATokenToKVPoolFP4: its FP4 block scales"):
        _plain_rank(sglang, MLATokenToKVPoolFP4)
    with pytest.raises(ValueError, match=r"pdwire: SGLang pool MHATokenToKVPoolFP4: its FP4 block scales"):
        _plain_rank(sglang, MHATokenToKVPoolFP4)
    with pytest.raises(ValueError, match=r"pdwire: SGLang pool NoOpMHATokenToKVPool: it stores no KV"):
        _plain_rank(sglang, NoOpMHATokenToKVPool)


def test_pools_known_by_their_kvargs_only_are_refused_by_name() -> None:
    """Without the plugin's pool classes (a hook that could not read the pools), KVArgs still
    give DeepSeek-V4's bucketed pool and NPU pools away."""
    from pdwire.integrations.sglang.memory import refused_pool_kind

    assert refused_pool_kind(SimpleNamespace()) is None
    dsv4 = refused_pool_kind(SimpleNamespace(mla_compression_ratios=[0, 4, 128]))
    assert dsv4 is not None and dsv4.startswith("DeepSeekV4TokenToKVPool: its KV is bucketed")
    npu = refused_pool_kind(SimpleNamespace(kv_buf_groups=2))
    assert npu is not None and npu.startswith("an NPU pool (KVArgs.kv_buf_groups)")


@pytest.mark.parametrize(("p", "d", "decode_pp"), [(1, 1, 1), (1, 1, 2), (2, 1, 2)])
def test_hybrid_mla_prefill_pipeline_stages_byte_for_byte(
    sglang: Any, monkeypatch: pytest.MonkeyPatch, p: int, d: int, decode_pp: int
) -> None:
    """Prefill PP 2 (each stage 2 KDA layers and 1 MLA layer, pools for its own layers) -> decode
    PP 1 holding all of them, or PP 2 stage to stage: latents at their full-attention-relative
    place, KDA state by its layer ids."""
    from tests.sglang.backend.test_decode_pp import _run_stages

    monkeypatch.setattr(h, "Request", MlaRequest)
    pair = MlaPair(sglang, p, d, pp=2, decode_pp=decode_pp)
    try:
        for rank in pair.prefill + pair.decode:
            lo, _ = MODEL.stage(rank.pp_size, rank.pp_rank)
            assert rank.manager.memory.first_layer == sum(1 for i in MODEL.full if i < lo)
        rooms = {6001 + 100 * decode_pp + 10 * p + d: 22, 6503 + 100 * decode_pp + 10 * p + d: 9}
        dec_out, pre_out = _run_stages(pair, rooms, 2)
        KVPoll = sglang["KVPoll"]
        assert {r: dec_out[r] for r in rooms} == {r: KVPoll.Success for r in rooms}, dec_out
        assert pre_out == {r: KVPoll.Success for r in rooms}
    finally:
        pair.close()
