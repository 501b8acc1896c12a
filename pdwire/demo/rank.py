"""One demo rank process (prefill or decode): memory, backend, worker, and a command pipe.

The parent (:mod:`pdwire.demo.cluster`) drives each rank over a multiprocessing
pipe with small tuples; that pipe is the demo's stand-in for an inference engine's
scheduler and is not part of the protocol (every prefill <-> decode message goes through
the workers and the generated codecs).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from pdwire.demo import register_mori_fake
from pdwire.demo.content import RoomSlots, untouched_problems
from pdwire.demo.model import Capacity, ModelSpec
from pdwire.demo.serve_model import DemoServeMemory, DemoServeRank, model_fingerprint
from pdwire.runtime import engine as pd
from pdwire.runtime.backends import shm


@dataclass(frozen=True)
class RankConfig:
    role: str  # "prefill" | "decode"
    engine_id: str
    tp: int
    rank: int
    spec: ModelSpec
    capacity: Capacity
    backend: str
    seed: int = 1
    room_timeout_s: float = 30.0
    transfer_timeout_s: float = 20.0
    chunk_pages: int = 8
    chunk_delay_s: float = 0.0
    versions: tuple[tuple[int, int], ...] = ()
    control_auth: pd.ControlAuth | None = None  # None: the environment's (see resolve)
    # Where the rank lives, for ranks on other hosts (tests place them in network namespaces):
    # the prefill ROUTER's bind address and the backend's constructor options (Mooncake's
    # ``hostname``, NIXL's ``net_devices``/``transports``); the defaults are this host's loopback.
    bind: str = "tcp://127.0.0.1:0"
    backend_options: Mapping[str, object] = field(default_factory=dict)
    fence_timeout_s: float | None = None  # decode: DecodeConfig.fence_timeout_s (None: its default)


def rank_main(cfg: RankConfig, conn: Connection) -> None:
    """Entry point of a rank process; reports ("error", text) instead of dying silently.

    SIGINT is ignored: a Ctrl-C at the terminal reaches every process of the group, and the
    parent, not each rank, decides how the ranks stop (cleanly, removing their shared memory)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # several ranks share few cores: no intra-op thread oversubscription
    try:
        (_prefill if cfg.role == "prefill" else _decode)(cfg, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", cfg.role, cfg.rank, traceback.format_exc()))
    finally:
        # the parent went away or the rank failed without closing its backend: its shared-memory
        # files must not outlive it (os._exit skips the hook that would remove them)
        shm.remove_owned()
        os._exit(0)  # skip engine atexit hooks that can hang on a half-torn-down peer


def _setup(cfg: RankConfig) -> tuple[pd.Backend, DemoServeMemory, DemoServeRank, dict[str, Any]]:
    """The rank's backend, its memory allocated through it, and the fields both worker configs
    share."""
    register_mori_fake()  # a forkserver child: the parent's registrations are not inherited
    backend = pd.create_backend(
        cfg.backend,
        agent_name=f"{cfg.engine_id}-{cfg.role}{cfg.rank}-{os.getpid()}",
        transfer_timeout_s=cfg.transfer_timeout_s,
        **cfg.backend_options,
    )
    model = DemoServeMemory(cfg.spec, cfg.capacity, cfg.seed)
    mem = model.open_rank(
        cfg.tp, cfg.rank, backend, cfg.seed * (7919 if cfg.role == "prefill" else 104729) + cfg.rank
    )
    common = {
        "engine_id": cfg.engine_id,
        "rank": pd.ParallelRank(tp_size=cfg.tp, tp_rank=cfg.rank),
        "model": model_fingerprint(cfg.spec),
        "room_timeout_s": cfg.room_timeout_s,
        "transfer_timeout_s": cfg.transfer_timeout_s,
        "versions": cfg.versions,
        "control_auth": cfg.control_auth,
    }
    return backend, model, mem, common


def _prefill(cfg: RankConfig, conn: Connection) -> None:
    backend, model, mem, common = _setup(cfg)
    held: dict[int, RoomSlots] = {}

    def released(room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        s = held.pop(room, None)
        if s is not None:
            mem.give(s)
        span = worker.spans.pop(room, [0.0, 0.0])
        conn.send(("prefill_done", cfg.rank, room, status.name, failure.reason if failure else "", span))

    ctx: zmq.Context[Any] = zmq.Context()
    worker = pd.PrefillWorker(
        pd.PrefillConfig(bind=cfg.bind, **common),
        mem.memory,
        backend=backend,
        context=ctx,
        on_released=released,
    )
    conn.send(("ready", cfg.rank, worker.endpoint))
    worker.poller.register(conn.fileno(), zmq.POLLIN)
    chunks: deque[tuple[float, int, int, int, bool]] = deque()  # due, room, start, stop, last
    while True:
        events = worker.step(5 if chunks else 50)
        now = time.monotonic()
        while chunks and chunks[0][0] <= now:
            _, room, start, stop, last = chunks.popleft()
            if room in held:
                s = held[room]
                state, aux = (s.state_indices(cfg.spec), s.aux) if last else (None, None)
                worker.send_chunk(room, s.pages[start:stop], last=last, state=state, aux_index=aux)
        if not events.get(conn.fileno()):
            continue
        while conn.poll():
            cmd = conn.recv()
            if cmd[0] == "prefill":
                _, room, tokens = cmd
                slots = mem.take(tokens)
                held[room] = slots
                mem.fill(slots, model.content(room, tokens))
                pages = len(slots.pages)
                t = time.monotonic()
                for i, start in enumerate(range(0, pages, cfg.chunk_pages)):
                    stop = min(pages, start + cfg.chunk_pages)
                    chunks.append((t + i * cfg.chunk_delay_s, room, start, stop, stop == pages))
            elif cmd[0] == "stop":
                conn.send(("final", "prefill", cfg.rank, asdict(worker.stats), []))
                worker.close()
                backend.close()
                return


def _decode(cfg: RankConfig, conn: Connection) -> None:
    backend, model, mem, common = _setup(cfg)
    mem.prepare()
    rooms: dict[int, tuple[RoomSlots, int, float]] = {}  # until the worker releases their slots
    fenced: set[int] = set()  # failed rooms whose senders may still write: never checked

    def finished(room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        slots, tokens, t0 = rooms[room]
        latency = time.perf_counter() - t0
        problems: list[str] = []
        if status is pd.Status.SUCCESS:
            problems = mem.verify(slots, model.content(room, tokens))
        else:
            fenced.add(room)
        reason = failure.reason if failure else ""
        conn.send(("room_done", cfg.rank, room, status.name, reason, latency, problems, False, t0))

    def slots_released(room: int) -> None:
        # Nothing writes into the slots any more (for a failed room: every prefill rank said so,
        # or the fence timed out, which the worker counts): wipe what landed and reuse them.
        slots, _, _ = rooms.pop(room)
        fenced.discard(room)
        mem.clear(slots)
        mem.give(slots)
        conn.send(("slots_released", cfg.rank, room, time.perf_counter()))

    groups: dict[str, pd.PrefillGroup] = {}  # prefill engine id -> what connect() returned

    def connected(group: pd.PrefillGroup) -> None:
        # the handshake runs in step(), between rooms: the cluster hears its outcome from here
        if group.ready:
            groups[group.engine_id] = group
            conn.send(("connected", cfg.rank, group.engine_id, ""))
        else:
            conn.send(("connected", cfg.rank, "", f"HandshakeError: {group.error}"))

    ctx: zmq.Context[Any] = zmq.Context()
    worker = pd.DecodeWorker(
        pd.DecodeConfig(fence_timeout_s=cfg.fence_timeout_s, **common),
        mem.memory,
        backend=backend,
        context=ctx,
        on_finished=finished,
        on_slots_released=slots_released,
        on_connected=connected,
    )
    conn.send(("ready", cfg.rank, worker.endpoint))
    worker.poller.register(conn.fileno(), zmq.POLLIN)
    while True:
        events = worker.step(50)
        if not events.get(conn.fileno()):
            continue
        while conn.poll():
            cmd = conn.recv()
            if cmd[0] == "connect":
                try:
                    worker.connect(cmd[1], timeout_s=cmd[2])  # answered from connected()
                except (pd.SessionError, pd.ConfigError) as exc:
                    conn.send(("connected", cfg.rank, "", f"{type(exc).__name__}: {exc}"))
            elif cmd[0] == "room":
                _, room, tokens, engine, timeout_s = cmd
                try:
                    worker.check_free(room)  # before taking memory for it
                    slots = mem.take(tokens)
                    rooms[room] = (slots, tokens, time.perf_counter())
                    worker.start_room(room, mem.request(slots), groups[engine], timeout_s=timeout_s)
                except pd.DuplicateRoomError as exc:
                    conn.send(
                        ("room_done", cfg.rank, room, "FAILED", f"duplicate_room: {exc}", 0.0, [], True, 0.0)
                    )
            elif cmd[0] == "stop":
                for room in fenced:
                    mem.clear(rooms[room][0])
                problems = untouched_problems(mem.caches)
                conn.send(("final", "decode", cfg.rank, asdict(worker.stats), problems))
                worker.close()
                backend.close()
                return
