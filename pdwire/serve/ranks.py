"""One rank of ``pdwire serve``: its backend, its memory (a registered memory model,
:mod:`.memory`), and the synthetic workload both roles agree on without talking about it.

The workload: a request's room id carries its prompt length, ``room = n * 2**16 + tokens``
(``n`` counts the decode engine's requests), so a prefill rank that is asked for a room it has
not seen produces that many tokens of content on its own: the memory model derives a room's
content from ``(seed, room, tokens)``; prefill writes its TP shard into source slots, decode
checks its shard byte for byte on arrival. In a real deployment the inference engine produces
the content and the router hands both sides the request; everything between (discovery,
handshake, transfers, faults) is the same.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pdwire import wire
from pdwire.discovery import Discovery, Geometry, RankEntry
from pdwire.runtime import engine as pd
from pdwire.runtime.backends.options import host_defaults
from pdwire.runtime.control_auth import ControlAuth
from pdwire.serve.config import ServeConfig
from pdwire.serve.memory import ServeMemory, ServeRank, open_memory_model

TOKEN_BITS = 16
STATS_EVERY_S = 10.0


def room_id(n: int, tokens: int) -> int:
    """The room of request ``n`` with a prompt of ``tokens`` tokens (1..65535)."""
    if not 0 < tokens < 1 << TOKEN_BITS:
        raise ValueError(f"{tokens} tokens: a serve request has 1..65535")
    return (n << TOKEN_BITS) | tokens


def tokens_of(room: int) -> int:
    """The prompt length a room id carries (0: not a serve room)."""
    return room & ((1 << TOKEN_BITS) - 1)


@dataclass
class RankParts:
    """What every serve rank holds, whatever its role."""

    tp_rank: int
    backend: pd.Backend
    memory: ServeRank
    incarnation: str


W = TypeVar("W", pd.PrefillWorker, pd.DecodeWorker)


@dataclass
class Rank(Generic[W]):
    parts: RankParts
    worker: W


R = TypeVar("R", bound=Rank[Any])


class RankServer(ABC, Generic[R]):
    """What both servers share: ranks started together (a failure closes those already started),
    a loop that steps until :meth:`stop` with a stats line every ``STATS_EVERY_S``, then
    :meth:`shutdown`."""

    def __init__(self, cfg: ServeConfig, discovery: Discovery, tp_ranks: Iterable[int]) -> None:
        self.cfg = cfg
        self.discovery = discovery
        self.ranks: list[R] = []
        self._stop = threading.Event()
        self._exit_status = 0
        try:  # a subclass may hold sockets already: a bad memory model closes them too
            self.memory_model = open_memory(cfg)
            for r in tp_ranks:
                self.ranks.append(self._start_rank(r))
        except BaseException:
            self._close()
            raise

    @abstractmethod
    def _start_rank(self, tp_rank: int) -> R: ...

    @abstractmethod
    def step(self, timeout_ms: int = 20) -> None: ...

    @abstractmethod
    def _log_stats(self) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    def serve(self) -> int:
        """Run until :meth:`stop` (a signal handler calls it), then stop cleanly; the exit status."""
        last_stats = time.monotonic()
        while not self._stop.is_set():
            self.step()
            if time.monotonic() - last_stats >= STATS_EVERY_S:
                last_stats = time.monotonic()
                self._log_stats()
        self.shutdown()
        return self._exit_status

    def stop(self) -> None:
        self._stop.set()

    def _close(self) -> None:
        for rk in self.ranks:
            rk.worker.close()
            rk.parts.backend.close()
        self.ranks.clear()


def backend_options(cfg: ServeConfig) -> dict[str, object]:
    """The configured options over what the advertised host implies."""
    name = cfg.backend or pd.default_backend()
    return {**host_defaults(name, cfg.advertise_host), **cfg.backend_options}


def open_memory(cfg: ServeConfig) -> ServeMemory:
    """The configured memory model, checked against the TP size (ValueError when it cannot)."""
    model = open_memory_model(cfg.memory)
    model.check_tp(cfg.tp)
    return model


def build_rank(cfg: ServeConfig, model: ServeMemory, tp_rank: int) -> RankParts:
    """Backend (with its options) and the rank's memory, allocated through it."""
    backend = pd.create_backend(
        cfg.backend,
        agent_name=f"{cfg.engine_id}-{cfg.role}{tp_rank}-{os.getpid()}",
        transfer_timeout_s=cfg.transfer_timeout_s,
        **backend_options(cfg),
    )
    seed = cfg.memory.seed * (7919 if cfg.role == "prefill" else 104729) + tp_rank
    try:
        memory = model.open_rank(cfg.tp, tp_rank, backend, seed)
    except BaseException:
        backend.close()
        raise
    incarnation = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
    return RankParts(tp_rank, backend, memory, incarnation)


def common_config(cfg: ServeConfig, model: ServeMemory, tp_rank: int) -> dict[str, Any]:
    """The fields PrefillConfig and DecodeConfig share."""
    return {
        "engine_id": cfg.engine_id,
        "rank": pd.ParallelRank(tp_size=cfg.tp, tp_rank=tp_rank),
        "model": model.fingerprint,
        "room_timeout_s": cfg.room_timeout_s,
        "transfer_timeout_s": cfg.transfer_timeout_s,
        "control_auth": ControlAuth.from_directory(cfg.control_keys) if cfg.control_keys else None,
        "insecure_control": cfg.insecure_control,
    }


def model_label(model: wire.ModelFingerprint) -> str:
    return f"{model.model_name}@{model.revision[:12]}"


def registry_entry(cfg: ServeConfig, parts: RankParts, hello: wire.Hello, control: str) -> RankEntry:
    return RankEntry(
        role=wire.Role.PREFILL if cfg.role == "prefill" else wire.Role.DECODE,
        engine_id=cfg.engine_id,
        geometry=Geometry(tp_size=cfg.tp, tp_rank=parts.tp_rank),
        incarnation=parts.incarnation,
        control=control,
        backend=parts.backend.name,
        protocol=tuple(f"{v.major}.{v.minor}" for v in hello.versions),
        model=model_label(hello.model),
        host=socket.gethostname(),
        pid=os.getpid(),
    )
