"""How the vLLM harness starts its engine processes (no vLLM needed: the child fails its start-up).

Engines run in the caller's session, each in a process group of its own. A session is one
scheduling autogroup for the kernel: with every engine in a session of its own, a mostly idle
engine (a prefill engine waiting for decode's handshake) was woken only after 0.2-1 s per wake-up
while a TP 2 engine spun on 2 cores, and different-TP handshakes ran past their timeouts
(docs/vllm.md, "Engines on a shared host"). kill() still takes the engine's whole group.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.vllm import harness as h


def test_engine_shares_the_callers_session_in_a_process_group_of_its_own(tmp_path: Path) -> None:
    engine = h.Engine(h.EngineSpec(str(tmp_path / "no-model"), "probe"), tmp_path / "probe.log").start()
    try:
        proc = engine._proc
        assert proc is not None
        # Popen returns once the child exec'd, so its session and group are set (a child that
        # already failed is a zombie until reaped, and keeps both)
        assert os.getsid(proc.pid) == os.getsid(0)
        assert os.getpgid(proc.pid) == proc.pid
        with pytest.raises(h.EngineError):  # no vLLM or no model here: start-up fails, reported
            engine.wait_ready(120)
    finally:
        engine.kill()
    assert proc.returncode is not None
