"""MLA with TP-sharded Mamba state from a larger prefill TP, through real workers.

Prefill and decode engines of an MLA + Mamba hybrid, built from the engine API alone (numpy
views over memory from the backend, no torch, no demo): per layer a paged MLA latent (one
replicated latent "head"), a Mamba conv state whose channels are q|k|v sub-blocks each split over
TP, a temporal state split by heads, and one aux item per request. With prefill TP > decode TP
the latent and the aux item come from the first prefill rank of each decode rank's group, and
every prefill rank of the group writes its own state shard.

Each prefill rank fills its shard of deterministic full tensors; after each request every decode
rank's whole buffer must equal a sentinel-filled copy with exactly the shard numpy slicing says
that rank holds placed into the request's pages, slot and aux item (so no other byte, including
the gaps between buffers and the prefix pages decode already holds, was written). The prefill
workers' byte counts show who wrote what: the first rank of a group its latent pages, its state
shard and the aux item, every other rank exactly its state shard.

The conv state is laid out two ways: channel-major ``[channels/TP, kernel-1]`` and, as
Kimi-Linear stores it, ``[kernel-1, channels/TP]`` (the sharded axis after ``kernel-1`` rows).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest

from pdwire.runtime import engine as pd

LAYERS, PAGE, LATENT = 2, 4, 12  # MLA: per token one latent of LATENT uint16, the same on every rank
CONV_BLOCKS, CONV_ROWS = (8, 8, 16), 3  # Mamba conv: q|k|v channels (each split over TP) x kernel-1
SSM_HEADS, SSM_DIM = 4, 6  # Mamba temporal state: heads split over TP, SSM_DIM uint16 per head
AUX_BYTES = 16
CHANNELS = sum(CONV_BLOCKS)
GAP = 64  # unregistered bytes between two buffers of a rank: they must stay the sentinel
SENTINEL = 0xA5  # every decode byte nobody may write
MODEL = pd.ModelFingerprint(model_name="mla-mamba", revision="r1", dtype="uint16", num_layers=LAYERS)


@dataclass(frozen=True)
class Capacity:
    pages: int
    slots: int
    items: int


PREFILL_CAP, DECODE_CAP = Capacity(pages=8, slots=3, items=3), Capacity(pages=12, slots=4, items=4)


@dataclass
class Cache:
    """One rank's memory: numpy views into one buffer (``buf``, bytes, gaps included)."""

    buf: np.ndarray
    latent: list[np.ndarray]  # per layer [pages, PAGE, 1, LATENT]
    conv: list[np.ndarray]  # per layer [slots, channels/TP, CONV_ROWS] or [slots, CONV_ROWS, channels/TP]
    ssm: list[np.ndarray]  # per layer [slots, heads/TP, SSM_DIM]
    aux: np.ndarray  # [items, AUX_BYTES]
    conv_rows_first: bool


