"""A decode engine in PP stages fed by a prefill engine of as many stages, stage to stage (as
SGLang's Mooncake backend pairs them), through pdwire's SGLang backend.

SGLang 0.5.23's real pools on the CPU for each stage's own layers (``test_transfer``'s models:
``SWAKVPool`` + Mamba state in the request pool, and a ``HybridLinearKVPool``), ``KVArgs`` and
managers from its own ``_init_kv_manager``, its bootstrap server, senders and receivers in the
schedulers' order. Decode stage s reads prefill stage s only and gets its layers' KV, SWA window
and Mamba state and the aux item (SGLang's decode reads the metadata on every stage:
``_commit_transfer_to_req`` checks its bootstrap room); every decode rank is compared byte for
byte. A prefill engine of another PP size is refused at the handshake by name.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest

warnings.filterwarnings("ignore")

from tests.sglang.backend import harness as h  # noqa: E402
from tests.sglang.backend import test_transfer as tt  # noqa: E402

pytest.importorskip("nixl")

sglang = tt.sglang  # the module's plugin-loaded SGLang classes


class StagedPair(tt.Pair):
    """Prefill TP ``p`` x PP ``pp`` and decode TP ``d`` x PP ``decode_pp`` (stage-major)."""

    def __init__(self, sglang: Any, p: int, d: int, pp: int, decode_pp: int, model: h.Model) -> None:
        self.sg = sglang
        self.port = h.free_port()
        self.server = sglang["server"](host="127.0.0.1", port=self.port)
        self.addr = f"127.0.0.1:{self.port}"
        http_p, http_d = h.free_port(), h.free_port()
        self.prefill = [
            h.make_rank("prefill", p, r, self.port, http_p, model, pp, s) for s in range(pp) for r in range(p)
        ]
        self.decode = [
            h.make_rank("decode", d, r, self.port, http_d, model, decode_pp, s)
            for s in range(decode_pp)
            for r in range(d)
        ]


def _run_stages(pair: tt.Pair, rooms: dict[int, int], pp: int) -> tuple[dict[int, int], dict[int, int]]:
    """Decode on one scheduler thread (every stage's receivers, polls all-reduced), prefill on one
    thread per PP stage."""
    pre_out: list[dict[int, int]] = [{} for _ in range(pp)]
    dec_out: dict[int, int] = {}
    dec = h.EngineThread("decode-scheduler", tt._decode_engine(pair, rooms, dec_out))
    pres = [
        h.EngineThread(
            f"prefill-stage{s}", tt._prefill_engine(pair.stage(s), rooms, pre_out[s], chunk_pages=2)
        )
        for s in range(pp)
    ]
    dec.start()
    for t in pres:
        t.start()
    dec.join(300)
    for t in pres:
        t.join(300)
    assert dec.error is None, repr(dec.error)
    for t in pres:
        assert t.error is None, repr(t.error)
    merged: dict[int, int] = {}
    for out in pre_out:
        for room, poll in out.items():
            merged[room] = min(poll, merged.get(room, poll))
    return dec_out, merged


@pytest.mark.parametrize("model", [h.SWA_HYBRID, h.LINEAR_HYBRID], ids=["swa", "linear"])
@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2)])
def test_decode_stages_read_their_own_prefill_stage_byte_for_byte(
    sglang: Any, model: h.Model, p: int, d: int
) -> None:
    pair = StagedPair(sglang, p, d, 2, 2, model)
    try:
        # each decode stage holds its own layers, at their model-wide place
        for rank in pair.decode:
            lo, hi = model.stage(2, rank.pp_rank)
            assert rank.full_layers + rank.swa_layers + rank.mamba_layers == [
                i for i in (*model.full, *model.swa, *model.mamba) if lo <= i < hi
            ]
            first_full = sum(1 for i in model.full if i < lo)
            assert rank.manager.memory.first_layer == first_full
        rooms = {7001 + 10 * p + d: 22, 8003 + 10 * p + d: 9}
        dec_out, pre_out = _run_stages(pair, rooms, 2)
        KVPoll = sglang["KVPoll"]
        assert {r: dec_out[r] for r in rooms} == {r: KVPoll.Success for r in rooms}, dec_out
        assert pre_out == {r: KVPoll.Success for r in rooms}
    finally:
        pair.close()


def test_a_decode_stage_and_a_prefill_of_another_pp_size_are_refused_at_the_handshake(sglang: Any) -> None:
    """Decode PP 2 against prefill PP 1: the receiver fails naming the PP sizes (SGLang's own
    backends assert the same), nothing is written."""
    pair = StagedPair(sglang, 1, 1, 1, 2, h.LINEAR_HYBRID)
    try:
        rank = pair.decode[0]
        tt._wait("prefill topology", lambda: rank.manager.try_ensure_parallel_info(pair.addr))
        rx = sglang["receiver"](mgr=rank.manager, bootstrap_addr=pair.addr, bootstrap_room=9001)
        rx.init(0)
        deadline = time.monotonic() + 60
        while rx.poll() != sglang["KVPoll"].Failed:
            assert time.monotonic() < deadline, "no refusal"
            time.sleep(0.01)
        assert "decode PP must be 1 or equal prefill PP 1, got 2" in str(rx._failure)
    finally:
        pair.close()
