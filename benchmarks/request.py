"""End-to-end request benchmark: one whole hybrid request through the runtime, against memcpy.

    .venv/bin/python benchmarks/request.py [--backends nixl,local] [--tokens 4096,32768]
        [--cases 4-4,2-4,4-2] [--layouts NHD,HND] [--repeats 3] [--ranks auto|all|peer] [--quick]

One request of the planner benchmark's model (``request_model.py``) moves from a prefill group to
a decode group through ``pdwire.runtime.engine`` (decode ``connect`` and ``start_room``, prefill
``send_chunk`` chunk by chunk): two processes, each rank a worker with its own backend agent on a
``WorkerThread`` (a 2-core machine is not asked to schedule six busy processes).

Per run: **request** = first ``send_chunk`` -> the last decode rank's Success (one host, one
CLOCK_MONOTONIC); bytes, descriptors and posts from the prefill workers' stats. Right after each
request, **memcpy** = ``np.copyto`` of the same bytes in the decode process (two 256 MiB buffers
copied in turn: DRAM to DRAM, one core). **planner** = ``plan_request`` of every peer (medians,
before the runs), part of the request time. One warm-up run is not timed. After the timed runs
every destination byte is compared with its shard cut by numpy (not the planner) and every other
byte must still hold the sentinel written before each run.

Ranks: ``all`` moves the request to every decode rank; ``peer`` (the default at 32k tokens, which
would not fit this machine) to the decode ranks reading from prefill rank 1 and the prefill ranks
they read from: the per-rank work of a deployment whose hosts run in parallel.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pdwire.runtime.control_auth import ENV_INSECURE, ENV_KEYS, generate_directory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # request_model when imported by tests

from _common import arguments, load, machine, median_s, single_host
from request_model import (
    Content,
    Model,
    Placement,
    RankLayout,
    fill,
    placement,
    pools_for,
    request_bytes,
    reset,
    verify,
)

TIMEOUT_S = 1800.0  # room and transfer timeouts: a direct 32k NHD request takes tens of seconds here
SCRATCH = 256 << 20
SRC_SEED, DST_SEED = 11, 22


@dataclass(frozen=True)
class Case:
    backend: str
    prefill_tp: int
    decode_tp: int
    layout: str
    tokens: int
    prefill_ranks: tuple[int, ...]
    decode_ranks: tuple[int, ...]
    model: Model
    chunk_pages: int
    repeats: int
    staging_mib: int = 0  # the prefill ranks' staging buffer (0: staging off)
    scatter_mib: int = 0  # the decode ranks' receive staging buffer (0: decode-side scatter off)

    @property
    def pair(self) -> str:
        return f"P{self.prefill_tp} -> D{self.decode_tp}"

    @property
    def ranks_text(self) -> str:
        if len(self.decode_ranks) == self.decode_tp and len(self.prefill_ranks) == self.prefill_tp:
            return "all"
        p = ",".join(map(str, self.prefill_ranks))
        d = ",".join(map(str, self.decode_ranks))
        return f"p{p} -> d{d}"


def subset(prefill_tp: int, decode_tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Decode ranks reading from prefill rank 1 and every prefill rank they read from."""
    from pdwire.runtime.planner import decode_ranks_of_prefill, route_decode_rank

    p1 = min(1, prefill_tp - 1)
    decode = decode_ranks_of_prefill(prefill_tp, decode_tp, p1)
    prefill = sorted(
        {p for d in decode for p in route_decode_rank(prefill_tp, decode_tp, d, is_mla=False).prefill_ranks}
    )
    return tuple(prefill), tuple(decode)


def layout_of(case: Case, tp: int, rank: int) -> RankLayout:
    from pdwire.runtime.planner import Layout

    return RankLayout(case.model, tp, rank, Layout(case.layout), pools_for(case.model, case.tokens))


def placements(case: Case) -> tuple[Placement, Placement]:
    pools = pools_for(case.model, case.tokens)
    src = placement(case.model, case.tokens, pools, SRC_SEED, slot=2, aux=3)
    dst = placement(case.model, case.tokens, pools, DST_SEED, slot=1, aux=5)
    return src, dst