def shapes(tp: int, cap: Capacity, conv_rows_first: bool) -> list[tuple[str, tuple[int, ...]]]:
    ch = CHANNELS // tp
    conv = (cap.slots, CONV_ROWS, ch) if conv_rows_first else (cap.slots, ch, CONV_ROWS)
    out: list[tuple[str, tuple[int, ...]]] = [("latent", (cap.pages, PAGE, 1, LATENT))] * LAYERS
    out += [("conv", conv)] * LAYERS + [("ssm", (cap.slots, SSM_HEADS // tp, SSM_DIM))] * LAYERS
    return out


def cache_bytes(tp: int, cap: Capacity, conv_rows_first: bool) -> int:
    n = GAP
    for _, shape in shapes(tp, cap, conv_rows_first):
        n += -(-int(np.prod(shape)) * 2 // GAP) * GAP + GAP
    return n + cap.items * AUX_BYTES + GAP


def lay_out(buf: np.ndarray, tp: int, cap: Capacity, conv_rows_first: bool) -> Cache:
    """Views into ``buf``: every buffer packed, a gap before, between and after them."""
    views: dict[str, list[np.ndarray]] = {"latent": [], "conv": [], "ssm": []}
    offset = GAP
    for name, shape in shapes(tp, cap, conv_rows_first):
        n = int(np.prod(shape)) * 2
        views[name].append(buf[offset : offset + n].view(np.uint16).reshape(shape))
        offset += -(-n // GAP) * GAP + GAP
    aux = buf[offset : offset + cap.items * AUX_BYTES].reshape(cap.items, AUX_BYTES)
    assert offset + aux.nbytes + GAP == buf.nbytes
    return Cache(buf, views["latent"], views["conv"], views["ssm"], aux, conv_rows_first)


def describe(c: Cache, tp: int, rank: int) -> pd.RankMemory:
    """The planner's model of ``c``: MLA latent pages, the Mamba pool (conv with its sub-blocks,
    temporal state), the aux buffer."""

    def bases(layers: list[np.ndarray]) -> tuple[int, ...]:
        return tuple(int(a.ctypes.data) for a in layers)

    def lens(layers: list[np.ndarray]) -> tuple[int, ...]:
        return tuple(a.nbytes for a in layers)

    page = PAGE * LATENT * 2
    kv = pd.KvPool(
        k_base_addrs=bases(c.latent), v_base_addrs=(), region_lens=lens(c.latent), bytes_per_page=page,
        page_size=PAGE, layout=pd.Layout.NHD, kv_heads_per_rank=1, total_kv_heads=1,
        bytes_per_head=LATENT * 2, is_mla=True, memory_kind=pd.MemoryKind.DRAM,
    )  # fmt: skip
    ch, heads = CHANNELS // tp, SSM_HEADS // tp
    # the TP-split channel axis: first in a slot (each channel holds its kernel-1 elements), or
    # after kernel-1 rows (each row holds this rank's channels)
    outer = CONV_ROWS if c.conv_rows_first else 1
    conv = pd.StateTensor(
        "conv", bases(c.conv), lens(c.conv), ch * CONV_ROWS * 2, ch, CONV_BLOCKS, outer_rows=outer
    )
    ssm = pd.StateTensor("ssm", bases(c.ssm), lens(c.ssm), heads * SSM_DIM * 2, heads)
    mamba = pd.StatePool(pd.StateKind.MAMBA, pd.Indexing.SLOT, (conv, ssm), memory_kind=pd.MemoryKind.DRAM)
    aux = pd.AuxBuffer("output_ids", int(c.aux.ctypes.data), c.aux.nbytes, AUX_BYTES)
    return pd.RankMemory(pd.ParallelRank(tp, rank), kv, (mamba,), (aux,))


# --------------------------------------------------------------------------- content and shards


def full_content(seed: int, tokens: int) -> dict[str, np.ndarray]:
    """What the model holds for one request, unsharded (conv channel-major)."""
    rng = np.random.default_rng(seed)
    top = np.iinfo(np.uint16).max
    return {
        "latent": rng.integers(0, top, (LAYERS, tokens, 1, LATENT), dtype=np.uint16),
        "conv": rng.integers(0, top, (LAYERS, CHANNELS, CONV_ROWS), dtype=np.uint16),
        "ssm": rng.integers(0, top, (LAYERS, SSM_HEADS, SSM_DIM), dtype=np.uint16),
        "aux": rng.integers(0, 255, AUX_BYTES, dtype=np.uint8),
    }


def shard(full: dict[str, np.ndarray], tp: int, rank: int) -> dict[str, np.ndarray]:
    """What TP rank ``rank`` of ``tp`` holds, by plain slicing: the whole latent and aux item,
    its part of each of q|k|v, its heads of the temporal state."""
    blocks, start = [], 0
    for b in CONV_BLOCKS:
        per = b // tp
        blocks.append(full["conv"][:, start + rank * per : start + (rank + 1) * per])
        start += b
    s = SSM_HEADS // tp
    return {
        "latent": full["latent"],
        "conv": np.concatenate(blocks, axis=1),
        "ssm": full["ssm"][:, rank * s : (rank + 1) * s],
        "aux": full["aux"],
    }


def place(
    c: Cache, part: dict[str, np.ndarray], pages: np.ndarray, slot: int, item: int, skip: int = 0
) -> None:
    """Write a shard into ``pages`` (the request's pages from page ``skip`` on: the ones before are
    held already), ``slot`` and ``item``; the tail of the last page is zeros."""
    n = len(pages) + skip
    for layer in range(LAYERS):
        tokens = part["latent"][layer]
        padded = np.zeros((n * PAGE, *tokens.shape[1:]), np.uint16)
        padded[: len(tokens)] = tokens
        c.latent[layer][pages] = padded.reshape(n, PAGE, *tokens.shape[1:])[skip:]
        conv = part["conv"][layer]
        c.conv[layer][slot] = conv.T if c.conv_rows_first else conv
        c.ssm[layer][slot] = part["ssm"][layer]
    c.aux[item] = part["aux"]


def differences(got: Cache, want: Cache) -> list[str]:
    """Which views of ``got`` differ from ``want``, and how many bytes outside them do."""
    out, inside = [], np.zeros(got.buf.nbytes, bool)
    named = [
        (f"{name} layer {i}", getattr(got, name)[i], getattr(want, name)[i])
        for name in ("latent", "conv", "ssm")
        for i in range(LAYERS)
    ]
    for what, g, w in [*named, ("aux", got.aux, want.aux)]:
        start = int(g.ctypes.data) - int(got.buf.ctypes.data)
        inside[start : start + g.nbytes] = True
        if not np.array_equal(g, w):
            out.append(f"{what}: {int((g != w).sum())} elements differ")
    outside = int(((got.buf != want.buf) & ~inside).sum())
    if outside:
        out.append(f"{outside} bytes outside every buffer were written")
    return out


# --------------------------------------------------------------------------- the two engines


@dataclass
class Engines:
    """A prefill engine of TP ``p`` and a decode engine of TP ``d`` in this process, and what their
    workers reported (room -> status, per rank)."""

    p: int
    d: int
    prefills: list[pd.PrefillWorker]
    decoders: list[pd.DecodeWorker]
    pre: list[Cache]
    dec: list[Cache]
    want: list[Cache]  # per decode rank: what its buffer must hold (sentinel, then every room placed)
    groups: list[pd.PrefillGroup] = field(default_factory=list)
    finished: dict[tuple[int, int], tuple[pd.Status, pd.Failure | None]] = field(default_factory=dict)
    released: dict[tuple[int, int], tuple[pd.Status, pd.Failure | None]] = field(default_factory=dict)

    def pump(self, done: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
        end = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < end, f"timed out waiting for {what}"
            for w in (*self.prefills, *self.decoders):
                w.step(1)


@contextmanager
def engines(backend: str, p: int, d: int, conv_rows_first: bool) -> Iterator[Engines]:
    # every worker closes before any backend (the later stack unwinds first)
    with ExitStack() as backends, ExitStack() as workers:
        e = Engines(p, d, [], [], [], [], [])
        pre, dec, want, prefills, decoders = e.pre, e.dec, e.want, e.prefills, e.decoders
        tag = f"{p}{d}{'r' if conv_rows_first else 'c'}"
        for r in range(p):
            b = backends.enter_context(pd.create_backend(backend, agent_name=f"mla-pre{r}-{tag}"))
            buf = b.allocate("cache", cache_bytes(p, PREFILL_CAP, conv_rows_first)).array
            c = lay_out(buf, p, PREFILL_CAP, conv_rows_first)
            cfg = pd.PrefillConfig(engine_id=f"pre-{tag}", rank=pd.ParallelRank(p, r), model=MODEL)
            w = pd.PrefillWorker(
                cfg,
                describe(c, p, r),
                backend=b,
                on_released=lambda room, st, f, r=r: e.released.update({(r, room): (st, f)}),
            )
            workers.callback(w.close)
            pre.append(c)
            prefills.append(w)
        for r in range(d):
            b = backends.enter_context(pd.create_backend(backend, agent_name=f"mla-dec{r}-{tag}"))
            nbytes = cache_bytes(d, DECODE_CAP, conv_rows_first)
            buf = b.allocate("cache", nbytes).array
            buf.fill(SENTINEL)
            c = lay_out(buf, d, DECODE_CAP, conv_rows_first)
            cfg = pd.DecodeConfig(engine_id=f"dec-{tag}", rank=pd.ParallelRank(d, r), model=MODEL)
            w = pd.DecodeWorker(
                cfg,
                describe(c, d, r),
                backend=b,
                on_finished=lambda room, st, f, r=r: e.finished.update({(r, room): (st, f)}),
            )
            workers.callback(w.close)
            dec.append(c)
            decoders.append(w)
            want.append(lay_out(np.full(nbytes, SENTINEL, np.uint8), d, DECODE_CAP, conv_rows_first))
        e.groups = [w.connect([x.endpoint for x in prefills]) for w in decoders]
        e.pump(lambda: all(g.state is not pd.GroupState.CONNECTING for g in e.groups), "the handshakes")
        for g in e.groups:
            assert not g.failed, g.error
            assert g.tp_size == p
        yield e


@dataclass(frozen=True)
class Request:
    name: str
    tokens: int
    src_pages: tuple[int, ...]  # prefill's pages (every prefill rank uses the same indices)
    dst_pages: tuple[int, ...]  # decode's pages, the prefix decode already holds included
    prefix_pages: int  # pages decode already holds (decode_prefix_len = prefix_pages * PAGE)
    src_slot: int
    dst_slot: int
    src_item: int
    dst_item: int
    chunks: int  # chunked prefill: the pages in this many send_chunk calls, state and aux with the last


REQUESTS = [
    Request("mla-request-1", 7, (1, 0), (11, 8), 0, 1, 3, 2, 0, 1),  # a partial last page
    Request("mla-request-2", 13, (7, 2, 5, 3), (2, 9, 4, 10), 1, 0, 1, 0, 2, 2),  # prefix held, two chunks
]


def move(e: Engines, n: int, req: Request) -> None:
    """Fill every prefill rank's shard of request ``n``, move it, and check decode byte for byte."""
    room = pd.room_for_request(req.name)
    content = full_content(seed=n, tokens=req.tokens)
    src, dst = np.array(req.src_pages, np.int32), np.array(req.dst_pages, np.int32)
    skip = req.prefix_pages
    for r, c in enumerate(e.pre):
        place(c, shard(content, e.p, r), src, req.src_slot, req.src_item)
    for r, (w, g) in enumerate(zip(e.decoders, e.groups, strict=True)):
        indices = pd.RequestIndices(
            dst[skip:], state=[[req.dst_slot]], aux_index=req.dst_item, decode_prefix_len=skip * PAGE
        )
        w.start_room(room, indices, g)
        place(e.want[r], shard(content, e.d, r), dst[skip:], req.dst_slot, req.dst_item, skip=skip)
    cuts = np.array_split(src, req.chunks)
    for w in e.prefills:
        for i, pages in enumerate(cuts):
            if i < len(cuts) - 1:
                w.send_chunk(room, pages, last=False)
            else:
                w.send_chunk(room, pages, last=True, state=[[req.src_slot]], aux_index=req.src_item)
    e.pump(
        lambda: (
            all((r, room) in e.finished for r in range(e.d))
            and all((r, room) in e.released for r in range(e.p))
        ),
        f"{req.name} on every rank",
    )
    for side, outcomes in (("decode", e.finished), ("prefill", e.released)):
        for (r, rm), (status, failure) in outcomes.items():
            if rm == room:
                assert status is pd.Status.SUCCESS, f"{side} rank {r}: {status.name} {failure}"
    for r in range(e.d):
        bad = differences(e.dec[r], e.want[r])
        assert not bad, f"{req.name}, decode rank {r} of {e.d}: {bad}"
        assert np.array_equal(e.dec[r].buf, e.want[r].buf)


def expected_bytes_posted(p: int, d: int, r: int) -> int:
    """What prefill rank ``r`` of ``p`` writes over REQUESTS: its state shard for every request
    (every rank of a group), and the latent pages decode lacks and the aux item when it is the
    first rank of its decode rank's group."""
    shard_bytes = LAYERS * ((CHANNELS // p) * CONV_ROWS + (SSM_HEADS // p) * SSM_DIM) * 2
    total = len(REQUESTS) * shard_bytes
    if r % (p // d) == 0:
        for req in REQUESTS:
            total += LAYERS * (len(req.dst_pages) - req.prefix_pages) * PAGE * LATENT * 2 + AUX_BYTES
    return total


CASES = [(2, 1, False), (4, 2, False), (2, 2, False), (2, 1, True), (4, 2, True)]


@pytest.mark.parametrize("backend", ["local", "nixl"])
@pytest.mark.parametrize(
    ("p", "d", "conv_rows_first"),
    CASES,
    ids=[f"P{p}-D{d}-conv-{'rows' if rows else 'channels'}-first" for p, d, rows in CASES],
)
def test_mla_with_sharded_mamba_state_moves_byte_for_byte(
    backend: str, p: int, d: int, conv_rows_first: bool
) -> None:
    if backend not in pd.available_backends():
        pytest.fail(f"backend {backend} does not import here: CI must install it (./dev setup)")
    with engines(backend, p, d, conv_rows_first) as e:
        for n, req in enumerate(REQUESTS):
            move(e, n, req)
        posted = [w.stats.bytes_posted for w in e.prefills]
        # every prefill rank wrote: the first of each group latent, state shard and aux, the
        # others exactly their state shard (none of them is a dummy)
        assert posted == [expected_bytes_posted(p, d, r) for r in range(p)]
        assert all(w.stats.posts >= 1 for w in e.prefills)
        for side, workers in (("prefill", e.prefills), ("decode", e.decoders)):
            for r, w in enumerate(workers):
                assert w.stats.rooms_ok == len(REQUESTS) and w.stats.rooms_failed == 0, (side, r)
                assert len(w.stats.failures) == 0, f"{side} rank {r}: {list(w.stats.failures)}"
