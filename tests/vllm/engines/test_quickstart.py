"""The vLLM quick start of docs/vllm.md ("Using it"), run as written.

Its three shell blocks (keys; prefill, decode and the proxy; one completion with curl) run in
bash, in this order, with the suite's ``PDWIRE_*`` variables removed from the environment (the
suite sets ``PDWIRE_INSECURE_CONTROL=1``: without keys every rank would refuse to start, which
is what the keys block is for). What the test changes, and only that: MODEL is the tiny dense
Llama (with a word-level tokenizer written here, so the curl's text prompt runs as written),
the three ports are free ones, ``HOME`` is a temporary folder (the keys go into it) and each
server command gets :data:`SIZING` (no torch.compile on two shared cores). The answer through
the proxy must equal the prefill server's own greedy answer to the same curl (one engine, no
transfer), and the decode server must have loaded the prompt through the connector. The
deployment's control plane must be CURVE with the generated keys: a plain ZMTP peer is refused
by a prefill rank, a peer holding the directory's keys completes the handshake. README.md's
vLLM quick start must be the same commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdwire.integrations.vllm.proxy import prefill_body
from pdwire.runtime.control_auth import ControlAuth
from tests.support.quickstart import KEYS, assert_curve_on, commands, doc_blocks, environment, run_bash
from tests.vllm import harness as h
from tests.vllm import tiny_models as tm
from tests.vllm.engines.test_metrics import free_port
from tests.vllm.test_proxy import _go_router, _nixl_router_legs

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

DOC = h.ROOT / "docs" / "vllm.md"
README = h.ROOT / "README.md"
PORTS = ("8100", "8200", "8000")  # prefill, decode, proxy as the doc names them
# sizing for the tiny model on two busy cores, nothing pdwire needs: eager mode (torch.compile
# takes minutes here); the KV cache size comes from VLLM_CPU_KVCACHE_SPACE (environment)
SIZING = "--enforce-eager"
WORDS = ("The", "capital", "of", "France", "is")


def write_tokenizer(model: Path) -> None:
    """A word-level tokenizer over the tiny model's vocabulary (the doc's prompt words first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<unk>", "<s>", "</s>", *WORDS]
    names += [f"w{i}" for i in range(len(names), tm.VOCAB)]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(model)


