"""pdwire's numbers in vLLM's connector-stats API: the periodic "KV Transfer metrics" log line
and Prometheus series ``vllm:pdwire_*`` on a server's ``/metrics`` (docs/vllm.md, "Metrics").

vLLM asks each worker rank's connector for the stats of the last step
(``get_kv_connector_stats``), sums the ranks' stats with :meth:`PdwireKVConnectorStats.aggregate`,
carries them as a plain dict (:meth:`~PdwireKVConnectorStats.to_dict`, msgpack across processes)
to the frontend, which rebuilds them (``build_kv_connector_stats``) to log a
:meth:`~PdwireKVConnectorStats.reduce` summary per interval and hands the dict to
:class:`PdwirePromMetrics`. So the stats are deltas of plain numbers: a sum is right for ranks
and for steps alike. :class:`IntervalCounts` gathers one rank's deltas; callbacks on pdwire's
worker thread and vLLM's engine thread both reach it, so it holds a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# Counters, summed over ranks and steps: key -> what it counts. Transfers and failures are
# counted per rank (a request moved by TP 2 ranks counts twice), as NixlConnector counts them.
COUNTERS: dict[str, str] = {
    "bytes_sent": "Bytes prefill ranks handed to the transfer engine to write into decode memory.",
    "descriptors": "Transfer-engine descriptors (contiguous ranges) prefill ranks posted.",
    "posts": "Transfer-engine writes prefill ranks posted (each with one notification).",
    "transfers": "Rooms (one request on one rank) that completed: prefill wrote all, decode received all.",
    "blocks_received": "KV blocks and state slots decode ranks received (successful rooms).",
    "unrevocable_peers": "Prefill ranks a decode rank could not revoke: their failed rooms stay quarantined.",
    "peers_lost": "Control connections to prefill ranks a decode rank lost (closed, or silent too long).",
}
# pdwire worker stats (PrefillStats / DecodeStats) counted as-is: the worker's name -> ours
WORKER_COUNTERS: dict[str, str] = {
    "bytes_posted": "bytes_sent",
    "descriptors": "descriptors",
    "posts": "posts",
    "unrevocable": "unrevocable_peers",
    "peers_lost": "peers_lost",
}
# A refusal by this rank before anything was written (bad block ids, an unsupported TP pair),
# beside the wire's typed FailureKind names (timeout, peer_gone, aborted, ...)
REFUSED = "refused"

TIME_BUCKETS_S = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


def _empty() -> dict[str, Any]:
    return {
        "counts": dict.fromkeys(COUNTERS, 0),
        "failures": {},  # failure kind -> rooms failed
        "quarantined_blocks": 0,  # change: + blocks of failed rooms, - once their writers fenced
        "transfer_seconds": [],  # one per completed room
    }


@dataclass
class PdwireKVConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """One interval of pdwire numbers, from one rank or summed over ranks and steps."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = _empty()

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = self.data["counts"]
        return out

    @property
    def failures(self) -> dict[str, int]:
        out: dict[str, int] = self.data["failures"]
        return out

    @property
    def transfer_seconds(self) -> list[float]:
        out: list[float] = self.data["transfer_seconds"]
        return out

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = other.data
        for key, n in theirs["counts"].items():
            self.counts[key] = self.counts.get(key, 0) + n
        for kind, n in theirs["failures"].items():
            self.failures[kind] = self.failures.get(kind, 0) + n
        self.data["quarantined_blocks"] += theirs["quarantined_blocks"]
        self.transfer_seconds.extend(theirs["transfer_seconds"])
        return self

    def is_empty(self) -> bool:
        return (
            not any(self.counts.values())
            and not any(self.failures.values())
            and not self.data["quarantined_blocks"]
            and not self.transfer_seconds
        )

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's log line (times of completed rooms only)."""
        c = self.counts
        times = np.asarray(self.transfer_seconds, dtype=np.float64)
        out: dict[str, int | float] = {
            "Num successful transfers": c["transfers"],
            "Num failed transfers": sum(self.failures.values()),
            "Avg xfer time (ms)": round(float(times.mean()) * 1e3, 3) if times.size else 0,
            "P90 xfer time (ms)": round(float(np.percentile(times, 90)) * 1e3, 3) if times.size else 0,
            "MB sent": round(c["bytes_sent"] / 2**20, 3),
            "Num descriptors": c["descriptors"],
            "Num posts": c["posts"],
            "Blocks received": c["blocks_received"],
        }
        for kind, n in sorted(self.failures.items()):
            out[f"Failed ({kind})"] = n
        if self.data["quarantined_blocks"]:
            out["Quarantined blocks (change)"] = self.data["quarantined_blocks"]
        if c["unrevocable_peers"]:
            out["Unrevocable peers"] = c["unrevocable_peers"]
        if c["peers_lost"]:
            out["Peers lost"] = c["peers_lost"]
        return out


