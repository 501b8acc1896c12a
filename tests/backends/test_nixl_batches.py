"""NIXL adapter: a transfer split into several NIXL requests is final only when none is active.

The agent is wrapped so that each request's state is scripted: the first batch reports ERR while
the second still reports PROC. The transfer must stay PENDING (a FAILED now would let the caller
reuse memory the second batch is still writing), become FAILED with the engine's reason once the
second batch ended, and never send the notification.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from pdwire.runtime.backends import TransferState, available_backends, create_backend
from tests.backends.test_conformance import MiB, mib_table, source

pytestmark = pytest.mark.engine("nixl")


class _ScriptedAgent:
    """Every request starts in flight; then request 0 reports ERR and the others PROC until
    ``gate`` is set, then the truth."""

    def __init__(self, agent: Any, gate: threading.Event) -> None:
        self._agent, self._gate = agent, gate
        self._order: list[Any] = []
        self._done: set[int] = set()
        self.notified: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def initialize_xfer(self, *args: Any) -> Any:
        req = self._agent.initialize_xfer(*args)
        self._order.append(req)
        return req

    def transfer(self, req: Any) -> str:
        # started for real, but reported in flight: on one host the UCX engine can finish a small
        # write inside transfer() and answer DONE, and then no state below would ever be asked
        state = str(self._agent.transfer(req))
        if state == "DONE":
            self._done.add(id(req))  # NIXL is not asked again about a request it called DONE
        return state if state.startswith("ERR") else "PROC"

    def check_xfer_state(self, req: Any) -> str:
        if req is self._order[0]:
            return "ERR"
        if not self._gate.is_set():
            return "PROC"
        return "DONE" if id(req) in self._done else self._agent.check_xfer_state(req)

    def send_notif(self, agent: str, msg: bytes) -> None:
        self.notified.append(msg)
        self._agent.send_notif(agent, msg)


def test_an_error_in_one_batch_fails_the_transfer_only_after_the_others_ended() -> None:
    if "nixl" not in available_backends():
        pytest.fail("NIXL does not import here: CI must install it (./dev setup)")
    size = 4 * MiB
    a = create_backend("nixl", agent_name="nixl-batches-a", max_descs_per_xfer=2)
    b = create_backend("nixl", agent_name="nixl-batches-b")
    try:
        src = source(a, size)
        dst = b.allocate("dst", size)
        b.register([dst.region()])
        peer = a.add_peer(b.local_metadata())
        gate = threading.Event()
        agent = _ScriptedAgent(a._agent, gate)  # type: ignore[attr-defined]
        a._agent = agent  # type: ignore[attr-defined]
        h = a.post(peer, mib_table(src.address, dst.address, size), b"two-batches")  # 4 rows: 2 requests
        assert len(agent._order) == 2
        for _ in range(5):
            assert a.poll(h).state is TransferState.PENDING  # batch 0 failed, batch 1 may still write
        gate.set()
        final = a.wait(h, 30)
        assert final.state is TransferState.FAILED and "NIXL reported ERR" in final.reason, final
        assert agent.notified == []  # a failed transfer is never announced
        snapshot = dst.array.copy()
        a.release(h)
        assert np.array_equal(dst.array, snapshot)
    finally:
        a.close()
        b.close()
