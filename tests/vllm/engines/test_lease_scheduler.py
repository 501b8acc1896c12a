"""PdwireConnector's decode scheduler side of leases, without engines (vLLM's own request
statuses, pdwire's connector classes): which queued requests it holds and releases through the
connector metadata, and that a released request never asks for its room later."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from pdwire.integrations.vllm import connector as vc
from pdwire.integrations.vllm import params as tp

pytestmark = pytest.mark.vllm

BLOCK, TOKENS = 32, 80


def scheduler() -> vc._Scheduler:
    config: Any = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(is_kv_producer=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    groups: Any = SimpleNamespace(
        state=[], windows={}, kv=0, block_size=BLOCK,
        split=lambda ids, n: (list(ids[0]), []), first_live_page=lambda n: float("inf"),
    )  # fmt: skip
    return vc._Scheduler(config, groups, "decode-engine")


def request(rid: str, room: int = 7, **params: Any) -> Any:
    handle = tp.PrefillHandle(room, "prefill-engine", ("tcp://127.0.0.1:1",), 1, TOKENS, BLOCK)
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=handle.to_params() | params,
        prompt_token_ids=list(range(TOKENS)),
        status=RequestStatus.WAITING,
    )


def blocks(n: int) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(range(n)),))


def test_a_queued_request_is_held_then_dropped_from_the_book_when_its_room_starts() -> None:
    s = scheduler()
    r = request("a")
    s.on_new_request(r)
    assert s.has_pending_push_work()  # the hold must reach the workers even on an idle engine
    meta = s.build_meta()
    assert [(h.request_id, h.room, h.prefill_engine_id) for h in meta.holds] == [("a", 7, "prefill-engine")]
    assert s.get_num_new_matched_tokens(r, 0) == (TOKENS, True)
    s.update_state_after_alloc(r, blocks(3), TOKENS)
    meta = s.build_meta()
    assert [x.room for x in meta.recvs] == [7] and meta.releases == []
    r.status = RequestStatus.FINISHED_ABORTED
    s.request_finished(r, ([0, 1, 2],))  # started: aborted as a live room, never released
    meta = s.build_meta()
    assert meta.aborts == ["a"] and meta.releases == []


def test_a_request_aborted_in_the_queue_releases_its_room_once() -> None:
    s = scheduler()
    r = request("b", room=9)
    s.on_new_request(r)
    s.build_meta()
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r, ([],)) == (False, None)  # nothing allocated: vLLM frees at once
    meta = s.build_meta()
    assert [(x.request_id, x.room) for x in meta.releases] == [("b", 9)]
    assert "decode queue" in meta.releases[0].why and meta.aborts == []
    s.request_finished(r, ([],))
    assert s.build_meta().releases == []


@pytest.mark.parametrize("why", ["mismatch", "nothing to load"])
def test_a_request_decode_computes_locally_releases_its_room_and_never_asks_later(why: str) -> None:
    s = scheduler()
    r = request("c", room=11, pdwire_num_tokens=TOKENS - 1) if why == "mismatch" else request("c", room=11)
    s.on_new_request(r)
    s.build_meta()
    if why == "mismatch":
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    else:  # a full local prefix hit: vLLM allocates with no external tokens
        s.update_state_after_alloc(r, blocks(3), 0)
    meta = s.build_meta()
    assert [x.room for x in meta.releases] == [11] and meta.recvs == []
    # preempted and scheduled again: it computes again, never asks for the released room
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, blocks(3), 0)
    r.status = RequestStatus.FINISHED_STOPPED
    s.request_finished(r, ([0, 1, 2],))
    meta = s.build_meta()
    assert meta.releases == [] and meta.recvs == [] and meta.aborts == []


def test_parameters_that_do_not_parse_hold_nothing() -> None:
    s = scheduler()
    r = request("d", pdwire_endpoints=["not-an-endpoint"])
    s.on_new_request(r)
    assert s.build_meta().holds == [] and not s.has_pending_push_work()
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # computed locally, by name in the log
    assert s.build_meta().releases == []
