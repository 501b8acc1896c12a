"""Real vLLM engines (the CPU build, in .venv-vllm) on tiny random models written here.

Starting an engine is the expensive part (about a minute on 2 busy cores, mostly importing
vLLM), so each module starts the engines it needs once, all at the same time, and its cases
share them; the single-engine reference tokens are computed once per session per model.
``cpus`` binds a TP 2 engine's workers one per core (vLLM 0.32 binds only the workers its
multiprocessing executor starts; a TP 1 engine runs unbound). Engines run in the driver's session,
one scheduling group (see the harness and docs/vllm.md, "Engines on a shared host").
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import zmq

from pdwire import wire
from tests.vllm import harness as h
from tests.vllm import tiny_models as tm

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

pytestmark = pytest.mark.vllm

PROMPT_LEN = 80  # not a multiple of the block size: the last page is partly filled
MAX_TOKENS = 12

# A side-channel port per NIXL engine (NixlConnector has no port-0 option).
_next_port = [26000 + (os.getpid() % 200) * 20]


def nixl_env() -> dict[str, str]:
    _next_port[0] += 1
    return {
        "UCX_NET_DEVICES": "lo",
        "NIXL_LOG_LEVEL": "WARN",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_next_port[0]),
    }


def nixl_config(role: str) -> dict[str, object]:
    return {"kv_connector": "NixlConnector", "kv_role": role}


def pdwire_config(role: str, **extra: object) -> dict[str, object]:
    if role == "kv_consumer":
        # Up to seven engines share these 2 cores, their threads pinned by vLLM: a prefill rank's
        # ZMTP heartbeat answers can wait seconds (a killed one is still noticed at once, by its
        # closed connection, which test_dense's kill test relies on)
        extra.setdefault("pdwire_peer_timeout_s", 60.0)
    return {
        "kv_connector": "PdwireConnector",
        "kv_connector_module_path": "pdwire.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


PDWIRE_ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}


def kv_usage(engine: h.Engine) -> float:
    """The decode engine's KV cache usage (0 when every block is free again)."""
    return sum(v for k, v in engine.metrics().items() if k.startswith("vllm:kv_cache_usage_perc"))


def settle(probe: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Poll ``probe`` until it holds (engines report freed blocks on their next steps)."""
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


class FuturePrefill:
    """A prefill rank of a later pdwire major (2.0) at a real socket: it answers every Hello
    with its own and nothing else, as a skewed peer would."""

    def __init__(self, model: wire.ModelFingerprint | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.hellos: list[wire.Hello] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            ident, *frames = self.sock.recv_multipart()
            theirs = wire.decode(frames)
            if not isinstance(theirs, wire.Hello):
                continue
            self.hellos.append(theirs)
            mine = wire.Hello(
                protocol=theirs.protocol,
                versions=[wire.Version(major=2, minor=0)],
                role=wire.Role.PREFILL,
                engine_id="future-prefill",
                geometry=wire.ParallelGeometry(tp_size=1, tp_rank=0),
                model=theirs.model,
            )
            self.sock.send_multipart([ident, *wire.encode(mine)])

    def params(self, room: int, num_tokens: int, block_size: int) -> dict[str, object]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "pdwire_room": room,
            "pdwire_engine_id": "future-prefill",
            "pdwire_endpoints": [self.endpoint],
            "pdwire_pp_size": 1,
            "pdwire_num_tokens": num_tokens,
            "pdwire_block_size": block_size,
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("models")
    return {kind: str(tm.write_model(kind, base / kind)) for kind in tm.MODELS}


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def dense_prompts() -> dict[str, list[int]]:
    return h.random_prompts(4, PROMPT_LEN, seed=1)


@pytest.fixture(scope="session")
def hybrid_prompts() -> dict[str, list[int]]:
    # two prompts: the NixlConnector comparison; batches of four are test_hybrid.py's own
    return h.random_prompts(2, PROMPT_LEN, seed=2)


class References:
    """Greedy tokens of one engine without disaggregation, per (model, prompts), computed once."""

    def __init__(self, engines: Mapping[str, h.Engine]) -> None:
        self.engines = engines
        self._cache: dict[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], dict[str, list[int]]] = {}

    def tokens(
        self, model: str, prompts: Mapping[str, list[int]], max_tokens: int = MAX_TOKENS
    ) -> dict[str, list[int]]:
        key = (model, tuple((k, tuple(v)) for k, v in sorted(prompts.items())))
        if key not in self._cache:
            self._cache[key] = h.tokens(h.run_single(self.engines[model], prompts, max_tokens))
        return self._cache[key]


def start(specs: list[h.EngineSpec], logs: Path) -> list[h.Engine]:
    return h.start_engines(specs, logs)


@pytest.fixture(scope="session")
def references(models: dict[str, str], engine_logs: Path) -> Iterator[References]:
    engines = start(
        [
            h.EngineSpec(models[tm.DENSE], "single-dense", cpus="0"),
            h.EngineSpec(models[tm.HYBRID], "single-hybrid", cpus="1", block_size=None, max_num_seqs=1),
        ],
        engine_logs,
    )
    try:
        yield References({tm.DENSE: engines[0], tm.HYBRID: engines[1]})
    finally:
        for e in engines:
            e.close()
