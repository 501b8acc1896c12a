"""pdwire's SGLang backend moving a hybrid model's state between TP sizes and from PP stages,
driven like SGLang.

SGLang 0.5.23's real parts: the plugin (``load_plugins``), its bootstrap server on 127.0.0.1,
its memory pools (``SWAKVPool``, ``HybridReqToTokenPool`` with Mamba2 state,
``HybridLinearKVPool``, ``MetadataBuffers``) on the CPU, ``KVArgs`` and managers built by its own
``_init_kv_manager`` of the prefill and decode queues, and the order its schedulers call the
sender and receiver in, from one scheduler thread per engine (per prefill PP stage): decode
``try_ensure_parallel_info`` -> ``init`` -> polls until WaitingForInput -> ``send_metadata``;
prefill polls until WaitingForInput -> ``pop_decode_prefix_len`` -> ``init`` -> one ``send``
per chunk with the state indices on the last -> polls until Success. Polls are all-reduced over
each TP group with MIN, as SGLang does. Transfers go through real NIXL agents (one per rank) over
loopback.
Every decode rank's pages, SWA window, Mamba slot and aux item are compared byte for byte,
layer by layer, with its shard of the model-wide content. The last tests run the prefill engine
in a process of its own (``prefill_process.py``), once to completion and once until it is
SIGKILLed mid-transfer.
"""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

warnings.filterwarnings("ignore")

from tests.sglang.backend import harness as h  # noqa: E402

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def sglang() -> Any:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend("pdwire")
    return {
        "KVPoll": KVPoll,
        "sender": get_kv_class(backend, KVClassType.SENDER),
        "receiver": get_kv_class(backend, KVClassType.RECEIVER),
        "server": get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER),
    }


