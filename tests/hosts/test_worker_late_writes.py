"""Late writes of a cut-off prefill rank land nowhere, with real workers on two hosts.

A prefill rank on host a and a decode rank on host b (real PrefillWorker / DecodeWorker
processes in two network namespaces, NIXL over UCX tcp or Mooncake over TCP on the veth pair)
run a room whose chunks are posted one page at a time. The link is cut in the middle of it: the
rank keeps posting into the cut until the room's deadline, so its writes wait in the engines'
connections. Decode fails the room at its deadline (typed ``timeout``), waits the fence timeout,
revokes the rank (the heartbeats may or may not have given up on it by then) and gives the slots
back; they are the decode rank's only slots, so a room from a second prefill engine on host b
reuses them at once, is verified byte for byte and wiped back to the sentinel. The cut lasts
one or two fence timeouts past the room's deadline, then the link returns and the cut rank's
engine delivers everything it had in flight through the metadata it holds. At the end not one
byte of the decode rank's memory may differ from the sentinel (the rank checks every byte when
it stops). The ``local`` backend moves bytes without the network and has no place here
(tests/e2e/test_late_writes.py stops a rank on it instead).
"""

from __future__ import annotations

import time
from typing import cast

import pytest

from pdwire.demo.cluster import Cluster
from pdwire.demo.content import pages_for
from pdwire.demo.model import Capacity
from pdwire.runtime.backends import available_backends
from tests.e2e.conftest import CAP, SPEC, assert_rooms_ok
from tests.hosts.netns_rank import RankProcess, start_on
from tests.hosts.test_engines import ENGINES
from tests.support.netns import TwoHosts

ROOM_S = 3.0  # the cut room's deadline, on both sides
FENCE_S = 2.0  # decode's fence timeout: how long past the deadline a failed room waits for its sender
TOKENS = 48  # 12 pages, one chunk of one page every CHUNK_S: about 2.4 s of posting
CHUNK_S = 0.2
CUT_AFTER_S = 0.8  # a few chunks landed; the rest is posted into the cut
SHORT_TOKENS = 8  # the room the rank serves after the fault: 2 pages, well inside its deadline


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "fences"),
    [("cut", 1), ("cut", 2), ("stop", 2)],
    ids=["cut-deadline+1fence", "cut-deadline+2fences", "sigstop-deadline+2fences"],
)
@pytest.mark.parametrize("backend", ENGINES)
def test_a_prefill_rank_cut_off_mid_room_is_revoked_and_its_late_writes_change_no_reused_byte(
    backend: str, fault: str, fences: int, net: TwoHosts
) -> None:
    if backend not in available_backends():
        pytest.fail(f"{backend} does not import here; ./dev setup installs it")
    pages, swa = pages_for(SPEC, TOKENS)
    one_room = Capacity(pages=pages, slots=2, swa_pages=swa, aux_items=1)  # Mamba slot 0 is the dummy
    with Cluster(SPEC, CAP, backend, room_timeout_s=30.0, chunk_pages=1) as cluster:
        cut = start_on(cluster, net.a, "prefill", "cut", chunk_delay_s=CHUNK_S, room_timeout_s=ROOM_S)
        spare = start_on(cluster, net.b, "prefill", "spare")
        dec = start_on(cluster, net.b, "decode", "dec", capacity=one_room, fence_timeout_s=FENCE_S)
        assert cluster.connect(dec, cut) == [""] and cluster.connect(dec, spare) == [""]
        rank = cast(RankProcess, cut.procs[0]).proc
        doomed = cluster.submit(dec, cut, 1, TOKENS, timeout_s=ROOM_S)
        deadline = time.monotonic() + ROOM_S
        time.sleep(CUT_AFTER_S)
        net.cut() if fault == "cut" else rank.pause()
        cut_at = time.monotonic()
        try:
            (r,) = cluster.wait_rooms([doomed], ROOM_S + 10)
            failed_at = time.monotonic()
            assert r.statuses == {0: "FAILED"}, r.reasons
            assert r.reasons[0].startswith("timeout" if fault == "cut" else ("timeout", "peer_gone")), (
                r.reasons
            )
            # back while the rank is still cut off, so no word of it fenced them: its revocation did
            cluster.wait_slots_released(dec, 1, FENCE_S + 20)
            released_at = time.monotonic()
            # the same slots serve a room from host b's prefill engine, verified and wiped
            assert_rooms_ok(cluster.wait_rooms([cluster.submit(dec, spare, 2, TOKENS)], 60))
            reused_at = time.monotonic()
            # the fault lasts `fences` fence timeouts past the deadline, and past the reuse
            time.sleep(
                max(0.0, deadline + fences * FENCE_S - time.monotonic(), reused_at + 0.5 - time.monotonic())
            )
        finally:
            net.restore() if fault == "cut" else rank.resume()
        restored_at = time.monotonic()
        # the cut rank's engine delivers what it had in flight, and the rank settles the room
        cluster._pump(lambda: 1 in cluster.prefill_done.get(("cut", 0), {}), 90, "the cut rank's room 1")
        settled_at = time.monotonic()
        # and serves again: decode registers anew with it (new windows), after reconnecting when
        # its heartbeats gave up during the fault. A room asked before that fails typed, unsent
        # (peer_gone); over Mooncake the first write after the fault can fail in the engine
        # (engine_error): that room's slots come back when the rank is revoked, at its fence timeout
        room, served, refused = 3, None, list[str]()
        while served is None:
            assert time.monotonic() < restored_at + 90, f"the cut rank never served again: {refused}"
            (r3,) = cluster.wait_rooms([cluster.submit(dec, cut, room, SHORT_TOKENS, timeout_s=ROOM_S)], 60)
            if r3.ok:
                served = time.monotonic()
            else:
                refused.append(f"{time.monotonic() - restored_at:.1f}s {r3.reasons[0]}")
                assert r3.reasons[0].split(":")[0] in ("peer_gone", "engine_error", "timeout"), refused
                cluster.wait_slots_released(dec, room, ROOM_S + FENCE_S + 20)
                room += 1
                time.sleep(0.5)  # prefill holds a room never asked of it until its own deadline
        time.sleep(2.0)  # stragglers
        stats, problems = cluster.stop(dec)[0]
        assert problems == [], problems  # not one byte of the reused memory changed
        assert stats["revocations"] >= 1 and stats["unrevocable"] == 0 and stats["rooms_ok"] == 2, stats
        print(
            f"{backend}: {fault} {restored_at - cut_at:.1f}s (deadline {ROOM_S}s, fence {FENCE_S}s); after "
            f"it began: failed {failed_at - cut_at:.1f}s ({r.reasons[0].split(':')[0]}), slots back "
            f"{released_at - cut_at:.1f}s, reused {reused_at - cut_at:.1f}s; after it ended: the rank "
            f"settled room 1 in {settled_at - restored_at:.1f}s ({cluster.prefill_done[('cut', 0)][1][0]}), "
            f"served again in {served - restored_at:.1f}s (room {room}); decode: revocations "
            f"{stats['revocations']}, unrevocable {stats['unrevocable']}, peers lost {stats['peers_lost']}, "
            f"reconnects {stats['reconnects']}; refused after it: {refused}"
        )
        t0 = time.monotonic()
        cluster.stop(spare)
        t1 = time.monotonic()
        cluster.stop(cut)  # a clean stop: it closes its worker and its engine
        stopped = time.monotonic() - t1
        print(f"{backend}: stopped the spare rank in {t1 - t0:.1f}s, the cut one in {stopped:.1f}s")
