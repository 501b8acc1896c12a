"""PdwireConnector's stats through vLLM's own classes, without an engine (here because it imports
vLLM, which only .venv-vllm has): a rank's deltas, the sum over ranks and steps, the crossing as
plain data (pickle worker -> scheduler, msgpack scheduler -> frontend), vLLM's KV-transfer log
line (``KVConnectorLogging``) and its Prometheus registration (``KVConnectorProm``), and the
connector's callbacks counting rooms, failures by kind and quarantined blocks."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from prometheus_client import REGISTRY
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

import pdwire.runtime.engine as pd
from pdwire.integrations.vllm import connector as vc
from pdwire.integrations.vllm.stats import COUNTERS, IntervalCounts, PdwireKVConnectorStats

pytestmark = pytest.mark.vllm

LABELS = {"model_name": "tiny", "engine": "0"}


def kv_config(role: str = "kv_producer") -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="PdwireConnector", kv_connector_module_path="pdwire.integrations.vllm", kv_role=role
    )


def rank_stats(
    bytes_sent: int, seconds: list[float], failures: dict[str, int] | None = None
) -> PdwireKVConnectorStats:
    s = PdwireKVConnectorStats()
    s.counts.update(bytes_sent=bytes_sent, descriptors=2, posts=1, transfers=len(seconds))
    s.transfer_seconds.extend(seconds)
    s.failures.update(failures or {})
    return s


def test_ranks_and_steps_sum_and_reset() -> None:
    total = rank_stats(100, [0.01], {"timeout": 1})
    out = total.aggregate(rank_stats(50, [0.03, 0.02], {"timeout": 2, "peer_gone": 1}))
    assert out is total
    assert total.counts["bytes_sent"] == 150 and total.counts["transfers"] == 3
    assert total.counts["descriptors"] == 4 and total.counts["posts"] == 2
    assert total.failures == {"timeout": 3, "peer_gone": 1}
    assert sorted(total.transfer_seconds) == [0.01, 0.02, 0.03]
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and total.counts == dict.fromkeys(COUNTERS, 0)
    assert PdwireKVConnectorStats().is_empty()
    # a failure alone, or a quarantine change alone, is news
    assert not PdwireKVConnectorStats().aggregate(rank_stats(0, [], {"aborted": 1})).is_empty()
    q = PdwireKVConnectorStats()
    q.data["quarantined_blocks"] = -3
    assert not q.is_empty()


def test_stats_cross_processes_as_plain_data() -> None:
    s = rank_stats(4096, [0.5], {"engine_error": 1})
    s.data["quarantined_blocks"] = 3
    back = pickle.loads(pickle.dumps(s))  # worker process -> engine core (TP > 1)
    assert back == s
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(s.to_dict()))  # engine core -> frontend
    rebuilt = vc.PdwireConnector.build_kv_connector_stats(wire)
    assert isinstance(rebuilt, PdwireKVConnectorStats) and rebuilt.data == s.data
    assert vc.PdwireConnector.build_kv_connector_stats().is_empty()
    assert vc.PdwireConnector.build_kv_connector_stats(None).is_empty()


def test_reduce_summarises_the_interval() -> None:
    s = rank_stats(3 * 2**20, [0.010, 0.020, 0.030, 0.040], {"timeout": 2})
    r = s.reduce()
    assert r["Num successful transfers"] == 4 and r["Num failed transfers"] == 2
    assert r["Avg xfer time (ms)"] == 25.0
    assert r["P90 xfer time (ms)"] == 37.0
    assert r["MB sent"] == 3.0 and r["Num descriptors"] == 2 and r["Failed (timeout)"] == 2
    assert "Quarantined blocks (change)" not in r
    empty = PdwireKVConnectorStats(data={}).reduce()
    assert empty["Avg xfer time (ms)"] == 0 and empty["Num failed transfers"] == 0


def test_a_rank_reports_deltas_of_its_worker_counters_and_its_rooms() -> None:
    c = IntervalCounts()
    assert c.take({"bytes_posted": 0, "posts": 0}) is None  # nothing happened: vLLM gets None
    c.started(7)
    c.done(7, blocks=3)
    c.done(8, seconds=0.25)
    c.failed(9, "timeout", quarantined_blocks=4)
    s = c.take({"bytes_posted": 1000, "descriptors": 10, "posts": 2, "failures": ["ignored"]})
    assert s is not None
    assert s.counts["bytes_sent"] == 1000 and s.counts["descriptors"] == 10 and s.counts["posts"] == 2
    assert s.counts["transfers"] == 2 and s.counts["blocks_received"] == 3
    assert len(s.transfer_seconds) == 2 and 0 <= s.transfer_seconds[0] < 5 and s.transfer_seconds[1] == 0.25
    assert s.failures == {"timeout": 1} and s.data["quarantined_blocks"] == 4
    assert c.take({"bytes_posted": 1000, "descriptors": 10, "posts": 2}) is None  # no change since
    c.released(4)
    s = c.take({"bytes_posted": 1500, "descriptors": 10, "posts": 3})
    assert s is not None and s.counts["bytes_sent"] == 500 and s.counts["posts"] == 1
    assert s.data["quarantined_blocks"] == -4 and s.counts["transfers"] == 0
    # a new worker (counters restarted): all of its count is new, never a negative delta
    s = c.take({"bytes_posted": 200})
    assert s is not None and s.counts["bytes_sent"] == 200


def test_rooms_counted_on_one_thread_while_another_takes() -> None:
    c = IntervalCounts()
    taken: list[PdwireKVConnectorStats] = []
    stop = threading.Event()

    def engine_thread() -> None:
        while not stop.is_set():
            if (s := c.take({})) is not None:
                taken.append(s)

    t = threading.Thread(target=engine_thread)
    t.start()
    for room in range(20_000):
        c.done(room, seconds=0.001, blocks=1)
    stop.set()
    t.join()
    if (s := c.take({})) is not None:
        taken.append(s)
    total = PdwireKVConnectorStats()
    for s in taken:
        total.aggregate(s)
    assert total.counts["transfers"] == 20_000 == total.counts["blocks_received"]
    assert len(total.transfer_seconds) == 20_000


def test_vllm_logs_the_interval_through_the_connector_class() -> None:
    logging = KVConnectorLogging(kv_config())
    logging.observe(rank_stats(2**20, [0.004]).to_dict())
    logging.observe(rank_stats(2**20, [0.006], {"peer_gone": 1}).to_dict())
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("KV Transfer metrics: ")
    for part in (
        "Num successful transfers=2",
        "Num failed transfers=1",
        "Avg xfer time (ms)=5.0",
        "MB sent=2.0",
    ):
        assert part in line, line
    assert "Failed (peer_gone)=1" in line
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # reset after each log: nothing new, no line


@pytest.fixture
def prom() -> Iterator[KVConnectorProm]:
    unregister_vllm_metrics()  # as vLLM's own stat logger does before registering
    yield KVConnectorProm(
        VllmConfig(kv_transfer_config=kv_config()), list(LABELS), {0: list(LABELS.values())}
    )
    unregister_vllm_metrics()


def sample(name: str, **extra: str) -> float | None:
    out: Any = REGISTRY.get_sample_value(name, LABELS | extra)
    return out


def test_prometheus_series_per_engine(prom: KVConnectorProm) -> None:
    for key in COUNTERS:  # registered and at 0 before anything happened
        assert sample(f"vllm:pdwire_{key}_total") == 0
    assert sample("vllm:pdwire_quarantined_blocks") == 0
    s = rank_stats(4096, [0.002, 0.2], {"timeout": 2})
    s.counts["blocks_received"] = 6
    s.data["quarantined_blocks"] = 5
    prom.observe(s.to_dict(), 0)
    prom.observe(rank_stats(1024, [], {"aborted": 1}).to_dict(), 0)
    assert sample("vllm:pdwire_bytes_sent_total") == 5120
    assert sample("vllm:pdwire_descriptors_total") == 4
    assert sample("vllm:pdwire_posts_total") == 2
    assert sample("vllm:pdwire_transfers_total") == 2
    assert sample("vllm:pdwire_blocks_received_total") == 6
    assert sample("vllm:pdwire_failed_transfers_total", kind="timeout") == 2
    assert sample("vllm:pdwire_failed_transfers_total", kind="aborted") == 1
    assert sample("vllm:pdwire_transfer_time_seconds_count") == 2
    assert sample("vllm:pdwire_transfer_time_seconds_bucket", le="0.005") == 1
    assert sample("vllm:pdwire_transfer_time_seconds_sum") == pytest.approx(0.202)
    assert sample("vllm:pdwire_quarantined_blocks") == 5
    released = PdwireKVConnectorStats()
    released.data["quarantined_blocks"] = -5  # the writers fenced
    prom.observe(released.to_dict(), 0)
    assert sample("vllm:pdwire_quarantined_blocks") == 0


def _worker() -> vc._Worker:
    """The connector's worker side with only what its room callbacks use (no engine, no pdwire
    worker): the callbacks are what the pdwire worker thread calls."""
    w = object.__new__(vc._Worker)
    w.worker = None
    w._lock = threading.Lock()
    w._sent, w._received, w._failed = set(), set(), set()
    w._room_req, w._room_recv, w._failed_rooms = {}, {}, {}
    w._aborted, w._reported = set(), {}
    w.counts = IntervalCounts()
    return w


def _recv(rid: str, room: int) -> vc.RecvReq:
    return vc.RecvReq(rid, room, "prefill-0", ("tcp://127.0.0.1:1",), 1, [4, 5, 6], [[9]], 0)


def test_decode_callbacks_count_rooms_failures_by_kind_and_quarantine() -> None:
    w = _worker()
    for rid, room in (("ok", 1), ("late", 2), ("gone", 3)):
        w._room_recv[room] = _recv(rid, room)
        w.counts.started(room)
    w._on_finished(1, pd.Status.SUCCESS, None)
    w._on_finished(2, pd.Status.FAILED, pd.Failure(pd.FailureKind.TIMEOUT, "no write within 60 s"))
    w._on_finished(3, pd.Status.FAILED, None)
    s = w.counts.take({})
    assert s is not None
    assert s.counts["transfers"] == 1 and s.counts["blocks_received"] == 4 and len(s.transfer_seconds) == 1
    assert s.failures == {"timeout": 1, "unspecified": 1}
    assert s.data["quarantined_blocks"] == 8  # two failed rooms' 3 pages + 1 state slot, not reported yet
    assert w.results().failed_recving == set()
    w._on_slots_released(2)  # its writers fenced: the blocks come back
    s = w.counts.take({})
    assert s is not None and s.data["quarantined_blocks"] == -4 and s.counts["transfers"] == 0
    assert w.results().failed_recving == {"late"}


def test_prefill_callback_counts_before_the_request_is_reported_sent() -> None:
    w = _worker()
    w._room_req.update({1: "ok", 2: "bad"})
    seen: list[int] = []
    # vLLM reads results, then stats, on its engine thread: a reported request's room is counted
    w._on_released(1, pd.Status.SUCCESS, None)
    seen.append(len(w.results().finished_sending or ()))
    w._on_released(2, pd.Status.FAILED, pd.Failure(pd.FailureKind.PEER_GONE, "decode went away"))
    s = w.counts.take({})
    assert seen == [1] and s is not None
    assert s.counts["transfers"] == 1 and s.failures == {"peer_gone": 1}
    assert s.transfer_seconds == []  # no pdwire worker: no span to time
