"""``pdwire serve decode``: every TP rank of one decode engine in this process.

Which prefill groups are routable, and when they stop being so, is docs/deployment.md ("What
the decode server does with the registry"). Requests come in waves (``--requests N`` at start,
or ``run`` on the admin socket): each gets a room id carrying its prompt length (:mod:`.ranks`),
slots on every rank and a routable prefill engine (round robin); it succeeds only when every
rank reported Success and every byte verified. Slots are wiped and reused only once the worker
releases them (for a failed room: once every writer fenced).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from pdwire import wire
from pdwire.discovery import Discovery, EngineGroup
from pdwire.runtime import engine as pd
from pdwire.serve.admin import AdminSocket
from pdwire.serve.config import ServeConfig
from pdwire.serve.ranks import (
    Rank,
    RankServer,
    build_rank,
    common_config,
    model_label,
    registry_entry,
    room_id,
)

log = logging.getLogger("pdwire.serve")
_Rank = Rank[pd.DecodeWorker]


@dataclass
class _Group:
    """One prefill engine as this decode engine sees it."""

    engine_id: str
    signature: tuple[tuple[str, str, str], ...] = ()  # (rank, incarnation, control) per rank
    connected: list[pd.PrefillGroup] | None = None  # per local rank, once every handshake passed
    connecting: list[pd.PrefillGroup] | None = None  # per local rank, while the handshakes run
    connect_started: float = 0.0
    routable: bool = False
    retry_at: float = 0.0
    backoff_s: float = 0.5
    last_error: str = ""
    skipped: str = ""  # why it is not used at all (another model or backend)


@dataclass
class _Request:
    n: int
    tokens: int
    wave: _Wave
    queued_at: float
    room: int = 0
    engine_id: str = ""
    started_at: float = 0.0
    slots: dict[int, Any] = field(default_factory=dict)  # rank index -> slots
    outcome: dict[int, tuple[pd.Status, str]] = field(default_factory=dict)  # rank index -> status
    problems: list[str] = field(default_factory=list)
    kinds: set[str] = field(default_factory=set)
    finished_at: float = 0.0
    content: Any = None  # the room's full tensors, once a rank verifies

    @property
    def ok(self) -> bool:
        return all(s is pd.Status.SUCCESS for s, _ in self.outcome.values()) and not self.problems


@dataclass
class _Wave:
    total: int
    reply: list[bytes] | None  # admin address to answer, or None (a start-up wave)
    started: float
    room_timeout_s: float
    done: list[_Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.done) == self.total

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.done if r.ok]
        failed = [r for r in self.done if not r.ok]
        lat = [1000 * (r.finished_at - r.queued_at) for r in ok]
        return {
            "requests": self.total,
            "ok": len(ok),
            "failed": [
                {
                    "room": r.room,
                    "tokens": r.tokens,
                    "engine": r.engine_id,
                    "kinds": sorted(r.kinds),
                    "reason": "; ".join(r.problems)[:500],
                }
                for r in failed
            ],
            "seconds": round(time.monotonic() - self.started, 3),
            "p50_ms": round(statistics.median(lat), 1) if lat else None,
            "verified_bytes": "every byte of every successful request, on every rank",
        }


class DecodeServer(RankServer[_Rank]):
    def __init__(self, cfg: ServeConfig, discovery: Discovery) -> None:
        self.groups: dict[str, _Group] = {}
        self.live: dict[int, _Request] = {}  # room -> request, until every rank finished it
        self.pending: deque[_Request] = deque()  # waiting for an engine or memory
        self.unreleased: dict[tuple[int, int], Any] = {}  # (rank, room) -> slots to wipe
        self.waves: list[_Wave] = []
        self.counts = {"ok": 0, "failed": 0}
        self._numbers = itertools.count(1)
        self._rr = itertools.count()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self.admin: AdminSocket | None = None
        try:
            self.admin = AdminSocket(cfg.admin, self._ctx) if cfg.admin else None
        except BaseException:
            self._ctx.term()
            raise
        super().__init__(cfg, discovery, range(cfg.tp))
        self.model = model_label(self.ranks[0].worker.hello.model)
        self.majors = {v.major for v in self.ranks[0].worker.hello.versions}
        for rk in self.ranks:
            discovery.register(registry_entry(cfg, rk.parts, rk.worker.hello, ""))
        log.info(
            "decode %s: %d ranks, backend %s, discovery %s%s",
            cfg.engine_id, cfg.tp, self.ranks[0].parts.backend.name, discovery.kind,
            f", admin socket {cfg.admin}" if cfg.admin else "",
        )  # fmt: skip
        if cfg.requests:
            self._queue_wave(cfg.requests, cfg.min_tokens, cfg.max_tokens, None)

    def _start_rank(self, tp_rank: int) -> _Rank:
        cfg = self.cfg
        parts = build_rank(cfg, self.memory_model, tp_rank)
        parts.memory.prepare()
        try:
            config = pd.DecodeConfig(
                **common_config(cfg, self.memory_model, tp_rank), handshake_timeout_s=cfg.handshake_timeout_s
            )  # type: ignore[arg-type]
            worker = pd.DecodeWorker(
                config,
                parts.memory.memory,
                backend=parts.backend,
                context=self._ctx,
                on_finished=lambda room, status, failure: self._finished(tp_rank, room, status, failure),
                on_slots_released=lambda room: self._slots_released(tp_rank, room),
            )
        except BaseException:
            parts.backend.close()
            raise
        return _Rank(parts, worker)

    # ---------------------------------------------------------------- prefill engines

    def _compatible(self, g: EngineGroup) -> str:
        """Why ``g`` cannot serve this engine ("" when it can)."""
        first = next(iter(g.ranks.values()))
        ours = self.ranks[0].parts.backend.name
        if first.backend and first.backend != ours:
            return f"it runs backend {first.backend!r}, this decode engine {ours!r}"
        if first.model and first.model != self.model:
            return f"it serves model {first.model}, this decode engine {self.model}"
        majors = {int(v.split(".")[0]) for v in first.protocol}
        if majors and not majors & self.majors:
            return f"it speaks protocol {', '.join(first.protocol)}, this build majors {sorted(self.majors)}"
        return ""

    def _unroute(self, st: _Group, why: str, lost: bool = False) -> None:
        if st.routable:
            log.warning("prefill %s is not routable any more: %s", st.engine_id, why)
        st.routable = False
        st.connected = None
        st.connecting = None  # a handshake under way is left to end on its own; its group is unused
        if lost:  # its ranks are gone: their rooms fail now and they are revoked (see the worker)
            for rk in self.ranks:
                rk.worker.peer_lost(st.engine_id, reason=f"prefill {st.engine_id}: {why}")
        for req in list(self.live.values()):
            if req.engine_id == st.engine_id:
                self._abort(req, f"prefill {st.engine_id}: {why}")

    def _abort(self, req: _Request, why: str) -> None:
        """Abort ``req`` on every rank that has not reported it yet."""
        for i, rk in enumerate(self.ranks):
            if i not in req.outcome:
                rk.worker.abort(req.room, why)

    def _reconcile(self, now: float) -> None:
        seen = self.discovery.membership.groups(wire.Role.PREFILL)
        for eid, st in list(self.groups.items()):
            if eid not in seen:
                why = "every rank left the registry (stopped, or their leases expired)"
                self._unroute(st, why, lost=True)
                del self.groups[eid]
        for eid, g in seen.items():
            st = self.groups.setdefault(eid, _Group(eid))
            why = self._compatible(g)
            if why:
                if st.skipped != why:
                    log.warning("prefill %s is not used: %s", eid, why)
                st.skipped = why
                self._unroute(st, why)
                continue
            st.skipped = ""
            if not g.complete:
                missing = ", ".join(g.missing) or "; ".join(g.problems)
                why = f"rank {missing} left the registry (stopped, or its lease expired)"
                self._unroute(st, why, lost=True)
                st.signature = ()
                continue
            sig = tuple((name, e.incarnation, e.control) for name, e in sorted(g.ranks.items()))
            if (st.connected is not None or st.connecting is not None) and sig == st.signature:
                continue
            if st.connected is not None:
                self._unroute(st, "a rank restarted or moved; connecting again", lost=True)
            if st.signature != sig:
                st.signature, st.retry_at, st.backoff_s, st.last_error = sig, 0.0, 0.5, ""
            if now < st.retry_at:
                continue
            self._connect(st, g, now)

    def _connect(self, st: _Group, g: EngineGroup, now: float) -> None:
        """Start every local rank's handshake with ``g``; :meth:`_advance_connects` sees them end
        (the workers run them from their steps: a prefill rank that never answers holds up
        nothing but this group)."""
        endpoints = g.control_endpoints()
        try:
            st.connecting = [rk.worker.connect(endpoints) for rk in self.ranks]
        except (pd.SessionError, pd.ConfigError) as exc:
            self._connect_failed(st, endpoints, f"{type(exc).__name__}: {exc}")
            return
        st.connect_started = now

    def _advance_connects(self) -> None:
        for st in self.groups.values():
            if st.connecting is None:
                continue
            failed = next((grp for grp in st.connecting if grp.failed), None)
            if failed is not None:
                st.connecting = None
                self._connect_failed(st, list(failed.endpoints), f"HandshakeError: {failed.error}")
            elif all(grp.ready for grp in st.connecting):
                st.connected, st.connecting, st.routable, st.last_error = st.connecting, None, True, ""
                grp, took = st.connected[0], time.monotonic() - st.connect_started
                log.info(
                    "connected to prefill %s (TP %d at %s) in %.2fs",
                    st.engine_id, grp.tp_size, ", ".join(grp.endpoints), took,
                )  # fmt: skip

    def _connect_failed(self, st: _Group, endpoints: list[str], err: str) -> None:
        if err != st.last_error:
            log.error(
                "handshake with prefill %s (%s) failed: %s; retrying", st.engine_id, ", ".join(endpoints), err
            )
        st.last_error = err
        st.retry_at = time.monotonic() + st.backoff_s
        st.backoff_s = min(10.0, st.backoff_s * 2)

    def _routable(self) -> list[_Group]:
        return [g for g in self.groups.values() if g.routable and g.connected is not None]

    # ---------------------------------------------------------------- requests

    def _queue_wave(
        self, n: int, lo: int, hi: int, reply: list[bytes] | None, room_timeout_s: float | None = None
    ) -> None:
        wave = _Wave(n, reply, time.monotonic(), room_timeout_s or self.cfg.room_timeout_s)
        self.waves.append(wave)
        rng = np.random.default_rng(self.cfg.memory.seed + len(self.waves))
        now = time.monotonic()
        for _ in range(n):
            self.pending.append(_Request(next(self._numbers), int(rng.integers(lo, hi + 1)), wave, now))
        log.info("wave %d: %d requests of %d-%d tokens queued", len(self.waves), n, lo, hi)
        if n == 0:
            self._wave_done(wave)

    def _start_pending(self, now: float) -> None:
        groups = self._routable()
        waiting: deque[_Request] = deque()
        while self.pending:
            req = self.pending.popleft()
            limit = req.wave.room_timeout_s
            if now - req.queued_at > limit:
                why = "no routable prefill engine" if not groups else "no free memory"
                self._fail_unstarted(req, "timeout", f"{why} within the room timeout ({limit}s)")
                continue
            if not groups or not self._start(req, groups[next(self._rr) % len(groups)], now):
                waiting.append(req)
        self.pending = waiting

    def _start(self, req: _Request, group: _Group, now: float) -> bool:
        """Start ``req`` on every rank; False (nothing held) when memory is short for now."""
        assert group.connected is not None
        req.room = room_id(req.n, req.tokens)
        taken: dict[int, Any] = {}
        try:
            for i, rk in enumerate(self.ranks):
                rk.worker.check_free(req.room)
                taken[i] = rk.parts.memory.take(req.tokens)
        except (MemoryError, pd.SessionError) as exc:
            for i, s in taken.items():
                self.ranks[i].parts.memory.give(s)
            pages = self.memory_model.pages_needed(req.tokens)
            if isinstance(exc, pd.SessionError):
                self._fail_unstarted(req, "duplicate_room", str(exc))
            elif pages > self.cfg.memory.pages:
                why = f"{req.tokens} tokens need {pages} pages, a rank has {self.cfg.memory.pages}"
                self._fail_unstarted(req, "validation", why)
            else:
                return False  # memory is short for now: the request waits
            return True
        req.slots, req.engine_id, req.started_at = taken, group.engine_id, now
        self.live[req.room] = req
        for i, rk in enumerate(self.ranks):
            try:
                rk.worker.start_room(
                    req.room,
                    rk.parts.memory.request(taken[i]),
                    group.connected[i],
                    timeout_s=req.wave.room_timeout_s,
                )
            except (pd.SessionError, pd.IndicesError, pd.ConfigError) as exc:
                req.kinds.add("refused")
                req.problems.append(f"rank {i}: could not start: {type(exc).__name__}: {exc}")
                for k in range(i, len(self.ranks)):  # never asked: their slots are free at once
                    req.outcome[k] = (pd.Status.FAILED, "refused")
                    self.ranks[k].parts.memory.give(taken[k])
                for j in range(i):  # the ranks already asked: abort them (they report back)
                    self.ranks[j].worker.abort(req.room, f"rank {i} could not start the room")
                break
            else:
                self.unreleased[(i, req.room)] = taken[i]
        self._maybe_done(req)
        return True

    def _fail_unstarted(self, req: _Request, kind: str, why: str) -> None:
        req.kinds.add(kind)
        req.problems.append(why)
        req.finished_at = time.monotonic()
        self.counts["failed"] += 1
        log.warning("request %d (%d tokens) failed before it started: %s", req.n, req.tokens, why)
        self._record(req)

    def _finished(self, rank: int, room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        req = self.live.get(room)
        if req is None:
            return
        if status is pd.Status.SUCCESS:
            if req.content is None:  # the same full tensors for every rank: generated once
                req.content = self.memory_model.content(room, req.tokens)
            bad = self.ranks[rank].parts.memory.verify(req.slots[rank], req.content)
            if bad:
                req.kinds.add("corrupt")
                req.problems.append(f"rank {rank}: {len(bad)} mismatches, first: {bad[0]}")
            req.outcome[rank] = (status, "")
        else:
            kind = failure.kind.name.lower() if failure is not None else "unspecified"
            req.kinds.add(kind)
            req.problems.append(f"rank {rank}: {failure.reason if failure else 'failed'}")
            req.outcome[rank] = (status, kind)
        self._maybe_done(req)

    def _maybe_done(self, req: _Request) -> None:
        if len(req.outcome) < len(self.ranks):
            return
        self.live.pop(req.room, None)
        req.content = None
        req.finished_at = time.monotonic()
        if req.ok:
            self.counts["ok"] += 1
            log.debug(
                "room %d (%d tokens) from %s: verified on %d ranks",
                req.room,
                req.tokens,
                req.engine_id,
                len(self.ranks),
            )
        else:
            self.counts["failed"] += 1
            kinds, why = ", ".join(sorted(req.kinds)), "; ".join(req.problems)[:400]
            log.warning(
                "room %d (%d tokens) from %s failed (%s): %s", req.room, req.tokens, req.engine_id, kinds, why
            )
        self._record(req)

    def _record(self, req: _Request) -> None:
        req.wave.done.append(req)
        if req.wave.finished:
            self._wave_done(req.wave)

    def _wave_done(self, wave: _Wave) -> None:
        summary = wave.summary()
        log.info(
            "wave %d: %d/%d requests ok in %.2fs%s",
            self.waves.index(wave) + 1, summary["ok"], wave.total, summary["seconds"],
            "" if summary["ok"] == wave.total else f"; {len(summary['failed'])} failed",
        )  # fmt: skip
        if wave.reply is not None and self.admin is not None:
            self.admin.reply(wave.reply, summary)
        elif wave.reply is None and self.cfg.exit_after:
            self._exit_status = 0 if summary["ok"] == wave.total else 1
            self.stop()

    def _slots_released(self, rank: int, room: int) -> None:
        slots = self.unreleased.pop((rank, room), None)
        if slots is None:
            return
        self.ranks[rank].parts.memory.clear(slots)
        self.ranks[rank].parts.memory.give(slots)

    # ---------------------------------------------------------------- admin

    def status(self) -> dict[str, Any]:
        return {
            "engine_id": self.cfg.engine_id,
            "ranks": self.cfg.tp,
            "registry_reachable": self.discovery.membership.reachable,
            "groups": {
                eid: {
                    "routable": g.routable,
                    "connecting": g.connecting is not None,
                    "ranks": [name for name, _, _ in g.signature],
                    "last_error": g.last_error,
                    "skipped": g.skipped,
                }
                for eid, g in self.groups.items()
            },
            "live": len(self.live),
            "pending": len(self.pending),
            "unreleased_slots": len(self.unreleased),
            "ok": self.counts["ok"],
            "failed": self.counts["failed"],
            "revocations": sum(rk.worker.stats.revocations for rk in self.ranks),
            "unrevocable": sum(rk.worker.stats.unrevocable for rk in self.ranks),
        }

    def _admin(self) -> None:
        if self.admin is None:
            return
        for address, cmd in self.admin.receive():
            if isinstance(cmd, str):
                self.admin.reply(address, {"error": cmd})
            elif cmd["cmd"] == "status":
                self.admin.reply(address, self.status())
            elif cmd["cmd"] == "run":
                n = cmd.get("requests", 8)
                lo = cmd.get("min_tokens", self.cfg.min_tokens)
                hi = cmd.get("max_tokens", self.cfg.max_tokens)
                timeout = cmd.get("room_timeout_s", self.cfg.room_timeout_s)
                if (
                    not all(isinstance(v, int) and not isinstance(v, bool) for v in (n, lo, hi))
                    or not (n >= 0 and 1 <= lo <= hi < 1 << 16)
                    or isinstance(timeout, bool)
                    or not (isinstance(timeout, int | float) and timeout > 0)
                ):
                    why = "run takes requests >= 0, 1 <= min_tokens <= max_tokens < 65536, room_timeout_s > 0"
                    self.admin.reply(address, {"error": why})
                else:
                    self._queue_wave(n, lo, hi, address, float(timeout))
            elif cmd["cmd"] == "stop":
                self.admin.reply(address, {"stopping": True})
                self.stop()
            else:
                self.admin.reply(address, {"error": f"unknown command {cmd['cmd']!r} (status, run, stop)"})

    # ---------------------------------------------------------------- the loop

    def step(self, timeout_ms: int = 20) -> None:
        now = time.monotonic()
        idle = [g for g in self.groups.values() if not g.routable and g.connecting is None]
        if self.discovery.poll() or any(now >= g.retry_at for g in idle):
            self._reconcile(now)
        if self.pending:
            self._start_pending(now)
        each = max(1, timeout_ms // len(self.ranks))
        for rk in self.ranks:
            rk.worker.step(each)
        self._advance_connects()
        self._admin()

    def serve(self) -> int:
        """As :meth:`RankServer.serve`; the exit status is 1 when the start-up wave failed."""
        self._reconcile(time.monotonic())
        return super().serve()

    def _log_stats(self) -> None:
        s = self.status()
        log.info(
            "%d rooms ok, %d failed, %d live, %d waiting; routable prefill: %s",
            s["ok"], s["failed"], s["live"], s["pending"],
            ", ".join(g.engine_id for g in self._routable()) or "none",
        )  # fmt: skip

    def shutdown(self, wait_s: float = 10.0) -> None:
        """Withdraw, fail waiting requests, abort live rooms, wait (bounded) for their slots."""
        log.info("stopping: %d live rooms, %d waiting requests", len(self.live), len(self.pending))
        self.discovery.withdraw()
        while self.pending:
            self._fail_unstarted(self.pending.popleft(), "aborted", "the decode engine is stopping")
        for req in list(self.live.values()):
            self._abort(req, "the decode engine is stopping")
        deadline = time.monotonic() + wait_s
        while (self.live or self.unreleased) and time.monotonic() < deadline:
            for rk in self.ranks:
                rk.worker.step(10)
        if self.unreleased:
            log.warning(
                "%d rooms' slots were not fenced within %.0fs; closing anyway", len(self.unreleased), wait_s
            )
        for wave in self.waves:
            if not wave.finished and wave.reply is not None and self.admin is not None:
                self.admin.reply(wave.reply, {**wave.summary(), "stopped": True})
        self._close()
        self.discovery.close()
        log.info("stopped: %d rooms ok, %d failed", self.counts["ok"], self.counts["failed"])

    def _close(self) -> None:
        super()._close()
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        self._ctx.term()
