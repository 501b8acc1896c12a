"""An MLA model (the tiny DeepSeek-V2 of ``tiny_models``) through PdwireConnector at equal and
different TP sizes, checked token for token against one engine.

vLLM 0.32's CPU build runs it with its ``CPU_MLA`` backend (block size 16): per layer one latent
of 512 + 64 elements per token, the same on every TP rank. The connector describes it as pdwire's
MLA pool, copied whole: prefill TP 2 -> decode TP 1 takes it from one prefill rank (the other is
a dummy that only frees its blocks), prefill TP 1 -> decode TP 2 writes every decode rank.

Engines: one reference engine, a TP 1 prefill and a TP 1 decode for the whole module; the TP 2
prefill (which feeds the TP 1 decode) and the TP 2 decode (fed by the TP 1 prefill) each live for
their own test only, so no two TP 2 engines spin on the two cores at once (see test_tp.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdwire.integrations.vllm.memory import LayoutError, MlaGroup, vllm_groups
from tests.vllm import harness as h
from tests.vllm import tiny_models as tm
from tests.vllm.engines.conftest import MAX_TOKENS, PDWIRE_ENV, kv_usage, pdwire_config, settle, start

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

BLOCK = 16  # CPU_MLA's only block size
PROMPT_LEN = 90  # not a multiple of the block size: the last page is partly filled
LATENT_BYTES = (512 + 64) * 4  # per token and layer (float32)
LAYERS = 2


def _spec(model: str, name: str, role: str | None, *, tp: int = 1, cpus: str) -> h.EngineSpec:
    kv = None
    if role is not None:
        # the lease: blocks of requests no decode takes come back after it
        extra = {"pdwire_room_timeout_s": 60.0} if role == "kv_producer" else {}
        kv = pdwire_config(role, **extra)
    return h.EngineSpec(
        model, name, tp=tp, cpus=cpus, block_size=BLOCK, kv_transfer_config=kv, env=PDWIRE_ENV
    )


def _engines(specs: list[h.EngineSpec], logs: Path) -> Iterator[list[h.Engine]]:
    started = start(specs, logs)
    try:
        yield started
    finally:
        for e in started:
            e.close()


@pytest.fixture(scope="module")
def mla_prompts() -> dict[str, list[int]]:
    return h.random_prompts(4, PROMPT_LEN, seed=3, prefix="mla")


@pytest.fixture(scope="module")
def base(models: dict[str, str], engine_logs: Path) -> Iterator[list[h.Engine]]:
    """The reference engine, the TP 1 prefill and the TP 1 decode."""
    m = models[tm.MLA]
    yield from _engines(
        [
            _spec(m, "mla-single", None, cpus="0"),
            _spec(m, "mla-tp1-prefill", "kv_producer", cpus="0"),
            _spec(m, "mla-tp1-decode", "kv_consumer", cpus="1"),
        ],
        engine_logs,
    )


@pytest.fixture(scope="module")
def expected(base: list[h.Engine], mla_prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    tokens = h.tokens(h.run_single(base[0], mla_prompts, MAX_TOKENS))
    # a model whose greedy output ignores the prompt (or repeats one token) would prove nothing
    assert len({tuple(t) for t in tokens.values()}) == len(mla_prompts)
    assert all(len(set(t)) > MAX_TOKENS // 2 for t in tokens.values()), tokens
    return tokens


@pytest.fixture  # its own test only: stopped before the next TP 2 engine starts
def prefill_tp2(models: dict[str, str], engine_logs: Path) -> Iterator[h.Engine]:
    for engines in _engines(
        [_spec(models[tm.MLA], "mla-tp2-prefill", "kv_producer", tp=2, cpus="0|1")], engine_logs
    ):
        yield engines[0]


@pytest.fixture  # its own test only: stopped before the next TP 2 engine starts
def decode_tp2(models: dict[str, str], engine_logs: Path) -> Iterator[h.Engine]:
    for engines in _engines(
        [_spec(models[tm.MLA], "mla-tp2-decode", "kv_consumer", tp=2, cpus="0|1")], engine_logs
    ):
        yield engines[0]


def _check_pd(
    prefill: h.Engine,
    decode: h.Engine,
    prompts: dict[str, list[int]],
    expected: dict[str, list[int]],
    prefill_tp: int,
) -> None:
    before = h.external_prompt_tokens(decode.metrics())
    pre, results = h.run_pd(prefill, decode, prompts, MAX_TOKENS)
    for r in pre.values():
        assert r.kv_transfer_params is not None
        assert len(r.kv_transfer_params["pdwire_endpoints"]) == prefill_tp
        assert r.kv_transfer_params["pdwire_block_size"] == BLOCK
    assert h.tokens(results) == expected
    # every prompt token came through the connector (MLA has no state: prefill computes them all)
    assert h.external_prompt_tokens(decode.metrics()) - before == len(prompts) * PROMPT_LEN
    # the blocks come back on both sides (with prefill TP 2, the dummy rank frees its blocks too)
    assert settle(lambda: kv_usage(decode) == 0 and kv_usage(prefill) == 0, 90)


def _latent_bytes(prompts: dict[str, list[int]]) -> int:
    """What one decode rank receives: every page of the prompt, each a block of latents, per layer."""
    return len(prompts) * LAYERS * math.ceil(PROMPT_LEN / BLOCK) * BLOCK * LATENT_BYTES


def test_mla_prefill_tp1_to_decode_tp1(
    base: list[h.Engine], expected: dict[str, list[int]], mla_prompts: dict[str, list[int]]
) -> None:
    _, prefill, decode = base
    sent = prefill.connector_stats()["bytes_posted"]
    _check_pd(prefill, decode, mla_prompts, expected, 1)
    stats = prefill.connector_stats()
    assert stats["bytes_posted"] - sent == _latent_bytes(mla_prompts)
    assert stats["failures"] == []


def test_mla_prefill_tp2_to_decode_tp1(
    base: list[h.Engine],
    prefill_tp2: h.Engine,
    expected: dict[str, list[int]],
    mla_prompts: dict[str, list[int]],
) -> None:
    _check_pd(prefill_tp2, base[2], mla_prompts, expected, 2)


def test_mla_prefill_tp1_to_decode_tp2(
    base: list[h.Engine],
    decode_tp2: h.Engine,
    expected: dict[str, list[int]],
    mla_prompts: dict[str, list[int]],
) -> None:
    prefill = base[1]
    sent = prefill.connector_stats()["bytes_posted"]
    _check_pd(prefill, decode_tp2, mla_prompts, expected, 1)
    # the latent is replicated: the one prefill rank writes it to both decode ranks
    assert prefill.connector_stats()["bytes_posted"] - sent == 2 * _latent_bytes(mla_prompts)


# ---- vLLM's own MLA specs (no engine) -------------------------------------------------------------


def _groups_of(spec: Any, dcp: int = 1) -> list[Any]:
    config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=dcp))
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.attn", "model.layers.1.attn"])
    return vllm_groups(config, SimpleNamespace(transfer_groups=[group]))


def test_vllm_mla_specs_are_one_latent_per_token_or_refused_by_name() -> None:
    import torch
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, MLAAttentionSpec, SparseCacheRole

    latent = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 576, "dtype": torch.float32}
    layers = ("model.layers.0.attn", "model.layers.1.attn")
    assert _groups_of(MLAAttentionSpec(**latent)) == [MlaGroup(layers, BLOCK, LATENT_BYTES)]
    padded = MLAAttentionSpec(**latent, alignment=5000)  # the page padded: the latent stays what it is
    assert padded.page_size_bytes > BLOCK * LATENT_BYTES
    assert _groups_of(padded) == [MlaGroup(layers, BLOCK, LATENT_BYTES)]
    refused = [
        (MLAAttentionSpec(**latent, tokens_per_state=4, model_version="deepseek_v4"), {}, "DeepSeek-V4"),
        (MLAAttentionSpec(**latent, cache_role=SparseCacheRole.INDEXER), {}, "indexer"),
        (MLAAttentionSpec(**latent), {"dcp": 2}, "decode context parallel"),
        (HiddenStateCacheSpec(**latent), {}, "hidden-state"),
    ]
    for spec, kw, why in refused:
        with pytest.raises(LayoutError, match=f"MLA KV cache group .*{why}"):
            _groups_of(spec, **kw)
