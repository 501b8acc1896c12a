"""Prefill and decode of different TP sizes through PdwireConnector, checked token for token.

vLLM 0.32's CPU build keeps, per attention block and KV head, that head's K page and then its V
page; the connector describes that with a KV head stride (protocol 1.4) and pdwire's planner
slices it by head. The dense Llama has 2 KV heads (one per rank at TP 2); the Mamba2 + attention
hybrid's Mamba state is TP-sharded too (conv channels x | B | C, SSM heads), so every prefill
rank writes its share of the state slot. vLLM's CPU build runs TP 2 with its OpenMP threads
bound one per core. NixlConnector, which reads per head, moves dense TP 2 -> 1 as the baseline;
its handshake starves with several requests on 2 cores, so one prompt goes there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm import harness as h
from tests.vllm import tiny_models as tm
from tests.vllm.engines.conftest import (
    MAX_TOKENS,
    PDWIRE_ENV,
    PROMPT_LEN,
    References,
    kv_usage,
    nixl_config,
    nixl_env,
    pdwire_config,
    settle,
    start,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]


def _pair(
    model: str, name: str, prefill_tp: int, decode_tp: int, *, hybrid: bool = False
) -> list[h.EngineSpec]:
    # the hybrid: one request at a time (batches are test_hybrid.py's), the allocator's own block size
    engine: dict[str, Any] = {"block_size": None, "max_num_seqs": 1} if hybrid else {}

    def cpus(tp: int, alone: str) -> str:
        return "0|1" if tp == 2 else alone

    return [
        h.EngineSpec(
            model,
            f"{name}-tp{prefill_tp}-prefill",
            tp=prefill_tp,
            cpus=cpus(prefill_tp, "0"),
            # the lease: blocks of requests no decode takes come back after it
            kv_transfer_config=pdwire_config("kv_producer", pdwire_room_timeout_s=60.0),
            env=PDWIRE_ENV,
            **engine,
        ),
        h.EngineSpec(
            model,
            f"{name}-tp{decode_tp}-decode",
            tp=decode_tp,
            cpus=cpus(decode_tp, "1"),
            kv_transfer_config=pdwire_config("kv_consumer"),
            env=PDWIRE_ENV,
            **engine,
        ),
    ]


def _engines(specs: list[h.EngineSpec], logs: Path) -> Iterator[list[h.Engine]]:
    started = start(specs, logs)
    try:
        yield started
    finally:
        for e in started:
            e.close()


@pytest.fixture  # one test each: its engines stop before the next test's start
def dense_2_to_1(models: dict[str, str], engine_logs: Path) -> Iterator[list[h.Engine]]:
    m = models[tm.DENSE]
    nixl = [
        h.EngineSpec(
            m,
            "tp2-nixl-prefill",
            tp=2,
            cpus="0|1",
            kv_transfer_config=nixl_config("kv_producer"),
            env=nixl_env(),
        ),
        h.EngineSpec(
            m, "tp1-nixl-decode", cpus="0", kv_transfer_config=nixl_config("kv_consumer"), env=nixl_env()
        ),
    ]
    yield from _engines(_pair(m, "dense", 2, 1) + nixl, engine_logs)


@pytest.fixture  # one test each: its engines stop before the next test's start
def dense_1_to_2(models: dict[str, str], engine_logs: Path) -> Iterator[list[h.Engine]]:
    yield from _engines(_pair(models[tm.DENSE], "dense", 1, 2), engine_logs)


@pytest.fixture  # one test each: its engines stop before the next test's start
def hybrid_2_to_1(models: dict[str, str], engine_logs: Path) -> Iterator[list[h.Engine]]:
    yield from _engines(_pair(models[tm.HYBRID], "hybrid", 2, 1, hybrid=True), engine_logs)


@pytest.fixture  # one test each: its engines stop before the next test's start
def hybrid_1_to_2(models: dict[str, str], engine_logs: Path) -> Iterator[list[h.Engine]]:
    yield from _engines(_pair(models[tm.HYBRID], "hybrid", 1, 2, hybrid=True), engine_logs)


def _check_pd(
    prefill: h.Engine,
    decode: h.Engine,
    prompts: dict[str, list[int]],
    expected: dict[str, list[int]],
    prefill_tp: int,
    loaded_per_prompt: int,
) -> None:
    before = h.external_prompt_tokens(decode.metrics())
    pre, results = h.run_pd(prefill, decode, prompts, MAX_TOKENS)
    for r in pre.values():
        assert r.kv_transfer_params is not None
        assert len(r.kv_transfer_params["pdwire_endpoints"]) == prefill_tp
    assert h.tokens(results) == expected
    # every prompt token (the hybrid: all but the last) came through the connector
    assert h.external_prompt_tokens(decode.metrics()) - before == len(prompts) * loaded_per_prompt
    assert settle(lambda: kv_usage(decode) == 0 and kv_usage(prefill) == 0, 90)


def test_dense_prefill_tp2_to_decode_tp1(
    references: References, dense_2_to_1: list[h.Engine], dense_prompts: dict[str, list[int]]
) -> None:
    prefill, decode, nixl_prefill, nixl_decode = dense_2_to_1
    expected = references.tokens(tm.DENSE, dense_prompts)
    _check_pd(prefill, decode, dense_prompts, expected, 2, PROMPT_LEN)
    one = dict(list(dense_prompts.items())[:1])
    _, nixl = h.run_pd(nixl_prefill, nixl_decode, one, MAX_TOKENS)
    assert h.tokens(nixl) == {k: expected[k] for k in one}


def test_dense_prefill_tp1_to_decode_tp2(
    references: References, dense_1_to_2: list[h.Engine], dense_prompts: dict[str, list[int]]
) -> None:
    prefill, decode = dense_1_to_2
    _check_pd(prefill, decode, dense_prompts, references.tokens(tm.DENSE, dense_prompts), 1, PROMPT_LEN)


def test_hybrid_prefill_tp2_to_decode_tp1(
    references: References, hybrid_2_to_1: list[h.Engine], hybrid_prompts: dict[str, list[int]]
) -> None:
    prefill, decode = hybrid_2_to_1
    expected = references.tokens(tm.HYBRID, hybrid_prompts)
    _check_pd(prefill, decode, hybrid_prompts, expected, 2, PROMPT_LEN - 1)


def test_hybrid_prefill_tp1_to_decode_tp2(
    references: References, hybrid_1_to_2: list[h.Engine], hybrid_prompts: dict[str, list[int]]
) -> None:
    prefill, decode = hybrid_1_to_2
    expected = references.tokens(tm.HYBRID, hybrid_prompts)
    _check_pd(prefill, decode, hybrid_prompts, expected, 1, PROMPT_LEN - 1)
