"""Real vLLM engines in child processes, driven request by request: for tests and benchmarks.

Each :class:`Engine` is one vLLM engine (``vllm.LLM``) in a process of its own, started with
``python -m tests.vllm.harness``. The engine core runs inside that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``; TP 1 also runs its worker there, TP > 1 spawns vLLM's
workers), which makes start-up one import of vLLM instead of three. The child steps the engine
continuously, so a prefill engine keeps serving its KV connector after its requests finished,
and answers commands over a socket pair: add requests, collect their results, read metrics.

:func:`run_pd` is the disaggregated flow vLLM's example proxy implements: each prompt goes to
the prefill engine with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``;
the parameters its connector returns go with the same prompt to the decode engine, whose tokens
are the answer. :func:`run_single` serves the same prompts without disaggregation.

Engines need a ``__main__`` guard in the calling script (vLLM spawns processes), token prompts
(``skip_tokenizer_init=True``) and, on CPU, a block size that is a multiple of 32.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository: tests/ is a package there


class EngineError(RuntimeError):
    """An engine process failed to start, died, or answered a command with an error."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine. ``cpus`` binds vLLM's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``: ``"0"``,
    ``"0|1"`` for TP 2); ``env`` is added to the child's environment."""

    model: str
    name: str = "engine"
    tp: int = 1
    pp: int = 1
    kv_transfer_config: Mapping[str, Any] | None = None
    max_num_seqs: int = 8
    block_size: int | None = 32
    max_model_len: int = 512
    kv_cache_gib: int = 1
    kv_blocks: int | None = 1024  # vLLM's num_gpu_blocks_override: a small pool, small memory
    dtype: str = "float32"
    cpus: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    enable_prefix_caching: bool = False
    max_num_batched_tokens: int | None = None  # a chunked-prefill chunk; None: vLLM's default


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt: Sequence[int]
    max_tokens: int
    kv_transfer_params: Mapping[str, Any] | None = None