class IntervalCounts:
    """One worker rank's stats since the last :meth:`take` (thread-safe: pdwire's worker thread
    records rooms, vLLM's engine thread takes them after each step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = PdwireKVConnectorStats()
        self._started: dict[int, float] = {}  # decode: room -> when it was started
        self._seen: dict[str, int] = {}  # the worker's counters at the last take

    def started(self, room: int) -> None:
        with self._lock:
            self._started[room] = time.perf_counter()

    def done(self, room: int, *, seconds: float | None = None, blocks: int = 0) -> None:
        """A room completed; ``seconds`` its transfer time (default: since :meth:`started`)."""
        with self._lock:
            t0 = self._started.pop(room, None)
            if seconds is None and t0 is not None:
                seconds = time.perf_counter() - t0
            self._stats.counts["transfers"] += 1
            self._stats.counts["blocks_received"] += blocks
            if seconds is not None:
                self._stats.transfer_seconds.append(seconds)

    def failed(self, room: int | None, kind: str, *, quarantined_blocks: int = 0) -> None:
        with self._lock:
            if room is not None:
                self._started.pop(room, None)
            failures = self._stats.failures
            failures[kind] = failures.get(kind, 0) + 1
            self._stats.data["quarantined_blocks"] += quarantined_blocks

    def released(self, blocks: int) -> None:
        """A failed room's writers fenced: its blocks leave quarantine."""
        with self._lock:
            self._stats.data["quarantined_blocks"] -= blocks

    def take(self, worker_counters: Mapping[str, Any]) -> PdwireKVConnectorStats | None:
        """The stats since the last call, or None if nothing happened. ``worker_counters``: a
        snapshot of the pdwire worker's stats (``dict(vars(worker.stats))``; cumulative)."""
        with self._lock:
            for theirs, ours in WORKER_COUNTERS.items():
                now = worker_counters.get(theirs)
                if isinstance(now, int):
                    before = self._seen.get(theirs, 0)
                    # a counter below the last one is a new worker's: all of it is new
                    self._stats.counts[ours] += now - before if now >= before else now
                    self._seen[theirs] = now
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, PdwireKVConnectorStats()
            return out


class PdwirePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``vllm:pdwire_*``: a counter per :data:`COUNTERS` key, failed transfers by ``kind``, the
    quarantined blocks gauge and the transfer time histogram, each per engine (vLLM's labels)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:pdwire_{key}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, doc in COUNTERS.items()
        }
        # the kind is a label of its own, so it is filled per observation, not per engine
        self.failed = self._counter_cls(
            name="vllm:pdwire_failed_transfers",
            documentation="Rooms that failed, by failure kind (pdwire's typed FailureKind, or "
            "'refused': refused by this rank before anything was written).",
            labelnames=[*labelnames, "kind"],
        )
        self.quarantined = create_metric_per_engine(
            self._gauge_cls(
                name="vllm:pdwire_quarantined_blocks",
                documentation="Decode blocks of failed rooms still held because a prefill writer "
                "has not fenced (their slots come back once it does).",
                # changes, not values, arrive: each frontend process holds its share
                multiprocess_mode="livesum",
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self.transfer_time = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:pdwire_transfer_time_seconds",
                documentation="Transfer time of completed rooms: prefill from its first write to "
                "its last completion, decode from starting the room to receiving all of it.",
                buckets=TIME_BUCKETS_S,
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for key, n in data["counts"].items():
            if n and key in self.counters:
                self.counters[key][engine_idx].inc(n)
        engine_labels = self.per_engine_labelvalues[engine_idx]
        for kind, n in data["failures"].items():
            if n:
                self.failed.labels(*engine_labels, kind).inc(n)
        if data["quarantined_blocks"]:
            self.quarantined[engine_idx].inc(data["quarantined_blocks"])
        for seconds in data["transfer_seconds"]:
            self.transfer_time[engine_idx].observe(seconds)
