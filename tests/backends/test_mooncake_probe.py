"""Adding a Mooncake peer asks the peer's engine for its first buffer (to catch a session that
is not that peer); the call runs on the rank's loop, so an engine that does not answer must not
stall it: the probe gives up after ``connect_timeout_s`` and the peer is refused by name."""

from __future__ import annotations

import threading
import time

import pytest

from pdwire.runtime.backends.errors import PeerError
from pdwire.runtime.backends.mooncake import MooncakeBackend
from pdwire.runtime.descriptors import MemoryKind, Region


class StuckEngine:
    """Answers ``get_first_buffer_address`` only once released (Mooncake recovering a link)."""

    def __init__(self, address: int) -> None:
        self.address = address
        self.release = threading.Event()

    def get_first_buffer_address(self, session: str) -> int:
        self.release.wait(30)
        return self.address


class Listening:
    """What ``socket.create_connection`` returns when the session's port listens."""

    def close(self) -> None:
        pass


def probe_only(engine: object, timeout_s: float) -> MooncakeBackend:
    """A backend with just what the probe reads (no real engine: nothing else is called)."""
    b = object.__new__(MooncakeBackend)
    b._engine = engine  # type: ignore[attr-defined]
    b.connect_timeout_s = timeout_s
    return b


def test_an_engine_that_does_not_answer_is_given_up_on_after_the_connect_timeout() -> None:
    engine = StuckEngine(0x1000)
    b = probe_only(engine, 0.3)
    start = time.monotonic()
    assert b._first_buffer("127.0.0.1:1") is None
    assert time.monotonic() - start < 5
    engine.release.set()


def test_a_peer_whose_engine_does_not_answer_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = StuckEngine(0x1000)
    b = probe_only(engine, 0.3)
    monkeypatch.setattr("socket.create_connection", lambda *a, **kw: Listening())
    region = Region(0x1000, 4096, MemoryKind.DRAM, name="kv")
    with pytest.raises(PeerError, match=r"did not answer within 0.3 s"):
        b._check_reachable("dec", "127.0.0.1:1", "127.0.0.1", 1, (region,))
    engine.release.set()


def test_a_prompt_answer_and_an_engine_error_come_through() -> None:
    engine = StuckEngine(0x2000)
    engine.release.set()
    assert probe_only(engine, 5)._first_buffer("s") == 0x2000

    class Broken:
        def get_first_buffer_address(self, session: str) -> int:
            raise RuntimeError("engine error")

    with pytest.raises(RuntimeError, match="engine error"):
        probe_only(Broken(), 5)._first_buffer("s")