@dataclass
class Result:
    """A finished request: its tokens, the connector's parameters, and when things happened
    (``time.monotonic()`` in the engine process; ``submitted`` when it was added)."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    submitted: float
    first_token: float | None
    finished: float

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted


class Engine:
    """A vLLM engine in a child process (see the module notes). Use as a context manager, or
    :meth:`start`, :meth:`wait_ready` and :meth:`close`."""

    def __init__(self, spec: EngineSpec, log_path: str | Path) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self.info: dict[str, Any] = {}

    # ------------------------------------------------------------------ life cycle

    def start(self) -> Engine:
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE=str(self.spec.kv_cache_gib),
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            TOKENIZERS_PARALLELISM="false",
        )
        if self.spec.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.spec.cpus
        env.update(self.spec.env)
        # the child runs this module as tests.vllm.harness, from whatever folder the caller runs in
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it from here
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.vllm.harness",
                    str(child.fileno()),
                    json.dumps(asdict(self.spec)),
                ],
                pass_fds=(child.fileno(),),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                # Its own process group, so kill() takes vLLM's workers too, but the caller's
                # session: with the kernel's autogroups (sched_autogroup_enabled) every session
                # is one scheduling group and CPU time is shared between groups, not threads. An
                # engine in a session of its own whose threads mostly sleep (a prefill engine
                # waiting for decode to connect) was woken only after 0.2-1 s per wake-up on
                # 2 cores while a TP 2 engine's session spun (its step loop and both workers
                # polling vLLM's shared-memory queue), so its pdwire handshake, which takes many
                # wake-ups (libzmq's I/O thread, the worker thread, GIL hand-offs), ran past
                # every timeout (docs/vllm.md, "Engines on a shared host").
                process_group=0,
            )
        finally:
            log.close()
            child.close()
        self._conn = Connection(parent.detach())
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Block until the engine is up; returns what it reports (start-up seconds, engine id)."""
        reply = self._recv(timeout_s, "start-up")
        if reply[0] != "ready":
            raise EngineError(f"{self.spec.name}: {reply[1]}\n{self.log_tail()}")
        self.info = reply[1]
        return self.info

    def close(self, timeout_s: float = 60.0) -> None:
        """Ask the engine to shut down; kill its process group if it does not within the time."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None and self._conn is not None:
            with contextlib.suppress(OSError, EOFError):
                self._conn.send(("shutdown",))
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.kill()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (a crash, for failure tests)."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    # ------------------------------------------------------------------ commands

    def submit(self, requests: Iterable[Request]) -> None:
        """Add requests; they run while the engine steps. Collect them with :meth:`results`."""
        self._call("add", [asdict(r) | {"prompt": list(r.prompt)} for r in requests])

    def results(self, request_ids: Sequence[str], timeout_s: float = 300.0) -> dict[str, Result]:
        """Wait until every request in ``request_ids`` finished; raises on timeout."""
        reply = self._call("results", list(request_ids), timeout_s, timeout_s=timeout_s + 30)
        return {rid: Result(**r) for rid, r in reply.items()}

    def generate(self, requests: Sequence[Request], timeout_s: float = 300.0) -> dict[str, Result]:
        self.submit(requests)
        return self.results([r.request_id for r in requests], timeout_s)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (as a client that goes away); their results read ``finish_reason="abort"``."""
        self._call("abort", list(request_ids))

    def metrics(self) -> dict[str, float]:
        """vLLM's counters and gauges, ``name{label=value,...}`` -> value (engine and model labels
        dropped); a histogram as ``name_sum{...}`` and ``name_count{...}``."""
        out: dict[str, float] = self._call("metrics")
        return out

    def connector_stats(self) -> dict[str, Any]:
        """What the engine's KV connector reports about itself, if it reports anything."""
        out: dict[str, Any] = self._call("connector_stats")
        return out

    def _call(self, *cmd: Any, timeout_s: float = 120.0) -> Any:
        if self._conn is None:
            raise EngineError(f"{self.spec.name} is not started")
        try:
            self._conn.send(cmd)
        except OSError as exc:
            raise EngineError(f"{self.spec.name} is gone ({exc})\n{self.log_tail()}") from None
        reply = self._recv(timeout_s, cmd[0])
        if reply[0] != "ok":
            raise EngineError(f"{self.spec.name}: {cmd[0]} failed: {reply[1]}")
        return reply[1]

    def _recv(self, timeout_s: float, what: str) -> Any:
        assert self._conn is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is not None and self._proc.poll() is not None and not self._conn.poll(0):
                raise EngineError(
                    f"{self.spec.name} exited with {self._proc.returncode} during {what}\n{self.log_tail()}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"{self.spec.name}: no answer to {what} within {timeout_s:.0f}s")
            try:
                if self._conn.poll(min(left, 1.0)):
                    return self._conn.recv()
            except (EOFError, OSError):
                raise EngineError(
                    f"{self.spec.name} closed its connection during {what}\n{self.log_tail()}"
                ) from None


def start_engines(specs: Sequence[EngineSpec], log_dir: str | Path, timeout_s: float = 900.0) -> list[Engine]:
    """Start every engine at once (start-up is mostly importing vLLM) and wait for all."""
    engines = [Engine(s, Path(log_dir) / f"{s.name}.log").start() for s in specs]
    try:
        for e in engines:
            e.wait_ready(timeout_s)
    except BaseException:
        for e in engines:
            e.kill()
        raise
    return engines


# ---------------------------------------------------------------------- the proxy's flow


def prefill_request(request_id: str, prompt: Sequence[int]) -> Request:
    """What the proxy sends the prefill engine: one token, and ask its connector to keep the KV."""
    return Request(request_id, prompt, 1, {"do_remote_decode": True})


def decode_request(
    request_id: str, prompt: Sequence[int], max_tokens: int, params: Mapping[str, Any]
) -> Request:
    """What the proxy sends the decode engine: the same prompt with the prefill's parameters."""
    return Request(request_id, prompt, max_tokens, dict(params))


def run_pd(
    prefill: Engine,
    decode: Engine,
    prompts: Mapping[str, Sequence[int]],
    max_tokens: int,
    timeout_s: float = 300.0,
) -> tuple[dict[str, Result], dict[str, Result]]:
    """Every prompt through prefill then decode (all prompts concurrently on each engine).
    Returns (prefill results, decode results) by request id."""
    pre = prefill.generate([prefill_request(rid, p) for rid, p in prompts.items()], timeout_s)
    missing = [rid for rid, r in pre.items() if not r.kv_transfer_params]
    if missing:
        raise EngineError(f"prefill returned no kv_transfer_params for {missing}")
    dec_reqs = [
        decode_request(rid, p, max_tokens, pre[rid].kv_transfer_params or {}) for rid, p in prompts.items()
    ]
    return pre, decode.generate(dec_reqs, timeout_s)


def run_single(
    engine: Engine, prompts: Mapping[str, Sequence[int]], max_tokens: int, timeout_s: float = 300.0
) -> dict[str, Result]:
    return engine.generate([Request(rid, p, max_tokens) for rid, p in prompts.items()], timeout_s)


def random_prompts(
    n: int, length: int, *, seed: int = 0, vocab: int = 512, prefix: str = "req"
) -> dict[str, list[int]]:
    """``n`` prompts of ``length`` token ids in [3, vocab), reproducible."""
    import random

    rng = random.Random(seed)
    return {f"{prefix}-{seed}-{i}": [rng.randrange(3, vocab) for _ in range(length)] for i in range(n)}


def tokens(results: Mapping[str, Result]) -> dict[str, list[int]]:
    return {rid: r.token_ids for rid, r in results.items()}


def external_prompt_tokens(metrics: Mapping[str, float]) -> float:
    """Prompt tokens this engine loaded through its KV connector (vLLM's own count)."""
    return sum(
        v
        for k, v in metrics.items()
        if k.startswith("vllm:prompt_tokens_by_source{") and "source=external_kv_transfer" in k
    )


# ---------------------------------------------------------------------- the child process


def _exit_with_parent() -> None:  # pragma: no cover - runs in the engine process
    """A driver that died (killed test run) must not leave engines behind, even mid start-up."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgrp(), signal.SIGKILL)  # this engine's own process group
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _serve(fd: int, spec: EngineSpec) -> None:  # pragma: no cover - runs in the engine process
    conn = Connection(fd)
    _exit_with_parent()
    started = time.monotonic()
    try:
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kwargs: dict[str, Any] = dict(
            model=spec.model,
            skip_tokenizer_init=True,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            enforce_eager=True,
            max_num_seqs=spec.max_num_seqs,
            tensor_parallel_size=spec.tp,
            pipeline_parallel_size=spec.pp,
            distributed_executor_backend="uni" if spec.tp * spec.pp == 1 else "mp",
            disable_log_stats=False,
            enable_prefix_caching=spec.enable_prefix_caching,
        )
        if spec.block_size is not None:
            kwargs["block_size"] = spec.block_size
        if spec.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = spec.max_num_batched_tokens
        if spec.kv_blocks is not None:
            kwargs["num_gpu_blocks_override"] = spec.kv_blocks
        if spec.kv_transfer_config is not None:
            kwargs["kv_transfer_config"] = dict(spec.kv_transfer_config)
        llm = LLM(**kwargs)
    except BaseException as exc:
        conn.send(("error", f"start-up failed: {exc!r}"))
        raise
    engine = llm.llm_engine
    kv_cfg = engine.vllm_config.kv_transfer_config
    conn.send(
        (
            "ready",
            {
                "startup_s": time.monotonic() - started,
                "engine_id": None if kv_cfg is None else kv_cfg.engine_id,
                "pid": os.getpid(),
            },
        )
    )

    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, dict[str, Any]] = {}
    waiting: tuple[list[str], float] | None = None  # a results() call: ids, deadline

    def add(reqs: list[dict[str, Any]]) -> None:
        for r in reqs:
            extra = {"kv_transfer_params": dict(r["kv_transfer_params"])} if r["kv_transfer_params"] else None
            params = SamplingParams(
                max_tokens=r["max_tokens"],
                temperature=0.0,
                ignore_eos=True,
                detokenize=False,
                output_kind=RequestOutputKind.CUMULATIVE,
                extra_args=extra,
            )
            submitted[r["request_id"]] = time.monotonic()
            engine.add_request(r["request_id"], {"prompt_token_ids": list(r["prompt"])}, params)

    def metrics() -> dict[str, float]:
        out: dict[str, float] = {}
        for m in llm.get_metrics():
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name")
            )
            values = {"": getattr(m, "value", None)}
            if hasattr(m, "sum") and hasattr(m, "count"):  # a histogram: its sum and count
                values = {"_sum": m.sum, "_count": m.count}
            for suffix, value in values.items():
                if isinstance(value, int | float):
                    key = f"{m.name}{suffix}{{{labels}}}"
                    out[key] = out.get(key, 0.0) + float(value)
        return out

    def connector_stats() -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return {}
        worker_conn = get_kv_transfer_group()
        report = getattr(worker_conn, "report", None)
        return report() if callable(report) else {}

    while True:
        try:
            busy = engine.has_unfinished_requests()
            if conn.poll(0 if busy else 0.01):
                cmd = conn.recv()
                name = cmd[0]
                try:
                    if name == "shutdown":
                        break
                    if name == "add":
                        add(cmd[1])
                        conn.send(("ok", None))
                    elif name == "results":
                        waiting = (list(cmd[1]), time.monotonic() + float(cmd[2]))
                    elif name == "abort":
                        engine.abort_request(list(cmd[1]))
                        now = time.monotonic()
                        for rid in cmd[1]:
                            done.setdefault(
                                rid,
                                {
                                    "request_id": rid,
                                    "token_ids": [],
                                    "finish_reason": "abort",
                                    "kv_transfer_params": None,
                                    "submitted": submitted.get(rid, now),
                                    "first_token": first.get(rid),
                                    "finished": now,
                                },
                            )
                        conn.send(("ok", None))
                    elif name == "metrics":
                        conn.send(("ok", metrics()))
                    elif name == "connector_stats":
                        conn.send(("ok", connector_stats()))
                    else:
                        conn.send(("error", f"unknown command {name!r}"))
                except Exception as exc:
                    conn.send(("error", repr(exc)))
            # stepping with nothing scheduled is cheap and lets the connector finish its work
            for out in engine.step():
                now = time.monotonic()
                completion = out.outputs[0] if out.outputs else None
                if completion is not None and completion.token_ids and out.request_id not in first:
                    first[out.request_id] = now
                if out.finished:
                    done[out.request_id] = {
                        "request_id": out.request_id,
                        "token_ids": list(completion.token_ids) if completion else [],
                        "finish_reason": None if completion is None else completion.finish_reason,
                        "kv_transfer_params": out.kv_transfer_params,
                        "submitted": submitted.get(out.request_id, now),
                        "first_token": first.get(out.request_id),
                        "finished": now,
                    }
            if waiting is not None:
                ids, deadline = waiting
                if all(i in done for i in ids):
                    conn.send(("ok", {i: done.pop(i) for i in ids}))
                    waiting = None
                elif time.monotonic() > deadline:
                    missing = [i for i in ids if i not in done]
                    conn.send(("error", f"requests not finished in time: {missing}"))
                    waiting = None
        except (EOFError, OSError):
            break  # the driver is gone
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def main(argv: Sequence[str] | None = None) -> None:  # pragma: no cover - the engine process
    args = list(sys.argv[1:] if argv is None else argv)
    spec = EngineSpec(**json.loads(args[1]))
    _serve(int(args[0]), spec)
    # vLLM's atexit handlers can wait on threads of a connector that is already down
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