def expected_bytes(case: Case) -> int:
    _, dst = placements(case)
    return sum(
        n for d in case.decode_ranks for _, n in request_bytes(layout_of(case, case.decode_tp, d), dst)
    )


def memory_needed(case: Case) -> int:
    arenas = sum(layout_of(case, case.prefill_tp, r).nbytes for r in case.prefill_ranks)
    arenas += sum(layout_of(case, case.decode_tp, r).nbytes for r in case.decode_ranks)
    content = (
        case.tokens * case.model.heads * case.model.head_bytes * 3 * 2
    )  # both sides' mixes + temporaries
    staging = (len(case.prefill_ranks) * case.staging_mib + len(case.decode_ranks) * case.scatter_mib) << 20
    return arenas + content + staging + 2 * SCRATCH


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fingerprint(model: Model) -> Any:
    from pdwire import wire

    return wire.ModelFingerprint(
        model_name="pdwire-bench-hybrid",
        revision=f"{zlib.crc32(repr(model).encode()):08x}",
        dtype="bfloat16",
        num_layers=model.layers,
        num_attention_layers=model.layers,
        num_state_layers=model.mamba_layers,
    )


# --------------------------------------------------------------------------- the side processes


@dataclass
class _Rank:
    rank: int
    layout: RankLayout
    backend: Any
    buffer: Any
    worker: Any
    thread: Any
    group: Any = None


@dataclass
class _Side:
    case: Case
    conn: Connection
    ranks: list[_Rank] = field(default_factory=list)
    done: queue.Queue[tuple[int, int, str, str, float]] = field(default_factory=queue.Queue)


def side_main(role: str, case: Case, conn: Connection) -> None:
    try:
        (_prefill if role == "prefill" else _decode)(_Side(case, conn))
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:
        conn.send(("error", role, traceback.format_exc()))
    finally:
        os._exit(0)  # engine atexit hooks can hang on a half-torn-down peer


def _start_ranks(side: _Side, role: str, content: Content | None, where: Placement) -> None:
    import zmq

    from pdwire.runtime import engine as pd

    case = side.case
    tp = case.prefill_tp if role == "prefill" else case.decode_tp
    ctx = zmq.Context()
    for r in case.prefill_ranks if role == "prefill" else case.decode_ranks:
        lay = layout_of(case, tp, r)
        backend = pd.create_backend(
            case.backend, agent_name=f"bench-{role}{r}-{os.getpid()}", transfer_timeout_s=TIMEOUT_S
        )
        buf = backend.allocate(f"{role}{r}", lay.nbytes)
        if content is not None:
            fill(lay, buf.array, content, where)
        else:
            reset(buf.array)
        memory = lay.memory(buf.address)
        common = {
            "engine_id": f"bench-{role}", "rank": pd.ParallelRank(tp_size=tp, tp_rank=r),
            "model": fingerprint(case.model), "room_timeout_s": TIMEOUT_S, "transfer_timeout_s": TIMEOUT_S,
        }  # fmt: skip

        def done(room: int, status: Any, failure: Any, r: int = r) -> None:
            side.done.put((r, room, status.name, failure.reason if failure else "", time.perf_counter()))

        if role == "prefill":
            cfg = pd.PrefillConfig(**common, staging_bytes=case.staging_mib << 20)
            worker = pd.PrefillWorker(cfg, memory, backend=backend, context=ctx, on_released=done)
        else:
            cfg = pd.DecodeConfig(**common, scatter_bytes=case.scatter_mib << 20)
            worker = pd.DecodeWorker(cfg, memory, backend=backend, context=ctx, on_finished=done)
        thread = pd.WorkerThread(worker, name=f"{role}{r}").start()
        side.ranks.append(_Rank(r, lay, backend, buf, worker, thread))


