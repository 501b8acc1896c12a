"""Dense tiny Llama, 1 prefill + 1 decode engine, same TP, through PdwireConnector and vLLM's own
NixlConnector: the disaggregated tokens equal one engine's, decode really loaded every prompt
through the connector (vLLM's own count), many requests at once, a version-skewed prefill
refused by name, and a prefill engine killed with requests in flight."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm import harness as h
from tests.vllm import tiny_models as tm
from tests.vllm.engines.conftest import (
    MAX_TOKENS,
    PDWIRE_ENV,
    PROMPT_LEN,
    FuturePrefill,
    References,
    kv_usage,
    nixl_config,
    nixl_env,
    pdwire_config,
    settle,
    start,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

BLOCK = 32
DECODE_ROOM_TIMEOUT_S = 15.0  # how long decode waits for a prefill that went silent


class Engines:
    def __init__(self, engines: list[h.Engine]) -> None:
        self.prefill, self.decode, self.victim, self.nixl_prefill, self.nixl_decode = engines


@pytest.fixture(scope="module")
def engines(models: dict[str, str], engine_logs: Path) -> Iterator[Engines]:
    m = models[tm.DENSE]
    started = start(
        [
            h.EngineSpec(
                m, "pdwire-prefill", cpus="0", kv_transfer_config=pdwire_config("kv_producer"), env=PDWIRE_ENV
            ),
            h.EngineSpec(
                m,
                "pdwire-decode",
                cpus="1",
                kv_transfer_config=pdwire_config("kv_consumer", pdwire_room_timeout_s=DECODE_ROOM_TIMEOUT_S),
                env=PDWIRE_ENV,
            ),
            h.EngineSpec(
                m, "pdwire-victim", cpus="0", kv_transfer_config=pdwire_config("kv_producer"), env=PDWIRE_ENV
            ),
            h.EngineSpec(
                m, "nixl-prefill", cpus="0", kv_transfer_config=nixl_config("kv_producer"), env=nixl_env()
            ),
            h.EngineSpec(
                m, "nixl-decode", cpus="1", kv_transfer_config=nixl_config("kv_consumer"), env=nixl_env()
            ),
        ],
        engine_logs,
    )
    try:
        yield Engines(started)
    finally:
        for e in started:
            e.close()


def test_pdwire_tokens_equal_one_engine_and_nixl_connector(
    references: References, engines: Engines, dense_prompts: dict[str, list[int]]
) -> None:
    before = h.external_prompt_tokens(engines.decode.metrics())
    pre, results = h.run_pd(engines.prefill, engines.decode, dense_prompts, MAX_TOKENS)
    expected = references.tokens(tm.DENSE, dense_prompts)
    assert h.tokens(results) == expected
    _, nixl = h.run_pd(engines.nixl_prefill, engines.nixl_decode, dense_prompts, MAX_TOKENS)
    assert h.tokens(nixl) == expected
    # decode loaded every prompt token through the connector: it did not silently recompute
    assert h.external_prompt_tokens(engines.decode.metrics()) - before == len(dense_prompts) * PROMPT_LEN
    for r in pre.values():
        assert r.kv_transfer_params is not None and r.kv_transfer_params["pdwire_num_tokens"] == PROMPT_LEN
    stats = engines.prefill.connector_stats()
    assert stats["rooms_ok"] >= len(dense_prompts) and stats["failures"] == []
    assert stats["bytes_posted"] >= len(dense_prompts) * 3 * 2 * 32768  # 3 blocks of 2 layers each
    assert settle(lambda: kv_usage(engines.prefill) == 0)  # prefill's blocks came back once the rooms ended


def test_many_concurrent_requests_of_different_lengths(references: References, engines: Engines) -> None:
    prompts = {}
    for i, n in enumerate([1, 31, 32, 33, 64, 95, 128, 200, 257, 300, 17, 80, 160, 2, 63, 129]):
        prompts.update(h.random_prompts(1, n, seed=100 + i, prefix=f"conc{n}"))
    before = h.external_prompt_tokens(engines.decode.metrics())
    _, results = h.run_pd(engines.prefill, engines.decode, prompts, MAX_TOKENS)
    assert h.tokens(results) == references.tokens(tm.DENSE, prompts)
    loaded = h.external_prompt_tokens(engines.decode.metrics()) - before
    # vLLM computes at least one prompt token itself: a 1-token prompt is computed, not loaded
    assert loaded == sum(len(p) for p in prompts.values() if len(p) > 1)
    assert settle(lambda: kv_usage(engines.decode) == 0)


def test_a_version_skewed_prefill_is_refused_by_name_and_decode_keeps_serving(
    references: References, engines: Engines, dense_prompts: dict[str, list[int]], engine_logs: Path
) -> None:
    future = FuturePrefill()
    try:
        prompt = next(iter(dense_prompts.values()))
        req = h.decode_request("skewed", prompt, MAX_TOKENS, future.params(424242, PROMPT_LEN, BLOCK))
        started = time.monotonic()
        (result,) = engines.decode.generate([req], timeout_s=120).values()
        assert result.finish_reason == "error"  # kv_load_failure_policy=fail: refused, not hung
        assert time.monotonic() - started < 60
        assert future.hellos and future.hellos[0].role.name == "DECODE"
    finally:
        future.close()
    log = (engine_logs / "pdwire-decode.log").read_text(errors="replace")
    refusal = [line for line in log.splitlines() if "skewed" in line and "refused" in line]
    assert refusal and "HANDSHAKE" in refusal[0] and "no common protocol version" in refusal[0], refusal
    assert "the peer reads 2.0" in refusal[0], refusal  # the skew, by name
    assert settle(lambda: kv_usage(engines.decode) == 0)
    # the refused peer left decode healthy
    _, ok = h.run_pd(engines.prefill, engines.decode, dense_prompts, MAX_TOKENS)
    assert h.tokens(ok) == references.tokens(tm.DENSE, dense_prompts)


def test_a_decode_request_aborted_while_its_room_is_live_frees_its_blocks_once_fenced(
    references: References, engines: Engines, dense_prompts: dict[str, list[int]]
) -> None:
    # a room the prefill engine never had: decode's room stays live (waiting) until aborted
    prompt = next(iter(dense_prompts.values()))
    (real,) = engines.prefill.generate([h.prefill_request("abort-probe", prompt)]).values()
    assert real.kv_transfer_params is not None
    room = int(real.kv_transfer_params["pdwire_room"]) ^ 0x5A5A
    params = dict(real.kv_transfer_params, pdwire_room=str(room))
    decode = engines.decode
    decode.submit([h.decode_request("aborted", prompt, MAX_TOKENS, params)])
    assert settle(lambda: kv_usage(decode) > 0, 30)  # its blocks are allocated, waiting for KV
    time.sleep(1.0)
    decode.abort(["aborted"])
    # pdwire aborts the room, the prefill rank acknowledges (a fence), the blocks come back:
    # well before decode's own room timeout would have ended it
    started = time.monotonic()
    assert settle(lambda: kv_usage(decode) == 0, DECODE_ROOM_TIMEOUT_S)
    assert time.monotonic() - started < DECODE_ROOM_TIMEOUT_S
    _, after = h.run_pd(engines.prefill, decode, dense_prompts, MAX_TOKENS)
    assert h.tokens(after) == references.tokens(tm.DENSE, dense_prompts)


def test_a_killed_prefill_fails_its_requests_without_hanging_or_leaking_blocks(
    references: References, engines: Engines, dense_prompts: dict[str, list[int]]
) -> None:
    victim, decode = engines.victim, engines.decode
    # a first request links decode to the victim, so the kill hits an established peer
    warm = dict(list(dense_prompts.items())[:1])
    _, ok = h.run_pd(victim, decode, warm, MAX_TOKENS)
    assert h.tokens(ok) == references.tokens(tm.DENSE, warm)
    doomed = h.random_prompts(3, 150, seed=9, prefix="doomed")
    pre = victim.generate([h.prefill_request(rid, p) for rid, p in doomed.items()])
    victim.kill()
    started = time.monotonic()
    results = decode.generate(
        [
            h.decode_request(rid, p, MAX_TOKENS, pre[rid].kv_transfer_params or {})
            for rid, p in doomed.items()
        ],
        timeout_s=240,
    )
    waited = time.monotonic() - started
    assert {r.finish_reason for r in results.values()} == {"error"}
    assert waited < 4 * DECODE_ROOM_TIMEOUT_S + 30, waited
    assert settle(lambda: kv_usage(decode) == 0)  # the failed requests' blocks were freed, once fenced
    _, after = h.run_pd(engines.prefill, decode, dense_prompts, MAX_TOKENS)
    assert h.tokens(after) == references.tokens(tm.DENSE, dense_prompts)
