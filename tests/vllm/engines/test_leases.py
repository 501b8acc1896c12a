"""Leases with real engines (dense tiny Llama, TP 1 -> TP 1): a decode queue longer than the
prefill's room timeout, whose rooms the decode engine renews while its requests wait, and decode
requests that never ask for their room (aborted in the queue, computed locally because their
parameters do not match), whose prefill blocks come back at once instead of at the timeout.

The decode engine runs one sequence at a time (``max_num_seqs=1``) and long local requests
hold that slot, so pdwire's requests wait in vLLM's queue, unallocated, for as long as the test
says. The prefill engine computes the reference tokens too (requests without transfer parameters
run there like on any single engine)."""

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
    kv_usage,
    pdwire_config,
    settle,
    start,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

LEASE_S = 4.0  # the prefill's pdwire_room_timeout_s: how long it holds a room nobody renews
QUEUED_S = 2.5 * LEASE_S  # how long the queued requests wait behind the blocker
BLOCKER_TOKENS = 1000  # local requests (the model's 1024 positions), several: longer than QUEUED_S
BLOCKERS = 3


class Engines:
    def __init__(self, engines: list[h.Engine]) -> None:
        self.prefill, self.decode = engines


@pytest.fixture(scope="module")
def engines(models: dict[str, str], engine_logs: Path) -> Iterator[Engines]:
    m = models[tm.DENSE]
    started = start(
        [
            h.EngineSpec(
                m,
                "lease-prefill",
                cpus="0",
                kv_transfer_config=pdwire_config("kv_producer", pdwire_room_timeout_s=LEASE_S),
                env=PDWIRE_ENV,
                max_model_len=1024,
            ),
            h.EngineSpec(
                m,
                "lease-decode",
                cpus="1",
                kv_transfer_config=pdwire_config("kv_consumer"),
                env=PDWIRE_ENV,
                max_num_seqs=1,
                max_model_len=1024,
            ),
        ],
        engine_logs,
    )
    try:
        e = Engines(started)
        # a first request connects decode to prefill: the handshake is not part of any lease
        warm = h.random_prompts(1, PROMPT_LEN, seed=40, prefix="lease-warm")
        _, got = h.run_pd(e.prefill, e.decode, warm, MAX_TOKENS)
        assert h.tokens(got) == h.tokens(h.run_single(e.prefill, warm, MAX_TOKENS))
        yield e
    finally:
        for engine in started:
            engine.close()


def block_decode(decode: h.Engine, name: str) -> list[str]:
    """Take decode's one sequence slot with long local requests, queued before anything else."""
    names = [f"{name}-{i}" for i in range(BLOCKERS)]
    decode.submit([h.Request(n, [5, 6, 7, 8 + i], BLOCKER_TOKENS) for i, n in enumerate(names)])
    assert settle(lambda: kv_usage(decode) > 0, 30)
    return names


def unblock(decode: h.Engine, names: list[str]) -> None:
    decode.abort(names)
    blockers = decode.results(names).values()
    assert any(b.finish_reason == "abort" for b in blockers)  # they held the slot until now