def _wait_done(side: _Side, room: int) -> list[tuple[int, int, str, str, float]]:
    got = []
    while len(got) < len(side.ranks):
        item = side.done.get(timeout=TIMEOUT_S)
        if item[1] == room:
            got.append(item)
    return got


def _stop(side: _Side) -> None:
    failures = [f for r in side.ranks for f in r.worker.stats.failures]
    for r in side.ranks:
        r.thread.close()
        r.backend.close()
    side.conn.send(("stopped", failures))


STATS = (
    "posts",
    "descriptors",
    "bytes_posted",
    "planned_descriptors",
    "staged_parts",
    "copy_s",
    "scattered_parts",
)


def _stats(r: _Rank) -> tuple[float, ...]:
    s = r.thread.submit(lambda: r.worker.stats).result()
    return tuple(getattr(s, name) for name in STATS)


def _plan_like_the_worker(plan: Any, case: Case, src: Placement, dst: Placement) -> int:
    """Plan one request the way a prefill worker does (KV chunk by chunk, then state and aux);
    returns the descriptor count."""
    plan.check_request(dst.pages, dst.state(), dst.aux)
    n = 0
    for start in range(0, len(src.pages), case.chunk_pages):
        stop = start + case.chunk_pages
        n += len(plan.plan_kv_chunk(start, src.pages[start:stop], dst.pages[start:stop]).table)
    n += sum(len(g.table) for g in plan.plan_state(src.state(), dst.state()))
    return n + len(plan.plan_aux(src.aux, dst.aux).table)


def _prefill(side: _Side) -> None:
    from pdwire.runtime import engine as pd
    from pdwire.runtime.planner import Layout, prepare_peer, route_decode_rank

    case, conn = side.case, side.conn
    src, dst = placements(case)
    _start_ranks(side, "prefill", Content(case.model, case.tokens), src)
    conn.send(("ready", {r.rank: r.worker.endpoint for r in side.ranks}))
    state = src.state()
    while True:
        cmd = conn.recv()
        if cmd[0] == "plan":
            total, descs = 0.0, 0
            tp = case.prefill_tp, case.decode_tp
            reads = {d: route_decode_rank(*tp, d, is_mla=False).prefill_ranks for d in case.decode_ranks}
            for r in side.ranks:
                local = r.layout.memory(1 << 44)  # addresses do not change planning time
                for d in (d for d in case.decode_ranks if r.rank in reads[d]):
                    remote = RankLayout(case.model, case.decode_tp, d, Layout(case.layout), r.layout.pools)
                    plan = prepare_peer(local, remote.memory(1 << 50))
                    total += median_s(lambda plan=plan: _plan_like_the_worker(plan, case, src, dst), cmd[1])
                    descs += _plan_like_the_worker(plan, case, src, dst)
            conn.send(("planned", total, descs))
        elif cmd[0] == "run":
            room = cmd[1]
            waiting = pd.Status.WAITING_FOR_INPUT
            for r in side.ranks:  # every rank has all its TransferRequests: the clock starts at the chunk
                while r.thread.submit(r.worker.status, room).result() is not waiting:
                    time.sleep(1e-4)
            before = [_stats(r) for r in side.ranks]
            t0 = time.perf_counter()
            for r in side.ranks:
                pages = src.pages
                for start in range(0, len(pages), case.chunk_pages):
                    stop = min(len(pages), start + case.chunk_pages)
                    last = {"state": state, "aux_index": src.aux} if stop == len(pages) else {}
                    r.thread.submit(r.worker.send_chunk, room, pages[start:stop], last=bool(last), **last)
            released = _wait_done(side, room)
            after = [_stats(r) for r in side.ranks]
            delta = [sum(a[i] - b[i] for a, b in zip(after, before, strict=True)) for i in range(len(STATS))]
            conn.send(("ran", t0, [x[2:4] for x in released], delta))
        elif cmd[0] == "stop":
            return _stop(side)


def _scatter_s(side: _Side) -> float:
    """Seconds the decode ranks spent copying staged pages into place so far."""
    return sum(r.thread.submit(lambda r=r: r.worker.stats.scatter_s).result() for r in side.ranks)