def _wait(what: str, cond: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Pair:
    """A prefill engine of P ranks and a decode engine of D ranks around one bootstrap server.

    With ``pp`` > 1 the prefill engine has ``pp`` PP stages of P ranks each, each holding its
    own layers (stage-major in ``prefill``); decode is one stage holding them all."""

    def __init__(self, sglang: Any, p: int, d: int, pp: int = 1, model: h.Model = h.SWA_HYBRID) -> None:
        self.sg = sglang
        self.port = h.free_port()
        self.server = sglang["server"](host="127.0.0.1", port=self.port)
        self.addr = f"127.0.0.1:{self.port}"
        http_p, http_d = h.free_port(), h.free_port()
        self.prefill = [
            h.make_rank("prefill", p, r, self.port, http_p, model, pp, s) for s in range(pp) for r in range(p)
        ]
        self.decode = [h.make_rank("decode", d, r, self.port, http_d, model) for r in range(d)]

    def stage(self, pp_rank: int) -> Any:
        """The prefill ranks of one PP stage, which one scheduler (``_prefill_engine``) drives."""
        return SimpleNamespace(
            sg=self.sg, addr=self.addr, prefill=[r for r in self.prefill if r.pp_rank == pp_rank]
        )

    def close(self) -> None:
        for rank in self.prefill + self.decode:
            rank.manager.teardown()
        self.server.close()


def _decode_engine(pair: Pair, rooms: dict[int, int], outcome: dict[int, int]) -> Callable[[], None]:
    KVPoll = pair.sg["KVPoll"]

    def run() -> None:
        # DecodePreallocQueue: receivers, prefill info, init, handshake polls
        recv: dict[int, list[Any]] = {}
        reqs: dict[int, list[h.Request]] = {}
        for room in rooms:
            recv[room] = [
                pair.sg["receiver"](mgr=r.manager, bootstrap_addr=pair.addr, bootstrap_room=room)
                for r in pair.decode
            ]
        for rank in pair.decode:
            _wait("prefill topology", lambda rank=rank: rank.manager.try_ensure_parallel_info(pair.addr))
        for room in rooms:
            for rx in recv[room]:
                rx.init(0)
        waiting = set(rooms)
        handshake_by = time.monotonic() + 120
        while waiting:
            assert time.monotonic() < handshake_by, f"rooms {sorted(waiting)}: no handshake on decode"
            for room in list(waiting):
                poll = h.min_poll([rx.poll() for rx in recv[room]])
                assert poll != KVPoll.Failed, [rx._failure for rx in recv[room]]
                if poll == KVPoll.WaitingForInput:
                    waiting.discard(room)
                    reqs[room] = [h.Request(rank, room, rooms[room]) for rank in pair.decode]
                    for rx, req in zip(recv[room], reqs[room], strict=True):
                        rx.send_metadata(req.pages, req.aux, req.state_indices(), decode_prefix_len=0)
            time.sleep(0.002)
        # DecodeTransferQueue.pop_transferred
        pending = set(rooms)
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for room in list(pending):
                poll = h.min_poll([rx.poll() for rx in recv[room]])
                if poll in (KVPoll.Success, KVPoll.Failed):
                    outcome[room] = poll
                    if poll == KVPoll.Failed:
                        outcome[-room] = [rx._failure for rx in recv[room]]  # type: ignore[assignment]
                    else:
                        for req in reqs[room]:
                            bad = req.mismatches()
                            assert not bad, (
                                f"decode tp {req.rank.tp_rank}/{req.rank.tp_size} room {room}: {bad}"
                            )
                    for rx in recv[room]:
                        rx.clear()
                    pending.discard(room)
            time.sleep(0.002)
        assert not pending, f"rooms {sorted(pending)} never finished on decode"

    return run


def _prefill_engine(
    pair: Pair, rooms: dict[int, int], outcome: dict[int, int], chunk_pages: int
) -> Callable[[], None]:
    KVPoll = pair.sg["KVPoll"]

    def run() -> None:
        send = {
            room: [
                pair.sg["sender"](mgr=r.manager, bootstrap_addr=pair.addr, bootstrap_room=room)
                for r in pair.prefill
            ]
            for room in rooms
        }
        reqs = {room: [h.Request(rank, room, rooms[room]) for rank in pair.prefill] for room in rooms}
        for room in rooms:
            for req in reqs[room]:
                req.fill()
        # PrefillBootstrapQueue.pop_bootstrapped
        waiting = set(rooms)
        asked_by = time.monotonic() + 120
        while waiting:
            assert time.monotonic() < asked_by, f"rooms {sorted(waiting)}: no decode rank asked"
            for room in list(waiting):
                poll = h.min_poll([s.poll() for s in send[room]])
                assert poll != KVPoll.Failed
                if poll == KVPoll.WaitingForInput:
                    waiting.discard(room)
                    for s, req in zip(send[room], reqs[room], strict=True):
                        assert s.pop_decode_prefix_len() == 0
                        s.init(len(req.pages), req.aux)
                    # chunked prefill: one send per chunk, state indices on the last
                    n = len(reqs[room][0].pages)
                    for start in range(0, n, chunk_pages):
                        last = start + chunk_pages >= n
                        for s, req in zip(send[room], reqs[room], strict=True):
                            s.send(
                                req.pages[start : start + chunk_pages], req.state_indices() if last else None
                            )
            time.sleep(0.002)
        pending = set(rooms)
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for room in list(pending):
                poll = h.min_poll([s.poll() for s in send[room]])
                if poll in (KVPoll.Success, KVPoll.Failed):
                    outcome[room] = poll
                    for s in send[room]:
                        s.clear()
                    pending.discard(room)
            time.sleep(0.002)
        assert not pending, f"rooms {sorted(pending)} never finished on prefill"

    return run


@pytest.mark.parametrize(("p", "d"), [(2, 4), (2, 1), (1, 2)])
def test_hybrid_requests_move_byte_for_byte(sglang: Any, p: int, d: int) -> None:
    pair = Pair(sglang, p, d)
    try:
        rooms = {1001 + 10 * p + d: 22, 2003 + 10 * p + d: 9, 3005 + 10 * p + d: 16}  # prompt tokens
        pre_out: dict[int, int] = {}
        dec_out: dict[int, int] = {}
        dec = h.EngineThread("decode-scheduler", _decode_engine(pair, rooms, dec_out))
        pre = h.EngineThread("prefill-scheduler", _prefill_engine(pair, rooms, pre_out, chunk_pages=2))
        dec.start()
        pre.start()
        dec.join(300)
        pre.join(300)
        assert dec.error is None, repr(dec.error)
        assert pre.error is None, repr(pre.error)
        KVPoll = sglang["KVPoll"]
        assert {r: dec_out[r] for r in rooms} == {r: KVPoll.Success for r in rooms}, dec_out
        assert pre_out == {r: KVPoll.Success for r in rooms}
    finally:
        pair.close()


# what SGLang's own KVArgs say about each prefill stage's layers: a HybridLinearKVPool gives the
# Mamba layer ids and a full-attention-relative start layer; an SWAKVPool and Mamba state in the
# request pool give neither (start layer 0 on every stage), so pdwire's plugin reads them from
# the pools (PoolLayers) and the KVArgs here are after that
PP_LAYERS = {
    # model: ((prefill_start_layer, state_layer_ids) per stage, decode's state_layer_ids)
    "linear": ([(0, [[0, 1, 0, 1]]), (1, [[3, 3]])], [[0, 1, 3, 0, 1, 3]]),
    "swa": ([(0, [[1, 1], [0, 0]]), (1, [[4, 4], [3, 3]])], [[1, 4, 1, 4], [0, 3, 0, 3]]),
}


@pytest.mark.parametrize("model", [h.LINEAR_HYBRID, h.SWA_HYBRID], ids=lambda m: m.pools)
def test_prefill_pipeline_stages_feed_one_decode_rank(sglang: Any, model: h.Model) -> None:
    """Prefill PP 2, TP 1 -> decode PP 1, TP 1. Each prefill stage holds its own 3 of the 6
    layers (pools built for its layer range, as SGLang's ``layer_info`` slices them) and is its
    own scheduler thread, sending its layers' KV, SWA window and Mamba state; decode holds every
    layer and checks each one's bytes."""
    pair = Pair(sglang, 1, 1, pp=2, model=model)
    try:
        stages, decode_ids = PP_LAYERS[model.pools]
        for s, (start, ids) in enumerate(stages):
            kv_args = pair.stage(s).prefill[0].manager.kv_args
            assert (kv_args.prefill_start_layer, kv_args.state_layer_ids) == (start, ids), s
        assert pair.decode[0].manager.kv_args.state_layer_ids == decode_ids
        # each stage its own share of every kind; decode all of them
        assert [r.full_layers + r.swa_layers + r.mamba_layers for r in pair.prefill] == [
            [i for i in (*model.full, *model.swa, *model.mamba) if lo <= i < hi]
            for lo, hi in (model.stage(2, 0), model.stage(2, 1))
        ]
        dec_rank = pair.decode[0]
        assert (dec_rank.full_layers, dec_rank.swa_layers, dec_rank.mamba_layers) == (
            list(model.full),
            list(model.swa),
            list(model.mamba),
        )
        rooms = {5101: 22, 5102: 9, 5103: 16}  # prompt tokens
        pre_out: list[dict[int, int]] = [{}, {}]
        dec_out: dict[int, int] = {}
        dec = h.EngineThread("decode-scheduler", _decode_engine(pair, rooms, dec_out))
        pre = [
            h.EngineThread(f"prefill-pp{s}-scheduler", _prefill_engine(pair.stage(s), rooms, pre_out[s], 2))
            for s in range(2)
        ]
        for t in (dec, *pre):
            t.start()
        for t in (dec, *pre):
            t.join(300)
        assert dec.error is None, repr(dec.error)
        for t in pre:
            assert t.error is None, repr(t.error)
        KVPoll = sglang["KVPoll"]
        assert {r: dec_out[r] for r in rooms} == {r: KVPoll.Success for r in rooms}, dec_out
        assert pre_out == [{r: KVPoll.Success for r in rooms}] * 2
    finally:
        pair.close()


def test_the_backend_variables_old_name_is_refused(sglang: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """PDWIRE_SGLANG_ENGINE was renamed PDWIRE_SGLANG_BACKEND: a rank that still sets it would
    silently get the default backend, so the manager refuses at init, naming the new variable."""
    monkeypatch.setenv("PDWIRE_SGLANG_ENGINE", "local")
    with pytest.raises(ValueError, match="PDWIRE_SGLANG_ENGINE is now PDWIRE_SGLANG_BACKEND"):
        h.make_rank("decode", 1, 0, h.free_port(), h.free_port(), h.SWA_HYBRID)


def test_a_pipeline_stage_whose_layers_are_unknown_is_refused_by_name(
    sglang: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool pdwire cannot read layers from (here: the plugin's reader finds nothing), under PP:
    the stage's manager refuses at init, naming each component it could not place; so are a stage
    holding none of a state kind's layers and a decode stage whose first KV layer is unknown."""
    from pdwire.integrations.sglang import plugin
    from pdwire.integrations.sglang.memory import PoolLayers

    monkeypatch.setattr(plugin, "pool_layers", lambda *_: PoolLayers())
    with pytest.raises(ValueError, match=r"PP stage 1 of 2 cannot place state\[0\]:swa, state\[1\]:mamba"):
        h.make_rank("prefill", 1, 0, h.free_port(), h.free_port(), h.SWA_HYBRID, 2, 1)
    # without PP nothing needs them: positions stand for layers on both sides
    rank = h.make_rank("decode", 1, 0, h.free_port(), h.free_port(), h.SWA_HYBRID)
    rank.manager.teardown()
    monkeypatch.undo()
    # a stage that holds none of a state kind's layers (SGLang registers it with no buffers)
    one_swa_layer = h.Model("swa", 6, mamba=(0, 3), full=(2, 5), swa=(4,))
    with pytest.raises(ValueError, match=r"PP stage 0 of 2 holds no layer of state\[0\]:swa"):
        h.make_rank("prefill", 1, 0, h.free_port(), h.free_port(), one_swa_layer, 2, 0)

    # a decode PP stage whose pools the plugin's hook cannot read: SGLang's decode KVArgs carry
    # no start layer
    def unreadable(*_: Any) -> Any:
        raise AttributeError("a pool laid out otherwise")

    monkeypatch.setattr(plugin, "pool_layers", unreadable)
    with pytest.raises(ValueError, match=r"PP stage 0 of 2 cannot place the KV start layer \(not read from"):
        h.make_rank("decode", 1, 0, h.free_port(), h.free_port(), h.LINEAR_HYBRID, 2, 0)


def _poll_until(
    what: str, pollers: list[Any], want: set[int], timeout: float = 60.0, every: bool = False
) -> int:
    """Poll like SGLang (MIN over the group) until the result is in ``want``; with ``every``,
    until each rank's own poll is (a rank that only learns of a failure through the all-reduce
    reports it as coming from another rank, as SGLang's backends do)."""
    deadline = time.monotonic() + timeout
    while True:
        polls = [int(p.poll()) for p in pollers]
        poll = h.min_poll(polls)
        if all(q in want for q in polls) if every else poll in want:
            return poll
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still {poll} after {timeout}s")
        time.sleep(0.005)


def test_aborts_on_both_sides_and_a_failed_peer(sglang: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread plays both schedulers here (the order of calls is SGLang's)."""
    KVPoll = sglang["KVPoll"]
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "8")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "8")
    pair = Pair(sglang, 1, 2)
    torn_down = False
    try:
        for rank in pair.decode:
            _wait("prefill topology", lambda rank=rank: rank.manager.try_ensure_parallel_info(pair.addr))

        def start(room: int, seq_len: int) -> tuple[list[Any], list[Any], list[h.Request]]:
            tx = [
                sglang["sender"](mgr=r.manager, bootstrap_addr=pair.addr, bootstrap_room=room)
                for r in pair.prefill
            ]
            rx = [
                sglang["receiver"](mgr=r.manager, bootstrap_addr=pair.addr, bootstrap_room=room)
                for r in pair.decode
            ]
            for r in rx:
                r.init(0)
            _poll_until("decode handshake", rx, {KVPoll.WaitingForInput})
            dreqs = [h.Request(rank, room, seq_len) for rank in pair.decode]
            for r, req in zip(rx, dreqs, strict=True):
                r.send_metadata(req.pages, req.aux, req.state_indices(), decode_prefix_len=0)
            _poll_until("prefill bootstrap", tx, {KVPoll.WaitingForInput})
            return tx, rx, dreqs

        # decode aborts: prefill learns it (its room fails), and decode's fence comes back
        tx, rx, _ = start(7001, 12)
        rx[0].abort()
        assert rx[0].poll() == KVPoll.Failed and rx[0].abort_notified
        for r in rx[1:]:
            r.abort()
        assert _poll_until("prefill after decode abort", tx, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed
        with pytest.raises(Exception, match="abort"):
            tx[0].failure_exception()
        _wait("decode fence", lambda: all(r.is_abort_release_safe() for r in rx))
        assert all(r.kv_mgr.is_abort_release_safe(7001, 1) for r in rx)

        # prefill aborts after decode asked: every decode rank is told Failed
        tx, rx, _ = start(7002, 12)
        for s in tx:
            s.abort()
            assert s.poll() == KVPoll.Failed
        assert _poll_until("decode after prefill abort", rx, {KVPoll.Failed}, every=True) == KVPoll.Failed
        with pytest.raises(Exception, match="abort"):
            rx[0].failure_exception()

        # a room whose decode never asks: the prefill sender fails at the bootstrap timeout
        lonely = sglang["sender"](mgr=pair.prefill[0].manager, bootstrap_addr=pair.addr, bootstrap_room=7003)
        assert lonely.poll() == KVPoll.Bootstrapping
        assert _poll_until("bootstrap timeout", [lonely], {KVPoll.Failed}, timeout=30) == KVPoll.Failed
        with pytest.raises(Exception, match="Bootstrapping"):
            lonely.failure_exception()

        # a failed peer: the prefill engine goes away mid-request; decode fails typed once it
        # notices the lost connection (its heartbeat goes unanswered), at the deadline at the latest
        tx, rx, dreqs = start(7004, 12)
        tx[0].init(len(dreqs[0].pages), 0)
        tx[0].send(np.arange(1, 3, dtype=np.int32))  # the first chunk only
        for rank in pair.prefill:
            rank.manager.teardown()
        torn_down = True
        assert (
            _poll_until("decode after the prefill died", rx, {KVPoll.Failed}, 60, every=True) == KVPoll.Failed
        )
        lost = r"peer_gone: .*control connection lost|room 7004 incomplete at deadline"
        with pytest.raises(Exception, match=lost):
            rx[0].failure_exception()
    finally:
        if torn_down:
            for rank in pair.decode:
                rank.manager.teardown()
            pair.server.close()
        else:
            pair.close()


def test_warmup_requests_pair_sglang_fake_classes_with_the_pdwire_manager(sglang: Any) -> None:
    """SGLang's warm-up requests (bootstrap host 2.2.2.2) use its FakeKVSender/FakeKVReceiver with
    the real backend's manager: they must complete without touching pdwire's worker."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    KVPoll = sglang["KVPoll"]
    fake = TransferBackend.FAKE
    pair = Pair(sglang, 1, 1)
    try:
        pre, dec = pair.prefill[0], pair.decode[0]
        room = 9001
        tx = get_kv_class(fake, KVClassType.SENDER)(
            mgr=pre.manager, bootstrap_addr="2.2.2.2:1", bootstrap_room=room
        )
        rx = get_kv_class(fake, KVClassType.RECEIVER)(
            mgr=dec.manager, bootstrap_addr="2.2.2.2:1", bootstrap_room=room
        )
        rx.init(0)
        req = h.Request(dec, room, 8)
        rx.send_metadata(req.pages, req.aux, req.state_indices())
        tx.init(len(req.pages), 0)
        tx.send(req.pages, req.state_indices())
        assert _poll_until("fake sender", [tx], {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
        assert _poll_until("fake receiver", [rx], {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
        for mgr in (pre.manager, dec.manager):
            assert room not in mgr.watched and room not in mgr.outcomes
            assert mgr.submit(mgr.worker.status, room).result(30) is None
    finally:
        pair.close()


def test_prefill_and_decode_in_separate_processes(sglang: Any, tmp_path: Any) -> None:
    """The prefill engine (bootstrap server and 2 ranks) in a child process, 1 decode rank here;
    NIXL between the processes, everything else as in the in-process test."""
    KVPoll = sglang["KVPoll"]
    bport, http_p, http_d = h.free_port(), h.free_port(), h.free_port()
    rooms = {4101: 21, 4102: 10}
    child = h.PrefillProcess(2, bport, http_p, rooms, tmp_path / "prefill-stderr.txt")
    decode: list[h.Rank] = []
    try:
        child.next_line("READY", 180)  # SGLang's import, 2 ranks' managers
        decode = [h.make_rank("decode", 1, 0, bport, http_d)]
        pair = SimpleNamespace(sg=sglang, addr=f"127.0.0.1:{bport}", decode=decode)
        out: dict[int, int] = {}
        _decode_engine(pair, rooms, out)()  # type: ignore[arg-type]
        assert {r: out[r] for r in rooms} == {r: KVPoll.Success for r in rooms}
        done = child.next_line("DONE ", 120)
        assert json.loads(done[5:]) == {str(r): int(KVPoll.Success) for r in rooms}
        assert child.wait(120) == 0
    finally:
        for rank in decode:
            rank.manager.teardown()
        child.kill()


def test_a_prefill_process_killed_mid_transfer(
    sglang: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill engine (bootstrap server, 2 ranks) in a child process is SIGKILLed while a room
    is Transferring into the decode rank here (the first chunk handed over, the rest never).
    Decode fails the room typed within seconds (its room deadline is minutes away). The room's
    slots stay fenced: a dead rank confirms nothing and SGLang's own tensors cannot be revoked, so
    pdwire quarantines them and says so (SGLang's deferred release frees them at its own timeout).
    Once the engine is started again on the same addresses (new pdwire endpoints), a new request
    moves byte for byte."""
    KVPoll = sglang["KVPoll"]
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "300")  # the room deadline
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "1")
    bport, http_p, http_d = h.free_port(), h.free_port(), h.free_port()
    addr = f"127.0.0.1:{bport}"
    room = 4201
    first = h.PrefillProcess(2, bport, http_p, {room: 21}, tmp_path / "prefill-1-stderr.txt", stall=True)
    second: h.PrefillProcess | None = None
    decode: list[h.Rank] = []
    try:
        first.next_line("READY", 180)
        decode = [h.make_rank("decode", 1, 0, bport, http_d)]
        mgr = decode[0].manager
        assert mgr.supports_deferred_decode_kv_release and mgr.enable_deferred_decode_kv_release
        _wait("prefill topology", lambda: mgr.try_ensure_parallel_info(addr), timeout=60)
        rx = sglang["receiver"](mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
        rx.init(0)
        _poll_until("decode handshake", [rx], {KVPoll.WaitingForInput})
        req = h.Request(decode[0], room, 21)
        rx.send_metadata(req.pages, req.aux, req.state_indices(), decode_prefix_len=0)
        first.next_line(f"SENT {room}", 60)
        assert rx.poll() == KVPoll.WaitingForInput and not rx.is_abort_release_safe()

        os.kill(first.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        first.wait(30)
        # DecodeTransferQueue.pop_transferred: Failed, the cause, then the deferred release
        assert _poll_until("decode after SIGKILL", [rx], {KVPoll.Failed, KVPoll.Success}, 30) == KVPoll.Failed
        failed_after = time.monotonic() - killed
        assert failed_after < 10, f"Failed only {failed_after:.1f}s after the kill"
        with pytest.raises(Exception, match=r"peer_gone: .*control connection lost") as err:
            rx.failure_exception()
        assert not getattr(err.value, "is_from_another_rank", True)
        rx.ensure_abort_notified(force_arm=True)
        # pdwire's fence: a dead rank cannot confirm, and SGLang's own tensors cannot be revoked
        # (docs/fencing.md, engine-owned memory), so the room's slots stay quarantined and that
        # is reported; SGLang's deferred release frees them at its own timeout
        time.sleep(1.0)  # 20 times the revocation grace
        assert not mgr.is_abort_release_safe(room, 0) and not rx.is_abort_release_safe()

        def fence_view() -> tuple[int, int, tuple[int, ...], str]:
            w = mgr.worker
            return w.stats.peers_lost, w.stats.unrevocable, w.quarantined_rooms, str(w.stats.failures)

        lost, unrevocable, quarantined, failures = mgr.submit(fence_view).result(30)
        assert (lost, unrevocable, quarantined) == (2, 2, (room,)), (lost, unrevocable, quarantined, failures)
        assert "cannot be revoked" in failures, failures
        mgr.clear_deferred_abort_state(room)  # SGLang's _do_release at its deadline
        rx.clear()
        # SGLang took the slots back: pdwire's quarantine lets go of the room too
        _wait("the reclaim", lambda: mgr.submit(lambda: mgr.worker.quarantined_rooms).result(30) == (), 30)
        assert mgr.submit(lambda: mgr.worker.stats.reclaimed).result(30) == 1

        # the engine comes back on the same bootstrap and HTTP ports (new pdwire endpoints)
        second = h.PrefillProcess(2, bport, http_p, {4202: 13}, tmp_path / "prefill-2-stderr.txt")
        second.next_line("READY", 180)
        pair = SimpleNamespace(sg=sglang, addr=addr, decode=decode)
        out: dict[int, int] = {}
        _decode_engine(pair, {4202: 13}, out)()  # type: ignore[arg-type]
        assert out == {4202: KVPoll.Success}, out
        assert json.loads(second.next_line("DONE ", 60)[5:]) == {"4202": int(KVPoll.Success)}
        assert second.wait(60) == 0
        print(f"decode Failed {failed_after:.2f}s after the SIGKILL")
    finally:
        for rank in decode:
            rank.manager.teardown()
        first.kill()
        if second is not None:
            second.kill()
