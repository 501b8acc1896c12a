"""vLLM's defaults on both engines: prefix caching on and chunked prefill with prompts longer
than a chunk, and decode's ``kv_load_failure_policy=recompute``. A partial local prefix hit on
decode loads only the rest of the prompt through pdwire; a prompt prefilled in several chunks
moves whole; a request whose prefill engine was killed is recomputed by decode. Tokens equal to
one engine throughout."""

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
    References,
    kv_usage,
    pdwire_config,
    settle,
    start,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

CHUNK = 64  # tokens per chunked-prefill step (vLLM's max_num_batched_tokens)
BLOCK = 32
SMALL_POOL = 8  # blocks: one request of 80 + 40 tokens fits, four at once do not


@pytest.fixture(scope="module")
def engines(models: dict[str, str], engine_logs: Path) -> Iterator[list[h.Engine]]:
    m = models[tm.DENSE]
    common: dict[str, Any] = dict(enable_prefix_caching=True, max_num_batched_tokens=CHUNK, env=PDWIRE_ENV)
    # a room whose prefill is gone fails within its deadline, then decode recomputes it
    decode_config = {
        **pdwire_config("kv_consumer", pdwire_room_timeout_s=30.0),
        "kv_load_failure_policy": "recompute",
    }
    prefill_config = pdwire_config("kv_producer")
    started = start(
        [
            h.EngineSpec(m, "defaults-prefill", cpus="0", kv_transfer_config=prefill_config, **common),
            h.EngineSpec(m, "defaults-decode", cpus="1", kv_transfer_config=decode_config, **common),
            # a pool of SMALL_POOL blocks: concurrent requests outgrow it and vLLM preempts
            h.EngineSpec(
                m,
                "defaults-small-decode",
                cpus="1",
                kv_transfer_config=pdwire_config("kv_consumer"),
                kv_blocks=SMALL_POOL,
                max_model_len=(SMALL_POOL - 1) * BLOCK,  # vLLM keeps one block back
                **common,
            ),
        ],
        engine_logs,
    )
    try:
        yield started
    finally:
        for e in started:
            e.close()


def _loaded(decode: h.Engine, before: float) -> float:
    return h.external_prompt_tokens(decode.metrics()) - before


def test_a_prompt_prefilled_in_several_chunks_moves_whole(
    references: References, engines: list[h.Engine]
) -> None:
    prefill, decode, _ = engines
    prompts = h.random_prompts(2, 5 * CHUNK - 10, seed=21, prefix="long")  # five chunks each
    before = h.external_prompt_tokens(decode.metrics())
    _, results = h.run_pd(prefill, decode, prompts, MAX_TOKENS)
    assert h.tokens(results) == references.tokens(tm.DENSE, prompts)
    assert _loaded(decode, before) == sum(len(p) for p in prompts.values())


def test_a_partial_local_prefix_hit_loads_only_the_rest(
    references: References, engines: list[h.Engine]
) -> None:
    prefill, decode, _ = engines
    (first,) = h.random_prompts(1, 80, seed=22, prefix="first").values()
    _, warm = h.run_pd(prefill, decode, {"first": first}, MAX_TOKENS)  # decode now caches 2 blocks
    assert h.tokens(warm) == references.tokens(tm.DENSE, {"first": first})
    (tail,) = h.random_prompts(1, 30, seed=23).values()
    second = {"second": first[: 2 * BLOCK] + tail}  # 64 tokens decode holds, 30 it does not
    before = h.external_prompt_tokens(decode.metrics())
    _, results = h.run_pd(prefill, decode, second, MAX_TOKENS)
    assert h.tokens(results) == references.tokens(tm.DENSE, second)
    assert _loaded(decode, before) == len(tail)  # only the pages past decode's own prefix moved
    assert settle(lambda: kv_usage(prefill) == 0, 90)


def test_requests_preempted_on_decode_after_their_load_still_answer_right(
    references: References, engines: list[h.Engine]
) -> None:
    prefill, _, small = engines
    prompts = h.random_prompts(4, 80, seed=25, prefix="crowd")
    before = h.external_prompt_tokens(small.metrics())
    _, results = h.run_pd(prefill, small, prompts, 40)
    assert h.tokens(results) == references.tokens(tm.DENSE, prompts, 40)
    preempted = sum(v for k, v in small.metrics().items() if k.startswith("vllm:num_preemptions"))
    assert preempted > 0  # the pool really was outgrown
    assert _loaded(small, before) == 4 * 80  # each loaded once; a preempted one recomputes locally
    assert settle(lambda: kv_usage(small) == 0 and kv_usage(prefill) == 0, 90)


def test_decode_recomputes_a_request_whose_prefill_was_killed(
    references: References, engines: list[h.Engine]
) -> None:
    prefill, decode, _ = engines  # last in this module: it kills the prefill engine
    prompts = h.random_prompts(2, 90, seed=24, prefix="orphan")
    pre = prefill.generate([h.prefill_request(rid, p) for rid, p in prompts.items()])
    prefill.kill()
    before = h.external_prompt_tokens(decode.metrics())
    results = decode.generate(
        [
            h.decode_request(rid, p, MAX_TOKENS, pre[rid].kv_transfer_params or {})
            for rid, p in prompts.items()
        ],
        timeout_s=240,
    )
    assert {r.finish_reason for r in results.values()} <= {"length", "stop"}
    assert h.tokens(results) == references.tokens(tm.DENSE, prompts)
    assert _loaded(decode, before) == 0  # nothing came from the dead prefill: decode computed it all
    assert settle(lambda: kv_usage(decode) == 0, 90)
