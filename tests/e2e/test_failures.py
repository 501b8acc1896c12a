"""Failures across processes: a killed peer, a duplicate room, version skew, slots of a failed
room reused.

One local-backend cluster for the module; every case uses its own engines so that a killed
process or a refused peer cannot leak into another case. The killed-peer cases also run
over Mooncake, the reused-slots case over NIXL (ranks of another backend start from the same
cluster, with ``backend=``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from pdwire import wire
from pdwire.demo.cluster import Cluster, RoomResult
from pdwire.demo.content import pages_for
from pdwire.demo.model import Capacity
from tests.e2e.conftest import CAP, SPEC, assert_rooms_ok

TIMEOUT = 4.0  # room timeout on every rank of this module
SLOW = {"chunk_delay_s": 0.25}  # one page per chunk, a chunk every 250 ms: rooms last seconds


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(SPEC, CAP, "local", room_timeout_s=TIMEOUT, chunk_pages=1) as c:
        yield c


def _ok(c: Cluster, results: list[RoomResult]) -> None:
    assert_rooms_ok(c.wait_rooms(results, 60))


KILL_BACKENDS = ["local", "mooncake", "nixl"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", KILL_BACKENDS)
def test_decode_killed_mid_transfer_prefill_fails_the_room_and_keeps_serving(
    cluster: Cluster, backend: str
) -> None:
    pre = cluster.start("prefill", 1, f"kd-pre-{backend}", backend=backend, **SLOW)
    victim = cluster.start("decode", 1, f"kd-victim-{backend}", backend=backend)
    other = cluster.start("decode", 1, f"kd-other-{backend}", backend=backend)
    assert cluster.connect(victim, pre) == [""] and cluster.connect(other, pre) == [""]
    doomed = cluster.submit(victim, pre, 1, 48)  # 12 chunks, ~3 s
    alive = cluster.submit(other, pre, 2, 48)
    time.sleep(1.0)
    killed_at = time.monotonic()
    cluster.kill(victim, 0)
    _ok(cluster, [alive])  # the other decode engine's room is unaffected
    done = cluster.prefill_done
    cluster._pump(lambda: 1 in done.get((pre.engine_id, 0), {}), TIMEOUT + 10, "prefill release")
    status, reason = done[(pre.engine_id, 0)][1]
    assert status == "FAILED" and reason.split(":")[0] in ("engine_error", "timeout", "peer_gone"), reason
    assert time.monotonic() - killed_at < TIMEOUT + 3
    assert not doomed.ok
    _ok(cluster, [cluster.submit(other, pre, 3, 20)])  # prefill keeps serving
    fresh = cluster.start("decode", 1, f"kd-fresh-{backend}", backend=backend)  # and a new decode engine
    assert cluster.connect(fresh, pre) == [""]
    _ok(cluster, [cluster.submit(fresh, pre, 4, 20)])
    for g in (pre, other, fresh):
        for rank, (_stats, problems) in cluster.stop(g).items():
            assert problems == [], (g.engine_id, rank, problems)


@pytest.mark.slow
@pytest.mark.parametrize("backend", KILL_BACKENDS)
def test_prefill_killed_mid_transfer_decode_fails_the_room_at_once_revokes_it_and_keeps_serving(
    cluster: Cluster, backend: str
) -> None:
    # the killed rank's control connection closes: decode fails its room then (not at the
    # room's deadline), revokes the rank (a dead process's buffered bytes may still arrive) and
    # hands the slots back once that settled
    doomed_pre = cluster.start("prefill", 1, f"kp-doomed-{backend}", backend=backend, **SLOW)
    spare_pre = cluster.start("prefill", 1, f"kp-spare-{backend}", backend=backend)
    dec = cluster.start("decode", 1, f"kp-dec-{backend}", backend=backend)
    assert cluster.connect(dec, doomed_pre) == [""] and cluster.connect(dec, spare_pre) == [""]
    doomed = cluster.submit(dec, doomed_pre, 10, 48)
    time.sleep(1.0)
    cluster.kill(doomed_pre, 0)
    t0 = time.monotonic()
    (r,) = cluster.wait_rooms([doomed], TIMEOUT + 10)
    failed_after = time.monotonic() - t0
    assert r.statuses == {0: "FAILED"} and r.reasons[0].startswith("peer_gone:"), r.reasons
    assert "control connection lost" in r.reasons[0]
    assert failed_after < TIMEOUT, "the room failed at its deadline, not when its prefill rank died"
    cluster.wait_slots_released(dec, 10, TIMEOUT + 10)  # fenced by the revocation, not by a timeout
    _ok(cluster, [cluster.submit(dec, spare_pre, 11, 30)])  # the decode rank keeps serving
    stats, problems = cluster.stop(dec)[0]
    assert problems == [] and stats["rooms_failed"] == 1 and stats["rooms_ok"] == 1
    assert stats["peers_lost"] == 1 and stats["revocations"] == 1 and stats["unrevocable"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_a_timed_out_rooms_slots_come_back_after_prefill_fenced_and_verify_when_reused(
    cluster: Cluster, backend: str
) -> None:
    tokens = 48  # 12 pages: 12 chunks, one every 250 ms
    pages, swa = pages_for(SPEC, tokens)
    one_room = Capacity(pages=pages, slots=2, swa_pages=swa, aux_items=1)  # Mamba slot 0 is the dummy
    pre = cluster.start("prefill", 1, f"fence-pre-{backend}", backend=backend, **SLOW)
    dec = cluster.start("decode", 1, f"fence-dec-{backend}", backend=backend, capacity=one_room)
    assert cluster.connect(dec, pre) == [""]
    doomed = cluster.submit(dec, pre, 1, tokens, timeout_s=1.0)  # decode gives up mid-transfer
    (r,) = cluster.wait_rooms([doomed], TIMEOUT + 10)
    assert r.statuses == {0: "FAILED"} and r.reasons[0].startswith("timeout:"), r.reasons
    released_at = cluster.wait_slots_released(dec, 1, TIMEOUT + 10)[0]
    done = cluster.prefill_done
    cluster._pump(lambda: 1 in done.get((pre.engine_id, 0), {}), 10, "prefill release")
    status, reason = done[(pre.engine_id, 0)][1]
    assert status == "FAILED" and reason.startswith("aborted:"), reason
    first_post, last_final = cluster.spans[(pre.engine_id, 0)][1]
    assert 0 < first_post <= last_final <= released_at  # slots back only after prefill's last transfer ended
    # The only slots this decode rank has: a new room must reuse every one of them.
    _ok(cluster, [cluster.submit(dec, pre, 2, tokens, timeout_s=30)])
    stats, problems = cluster.stop(dec)[0]
    assert problems == []  # no byte outside a verified room changed
    assert stats["revocations"] == 0 and stats["rooms_failed"] == 1 and stats["rooms_ok"] == 1
    assert [f.split(":")[:2] for f in stats["failures"]] == [["room 1", " timeout"]]
    cluster.stop(pre)


@pytest.mark.slow
def test_duplicate_room_gets_a_typed_error_and_leaves_other_rooms_alone(cluster: Cluster) -> None:
    pre = cluster.start("prefill", 1, "dup-pre", **SLOW)
    a = cluster.start("decode", 1, "dup-a")
    b = cluster.start("decode", 1, "dup-b")
    assert cluster.connect(a, pre) == [""] and cluster.connect(b, pre) == [""]
    first = cluster.submit(a, pre, 20, 24)
    bystander = cluster.submit(a, pre, 21, 12)
    time.sleep(0.3)
    same_engine = cluster.submit(a, pre, 20, 24, prefill_too=False)  # refused by decode itself
    other_engine = cluster.submit(b, pre, 20, 24, prefill_too=False)  # refused by the prefill rank
    cluster.wait_rooms([same_engine, other_engine], 30)
    assert same_engine.statuses == {0: "FAILED"} and same_engine.reasons[0].startswith("duplicate_room:")
    assert other_engine.statuses == {0: "FAILED"} and other_engine.reasons[0].startswith("duplicate_room:")
    assert "dup-a" in other_engine.reasons[0]  # names the engine that owns the room
    _ok(cluster, [first, bystander])
    _ok(cluster, [cluster.submit(b, pre, 22, 12)])


@pytest.mark.slow
def test_older_compatible_version_still_works(cluster: Cluster) -> None:
    spec10 = replace(SPEC, mamba_layers=0)  # one state component: what the flat 1.0 state carries
    pre = cluster.start("prefill", 2, "v10-pre", spec=spec10)
    old = cluster.start("decode", 1, "v10-old", spec=spec10, versions=((1, 0),))
    assert cluster.connect(old, pre) == [""]
    _ok(cluster, [cluster.submit(old, pre, 30, 21), cluster.submit(old, pre, 31, 9)])
    stats, problems = cluster.stop(old)[0]
    assert problems == [] and stats["versions"] == ["v10-pre/0=1.0", "v10-pre/1=1.0"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "mori-fake"])
def test_a_1_1_peer_still_works(cluster: Cluster, backend: str) -> None:
    # 1.1 carries the whole model (several components); over MoRI the aux descriptors ride at the
    # tail of kv_mem_descs, and the registration is answered by a TransferStatus for room 0
    pre = cluster.start("prefill", 2, f"v11-pre-{backend}", backend=backend)
    old = cluster.start("decode", 1, f"v11-old-{backend}", versions=((1, 1),), backend=backend)
    assert cluster.connect(old, pre) == [""]
    _ok(cluster, [cluster.submit(old, pre, 60, 21), cluster.submit(old, pre, 61, 9)])
    stats, problems = cluster.stop(old)[0]
    assert problems == [] and stats["versions"] == [f"v11-pre-{backend}/0=1.1", f"v11-pre-{backend}/1=1.1"]


@pytest.mark.slow
def test_incompatible_major_and_other_model_are_refused_at_the_handshake(cluster: Cluster) -> None:
    pre = cluster.start("prefill", 1, "skew-pre")
    future = cluster.start("decode", 1, "skew-future", versions=((2, 0),))
    (err,) = cluster.connect(future, pre)
    newest = f"1.0-{wire.NEWEST[0]}.{wire.NEWEST[1]}"
    assert err.startswith("HandshakeError") and "2.0" in err and newest in err, err
    other_model = cluster.start("decode", 1, "skew-model", spec=replace(SPEC, page_size=8))
    (err,) = cluster.connect(other_model, pre)
    assert "model differs" in err, err
    ok = cluster.start("decode", 1, "skew-ok")  # the refused peers left the prefill rank healthy
    assert cluster.connect(ok, pre) == [""]
    _ok(cluster, [cluster.submit(ok, pre, 40, 10)])


@pytest.mark.slow
def test_descriptor_backend_refuses_a_1_0_peer_at_the_handshake(cluster: Cluster) -> None:
    # A one-component model: 1.0 carries it over the local backend (test above), so the
    # refusal here is about MoRI's memory descriptors, which only 1.1's RegisterInfo carries.
    spec10 = replace(SPEC, mamba_layers=0)
    mori = {"backend": "mori-fake", "spec": spec10}
    pre = cluster.start("prefill", 1, "mori10-pre", **mori)
    old = cluster.start("decode", 1, "mori10-old", versions=((1, 0),), **mori)
    (err,) = cluster.connect(old, pre)
    assert err.startswith("HandshakeError") and "addresses memory by descriptor" in err, err
    assert "1.0" in err and "mem_descs" in err, err
    new = cluster.start("decode", 1, "mori10-new", **mori)  # the prefill rank still serves newer peers
    assert cluster.connect(new, pre) == [""]
    _ok(cluster, [cluster.submit(new, pre, 50, 21)])
    stats, problems = cluster.stop(new)[0]
    assert problems == [] and stats["versions"] == [f"mori10-pre/0={wire.NEWEST[0]}.{wire.NEWEST[1]}"]
