"""Mamba2 + attention hybrid (GraniteMoeHybrid), 1 prefill + 1 decode engine, same TP, with the
hybrid memory allocator: KV pages and the Mamba state slot (conv and SSM state in one page,
aliasing the attention blocks) through PdwireConnector, tokens equal to one engine and to
NixlConnector. vLLM CPU's Mamba2 kernel fails with several prefills in one batch, so these
engines serve one request at a time."""

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


@pytest.fixture(scope="module")
def engines(models: dict[str, str], engine_logs: Path) -> Iterator[list[h.Engine]]:
    m = models[tm.HYBRID]
    one = {"block_size": None, "max_num_seqs": 1}
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
