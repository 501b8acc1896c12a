"""A prefill rank that stalls in the middle of posting a room (stopped, starved) and resumes past
the room's deadline posts nothing more of it: each post checks the room at that moment."""

from __future__ import annotations

import time
from typing import Any

from pdwire.demo.content import fill, full_tensors
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.backends.values import TransferHandle
from pdwire.runtime.engine import FailureKind, Status
from tests.e2e.conftest import SPEC, room_slots, send, worker_pair

ROOM_S = 1.0


class StallsAfterFirstPost(LocalBackend):
    """The rank stops for longer than the room timeout right after its first post returns."""

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        self.posted: list[int] = []

    def _post(self, handle: TransferHandle, table: Any, notification: bytes) -> None:
        super()._post(handle, table, notification)
        self.posted.append(handle.id)
        if len(self.posted) == 1:
            time.sleep(ROOM_S * 1.5)  # as SIGSTOP between two posts of one batch would


def test_a_rank_that_stalls_mid_batch_past_the_deadline_posts_nothing_more() -> None:
    pb = StallsAfterFirstPost(agent_name="pre")
    # decode speaks 1.3: each part is a post of its own (at 1.4 the batch would be one write)
    with worker_pair(pb, prefill_kw={"room_timeout_s": ROOM_S}, decode_versions=((1, 3),)) as p:
        tokens = 40  # one KV chunk, two state components and aux: four posts in one batch
        src = room_slots(tokens)
        fill(p.pc, src, full_tensors(SPEC, 1, 9, tokens))
        p.ask(9, room_slots(tokens))
        p.step_until(lambda: p.pre.status(9) is Status.WAITING_FOR_INPUT, "the TransferRequest")
        send(p.pre, 9, src)  # posts the batch; the first post stalls past the deadline
        assert pb.posted == [1], "parts were posted after the room's deadline"
        p.step_until(lambda: bool(p.released), "prefill to release the room")
        ((room, status, failure),) = p.released
        assert room == 9 and status is Status.FAILED and failure is not None
        assert failure.kind is FailureKind.TIMEOUT and "before this part was posted" in failure.detail
