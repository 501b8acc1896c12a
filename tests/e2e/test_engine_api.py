"""The engine API end to end in one process, over real sockets and the local backend, with
memory laid out by hand (numpy, no torch, no demo): a prefill engine of TP 2 x PP 2 feeding a
decode rank of TP 1 (sender ranks unique over the grid, each stage's layers where they belong,
aux from the last stage), prefill-side abort, bind and advertise, and the thread runner."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import pytest

from pdwire.runtime import engine as pd
from pdwire.runtime.backends.local import LocalBackend

LAYERS, HEADS, HEAD_BYTES, PAGE, PAGES, SLOTS = 4, 2, 4, 2, 8, 3
CONV = 8  # Mamba conv channels (one block), split over TP; bytes per channel: 1
MODEL = pd.ModelFingerprint(model_name="pp-hybrid", revision="r", dtype="u8", num_layers=LAYERS)


@dataclass
class Mem:
    backend: pd.Backend
    k: dict[int, np.ndarray]  # global layer -> [pages, PAGE, heads, HEAD_BYTES]
    conv: dict[int, np.ndarray]  # global layer -> [slots, channels]
    aux: np.ndarray  # [4, 8]
    memory: pd.RankMemory


def rank_memory(name: str, tp: int, rank: int, layers: list[int], pp: int = 1, stage: int = 0) -> Mem:
    """A rank holding ``layers`` (global ids): K and V pages (V is never checked: K is), a Mamba
    conv per layer split over TP, and one aux buffer."""
    backend = LocalBackend(agent_name=name)
    heads, chans = HEADS // tp, CONV // tp
    page = PAGE * heads * HEAD_BYTES
    n = len(layers)
    buf = backend.allocate("mem", 2 * n * PAGES * page + n * SLOTS * chans + 32).array
    k = {
        layer: buf[i * PAGES * page : (i + 1) * PAGES * page].reshape(PAGES, PAGE, heads, HEAD_BYTES)
        for i, layer in enumerate(layers)
    }
    v_base = n * PAGES * page
    v = [buf[v_base + i * PAGES * page : v_base + (i + 1) * PAGES * page] for i in range(n)]
    c_base = 2 * n * PAGES * page
    conv = {
        layer: buf[c_base + i * SLOTS * chans : c_base + (i + 1) * SLOTS * chans].reshape(SLOTS, chans)
        for i, layer in enumerate(layers)
    }
    aux = buf[c_base + n * SLOTS * chans :][:32].reshape(4, 8)
    kv = pd.KvPool(
        tuple(int(a.ctypes.data) for a in k.values()), tuple(int(a.ctypes.data) for a in v),
        (PAGES * page,) * n, page, PAGE, pd.Layout.NHD, heads, HEADS, HEAD_BYTES,
        memory_kind=pd.MemoryKind.DRAM,
    )  # fmt: skip
    tensor = pd.StateTensor(
        "conv", tuple(int(a.ctypes.data) for a in conv.values()), (SLOTS * chans,) * n, chans, chans
    )
    layer_ids = tuple(layers) if pp > 1 else None
    mamba = pd.StatePool(
        pd.StateKind.MAMBA, pd.Indexing.SLOT, (tensor,), layer_ids=layer_ids, memory_kind=pd.MemoryKind.DRAM
    )
    aux_buf = pd.AuxBuffer("out", int(aux.ctypes.data), aux.nbytes, 8)
    position = pd.ParallelRank(tp, rank, pp, stage)
    return Mem(backend, k, conv, aux, pd.RankMemory(position, kv, (mamba,), (aux_buf,), layers[0]))


def pump(workers: list[pd.PrefillWorker | pd.DecodeWorker], until: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + 20
    while not until():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        for w in workers:
            w.step(1)


def serve(workers: list[pd.PrefillWorker]) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for w in workers:
                w.step(2)

    t = threading.Thread(target=loop)
    t.start()
    return stop, t


def close(dec: pd.DecodeWorker, prefills: list[pd.PrefillWorker], mems: list[Mem]) -> None:
    dec.close()
    for w in prefills:
        w.close()
    for m in mems:
        m.backend.close()


def test_a_pp_and_tp_prefill_engine_feeds_one_decode_rank_layer_by_layer() -> None:
    rng = np.random.default_rng(3)
    tokens, room = 7, pd.room_for_request("pp-request")
    full_k = rng.integers(0, 255, (LAYERS, tokens, HEADS, HEAD_BYTES), dtype=np.uint8)
    full_conv = rng.integers(0, 255, (LAYERS, CONV), dtype=np.uint8)
    full_aux = rng.integers(0, 255, 8, dtype=np.uint8)
    pages = -(-tokens // PAGE)
    src_pages = np.arange(pages, dtype=np.int32)
    prefills, mems = [], []
    for stage in range(2):  # endpoints are listed PP stage major
        for r in range(2):
            layers = [2 * stage, 2 * stage + 1]
            m = rank_memory(f"pre-{stage}-{r}", 2, r, layers, pp=2, stage=stage)
            h = HEADS // 2
            for layer in layers:  # this rank's heads of its stage's layers, and its conv channels
                padded = np.zeros((pages * PAGE, h, HEAD_BYTES), np.uint8)
                padded[:tokens] = full_k[layer, :, r * h : (r + 1) * h]
                m.k[layer][src_pages] = padded.reshape(pages, PAGE, h, HEAD_BYTES)
                m.conv[layer][1] = full_conv[layer, r * (CONV // 2) : (r + 1) * (CONV // 2)]
            m.aux[2] = full_aux
            cfg = pd.PrefillConfig(engine_id="pre", rank=pd.ParallelRank(2, r, 2, stage), model=MODEL)
            prefills.append(pd.PrefillWorker(cfg, m.memory, backend=m.backend))
            mems.append(m)
    assert sorted(w.sender_rank for w in prefills) == [0, 1, 2, 3]  # unique over TP x PP
    dm = rank_memory("dec", 1, 0, list(range(LAYERS)))
    for a in (*dm.k.values(), *dm.conv.values()):
        a.fill(0xEE)
    finished: list[tuple[int, pd.Status, pd.Failure | None]] = []
    dec = pd.DecodeWorker(
        pd.DecodeConfig(engine_id="dec", rank=pd.ParallelRank(), model=MODEL),
        dm.memory,
        backend=dm.backend,
        on_finished=lambda *a: finished.append(a),
    )
    try:
        stop, thread = serve(prefills)
        try:
            group = dec.wait_ready(dec.connect([w.endpoint for w in prefills], prefill_pp=2))
        finally:
            stop.set()
            thread.join()
        assert (group.tp_size, group.pp_size) == (2, 2)
        dst_pages = np.array([7, 5, 3, 1], dtype=np.int32)
        dec.start_room(room, pd.RequestIndices(dst_pages, state=[[2]], aux_index=1), group)
        for w in prefills:
            w.send_chunk(room, src_pages, last=True, state=[[1]], aux_index=2)
        pump([*prefills, dec], lambda: bool(finished), "the room")
        assert finished == [(room, pd.Status.SUCCESS, None)]
        got = np.stack(
            [dm.k[layer][dst_pages].reshape(pages * PAGE, HEADS, HEAD_BYTES) for layer in range(LAYERS)]
        )
        assert np.array_equal(got[:, :tokens], full_k)  # every layer from its stage, both heads
        assert np.array_equal(np.stack([dm.conv[layer][2] for layer in range(LAYERS)]), full_conv)
        assert np.array_equal(dm.aux[1], full_aux)
        parts = {
            (w.config.rank.tp_rank, w.config.rank.pp_rank): w.stats.posts + w.stats.merged_parts
            for w in prefills
        }
        # KV and state from every rank; aux only from the first TP rank of the last stage
        assert parts == {(0, 0): 2, (1, 0): 2, (0, 1): 3, (1, 1): 2}
        # all of them ready at once: one engine write per rank (protocol 1.4)
        assert [w.stats.posts for w in prefills] == [1, 1, 1, 1]
    finally:
        close(dec, prefills, [*mems, dm])


def pair() -> tuple[
    pd.PrefillWorker, pd.DecodeWorker, Mem, Mem, list[tuple[object, ...]], list[tuple[object, ...]]
]:
    pm, dm = rank_memory("pre", 1, 0, list(range(LAYERS))), rank_memory("dec", 1, 0, list(range(LAYERS)))
    released: list[tuple[object, ...]] = []
    finished: list[tuple[object, ...]] = []
    cfg = pd.PrefillConfig(engine_id="pre", rank=pd.ParallelRank(), model=MODEL, advertise="tcp://localhost")
    pre = pd.PrefillWorker(cfg, pm.memory, backend=pm.backend, on_released=lambda *a: released.append(a))
    dcfg = pd.DecodeConfig(engine_id="dec", rank=pd.ParallelRank(), model=MODEL)
    dec = pd.DecodeWorker(dcfg, dm.memory, backend=dm.backend, on_finished=lambda *a: finished.append(a))
    return pre, dec, pm, dm, released, finished


def test_prefill_abort_before_and_after_the_request_and_the_advertised_address() -> None:
    pre, dec, pm, dm, released, finished = pair()
    try:
        port = pre.bound.rsplit(":", 1)[1]
        assert pre.bound.startswith("tcp://127.0.0.1:") and pre.endpoint == f"tcp://localhost:{port}"
        stop, thread = serve([pre])
        try:
            group = dec.wait_ready(dec.connect([pre.endpoint]))  # through the advertised name
        finally:
            stop.set()
            thread.join()
        indices = pd.RequestIndices([0, 1], state=[[0]], aux_index=0)
        pre.abort(11, "the engine dropped it")  # before decode asked: its request is refused
        dec.start_room(11, indices, group)
        dec.start_room(12, indices, group)  # and one aborted after its request arrived
        # until room 12's request is here (room 11's refusal may reach decode first: aborting 12
        # then would abort it before its request, the case room 11 already covers)
        pump([pre, dec], lambda: pre.status(12) is pd.Status.WAITING_FOR_INPUT, "room 12's request")
        pre.abort(12, "the engine dropped it after all")
        pump([pre, dec], lambda: len(finished) == 2, "both rooms")
        got = {
            room: (status, failure.kind if failure else None, failure.detail if failure else "")
            for room, status, failure in finished
        }  # type: ignore[union-attr,misc]
        assert (
            got[11][:2] == (pd.Status.FAILED, pd.FailureKind.ABORTED)
            and "the engine dropped it" in got[11][2]
        )
        assert got[12][:2] == (pd.Status.FAILED, pd.FailureKind.ABORTED)
        assert [r[0] for r in released] == [12]  # room 11 never lived here
    finally:
        dec.close()
        pre.close()
        pm.backend.close()
        dm.backend.close()


def test_the_thread_runner_runs_calls_on_the_worker_thread_and_reports_their_outcome() -> None:
    pm = rank_memory("pre", 1, 0, list(range(LAYERS)))
    pre = pd.PrefillWorker(
        pd.PrefillConfig(engine_id="pre", rank=pd.ParallelRank(), model=MODEL), pm.memory, backend=pm.backend
    )
    runner = pd.WorkerThread(pre, idle_ms=60_000)  # a call must wake the loop, not wait a minute
    with pm.backend, runner:
        ident: Future[int] = runner.submit(threading.get_ident)
        assert ident.result(timeout=10) == runner.ident != threading.get_ident()
        bad = runner.submit(pre.send_chunk, 0, [1], last=True)  # room 0 is reserved
        with pytest.raises(pd.IndicesError, match="room 0 is reserved"):
            bad.result(timeout=10)
        assert runner.submit(pre.status, 5).result(timeout=10) is None
    assert not runner.running
    late = runner.submit(pre.status, 5)
    with pytest.raises(pd.WorkerStopped):
        late.result(timeout=1)


def test_decode_declines_rooms_it_never_started_and_abort_leaves_them_alone() -> None:
    pre, dec, pm, dm, released, finished = pair()
    try:
        stop, thread = serve([pre])
        try:
            group = dec.wait_ready(dec.connect([pre.endpoint]))
        finally:
            stop.set()
            thread.join()
        dec.abort(21, "never started")  # nothing here to abort: no callback, nothing sent
        pre.send_chunk(21, [0, 1], last=True, state=[[0]], aux_index=0)  # produced, never asked for
        dec.decline(21, group, "the decode engine dropped the request")
        pump([pre, dec], lambda: any(r[0] == 21 for r in released), "room 21's release on prefill")
        rel = next(r for r in released if r[0] == 21)
        assert rel[1] is pd.Status.FAILED and rel[2] is not None and rel[2].kind is pd.FailureKind.ABORTED
        dec.decline(22, group)  # declined before prefill produced it: its chunks come back at once
        pump([pre, dec], lambda: pre.status(22) is pd.Status.FAILED, "room 22's refusal on prefill")
        pre.send_chunk(22, [2, 3], last=True, state=[[1]], aux_index=1)
        assert any(r[0] == 22 and r[1] is pd.Status.FAILED for r in released)
        assert finished == []  # decode never started either room: nothing is reported there
        with pytest.raises(pd.ConfigError, match="PrefillGroup"):
            dec.decline(23, "not a group")  # type: ignore[arg-type]
    finally:
        dec.close()
        pre.close()
        pm.backend.close()
        dm.backend.close()


def test_pp_stages_that_leave_decode_layers_unwritten_are_refused_at_connect() -> None:
    # stage 1 reports the wrong start layer: layers 0 and 1 twice, 2 and 3 never (before 1.4
    # every room of this group succeeded with decode's layers 2 and 3 never written)
    prefills, mems = [], []
    for stage in range(2):
        m = rank_memory(f"lie-{stage}", 1, 0, [0, 1], pp=2, stage=stage)
        cfg = pd.PrefillConfig(engine_id="pre", rank=pd.ParallelRank(1, 0, 2, stage), model=MODEL)
        prefills.append(pd.PrefillWorker(cfg, m.memory, backend=m.backend))
        mems.append(m)
    dm = rank_memory("dec-lied-to", 1, 0, list(range(LAYERS)))
    dec = pd.DecodeWorker(pd.DecodeConfig(engine_id="dec", rank=pd.ParallelRank(), model=MODEL), dm.memory,
                          backend=dm.backend)  # fmt: skip
    try:
        stop, thread = serve(prefills)
        try:
            with pytest.raises(pd.HandshakeError, match="KV layer 0 is held by PP stages 0 and 1"):
                dec.wait_ready(dec.connect([w.endpoint for w in prefills], prefill_pp=2))
        finally:
            stop.set()
            thread.join()
    finally:
        close(dec, prefills, [*mems, dm])