@dataclass
class QuickStart:
    """The doc's commands, substituted for this machine, and the bash running the servers."""

    model: Path
    home: Path
    ports: dict[str, str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def substitute(self, command: str) -> str:
        command = command.replace("--model MODEL", f"--model {self.model} {SIZING}")
        command = command.replace('"model": "MODEL"', f'"model": "{self.model}"')
        for doc_port, port in self.ports.items():
            command = re.sub(rf"\b{doc_port}\b", port, command)
        return command

    def run(self, block: str, *, background: bool = False) -> str:
        script = "\n".join(self.substitute(c) for c in commands(block))
        if not background:
            return run_bash(script, self.env)
        # one process group for bash, the servers and their engine cores: close() ends them all
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["bash", "-ec", script + "\nwait"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,
            )
        return ""

    def url(self, doc_port: str) -> str:
        return f"http://127.0.0.1:{self.ports[doc_port]}"

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = [self.url("8100") + "/health", self.url("8200") + "/health", self.url("8000") + "/healthz"]
        while pending:
            assert self.proc is not None
            # a server that died leaves bash waiting on the others: its traceback says so at once
            died = "Traceback (most recent call last)" in self.log.read_text(errors="replace")
            if died or self.proc.poll() is not None or time.monotonic() > deadline:
                raise h.EngineError(f"quick start not ready ({pending[0]})\n{self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(pending[0], timeout=5) as r:
                if r.status == 200:
                    pending.pop(0)
                    continue
            time.sleep(1.0)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def _group_alive(self) -> bool:
        assert self.proc is not None
        self.proc.poll()  # reap bash, the group leader
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def close(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60  # the servers stop their engine cores themselves
        while self._group_alive() and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


def quickstart_env(home: Path) -> dict[str, str]:
    env = environment(home)
    # engine sizing for two shared cores, nothing pdwire reads
    env.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


@pytest.fixture(scope="module")
def blocks() -> list[str]:
    found = doc_blocks(DOC.read_text(), "## Using it")
    assert len(found) == 3, found  # keys; servers and proxy; curl
    return found


@pytest.fixture(scope="module")
def quickstart(
    blocks: list[str], tmp_path_factory: pytest.TempPathFactory, engine_logs: Path
) -> Iterator[QuickStart]:
    base = tmp_path_factory.mktemp("quickstart")
    model = tm.write_model(tm.DENSE, base / "model")
    write_tokenizer(model)
    (base / "home").mkdir()
    qs = QuickStart(
        model=model,
        home=base / "home",
        ports={p: str(free_port()) for p in PORTS},
        env=quickstart_env(base / "home"),
        log=engine_logs / "quickstart.log",
    )
    try:
        # one shell, as the doc has it: the servers inherit the keys block's export
        qs.run(blocks[0] + blocks[1], background=True)
        qs.wait_ready()
        yield qs
    finally:
        qs.close()


def metric(url: str, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def settled_transfers(url: str, want: float, timeout_s: float = 60.0) -> float:
    """The decode's completed transfers once they reach ``want`` (stats reach /metrics a step
    after the request) or the timeout passed."""
    deadline = time.monotonic() + timeout_s
    while (seen := metric(url, "vllm:pdwire_transfers_total")) < want and time.monotonic() < deadline:
        time.sleep(0.5)
    return seen


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def test_readme_runs_the_same_quick_start(blocks: list[str]) -> None:
    readme = README.read_text()
    section = readme[readme.index("## vLLM\n") :]
    for command in commands(blocks[0]) + commands(blocks[1]):
        assert command in " ".join(commands(section)), command


def test_the_doc_quick_start_answers_through_the_proxy_as_one_engine(
    quickstart: QuickStart, blocks: list[str]
) -> None:
    keys = quickstart.home / KEYS
    assert (keys / "control.key_secret").stat().st_mode & 0o077 == 0
    assert "PDWIRE_INSECURE_CONTROL" not in quickstart.env

    decode = quickstart.url("8200")
    before = metric(decode, "vllm:pdwire_transfers_total")
    answer: dict[str, Any] = json.loads(quickstart.run(blocks[2]))
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert prompt_tokens == len(WORDS)
    # one engine: the same curl straight to the prefill server (no kv_transfer_params)
    direct = quickstart.run(blocks[2].replace("8000", "8100"))
    want = json.loads(direct)["choices"][0]["text"]
    got = answer["choices"][0]["text"]
    assert got == want and got.strip(), (got, want)
    # decode loaded the prompt through the connector (a transfer that failed or was skipped
    # would have been computed there, with the same tokens); stats reach /metrics a step later
    assert settled_transfers(decode, before + 1) == before + 1
    external = metric(decode, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
    assert external >= prompt_tokens


def test_the_control_plane_runs_on_the_generated_keys(quickstart: QuickStart) -> None:
    # a prefill request as the proxy sends it, for the prefill ranks' control endpoints
    body = {"model": str(quickstart.model), "prompt": "of France", "max_tokens": 1}
    params = post(quickstart.url("8100"), prefill_body(body))["kv_transfer_params"]
    endpoint = params["pdwire_endpoints"][0]
    assert_curve_on(endpoint, ControlAuth.from_directory(quickstart.home / KEYS))


def test_a_router_written_for_nixl_serves_the_quick_start(quickstart: QuickStart) -> None:
    """The two legs a NixlConnector router sends, the parameters through a router that holds
    JSON numbers as doubles: decode answers as one engine, over a transfer."""
    body = {
        "model": str(quickstart.model),
        "prompt": "France is The capital",
        "max_tokens": 16,
        "temperature": 0,
    }
    prefill, decode = quickstart.url("8100"), quickstart.url("8200")
    before = metric(decode, "vllm:pdwire_transfers_total")
    pre, _ = _nixl_router_legs(body, {})
    answer = post(prefill, pre)
    _, dec = _nixl_router_legs(body, {"kv_transfer_params": _go_router(answer["kv_transfer_params"])})
    got = post(decode, dec)["choices"][0]["text"]
    assert got == post(prefill, body)["choices"][0]["text"] and got.strip()
    assert settled_transfers(decode, before + 1) == before + 1
