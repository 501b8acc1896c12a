"""DP attention through pdwire's SGLang backend: each DP group of an engine is its own scheduler,
its own pools and its own identity to its peers, and a room moves between the one prefill DP
group SGLang's routing names and the decode DP group that holds it, byte for byte.

SGLang 0.5.23's real parts, as in ``test_transfer.py``: the plugin, its bootstrap server, its pools
and ``KVArgs``, managers built by its own ``_init_kv_manager`` in a runtime context with
``--enable-dp-attention`` (``dp_size`` groups of ``tp`` attention ranks), and its decode loop's own
DP-rank resolution (``DecodePreallocQueue._resolve_prefill_dp_rank``,
``prefetch_prefill_dp_rank_queries``, ``_resolve_pending_reqs``: the room's DP group follows the
room, or is queried from the bootstrap server where the prefill sender registered it). One
scheduler thread per DP group on each side; polls are all-reduced over each group's attention
TP ranks with MIN, as SGLang does.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from types import MethodType, SimpleNamespace
from typing import Any

import pytest

warnings.filterwarnings("ignore")

from tests.sglang.backend import harness as h  # noqa: E402

pytest.importorskip("nixl")

FOLLOW = "follow_bootstrap_room"


@pytest.fixture(scope="module")
def sglang() -> Any:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend("pdwire")
    return SimpleNamespace(
        KVPoll=KVPoll,
        sender=get_kv_class(backend, KVClassType.SENDER),
        receiver=get_kv_class(backend, KVClassType.RECEIVER),
        server=get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER),
    )


def _wait(what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Engines:
    """A prefill engine of ``pdp`` DP groups of ``ptp`` attention ranks and a decode engine of
    ``ddp`` x ``dtp`` around one bootstrap server (``groups[role][dp]``: a DP group's ranks)."""

    def __init__(
        self, sg: Any, pdp: int, ptp: int, ddp: int, dtp: int, balance: str = FOLLOW, replicas: bool = False
    ) -> None:
        self.sg = sg
        self.port = h.free_port()
        self.server = sg.server(host="127.0.0.1", port=self.port)
        self.addr = f"127.0.0.1:{self.port}"
        http_p, http_d = h.free_port(), h.free_port()
        self.ranks: list[h.Rank] = []
        self.groups: dict[str, list[list[h.Rank]]] = {}
        for role, dp, tp, http in (("prefill", pdp, ptp, http_p), ("decode", ddp, dtp, http_d)):
            extra = {"load_balance_method": balance} if role == "prefill" else {}
            self.groups[role] = [
                [
                    h.make_rank(role, tp, t, self.port, http, dp=dp, dp_rank=g, replicas=replicas, **extra)
                    for t in range(tp)
                ]
                for g in range(dp)
            ]
            self.ranks += [r for group in self.groups[role] for r in group]

    def close(self) -> None:
        for rank in self.ranks:
            rank.manager.teardown()
        self.server.close()


class PreallocQueue:
    """A decode rank's ``DecodePreallocQueue`` for what resolves a room's prefill DP group:
    SGLang's own methods on the queue's own fields; receivers are initialised as its
    ``_init_receiver`` does under the default (early) allocation policy."""

    def __init__(self, manager: Any) -> None:
        from sglang.srt.disaggregation.decode import DecodePreallocQueue as Q

        self.kv_manager = manager
        self.pending_reqs: list[Any] = []
        self._prefill_dp_rank_queries: dict[str, Any] = {}
        self._ensure_retry_count: dict[str, int] = {}
        self._max_ensure_retries = 15
        self._ensure_last_attempt_time: dict[str, float] = {}
        self._ensure_retry_interval = 1.0
        for name in (
            "_resolve_prefill_dp_rank", "_ensure_prefill_info", "prefetch_prefill_dp_rank_queries",
            "_cancel_prefill_dp_rank_queries", "_resolve_pending_reqs",
        ):  # fmt: skip
            setattr(self, name, MethodType(getattr(Q, name), self))

    def _init_receiver(self, decode_req: Any, prefill_dp_rank: int) -> None:
        decode_req.kv_receiver.init(prefill_dp_rank)

    def add(self, decode_req: Any) -> None:
        """``DecodePreallocQueue.add``: the fast path, else pending."""
        dp = self._resolve_prefill_dp_rank(decode_req.req)
        if dp is not None:
            self._init_receiver(decode_req, dp)
        else:
            self.pending_reqs.append(decode_req)


def _decode_group(
    eng: Engines, group: list[h.Rank], rooms: dict[int, int], out: dict[int, Any]
) -> Callable[[], None]:
    """One decode DP group's scheduler: its receivers, SGLang's DP-rank resolution, handshake,
    ``send_metadata``, then polls until every room ended; each rank's bytes are checked."""
    KVPoll = eng.sg.KVPoll

    def run() -> None:
        from sglang.srt.disaggregation.decode import DecodeRequest

        queues = [PreallocQueue(r.manager) for r in group]
        recv: dict[int, list[Any]] = {}
        for room in rooms:
            req = SimpleNamespace(
                rid=str(room), bootstrap_host="127.0.0.1", bootstrap_port=eng.port, bootstrap_room=room,
                disagg_prefill_dp_rank=None,
            )  # fmt: skip
            recv[room] = [
                eng.sg.receiver(mgr=r.manager, bootstrap_addr=eng.addr, bootstrap_room=room) for r in group
            ]
            for q, rx in zip(queues, recv[room], strict=True):
                q.add(DecodeRequest(req=req, kv_receiver=rx))
        by = time.monotonic() + 60
        while any(q.pending_reqs for q in queues):  # the scheduler's event loop
            assert time.monotonic() < by, "prefill DP groups never resolved"
            for q in queues:
                q.prefetch_prefill_dp_rank_queries()
                q._resolve_pending_reqs()
            time.sleep(0.01)
        for q in queues:
            q._cancel_prefill_dp_rank_queries()
        reqs: dict[int, list[h.Request]] = {}
        waiting, pending = set(rooms), set(rooms)
        by = time.monotonic() + 120
        while pending:
            assert time.monotonic() < by, f"rooms {sorted(pending)} never finished on decode"
            for room in sorted(pending):
                poll = h.min_poll([rx.poll() for rx in recv[room]])
                if room in waiting and poll == KVPoll.WaitingForInput:
                    waiting.discard(room)
                    reqs[room] = [h.Request(r, room, rooms[room]) for r in group]
                    for rx, rq in zip(recv[room], reqs[room], strict=True):
                        rx.send_metadata(rq.pages, rq.aux, rq.state_indices(), decode_prefix_len=0)
                elif poll == KVPoll.Failed or (poll == KVPoll.Success and room not in waiting):
                    out[room] = (
                        int(poll),
                        [rx.prefill_dp_rank for rx in recv[room]],
                        [rx._failure for rx in recv[room]] if poll == KVPoll.Failed else
                        [rq.mismatches() for rq in reqs[room]],
                    )  # fmt: skip
                    for rx in recv[room]:
                        rx.clear()
                    pending.discard(room)
            time.sleep(0.002)

    return run


def _prefill_group(
    eng: Engines, group: list[h.Rank], rooms: dict[int, int], out: dict[int, Any]
) -> Callable[[], None]:
    """One prefill DP group's scheduler (the rooms SGLang's DP controller dispatched to it):
    senders, the prompt's content, bootstrap polls, chunked sends, polls until the end."""
    KVPoll = eng.sg.KVPoll

    def run() -> None:
        send = {
            room: [eng.sg.sender(mgr=r.manager, bootstrap_addr=eng.addr, bootstrap_room=room) for r in group]
            for room in rooms
        }
        reqs = {room: [h.Request(r, room, rooms[room]) for r in group] for room in rooms}
        for rs in reqs.values():
            for rq in rs:
                rq.fill()
        started: set[int] = set()
        done: dict[int, Any] = {}
        by = time.monotonic() + 120
        while len(done) < len(rooms):
            assert time.monotonic() < by, f"rooms {sorted(set(rooms) - set(done))} never finished on prefill"
            for room in rooms:
                if room in done:
                    continue
                poll = h.min_poll([s.poll() for s in send[room]])
                if room not in started and poll == KVPoll.WaitingForInput:
                    started.add(room)
                    n = len(reqs[room][0].pages)
                    for s, rq in zip(send[room], reqs[room], strict=True):
                        s.init(n, rq.aux)
                    for start in range(0, n, 2):
                        last = start + 2 >= n
                        for s, rq in zip(send[room], reqs[room], strict=True):
                            s.send(rq.pages[start : start + 2], rq.state_indices() if last else None)
                elif poll in (KVPoll.Success, KVPoll.Failed):
                    done[room] = (int(poll), [s._failure for s in send[room]])
                    for s in send[room]:
                        s.clear()
            time.sleep(0.002)
        out.update(done)

    return run


def _run(
    eng: Engines, prefill_of: dict[int, int], decode_of: dict[int, int], seq: dict[int, int]
) -> tuple[dict[int, Any], dict[int, Any]]:
    """Every DP group's scheduler on its own thread: room -> its prefill and decode DP group."""
    pre_out: dict[int, Any] = {}
    dec_out: dict[int, Any] = {}
    threads = [
        h.EngineThread(f"{role}-dp{g}", make(eng, group, {r: seq[r] for r in seq if of[r] == g}, out))
        for role, make, of, out in (
            ("decode", _decode_group, decode_of, dec_out),
            ("prefill", _prefill_group, prefill_of, pre_out),
        )
        for g, group in enumerate(eng.groups[role])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
        assert not t.is_alive(), f"{t.name} still running"
        assert t.error is None, f"{t.name}: {t.error!r}"
    return pre_out, dec_out


def _seen(rank: h.Rank, room: int) -> Any:
    mgr = rank.manager
    return mgr.submit(mgr.worker.status, room).result(30)


def _check(
    eng: Engines, prefill_of: dict[int, int], pre_out: dict[int, Any], dec_out: dict[int, Any]
) -> None:
    """Every room Success on both sides with each decode rank's bytes equal to its shard, asked
    from the prefill DP group that holds it; no rank of another prefill group ever saw the room,
    and no decode rank was taken for another (no restart, no refused registration)."""
    KVPoll = eng.sg.KVPoll
    assert {r: o[0] for r, o in pre_out.items()} == dict.fromkeys(prefill_of, KVPoll.Success), pre_out
    for room, (poll, asked, bad) in dec_out.items():
        assert poll == KVPoll.Success, (room, bad)
        assert asked == [prefill_of[room]] * len(asked), (room, asked)
        assert not any(bad), (room, bad)
    assert set(dec_out) == set(prefill_of)
    for g, group in enumerate(eng.groups["prefill"]):
        for rank in group:
            assert [r for r in prefill_of if prefill_of[r] != g and _seen(rank, r) is not None] == []
            stats = rank.manager.worker.stats
            assert (stats.restarts, stats.takeovers_refused) == (0, 0), (g, rank.tp_rank)


def _rooms(n: int, base: int) -> dict[int, int]:
    return {base + i: (9, 22, 16, 13, 7, 18)[i % 6] for i in range(n)}


@pytest.mark.parametrize(
    ("keys", "replicas"),
    [(False, False), (True, False), (False, True)],
    ids=["insecure", "curve", "replicas"],
)
def test_dp2_prefill_to_dp2_decode_follows_the_room(
    sglang: Any, keys: bool, replicas: bool, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill DP 2 x TP 1 -> decode DP 2 x TP 1, SGLang's default routing (a room's prefill DP
    group is ``room % 2``): rooms of both prefill groups into both decode groups. The two decode
    ranks have the same attention TP rank (0) in one engine: both stay registered with every
    prefill rank, with the deployment's CURVE keys too (a shared key does not make one the
    other's restart). ``replicas``: the same with a DP controller's replicas (``--dp-size 2``
    without DP attention), filed by their replica rank."""
    if keys:
        from pdwire.runtime.control_auth import ENV_INSECURE, ENV_KEYS, generate_directory

        generate_directory(tmp_path / "keys")
        monkeypatch.setenv(ENV_KEYS, str(tmp_path / "keys"))
        monkeypatch.delenv(ENV_INSECURE, raising=False)
    eng = Engines(sglang, 2, 1, 2, 1, replicas=replicas)
    try:
        assert [r.manager.rank.dp_rank for r in eng.ranks] == [0, 1, 0, 1]
        assert {r.manager.system_dp_size for r in eng.ranks} == {2 if replicas else 1}
        rooms = _rooms(8, 6100 + 10 * keys + 20 * replicas)
        prefill_of = {r: r % 2 for r in rooms}
        decode_of = {r: (r // 2) % 2 for r in rooms}  # every (prefill, decode) pair of groups
        pre_out, dec_out = _run(eng, prefill_of, decode_of, rooms)
        _check(eng, prefill_of, pre_out, dec_out)
        for g, (rank,) in enumerate(eng.groups["decode"]):
            # one group per prefill DP group, each of its own DP rank
            groups = rank.manager.submit(lambda m=rank.manager: sorted(m.worker.links.groups)).result(30)
            assert [dp for _, dp in groups] == [0, 1], (g, groups)
    finally:
        eng.close()


@pytest.mark.parametrize(("pdp", "ddp"), [(2, 1), (1, 2), (3, 2)], ids=lambda n: f"dp{n}")
def test_any_dp_size_on_either_side(sglang: Any, pdp: int, ddp: int) -> None:
    """Prefill DP ``pdp`` x TP 1 -> decode DP ``ddp`` x TP 1 (DP attention on one side only, or
    sizes that do not divide): every decode group reads rooms of every prefill group it is given,
    each from the group ``room % pdp``, byte for byte."""
    eng = Engines(sglang, pdp, 1, ddp, 1)
    try:
        assert [r.manager.rank.dp_rank for r in eng.ranks] == [*range(pdp), *range(ddp)]
        rooms = _rooms(max(4, pdp * ddp), 6400 + 10 * pdp + ddp)  # at most 4 per rank (its Mamba slots)
        prefill_of = {r: r % pdp for r in rooms}
        decode_of = {r: (r // pdp) % ddp for r in rooms}
        assert len({(prefill_of[r], decode_of[r]) for r in rooms}) == pdp * ddp
        pre_out, dec_out = _run(eng, prefill_of, decode_of, rooms)
        _check(eng, prefill_of, pre_out, dec_out)
    finally:
        eng.close()


@pytest.mark.parametrize(
    ("balance", "force", "ptp"),
    [("round_robin", False, 2), (FOLLOW, True, 1)],
    ids=["round-robin-dp2xtp2", "forced-query-dp2xtp1"],
)
def test_a_prefill_dp_group_registered_with_the_bootstrap_server_is_queried(
    sglang: Any, balance: str, force: bool, ptp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill DP 2 x TP ``ptp`` -> decode DP 2 x TP 1 where prefill DP groups do not follow the
    room: a non-default ``--load-balance-method``, or SGLang's
    SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1. Each room is dispatched to the group
    ``room % 2`` does *not* name; its senders register the group with the bootstrap server, and
    SGLang's decode loop queries it there (on the manager's executor) before it initialises the
    receivers. With TP 2 groups each decode rank reads both ranks of the group for its heads."""
    if force:
        monkeypatch.setenv("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "1")
    eng = Engines(sglang, 2, ptp, 2, 1, balance=balance)
    try:
        rooms = _rooms(6, 6200 + 10 * ptp)
        prefill_of = {r: (r + 1) % 2 for r in rooms}
        decode_of = {r: (r // 2) % 2 for r in rooms}
        pre_out, dec_out = _run(eng, prefill_of, decode_of, rooms)
        _check(eng, prefill_of, pre_out, dec_out)
        # the queries ran on the managers' executors; whether every decode rank asks depends on
        # when SGLang's loop polls it (under load one was seen to find its rooms resolved)
        decode_ranks = eng.groups["decode"][0] + eng.groups["decode"][1]
        assert any(rank.manager._executor is not None for rank in decode_ranks)
    finally:
        eng.close()


class _SaysDp0:
    """A prefill group handle whose ranks said they are DP group 0."""

    ready = True
    dp_rank = 0


def test_misrouted_rooms_fail_at_once_by_name(sglang: Any) -> None:
    """Under SGLang's default routing a room dispatched to another prefill DP group than
    ``room % DP size`` would never be asked for (decode asks that group): its sender fails at
    once, naming the conflict and the variable that allows such routing, and a decode rank asking
    the group anyway is refused. A receiver told a DP group the prefill does not have fails by
    name, and so does a group whose ranks say another DP group than the bootstrap server named."""
    import pdwire.runtime.engine as pd

    KVPoll = sglang.KVPoll
    eng = Engines(sglang, 2, 1, 1, 1)
    try:
        (p1,) = eng.groups["prefill"][1]
        tx = sglang.sender(mgr=p1.manager, bootstrap_addr=eng.addr, bootstrap_room=6300)
        assert tx.poll() == KVPoll.Failed
        with pytest.raises(
            Exception,
            match=r"follow_bootstrap_room conflict: room 6300 .* DP group 1, decode asks DP group 0",
        ) as err:
            tx.failure_exception()
        assert "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1" in str(err.value)
        # the same room, asked from DP group 1 anyway, is refused there (never transferred)
        (d0,) = eng.groups["decode"][0]
        _wait("prefill topology", lambda: d0.manager.try_ensure_parallel_info(eng.addr))
        rx = sglang.receiver(mgr=d0.manager, bootstrap_addr=eng.addr, bootstrap_room=6300)
        rx.init(1)
        _wait("handshake", lambda: rx.poll() != KVPoll.Bootstrapping)
        rq = h.Request(d0, 6300, 12)
        rx.send_metadata(rq.pages, rq.aux, rq.state_indices(), decode_prefix_len=0)
        _wait("the refusal", lambda: rx.poll() == KVPoll.Failed, 30)
        with pytest.raises(Exception, match=r"follow_bootstrap_room conflict") as err:
            rx.failure_exception()
        # a DP group the prefill engine does not have
        bad = sglang.receiver(mgr=d0.manager, bootstrap_addr=eng.addr, bootstrap_room=6301)
        bad.init(2)
        assert bad.poll() == KVPoll.Failed
        with pytest.raises(Exception, match=r"has 2 DP groups, the room was routed to DP group 2"):
            bad.failure_exception()
        # ranks that say another DP group than the one they were asked as
        group = _SaysDp0()
        fut: Future[Any] = Future()
        d0.manager._connecting[group] = (1, fut)
        d0.manager._on_connected(group)
        with pytest.raises(pd.HandshakeError, match=r"for prefill DP group 1 say they are DP group 0"):
            fut.result(0)
    finally:
        eng.close()
