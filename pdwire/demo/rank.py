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

import numpy as np
import torch
import zmq

from pdwire import wire
from pdwire.demo import register_mori_fake
from pdwire.demo.content import (
    RoomSlots,
    fill,
    fill_sentinel,
    full_tensors,
    pages_for,
    reset,
    untouched_problems,
    verify,
)
from pdwire.demo.model import Capacity, ModelSpec, RankCaches, build_caches, bytes_needed
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
    peer_timeout_s: float = 5.0  # decode: DecodeConfig.peer_timeout_s


def model_fingerprint(spec: ModelSpec) -> wire.ModelFingerprint:
    return wire.ModelFingerprint(
        model_name="pdwire-demo-hybrid-mla" if spec.mla else "pdwire-demo-hybrid",
        revision=spec.fingerprint().hex(),
        dtype="int16",
        num_layers=spec.layers,
        num_attention_layers=spec.layers,
        num_state_layers=spec.mamba_layers,
    )


class SlotPool:
    """Free pages/slots of one rank; random picks, so rooms are scattered through the pools."""

    def __init__(self, cap: Capacity, seed: int) -> None:
        self.pages = list(range(cap.pages))
        self.slots = list(range(1, cap.slots))  # slot 0 is the dummy Mamba slot
        self.swa = list(range(cap.swa_pages))
        self.aux = list(range(cap.aux_items))
        self.rng = np.random.default_rng(seed)

    def _take(self, free: list[int], n: int, what: str) -> list[int]:
        if n > len(free):
            raise MemoryError(f"out of {what}: need {n}, {len(free)} free")
        picks = sorted(self.rng.choice(len(free), size=n, replace=False).tolist(), reverse=True)
        return [free.pop(i) for i in picks]

    def take(self, spec: ModelSpec, tokens: int) -> RoomSlots:
        pages, swa = pages_for(spec, tokens)
        if pages > len(self.pages) or swa > len(self.swa) or not self.slots or not self.aux:
            raise MemoryError(
                f"out of memory for {tokens} tokens: {len(self.pages)} KV pages, {len(self.slots)} Mamba "
                f"slots, {len(self.swa)} SWA pages, {len(self.aux)} aux items free"
            )
        return RoomSlots(
            np.asarray(self._take(self.pages, pages, "KV pages"), dtype=np.int32),
            self._take(self.slots, 1, "Mamba slots")[0],
            np.asarray(self._take(self.swa, swa, "SWA pages"), dtype=np.int32),
            self._take(self.aux, 1, "aux items")[0],
        )

    def give(self, s: RoomSlots) -> None:
        self.pages += s.pages.tolist()
        self.slots.append(s.slot)
        self.swa += s.swa_pages.tolist()
        self.aux.append(s.aux)


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


def _setup(cfg: RankConfig) -> tuple[pd.Backend, RankCaches, dict[str, Any]]:
    """The rank's backend, its caches carved out of memory allocated through it, and the
    fields both worker configs share."""
    register_mori_fake()  # a forkserver child: the parent's registrations are not inherited
    backend = pd.create_backend(
        cfg.backend,
        agent_name=f"{cfg.engine_id}-{cfg.role}{cfg.rank}-{os.getpid()}",
        transfer_timeout_s=cfg.transfer_timeout_s,
        **cfg.backend_options,
    )
    buf = backend.allocate("caches", bytes_needed(cfg.spec, cfg.tp, cfg.rank, cfg.capacity))
    caches = build_caches(cfg.spec, cfg.tp, cfg.rank, cfg.capacity, buf.array)
    common = {
        "engine_id": cfg.engine_id,
        "rank": pd.ParallelRank(tp_size=cfg.tp, tp_rank=cfg.rank),
        "model": model_fingerprint(cfg.spec),
        "room_timeout_s": cfg.room_timeout_s,
        "transfer_timeout_s": cfg.transfer_timeout_s,
        "versions": cfg.versions,
        "control_auth": cfg.control_auth,
    }
    return backend, caches, common


def _prefill(cfg: RankConfig, conn: Connection) -> None:
    backend, caches, common = _setup(cfg)
    pool = SlotPool(cfg.capacity, cfg.seed * 7919 + cfg.rank)
    held: dict[int, RoomSlots] = {}

    def released(room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        s = held.pop(room, None)
        if s is not None:
            pool.give(s)
        span = worker.spans.pop(room, [0.0, 0.0])
        conn.send(("prefill_done", cfg.rank, room, status.name, failure.reason if failure else "", span))

    ctx: zmq.Context[Any] = zmq.Context()
    worker = pd.PrefillWorker(
        pd.PrefillConfig(bind=cfg.bind, **common),
        caches.memory,
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
                if last:
                    state, aux = s.state_indices(cfg.spec), s.aux
                    worker.send_chunk(room, s.pages[start:stop], last=True, state=state, aux_index=aux)
                else:
                    worker.send_chunk(room, s.pages[start:stop], last=False)
        if not events.get(conn.fileno()):
            continue
        while conn.poll():
            cmd = conn.recv()
            if cmd[0] == "prefill":
                _, room, tokens = cmd
                slots = pool.take(cfg.spec, tokens)
                held[room] = slots
                fill(caches, slots, full_tensors(cfg.spec, cfg.seed, room, tokens))
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
    backend, caches, common = _setup(cfg)
    fill_sentinel(caches)
    pool = SlotPool(cfg.capacity, cfg.seed * 104729 + cfg.rank)
    rooms: dict[int, tuple[RoomSlots, int, float]] = {}  # until the worker releases their slots
    fenced: set[int] = set()  # failed rooms whose senders may still write: never checked

    def finished(room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        slots, tokens, t0 = rooms[room]
        latency = time.perf_counter() - t0
        problems: list[str] = []
        if status is pd.Status.SUCCESS:
            problems = verify(caches, slots, full_tensors(cfg.spec, cfg.seed, room, tokens))
        else:
            fenced.add(room)
        reason = failure.reason if failure else ""
        conn.send(("room_done", cfg.rank, room, status.name, reason, latency, problems, False, t0))

    def slots_released(room: int) -> None:
        # Nothing writes into the slots any more (for a failed room: every prefill rank said so,
        # or the fence timed out, which the worker counts): wipe what landed and reuse them.
        slots, _, _ = rooms.pop(room)
        fenced.discard(room)
        reset(caches, slots)
        pool.give(slots)
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
        pd.DecodeConfig(fence_timeout_s=cfg.fence_timeout_s, peer_timeout_s=cfg.peer_timeout_s, **common),
        caches.memory,
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
                    slots = pool.take(cfg.spec, tokens)
                    rooms[room] = (slots, tokens, time.perf_counter())
                    worker.start_room(room, slots.request(cfg.spec), groups[engine], timeout_s=timeout_s)
                except pd.DuplicateRoomError as exc:
                    conn.send(
                        ("room_done", cfg.rank, room, "FAILED", f"duplicate_room: {exc}", 0.0, [], True, 0.0)
                    )
            elif cmd[0] == "stop":
                for room in fenced:
                    reset(caches, rooms[room][0])
                problems = untouched_problems(caches)
                conn.send(("final", "decode", cfg.rank, asdict(worker.stats), problems))
                worker.close()
                backend.close()
                return
