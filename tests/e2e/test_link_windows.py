"""The windows of a decode rank's links: a link that closes (connect() again, a lost prefill rank,
a revocation) gives its windows back, so reconnects leave no mapping behind; link keys are
unique per backend.

In-process workers over real sockets (``worker_pair``); the backend's own counters
(``Backend.window_counts``, ``windows_released``) and this process's ``/proc/self/maps`` say what
is mapped. The same over real rank processes, many cycles: ``test_reconnect_soak.py``.
"""

from __future__ import annotations

import pytest

from pdwire.runtime.backends import Backend, available_backends, create_backend
from pdwire.runtime.engine import DecodeWorker, Status
from tests.e2e.conftest import (
    WorkerPair,
    decode_config,
    room_slots,
    send,
    serving,
    worker_pair,
)

BACKENDS = ["local", "nixl"]


def _backend(name: str, agent: str) -> Backend:
    if name not in available_backends():
        pytest.fail(f"backend {name} does not import here: CI must install it (./dev setup)")
    return create_backend(name, agent_name=agent)


def _maps() -> int:
    with open("/proc/self/maps", encoding="utf-8") as f:
        return sum(1 for _ in f)


def _room_ok(p: WorkerPair, room: int) -> None:
    slots = room_slots(8)
    p.ask(room, slots)
    send(p.pre, room, slots)
    p.step_until(lambda: any(r == room for r, _, _ in p.finished), f"room {room}")
    got = next(s for r, s, _ in p.finished if r == room)
    assert got is Status.SUCCESS, p.events


def _connect_again(p: WorkerPair) -> None:
    with serving(p.pre):
        p.group = p.dec.wait_ready(p.dec.connect([p.pre.endpoint], timeout_s=10))
    assert p.group.ready, p.group.error


@pytest.mark.parametrize("backend", BACKENDS)
def test_connecting_again_unmaps_the_replaced_links_windows(backend: str) -> None:
    with worker_pair(_backend(backend, "pre"), _backend(backend, "dec")) as p:
        _room_ok(p, 1)
        per_link, junk = p.db.window_counts()
        assert per_link >= 2 and junk == 0  # the caches and the receive staging buffer
        maps: list[int] = []
        for cycle in range(6):
            released = p.db.windows_released
            _connect_again(p)
            _room_ok(p, 10 + cycle)
            # the replaced link had no room in flight: its windows went at once, unrevoked
            assert p.db.windows_released - released == per_link
            assert p.db.window_counts() == (per_link, 0)
            assert p.dec.stats.revocations == 0
            maps.append(_maps())
        assert maps[-1] - maps[1] <= 2, maps  # no mapping per cycle (others' threads may add one)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replaced_link_with_a_room_in_flight_is_revoked_and_its_junk_unmapped_where_proven(
    backend: str,
) -> None:
    with worker_pair(_backend(backend, "pre"), _backend(backend, "dec")) as p:
        _room_ok(p, 1)
        per_link, _ = p.db.window_counts()
        for cycle in range(4):
            room = 20 + cycle
            p.ask(room, room_slots(8))  # asked, never produced: its writer never fences
            sent = cycle + 2
            p.step_until(lambda: p.dec.stats.requests_sent >= sent, "request sent")  # noqa: B023
            revocations = p.dec.stats.revocations
            _connect_again(p)
            assert p.dec.stats.revocations == revocations + 1  # the unfenced room revoked the rank
            p.step_until(lambda: room in p.slots_released, f"room {room}'s slots")  # noqa: B023
            _room_ok(p, 40 + cycle)  # the rank registered again with new windows and serves
            live, junk = p.db.window_counts()
            assert live == per_link
            # the prefill rank accepts a registration only once every older transfer to this
            # rank is final: junk revoked before it was sent is unmapped then
            assert p.db.registration_fences_older
            assert junk == 0, (cycle, junk)


def test_link_keys_are_unique_per_backend_across_workers() -> None:
    # Two decode workers on one backend: the second one's link to the same prefill rank must not
    # name (and so share, and later revoke or unmap) the first one's windows. The prefill rank
    # refuses its registration (the agent name is the first worker's), and the first serves on.
    with worker_pair() as p:
        per_link, _ = p.db.window_counts()
        first = {link.key for link in p.dec.links.registered.values()}
        second = DecodeWorker(decode_config(engine="dec2"), p.dc.memory, backend=p.db)
        try:
            g = second.connect([p.pre.endpoint], timeout_s=5)
            keys = {link.key for link in second.links._connecting}
            assert keys and not keys & first, (first, keys)
            assert p.db.window_counts()[0] > per_link  # its own windows, not the first one's
            while not g.failed:
                p.pre.step(2)
                second.step(2)
            assert "registered by dec/0" in (g.error or ""), g.error
            assert p.db.window_counts() == (per_link, 0)  # the refused link's windows went
            _room_ok(p, 7)
        finally:
            second.close()
