"""Mamba2 + attention hybrid (GraniteMoeHybrid), 1 prefill + 1 decode engine, same TP, with the
hybrid memory allocator: KV pages and the Mamba state slot (conv and SSM state in one page,
aliasing the attention blocks) through PdwireConnector, tokens equal to one engine and to
NixlConnector, and concurrent requests batched on both engines (vLLM 0.32's CPU build batches
this model's prefills correctly: a plain engine's batch of four equals four single runs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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

BATCH = 4


@pytest.fixture(scope="module")
def engines(models: dict[str, str], engine_logs: Path) -> Iterator[list[h.Engine]]:
    m = models[tm.HYBRID]
    one = {"block_size": None, "max_num_seqs": BATCH}
    started = start(
        [
            h.EngineSpec(
                m,
                "hybrid-pdwire-prefill",
                cpus="0",
                kv_transfer_config=pdwire_config("kv_producer"),
                env=PDWIRE_ENV,
                **one,
            ),
            h.EngineSpec(
                m,
                "hybrid-pdwire-decode",
                cpus="1",
                kv_transfer_config=pdwire_config("kv_consumer"),
                env=PDWIRE_ENV,
                **one,
            ),
            h.EngineSpec(
                m,
                "hybrid-nixl-prefill",
                cpus="0",
                kv_transfer_config=nixl_config("kv_producer"),
                env=nixl_env(),
                **one,
            ),
            h.EngineSpec(
                m,
                "hybrid-nixl-decode",
                cpus="1",
                kv_transfer_config=nixl_config("kv_consumer"),
                env=nixl_env(),
                **one,
            ),
        ],
        engine_logs,
    )
    try:
        yield started
    finally:
        for e in started:
            e.close()


def test_hybrid_tokens_equal_one_engine_and_nixl_connector(
    references: References, engines: list[h.Engine], hybrid_prompts: dict[str, list[int]]
) -> None:
    prefill, decode, nixl_prefill, nixl_decode = engines
    expected = references.tokens(tm.HYBRID, hybrid_prompts)
    before = h.external_prompt_tokens(decode.metrics())
    pre, results = h.run_pd(prefill, decode, hybrid_prompts, MAX_TOKENS)
    assert h.tokens(results) == expected
    # prefill stops one token short (decode derives the last state itself), like vLLM's NIXL path
    for r in pre.values():
        assert (
            r.kv_transfer_params is not None and r.kv_transfer_params["pdwire_num_tokens"] == PROMPT_LEN - 1
        )
    assert h.external_prompt_tokens(decode.metrics()) - before == len(hybrid_prompts) * (PROMPT_LEN - 1)
    _, nixl = h.run_pd(nixl_prefill, nixl_decode, hybrid_prompts, MAX_TOKENS)
    assert h.tokens(nixl) == expected
    stats = prefill.connector_stats()
    assert stats["rooms_ok"] >= len(hybrid_prompts) and stats["failures"] == []
    assert settle(lambda: kv_usage(prefill) == 0 and kv_usage(decode) == 0)


def test_hybrid_concurrent_requests_batched_on_both_engines(
    references: References, engines: list[h.Engine]
) -> None:
    prefill, decode, _, _ = engines
    prompts = h.random_prompts(BATCH, PROMPT_LEN, seed=12, prefix="batched")
    expected = references.tokens(tm.HYBRID, prompts)  # one engine, one request at a time
    before = h.external_prompt_tokens(decode.metrics())
    _, results = h.run_pd(prefill, decode, prompts, MAX_TOKENS)  # all submitted at once
    assert h.tokens(results) == expected
    assert h.external_prompt_tokens(decode.metrics()) - before == BATCH * (PROMPT_LEN - 1)
    assert settle(lambda: kv_usage(prefill) == 0 and kv_usage(decode) == 0)