def _decode(side: _Side) -> None:
    from pdwire.runtime import engine as pd

    case, conn = side.case, side.conn
    _, dst = placements(case)
    _start_ranks(side, "decode", None, dst)
    content: Content | None = None
    scratch = np.ones(2 * min(SCRATCH, max(expected_bytes(case), 1 << 20)), np.uint8)  # pre-faulted
    a, b = scratch[: len(scratch) // 2], scratch[len(scratch) // 2 :]
    conn.send(("ready", {}))
    while True:
        cmd = conn.recv()
        if cmd[0] == "connect":
            for r in side.ranks:
                r.group = r.thread.submit(r.worker.connect, cmd[1]).result()
            conn.send(("connected",))
        elif cmd[0] == "run":
            room = cmd[1]
            for r in side.ranks:
                reset(r.buffer.array)
            indices = pd.RequestIndices(dst.pages, dst.state(), dst.aux)
            for r in side.ranks:
                r.thread.submit(r.worker.start_room, room, indices, r.group).result()
            scatter_s = _scatter_s(side)
            conn.send(("started",))
            finished = _wait_done(side, room)
            scatter_s = _scatter_s(side) - scatter_s
            conn.send(("finished", max(x[4] for x in finished), [x[2:4] for x in finished], scatter_s))
        elif cmd[0] == "memcpy":
            left, t = cmd[1], time.perf_counter()
            while left > 0:  # a -> b, then b -> a: each pass reads and writes DRAM
                n = min(left, len(a))
                np.copyto(b[:n], a[:n])
                a, b = b, a
                left -= n
            conn.send(("copied", time.perf_counter() - t))
        elif cmd[0] == "verify":
            content = content or Content(case.model, case.tokens)
            checked, problems = 0, []
            for r in side.ranks:
                n, p = verify(r.layout, r.buffer.array, content, dst)
                checked += n
                problems += [f"decode rank {r.rank}: {x}" for x in p]
            conn.send(("verified", checked, problems))
        elif cmd[0] == "stop":
            return _stop(side)


# --------------------------------------------------------------------------- the parent


class BenchError(RuntimeError):
    pass


def _expect(conn: Connection, kind: str, timeout_s: float = TIMEOUT_S) -> tuple[Any, ...]:
    if not conn.poll(timeout_s):
        raise BenchError(f"no {kind!r} within {timeout_s}s")
    msg = conn.recv()
    if msg[0] == "error":
        raise BenchError(f"{msg[1]} process failed:\n{msg[2]}")
    if msg[0] != kind:
        raise BenchError(f"expected {kind!r}, got {msg!r}")
    return msg  # type: ignore[no-any-return]


@dataclass
class Result:
    case: Case
    bytes: int = 0
    descriptors: int = 0
    posts: int = 0
    request_s: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)
    planner_s: float = 0.0
    planned_descriptors: int = 0
    engine_rows: int = 0
    staged_parts: int = 0
    scattered_parts: int = 0
    copy_s: list[float] = field(default_factory=list)
    scatter_s: list[float] = field(default_factory=list)
    verified: str = ""
    load: tuple[float, float] = (0.0, 0.0)


