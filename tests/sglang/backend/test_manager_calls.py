"""What SGLang 0.5.23 asks of a transfer backend's manager beyond moving rooms: the retraction
rebootstrap its decode loop submits (``submit_prefill_recompute``), the GPU its ``_init_kv_manager``
names (``KVArgs.gpu_id``), and its own staging buffer (SGLANG_DISAGG_STAGING_BUFFER), which
pdwire refuses at start-up on both sides. Managers are built by SGLang's own ``_init_kv_manager``
(``harness.make_rank``) around its real bootstrap server.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest

warnings.filterwarnings("ignore")

from tests.sglang.backend import harness as h  # noqa: E402

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def sglang() -> Any:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend("pdwire")
    return SimpleNamespace(
        KVPoll=KVPoll,
        receiver=get_kv_class(backend, KVClassType.RECEIVER),
        server=get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER),
    )


class _Generate(BaseHTTPRequestHandler):
    """A prefill engine's ``/generate``: records each body, answers ``status``."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.posts.append((self.path, body))  # type: ignore[attr-defined]
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


def _wait(what: str, cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_the_retraction_rebootstrap_asks_the_prefill_engine_once(sglang: Any) -> None:
    """Prefill TP 1, decode TP 2: SGLang's decode loop submits the rebootstrap on every decode
    rank; only attention TP rank 0 posts the payload to the prefill's ``/generate`` (at the HTTP
    port its ranks registered), once; a failed post (an error status, nothing listening) fails
    the room with the URL and the cause."""
    KVPoll = sglang.KVPoll
    port, http_p, http_d = h.free_port(), h.free_port(), h.free_port()
    server = sglang.server(host="127.0.0.1", port=port)
    addr = f"127.0.0.1:{port}"
    ranks = [h.make_rank("prefill", 1, 0, port, http_p)]
    ranks += [h.make_rank("decode", 2, t, port, http_d) for t in range(2)]
    generate = ThreadingHTTPServer(("127.0.0.1", http_p), _Generate)
    generate.posts, generate.status = [], 200  # type: ignore[attr-defined]
    threading.Thread(target=generate.serve_forever, daemon=True).start()
    try:
        decode = ranks[1:]
        for r in decode:
            _wait("prefill topology", lambda r=r: r.manager.try_ensure_parallel_info(addr))

        def submit(room: int) -> list[Any]:
            rxs = [sglang.receiver(mgr=r.manager, bootstrap_addr=addr, bootstrap_room=room) for r in decode]
            for r, rx in zip(decode, rxs, strict=True):
                rx.init(0)
                r.manager.submit_prefill_recompute(rx, {"rid": f"r{room}", "bootstrap_room": room})
            return rxs

        rxs = submit(7101)
        _wait("the post", lambda: len(generate.posts) == 1)  # type: ignore[attr-defined]
        time.sleep(0.3)  # a second rank's post would have landed by now
        assert generate.posts == [("/generate", {"rid": "r7101", "bootstrap_room": 7101})]  # type: ignore[attr-defined]
        assert all(rx.poll() != KVPoll.Failed for rx in rxs)
        for rx in rxs:
            rx.abort()

        generate.status = 503  # type: ignore[attr-defined]
        rxs = submit(7102)
        _wait("the failure", lambda: rxs[0].poll() == KVPoll.Failed)
        with pytest.raises(
            Exception, match=rf"rebootstrap: http://127.0.0.1:{http_p}/generate \(rid r7102\) failed: 503"
        ):
            rxs[0].failure_exception()

        generate.shutdown()
        generate.server_close()
        rxs = submit(7103)
        _wait("the failure", lambda: rxs[0].poll() == KVPoll.Failed)
        with pytest.raises(Exception, match=r"rebootstrap: .*\(rid r7103\) failed: ConnectionError"):
            rxs[0].failure_exception()
    finally:
        generate.server_close()
        for r in ranks:
            r.manager.teardown()
        server.close()


def test_the_pools_are_registered_on_the_gpu_sglang_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVArgs.gpu_id`` (SGLang's ``_init_kv_manager`` sets it from the rank's device) is the
    device of every KV and state region pdwire describes in device memory; host memory keeps 0;
    a negative id is refused by name."""
    from pdwire.integrations.sglang import conn
    from pdwire.integrations.sglang.memory import rank_memory

    rank = h.make_rank("decode", 1, 0, h.free_port(), h.free_port())
    try:
        args = rank.manager.kv_args
        assert hasattr(args, "gpu_id")  # SGLang's queue set it
        assert {rank.manager.memory.kv.device_id} | {c.device_id for c in rank.manager.memory.state} == {0}
        monkeypatch.setattr(conn, "_memory_kind", lambda: conn.pd.MemoryKind.VRAM)
        monkeypatch.setattr(args, "gpu_id", 3)
        mem = rank_memory(args, conn._geometry(args, rank.manager.rank, False))
        assert mem.kv.memory_kind is conn.pd.MemoryKind.VRAM
        assert [mem.kv.device_id, *(c.device_id for c in mem.state)] == [3] * (1 + len(mem.state))
        monkeypatch.setattr(args, "gpu_id", -1)
        with pytest.raises(ValueError, match=r"KVArgs.gpu_id must be >= 0, got -1"):
            conn._geometry(args, rank.manager.rank, False)
    finally:
        rank.manager.teardown()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sglangs_staging_buffer_is_refused_at_start_up(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLANG_DISAGG_STAGING_BUFFER is a protocol of SGLang's own backends: a pdwire rank of
    either side refuses to start with it, naming it (decode would otherwise crash building its
    staging handler, prefill silently ignore it)."""
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    with pytest.raises(ValueError, match=r"SGLANG_DISAGG_STAGING_BUFFER .* is not supported"):
        h.make_rank(role, 1, 0, h.free_port(), h.free_port())
