"""Prefill and decode groups as separate processes on this machine, driven from the parent.

Used by ``pdwire demo``, the end-to-end tests and the control-plane benchmark. Every rank is
a process forked from a forkserver (:func:`pdwire.demo.rank.rank_main`) with its own backend and
memory; the parent only sends scheduler commands and collects results. ``close`` kills
every child that is still alive, so nothing outlives the cluster.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, cast

from pdwire.demo.model import Capacity, ModelSpec
from pdwire.demo.rank import RankConfig, rank_main
from pdwire.runtime.control_auth import ControlAuth


class ClusterError(RuntimeError):
    """A rank process crashed or did not answer in time."""


@dataclass
class Group:
    role: str
    engine_id: str
    tp: int
    procs: Sequence[BaseProcess]
    conns: list[Connection]
    endpoints: list[str] = field(default_factory=list)
    finals: dict[int, tuple[dict[str, Any], list[str]]] = field(default_factory=dict)


@dataclass
class RoomResult:
    """One room across every decode rank of its group."""

    room: int
    ranks: int
    submitted: float
    statuses: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    latencies: dict[int, float] = field(default_factory=dict)  # decode rank -> request sent .. done
    started: dict[int, float] = field(default_factory=dict)  # decode rank -> perf_counter at request
    problems: list[str] = field(default_factory=list)
    finished: float = 0.0

    @property
    def done(self) -> bool:
        return len(self.statuses) == self.ranks

    @property
    def ok(self) -> bool:
        return self.done and all(s == "SUCCESS" for s in self.statuses.values()) and not self.problems

    @property
    def reason(self) -> str:
        return "; ".join(f"decode rank {r}: {x}" for r, x in sorted(self.reasons.items()) if x)


class Cluster:
    def __init__(
        self,
        spec: ModelSpec,
        capacity: Capacity,
        backend: str,
        *,
        seed: int = 1,
        room_timeout_s: float = 30.0,
        transfer_timeout_s: float = 20.0,
        chunk_pages: int = 8,
        chunk_delay_s: float = 0.0,
    ) -> None:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        # Mooncake logs every connection at INFO; its level is read when mooncake.engine is
        # imported, which happens in the ranks, after this.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        # One forkserver imports torch (and the engine) once; every rank forks from it, instead of
        # each spawned rank paying the multi-second torch import on a small machine.
        self._ctx = mp.get_context("forkserver")
        preload = ["pdwire.demo.rank"] + (["nixl._api"] if backend == "nixl" else [])
        self._ctx.set_forkserver_preload(preload)
        # one CURVE key for the cluster's ranks, like a deployment's: the control plane is
        # authenticated as it is by default
        auth = ControlAuth.generate()
        self.base = RankConfig(
            "prefill", "", 1, 0, spec, capacity, backend, seed, room_timeout_s, transfer_timeout_s,
            chunk_pages, chunk_delay_s, control_auth=auth,
        )  # fmt: skip
        self.groups: list[Group] = []
        self._pids: list[int] = []  # every rank process ever started (for leftover_shm)
        self.results: dict[tuple[str, int], RoomResult] = {}  # (decode engine, room)
        self.duplicates: dict[tuple[str, int], RoomResult] = {}  # refused repeated submissions
        # (prefill engine, rank) -> room -> (first post, last completion), perf_counter seconds
        self.spans: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
        self.prefill_done: dict[tuple[str, int], dict[int, tuple[str, str]]] = {}
        # (decode engine, rank) -> room -> perf_counter when the rank got the room's slots back
        self.slots_released: dict[tuple[str, int], dict[int, float]] = {}
        # (decode engine, rank) -> (prefill engine id, error) of each connect answered meanwhile
        self.connected: dict[tuple[str, int], list[tuple[str, str]]] = {}

    # ------------------------------------------------------------------ processes

    def start(self, role: str, tp: int, engine_id: str, **overrides: Any) -> Group:
        """Start ``tp`` rank processes of one engine; ``overrides`` replace RankConfig fields
        (``spec``, ``versions``, ``chunk_delay_s``, ``room_timeout_s``, ...)."""
        procs, conns = [], []
        for rank in range(tp):
            cfg = replace(self.base, role=role, engine_id=engine_id, tp=tp, rank=rank, **overrides)
            parent, child = self._ctx.Pipe()
            p = self._ctx.Process(
                target=rank_main, args=(cfg, child), daemon=True, name=f"{engine_id}-{rank}"
            )
            p.start()
            if p.pid is not None:
                self._pids.append(p.pid)
            child.close()
            procs.append(p)
            conns.append(parent)
        g = Group(role, engine_id, tp, procs, conns, [""] * tp)
        self.groups.append(g)
        for rank, msg in self._gather(g, "ready", 120.0).items():
            g.endpoints[rank] = msg[2]
        return g

    def connect(self, decode: Group, prefill: Group, timeout_s: float = 30.0) -> list[str]:
        """Handshake every decode rank with ``prefill``; returns per-rank errors ('' = connected)."""
        self.start_connect(decode, prefill, timeout_s)
        got = self._gather(decode, "connected", timeout_s + 30.0)
        return [got[r][3] for r in range(decode.tp)]

    def start_connect(self, decode: Group, prefill: Group, timeout_s: float = 30.0) -> None:
        """Ask every decode rank to connect to ``prefill`` without waiting: the ranks run the
        handshake between their rooms; :attr:`connected` collects the answers."""
        for c in decode.conns:
            c.send(("connect", prefill.endpoints, timeout_s))

    def wait_connected(self, decode: Group, timeout_s: float) -> list[tuple[str, str]]:
        """The answers to :meth:`start_connect`, once every rank of ``decode`` gave one."""
        keys = [(decode.engine_id, r) for r in range(decode.tp)]
        self._pump(lambda: all(self.connected.get(k) for k in keys), timeout_s, f"{decode.engine_id} connect")
        return [self.connected[k].pop(0) for k in keys]

    def kill(self, group: Group, rank: int) -> None:
        p = group.procs[rank]
        if p.is_alive() and p.pid is not None:
            p.kill()
        p.join(10)

    def stop(self, group: Group, timeout_s: float = 60.0) -> dict[int, tuple[dict[str, Any], list[str]]]:
        """Ask every live rank to finish; returns rank -> (stats, end-of-run problems)."""
        live = [r for r in range(group.tp) if group.procs[r].is_alive()]
        for r in live:
            group.conns[r].send(("stop",))
        self._pump(lambda: all(r in group.finals for r in live), timeout_s, f"{group.engine_id} stop")
        for r in live:
            group.procs[r].join(10)
        return group.finals

    def shutdown(self, timeout_s: float = 20.0) -> int:
        """Stop every live rank cleanly (each closes its worker and backend, removing its
        shared memory), waiting up to ``timeout_s``; kill the ones that did not exit. Returns
        how many rank processes there were."""
        procs = [p for g in self.groups for p in g.procs]
        conns = [c for g in self.groups for p, c in zip(g.procs, g.conns, strict=True) if p.is_alive()]
        # A rank interrupted mid-wave may be blocked writing results to us while its own command
        # pipe is full: a plain send of "stop" would then block both sides for good. So each stop
        # goes out on a thread of its own, and meanwhile we read (and drop) what the ranks send,
        # which lets them reach the stop; a rank still alive at the deadline is killed by close().
        for c in conns:
            threading.Thread(target=_send_stop, args=(c,), daemon=True).start()
        end = time.monotonic() + timeout_s
        try:
            while any(p.is_alive() for p in procs) and time.monotonic() < end:
                open_conns = [c for c in conns if not c.closed]
                ready = wait(open_conns, timeout=0.05) if open_conns else []
                for c in open_conns:
                    if c not in ready:
                        continue
                    try:
                        c.recv()
                    except (EOFError, OSError):
                        conns.remove(c)
                if not open_conns:
                    time.sleep(0.05)
        finally:
            self.close()
        return len(procs)

    def leftover_shm(self) -> list[str]:
        """Shared-memory files the rank processes of this cluster still have after they exited;
        those of a rank that had to be killed are removed here (a dead process cannot)."""
        from pdwire.runtime.backends import shm

        left: list[str] = []
        for pid in self._pids:
            for name in shm.leftover_paths(pid):
                shm.remove_path(f"{shm.SHM_DIR}/{name}")
            left += shm.leftover_paths(pid)
        return left

    def close(self) -> None:
        for g in self.groups:
            for p in g.procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
            for c in g.conns:
                c.close()
        self.groups.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ rooms

    def submit(self, decode: Group, prefill: Group, room: int, tokens: int, *, timeout_s: float | None = None,
               prefill_too: bool = True) -> RoomResult:  # fmt: skip
        """Start one request: decode ranks allocate and ask; prefill ranks run chunked prefill."""
        engine = prefill.engine_id
        res = RoomResult(room, decode.tp, time.perf_counter())
        key = (decode.engine_id, room)
        if key in self.results and not self.results[key].done:
            self.duplicates[key] = res  # this decode engine refuses it itself, with a typed error
        else:
            self.results[key] = res
        for c in decode.conns:
            c.send(("room", room, tokens, engine, timeout_s))
        if prefill_too:
            self.prefill(prefill, room, tokens)
        return res

    def prefill(self, prefill: Group, room: int, tokens: int) -> None:
        """Run chunked prefill for ``room`` ahead of any request (its chunks wait in the room)."""
        for r, c in enumerate(prefill.conns):
            if prefill.procs[r].is_alive():
                c.send(("prefill", room, tokens))

    def wait_rooms(self, rooms: list[RoomResult], timeout_s: float, progress: Any = None) -> list[RoomResult]:
        def done() -> bool:
            if progress is not None:
                progress(sum(r.done for r in rooms))
            return all(r.done for r in rooms)

        self._pump(done, timeout_s, f"rooms {[r.room for r in rooms[:4]]}...")
        return rooms

    def wait_slots_released(self, decode: Group, room: int, timeout_s: float) -> dict[int, float]:
        """Wait until every live rank of ``decode`` got ``room``'s destination slots back (after a
        failure: once every prefill rank fenced it); returns rank -> perf_counter of the release."""
        live = [r for r in range(decode.tp) if decode.procs[r].is_alive()]

        def released() -> bool:
            return all(room in self.slots_released.get((decode.engine_id, r), {}) for r in live)

        self._pump(released, timeout_s, f"{decode.engine_id} slots of room {room}")
        return {r: self.slots_released[(decode.engine_id, r)][room] for r in live}

    def data_spans(
        self, prefill: Group, rooms: Sequence[int], timeout_s: float = 30.0
    ) -> list[tuple[float, float]]:
        """(first post, last completion) of every live prefill rank that moved data for ``rooms``.

        Waits until each of those ranks has reported every room (its report can trail the
        decode side's Success by a poll interval). Times are ``perf_counter`` seconds, one
        system-wide monotonic clock, so they compare with this process's timestamps.
        """
        live = [r for r in range(prefill.tp) if prefill.procs[r].is_alive()]

        def reported() -> bool:
            return all(room in self.spans.get((prefill.engine_id, r), {}) for r in live for room in rooms)

        self._pump(reported, timeout_s, f"prefill {prefill.engine_id} data spans")
        return [
            span
            for r in live
            for room in rooms
            if (span := self.spans[(prefill.engine_id, r)][room])[1] > 0  # (0, 0): this rank posted nothing
        ]

    # ------------------------------------------------------------------ message pump

    def _on(self, g: Group, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "room_done":
            _, rank, room, status, reason, latency, problems, duplicate, started = msg
            key = (g.engine_id, room)
            res = (self.duplicates if duplicate else self.results).get(key)
            if res is None:
                return
            res.statuses[rank], res.reasons[rank], res.latencies[rank] = status, reason, latency
            res.started[rank] = started
            res.problems += [f"decode rank {rank}: {p}" for p in problems]
            if res.done:
                res.finished = time.perf_counter()
        elif kind == "prefill_done":
            _, rank, room, status, reason, span = msg
            self.prefill_done.setdefault((g.engine_id, rank), {})[room] = (status, reason)
            self.spans.setdefault((g.engine_id, rank), {})[room] = (span[0], span[1])
        elif kind == "slots_released":
            _, rank, room, at = msg
            self.slots_released.setdefault((g.engine_id, rank), {})[room] = at
        elif kind == "connected":
            _, rank, engine, error = msg
            self.connected.setdefault((g.engine_id, rank), []).append((engine, error))
        elif kind == "final":
            _, _, rank, stats, problems = msg
            g.finals[rank] = (stats, problems)
        elif kind == "error":
            raise ClusterError(f"{g.engine_id} {msg[1]} rank {msg[2]} crashed:\n{msg[3]}")

    def _pump(self, until: Any, timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        while not until():
            left = end - time.monotonic()
            if left <= 0:
                raise ClusterError(f"timed out after {timeout_s}s waiting for {what}")
            owners = {c: g for g in self.groups for r, c in enumerate(g.conns) if not c.closed}
            for ready in wait(list(owners), timeout=min(left, 0.5)):
                c = cast(Connection, ready)
                g = owners[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    c.close()  # that rank died (killed on purpose, or crashed: its "error" came first)
                    continue
                self._on(g, msg)

    def _gather(self, g: Group, kind: str, timeout_s: float) -> dict[int, tuple[Any, ...]]:
        got: dict[int, tuple[Any, ...]] = {}
        end = time.monotonic() + timeout_s
        while len(got) < g.tp:
            left = end - time.monotonic()
            if left <= 0:
                raise ClusterError(
                    f"{g.engine_id}: no {kind!r} from ranks {sorted(set(range(g.tp)) - set(got))}"
                )
            for ready in wait(g.conns, timeout=min(left, 0.5)):
                try:
                    msg = cast(Connection, ready).recv()
                except EOFError:
                    raise ClusterError(f"{g.engine_id}: a rank exited during {kind!r}") from None
                if msg[0] == kind:
                    got[msg[1]] = msg
                else:
                    self._on(g, msg)
        return got


def busy_seconds(spans: Sequence[tuple[float, float]], window: tuple[float, float] | None = None) -> float:
    """Length of the union of ``[start, end)`` intervals: the time during which any data moved.

    ``window`` clips every interval first: a prefill rank may see its transfer complete after
    the decode side already reported the room done, and that tail is not inside the batch.
    """
    if window is not None:
        lo, hi = window
        spans = [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _send_stop(conn: Connection) -> None:
    """Ask one rank to stop (see :meth:`Cluster.shutdown`); a rank that is gone is no error."""
    with contextlib.suppress(OSError, ValueError):
        conn.send(("stop",))