def run_case(case: Case) -> Result:
    # a forkserver imports the runtime (and NIXL) once; each side forks from it
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["request_model", "pdwire.runtime.engine", "zmq"] + (["nixl._api"] if case.backend == "nixl" else [])
    )
    res = Result(case, load=(os.getloadavg()[0], 0.0))
    procs, conns = [], {}
    for role in ("decode", "prefill"):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=side_main, args=(role, case, child), daemon=True, name=f"bench-{role}")
        p.start()
        child.close()
        procs.append(p)
        conns[role] = parent
    try:
        pre, dec = conns["prefill"], conns["decode"]
        endpoints = _expect(pre, "ready", 600)[1]
        _expect(dec, "ready", 600)
        # ranks outside the run are never contacted (the routing names only those that are)
        dec.send(("connect", [endpoints.get(r, "tcp://127.0.0.1:9") for r in range(case.prefill_tp)]))
        _expect(dec, "connected", 120)
        pre.send(("plan", 5 if case.tokens >= 16384 else 9))
        _, res.planner_s, res.planned_descriptors = _expect(pre, "planned")
        want = expected_bytes(case)
        for i in range(1 + case.repeats):
            room = 1000 + i
            dec.send(("run", room))
            _expect(dec, "started")
            pre.send(("run", room))
            _, t0, released, (posts, descs, nbytes, planned, staged, copy_s, scattered) = _expect(pre, "ran")
            _, t1, finished, scatter_s = _expect(dec, "finished")
            bad = [x for x in finished + released if x[0] != "SUCCESS"]
            if bad:
                raise BenchError(f"{case}: room {room} ended {bad}")
            if nbytes != want:
                raise BenchError(f"{case}: prefill posted {nbytes} bytes, the request is {want}")
            if not case.staging_mib and not case.scatter_mib and planned != res.planned_descriptors:
                # with staging, KV chunks are cut to fit the staging buffer: other chunk edges
                raise BenchError(
                    f"posted {planned} planned rows, the planner alone made {res.planned_descriptors}"
                )
            dec.send(("memcpy", nbytes))
            (_, memcpy_s) = _expect(dec, "copied")
            if i == 0:
                continue  # warm-up: connections, first-touch of engine state
            res.request_s.append(t1 - t0)
            res.memcpy_s.append(memcpy_s)
            res.copy_s.append(copy_s)
            res.scatter_s.append(scatter_s)
            res.bytes, res.descriptors, res.posts = int(nbytes), int(planned), int(posts)
            res.engine_rows, res.staged_parts, res.scattered_parts = int(descs), int(staged), int(scattered)
        dec.send(("verify",))
        _, checked, problems = _expect(dec, "verified")
        if problems:
            raise BenchError("verification failed:\n" + "\n".join(problems[:10]))
        res.verified = f"{checked / 2**30:.2f} GiB" if checked >= 2**30 else f"{checked / 2**20:.0f} MiB"
        for conn in (dec, pre):
            conn.send(("stop",))
            failures = _expect(conn, "stopped", 120)[1]
            if failures:
                raise BenchError(f"worker failures: {failures[:5]}")
    finally:
        for conn in conns.values():
            conn.close()  # a side still waiting for a command sees EOF and exits
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    res.load = (res.load[0], os.getloadavg()[0])
    return res


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _staging_text(r: Result) -> str:
    parts = []
    if r.staged_parts or not r.scattered_parts:
        parts.append(f"{r.staged_parts} parts, gather {statistics.median(r.copy_s) * 1e3:.0f} ms")
    if r.scattered_parts:
        parts.append(f"{r.scattered_parts} scattered, {statistics.median(r.scatter_s) * 1e3:.0f} ms")
    return "; ".join(parts)


def _row(r: Result) -> str:
    c = r.case
    req, cp = statistics.median(r.request_s), statistics.median(r.memcpy_s)
    spread = f"{min(r.request_s) * 1e3:.0f}-{max(r.request_s) * 1e3:.0f}"
    layers = "" if c.model.layers == Model().layers else f" ({c.model.layers} layers)"
    staging = "off" if not c.staging_mib and not c.scatter_mib else _staging_text(r)
    return (
        f"| {c.backend} | {c.pair} | {c.layout} | {c.tokens}{layers} | {c.ranks_text} | {_size(r.bytes)} | "
        f"{r.descriptors:,} | {staging} | {r.engine_rows:,} | {r.posts:,} | {req * 1e3:.1f} ({spread}) | "
        f"{cp * 1e3:.1f} | {req / cp:.2f}x | {r.planner_s * 1e3:.1f} | {r.verified} | "
        f"{r.load[0]:.1f}-{r.load[1]:.1f} |"
    )


