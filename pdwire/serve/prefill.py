"""``pdwire serve prefill``: the prefill ranks of one engine in this process.

A rank asked for a room it has not produced produces it from the room id (:mod:`.ranks`) and
sends it as chunked prefill would; a room it cannot serve (no prompt length in its id, no free
memory) is aborted, which tells decode why. The stop is docs/deployment.md's ("Stop").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdwire.discovery import Discovery
from pdwire.runtime import engine as pd
from pdwire.serve.config import ServeConfig
from pdwire.serve.ranks import Rank, RankServer, build_rank, common_config, registry_entry, tokens_of

log = logging.getLogger("pdwire.serve")


@dataclass
class _Rank(Rank[pd.PrefillWorker]):
    held: dict[int, Any] = field(default_factory=dict)  # produced rooms until released
    refused: set[int] = field(default_factory=set)  # aborted before producing: not again
    ok: int = 0
    failed: int = 0


def _asked_rooms(worker: pd.PrefillWorker) -> list[int]:
    """Rooms live on the worker: asked for by a decode rank, or produced here."""
    return list(worker.session.rooms)


class PrefillServer(RankServer[_Rank]):
    def __init__(self, cfg: ServeConfig, discovery: Discovery) -> None:
        self._contents: dict[int, list[Any]] = {}  # room -> [full tensors, ranks that used them]
        super().__init__(cfg, discovery, cfg.local_ranks)
        for rk in self.ranks:
            entry = registry_entry(cfg, rk.parts, rk.worker.hello, rk.worker.endpoint)
            discovery.register(entry)
            log.info(
                "prefill %s rank %d/%d: listening on %s, advertised as %s (backend %s, registered with %s)",
                cfg.engine_id, rk.parts.tp_rank, cfg.tp, rk.worker.bound, rk.worker.endpoint,
                rk.parts.backend.name, discovery.kind,
            )  # fmt: skip

    def _start_rank(self, tp_rank: int) -> _Rank:
        cfg = self.cfg
        parts = build_rank(cfg, self.memory_model, tp_rank)
        holder: list[_Rank] = []

        def released(room: int, status: pd.Status, failure: pd.Failure | None) -> None:
            rk = holder[0]
            slots = rk.held.pop(room, None)
            if slots is not None:
                rk.parts.memory.give(slots)
            if status is pd.Status.SUCCESS:
                rk.ok += 1
                log.debug("rank %d room %d: sent", tp_rank, room)
            else:
                rk.failed += 1
                log.warning("rank %d room %d failed: %s", tp_rank, room, failure.reason if failure else "?")

        try:
            config = pd.PrefillConfig(
                **common_config(cfg, self.memory_model, tp_rank),
                bind=cfg.rank_bind(tp_rank),
                advertise=cfg.rank_advertise(tp_rank),
            )
            worker = pd.PrefillWorker(
                config, parts.memory.memory, backend=parts.backend, on_released=released
            )
        except BaseException:
            parts.backend.close()
            raise
        rk = _Rank(parts, worker)
        holder.append(rk)
        return rk

    # ---------------------------------------------------------------- the loop

    def _produce(self, rk: _Rank) -> None:
        for room in _asked_rooms(rk.worker):
            if room in rk.held or room in rk.refused:
                continue
            tokens = tokens_of(room)
            if tokens == 0:
                rk.refused.add(room)
                rk.worker.abort(room, f"room {room} carries no prompt length (not a pdwire serve request)")
                continue
            try:
                slots = rk.parts.memory.take(tokens)
            except MemoryError as exc:
                rk.refused.add(room)
                rk.worker.abort(room, f"prefill rank {rk.parts.tp_rank}: {exc}")
                continue
            rk.held[room] = slots
            rk.parts.memory.fill(slots, self._content(room, tokens))
            src = rk.parts.memory.request(slots)
            pages, step = len(src.kv_pages), self.cfg.chunk_pages
            for start in range(0, pages, step):
                stop = min(pages, start + step)
                last = stop == pages  # the last chunk carries state and aux
                state, aux = (src.state, src.aux_index) if last else (None, None)
                rk.worker.send_chunk(room, src.kv_pages[start:stop], last=last, state=state, aux_index=aux)
        if len(rk.refused) > 4096:  # the worker keeps tombstones; so little need be kept here
            rk.refused = {r for r in rk.refused if r in rk.worker.session.rooms}

    def _content(self, room: int, tokens: int) -> Any:
        """The room's full tensors, generated once for all ranks of this process."""
        entry = self._contents.get(room)
        if entry is None:
            entry = self._contents[room] = [self.memory_model.content(room, tokens), 0]
        entry[1] += 1
        content = entry[0]
        if entry[1] >= len(self.ranks):
            del self._contents[room]
        while len(self._contents) > 64:  # rooms a rank here was never asked for: forget the oldest
            self._contents.pop(next(iter(self._contents)))
        return content

    def step(self, timeout_ms: int = 20) -> None:
        each = max(1, timeout_ms // max(1, len(self.ranks)))
        for rk in self.ranks:
            rk.worker.step(each)
            self._produce(rk)
        self.discovery.poll()

    def _log_stats(self) -> None:
        for rk in self.ranks:
            s = rk.worker.stats
            if rk.ok or rk.failed or rk.held:
                log.info(
                    "rank %d: %d rooms sent, %d failed, %d live; %.1f MiB in %d descriptors",
                    rk.parts.tp_rank, rk.ok, rk.failed, len(rk.held), s.bytes_posted / 2**20, s.descriptors,
                )  # fmt: skip

    def shutdown(self, wait_s: float | None = None) -> None:
        """Withdraw, abort live rooms, wait (bounded) until they are released, close everything."""
        log.info("stopping: withdrawing from %s, aborting %d live rooms", self.discovery.kind,
                 sum(len(_asked_rooms(rk.worker)) for rk in self.ranks))  # fmt: skip
        self.discovery.withdraw()
        why = f"prefill engine {self.cfg.engine_id} is stopping"
        aborted: set[tuple[int, int]] = set()

        def abort_new() -> None:
            # requests keep arriving until decode sees the withdrawal: each is refused at once,
            # or the wait below would last until its room timed out for want of chunks
            for i, rk in enumerate(self.ranks):
                for room in _asked_rooms(rk.worker):
                    if (i, room) not in aborted:
                        aborted.add((i, room))
                        rk.worker.abort(room, why)

        abort_new()
        limit = wait_s if wait_s is not None else self.cfg.transfer_timeout_s + 2
        deadline = time.monotonic() + limit
        while any(_asked_rooms(rk.worker) for rk in self.ranks) and time.monotonic() < deadline:
            for rk in self.ranks:
                rk.worker.step(10)
            abort_new()
        left = sum(len(_asked_rooms(rk.worker)) for rk in self.ranks)
        if left:
            log.warning("%d rooms still had transfers in flight after %.0fs; closing anyway", left, limit)
        self._log_stats()
        self._close()
        self.discovery.close()
        log.info("stopped")