def test_a_decode_queue_longer_than_the_room_timeout_succeeds_token_identically(engines: Engines) -> None:
    prompts = h.random_prompts(3, PROMPT_LEN, seed=41, prefix="lease-q")
    expected = h.tokens(h.run_single(engines.prefill, prompts, MAX_TOKENS))
    before = engines.prefill.connector_stats()
    blockers = block_decode(engines.decode, "blocker-q")
    pre = engines.prefill.generate([h.prefill_request(rid, p) for rid, p in prompts.items()])
    engines.decode.submit(
        [
            h.decode_request(rid, p, MAX_TOKENS, pre[rid].kv_transfer_params or {})
            for rid, p in prompts.items()
        ]
    )
    time.sleep(QUEUED_S)  # past the room timeout: without renewals every room would have expired
    assert kv_usage(engines.prefill) > 0  # the rooms still hold their blocks on prefill
    unblock(engines.decode, blockers)
    results = engines.decode.results(list(prompts))
    assert h.tokens(results) == expected
    for r in results.values():
        assert r.finish_reason == "length" and r.ttft_s is not None and r.ttft_s > QUEUED_S > LEASE_S
    after = engines.prefill.connector_stats()
    assert (
        after["rooms_ok"] - before["rooms_ok"] == len(prompts)
        and after["rooms_failed"] == before["rooms_failed"]
    )
    # renewed by a few Leases (one a third of the lease), not one per step
    leases = after["leases"] - before["leases"]
    assert QUEUED_S / LEASE_S * 3 - 2 <= leases <= QUEUED_S / LEASE_S * 3 * 2 + 4, leases
    assert after["rooms_renewed"] - before["rooms_renewed"] >= len(prompts) * (leases - 2)
    assert settle(lambda: kv_usage(engines.prefill) == 0 and kv_usage(engines.decode) == 0)


def released_within(engines: Engines, act: object, before: dict[str, object]) -> float:
    """Seconds from now until the prefill's room failed and its blocks are free again."""
    t0 = time.monotonic()
    assert settle(
        lambda: (
            engines.prefill.connector_stats()["rooms_failed"] > before["rooms_failed"]  # type: ignore[operator]
            and kv_usage(engines.prefill) == 0
        ),
        LEASE_S,
    ), f"{act}: prefill still holds the room"
    return time.monotonic() - t0


def test_a_decode_request_aborted_in_the_queue_frees_the_prefill_blocks_within_a_second(
    engines: Engines,
) -> None:
    prompts = h.random_prompts(1, PROMPT_LEN, seed=42, prefix="lease-abort")
    ((rid, prompt),) = prompts.items()
    blockers = block_decode(engines.decode, "blocker-a")
    try:
        (pre,) = engines.prefill.generate([h.prefill_request(rid, prompt)]).values()
        engines.decode.submit([h.decode_request(rid, prompt, MAX_TOKENS, pre.kv_transfer_params or {})])
        time.sleep(1.0)  # queued (its room held on prefill), never allocated
        assert kv_usage(engines.prefill) > 0
        before = engines.prefill.connector_stats()
        engines.decode.abort([rid])
        took = released_within(engines, "an aborted queued request", before)
        assert took < 1.0 + 0.5, took  # within a second (the probes themselves take some of it)
        (aborted,) = engines.decode.results([rid]).values()
        assert aborted.finish_reason == "abort"
        failures = engines.prefill.connector_stats()["failures"]
        assert any("declined" in f or "ended in the decode queue" in f for f in failures), failures
    finally:
        unblock(engines.decode, blockers)
    assert settle(lambda: kv_usage(engines.decode) == 0)


def test_a_request_decode_computes_locally_frees_the_prefill_blocks_at_once(engines: Engines) -> None:
    prompts = h.random_prompts(1, PROMPT_LEN, seed=43, prefix="lease-local")
    expected = h.tokens(h.run_single(engines.prefill, prompts, MAX_TOKENS))
    ((rid, prompt),) = prompts.items()
    (pre,) = engines.prefill.generate([h.prefill_request(rid, prompt)]).values()
    assert pre.kv_transfer_params is not None
    before = engines.prefill.connector_stats()
    # a count that does not match this prompt: decode computes it itself and never asks for the room
    params = dict(pre.kv_transfer_params, pdwire_num_tokens=PROMPT_LEN - 1)
    t0 = time.monotonic()
    (got,) = engines.decode.generate([h.decode_request(rid, prompt, MAX_TOKENS, params)]).values()
    assert h.tokens({rid: got}) == expected
    took = released_within(engines, "a locally computed request", before)
    assert time.monotonic() - t0 < LEASE_S, took  # released, not expired
    assert engines.prefill.connector_stats()["rooms_ok"] == before["rooms_ok"]