HEADER = (
    "| backend | case | layout | tokens | ranks | bytes | descriptors | staging | engine rows | posts | "
    "request ms p50 (min-max) | memcpy ms | x memcpy | planner ms | verified | load |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def build_cases(args: argparse.Namespace) -> list[Case]:
    model = Model.small() if args.quick else Model()
    if args.layers:
        model = model.scaled(args.layers)
    cases = []
    chunk = max(1, args.chunk_tokens // model.page)
    tokens = (int(t) for t in args.tokens.split(","))
    for backend, n, item in itertools.product(args.backends.split(","), tokens, args.cases.split(",")):
        pair, _, only = item.partition(":")
        p, d = (int(x) for x in pair.split("-"))
        ranks = args.ranks if args.ranks != "auto" else ("peer" if n > 8192 else "all")
        pre, dec = (tuple(range(p)), tuple(range(d))) if ranks == "all" else subset(p, d)
        for layout, mib in itertools.product(
            [only] if only else args.layouts.split(","), args.staging.split(",")
        ):
            scatter = int(mib) if args.scatter < 0 else args.scatter if int(mib) else 0
            cases.append(
                Case(backend, p, d, layout, n, pre, dec, model, chunk, args.repeats, int(mib), scatter)
            )
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, backends="nixl,local")
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--cases", default="4-4,2-4,4-2", help="prefill TP-decode TP pairs (2-4:NHD: one layout)")
    ap.add_argument("--layouts", default="NHD,HND")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", default="auto", choices=("auto", "all", "peer"))
    ap.add_argument("--layers", type=int, default=0, help="scale the model to this many KV layers")
    ap.add_argument("--staging", default="0,256", help="prefill staging buffer sizes in MiB to run (0: off)")
    ap.add_argument(
        "--scatter",
        type=int,
        default=-1,
        help="decode receive staging buffer in MiB where staging is on (default: the --staging size)",
    )
    ap.add_argument("--chunk-tokens", type=int, default=8192, help="prefill chunk size (send_chunk)")
    ap.add_argument("--margin-gib", type=float, default=3.0, help="memory left free for others")
    ap.add_argument("--quick", action="store_true", help="the small model, 512 tokens, one repeat (CI)")
    args = ap.parse_args(argv)
    if not os.environ.get(ENV_KEYS) and os.environ.get(ENV_INSECURE) != "1":
        # the control plane as deployed: authenticated, one key for both sides (their processes
        # inherit the environment)
        keys = tempfile.mkdtemp(prefix="pdwire-bench-keys-")
        generate_directory(keys)
        os.environ[ENV_KEYS] = keys
    if args.quick:
        args.tokens, args.repeats, args.chunk_tokens = "512", 1, 256
        if args.staging == ap.get_default("staging"):
            args.staging = "0,4"
        if args.cases == ap.get_default("cases"):
            args.cases = "2-2:HND,2-4:NHD,4-2:NHD"
    single_host()
    from pdwire.runtime.backends import available_backends

    have = set(available_backends())
    args.backends = ",".join(b for b in args.backends.split(",") if b in have)
    print(machine(f"{mem_available() / 2**30:.1f} GiB available", load()))
    print(f"repeats: {args.repeats} (medians; one warm-up run first), chunks of {args.chunk_tokens} tokens\n")
    print(HEADER)
    sys.stdout.flush()
    failed = 0
    for case in build_cases(args):
        need = memory_needed(case)
        free = mem_available()
        if need + args.margin_gib * 2**30 > free:
            print(f"| {case.backend} | {case.pair} | {case.layout} | {case.tokens} | {case.ranks_text} | "
                  f"skipped: needs {_size(need)}, {_size(free)} available |")  # fmt: skip
            continue
        try:
            print(_row(run_case(case)))
        except BenchError as exc:
            failed += 1
            print(exc, file=sys.stderr)
            last = str(exc).strip().splitlines()[-1]
            print(f"| {case.backend} | {case.pair} | {case.layout} | {case.tokens} | FAILED: {last} |")
        sys.stdout.flush()
    print(f"\n{load()} at end")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
