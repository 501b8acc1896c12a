"""The request benchmark's hybrid model in real memory: layout, content, verification.

The model is the planner benchmark's (``benchmarks/planner.py``; :class:`Model`'s defaults). Here
every rank's pools are real host memory sized to the request (plus a little slack, so that
untouched pages exist), carved out of one buffer the transfer backend allocated, in the planner's
region order.

Content: every cache tensor has one *full* (unsharded) logical value per layer, defined by a
splitmix64 hash of each 8-byte word's position XOR a per-(tensor, layer) constant. Each rank's
shard is cut from that full value with numpy slicing (heads, q|k|v sub-blocks, temporal heads),
never with the planner, so decode's expected bytes do not depend on the code under test. A word
written to the wrong place, layer, tensor or side shows as a mismatch; every byte of a decode
rank outside the request's destination items must still hold the sentinel written before the
run.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from pdwire.runtime.descriptors import MemoryKind
from pdwire.runtime.planner import (
    AuxBuffer,
    HeadGeometry,
    Indexing,
    KvPool,
    Layout,
    ParallelRank,
    RankMemory,
    StateKind,
    StatePool,
    StateTensor,
    heads_held,
)

U64 = npt.NDArray[np.uint64]
I32 = npt.NDArray[np.int32]
SENTINEL = np.uint64(0xA5A5A5A5A5A5A5A5)  # every decode byte before a run
ALIGN = 4096  # each buffer starts on its own page


@dataclass(frozen=True, slots=True)
class Model:
    page: int = 64
    layers: int = 64
    heads: int = 8
    head_bytes: int = 256
    mamba_layers: int = 48
    conv_blocks: tuple[int, ...] = (2048, 2048, 4096)
    conv_unit: int = 6  # bytes per conv channel: 3 taps of bf16
    temporal_heads: int = 32
    temporal_unit: int = 128 * 128 * 4  # bytes per temporal head
    swa_layers: int = 16
    swa_window: int = 4096  # tokens
    dsa_layers: int = 64
    dsa_token_bytes: int = 132
    aux_item: int = 4096

    @classmethod
    def small(cls) -> Model:
        """A few layers of the same shapes: for --quick (CI keeps the script running)."""
        return cls(
            layers=4, mamba_layers=2, conv_blocks=(64, 64, 128), temporal_heads=8,
            temporal_unit=1024, swa_layers=2, swa_window=256, dsa_layers=2,
        )  # fmt: skip

    def scaled(self, layers: int) -> Model:
        """The same model with ``layers`` KV (and DSA) layers and the state layers in proportion."""
        f = layers / self.layers
        return replace(
            self, layers=layers, dsa_layers=max(1, round(self.dsa_layers * f)),
            mamba_layers=max(1, round(self.mamba_layers * f)), swa_layers=max(1, round(self.swa_layers * f)),
        )  # fmt: skip

    @property
    def conv_channels(self) -> int:
        return sum(self.conv_blocks)


@dataclass(frozen=True, slots=True)
class Pools:
    """How many items each pool of a rank holds."""

    pages: int
    swa_pages: int
    slots: int = 4
    aux_items: int = 8


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request lives on one side (the same on every rank of that side, as in SGLang)."""

    pages: I32  # KV and DSA page ids
    swa_pages: I32
    slot: int
    aux: int

    def state(self) -> list[I32]:
        """Per-component indices in component order: Mamba slot, SWA pages, DSA pages."""
        return [np.asarray([self.slot], np.int32), self.swa_pages, self.pages]


def request_pages(model: Model, tokens: int) -> tuple[int, int]:
    """(KV pages, SWA pages) of a prompt of ``tokens`` tokens (a multiple of the page size)."""
    if tokens % model.page:
        raise ValueError(f"{tokens} tokens is not a multiple of the page size {model.page}")
    pages = tokens // model.page
    return pages, min(pages, model.swa_window // model.page)


def pools_for(model: Model, tokens: int) -> Pools:
    pages, swa = request_pages(model, tokens)
    return Pools(pages + max(8, pages // 32), swa + 8)


def fragmented(rng: np.random.Generator, count: int, pool: int) -> I32:
    """``count`` distinct page ids of a pool of ``pool``: runs of 1-8 consecutive pages in random order
    (a free list after some churn)."""
    runs, start = [], 0
    while start < pool:
        n = min(int(rng.integers(1, 9)), pool - start)
        runs.append(np.arange(start, start + n))
        start += n
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order])[:count].astype(np.int32)


def placement(model: Model, tokens: int, pools: Pools, seed: int, slot: int, aux: int) -> Placement:
    rng = np.random.default_rng(seed)
    pages, swa = request_pages(model, tokens)
    return Placement(fragmented(rng, pages, pools.pages), fragmented(rng, swa, pools.swa_pages), slot, aux)


# --------------------------------------------------------------------------- one rank's memory


@dataclass(frozen=True, slots=True)
class Buffer:
    """One registered buffer: one layer of one tensor (offset into the rank's allocation)."""

    tensor: str  # kv.k kv.v conv temporal swa.k swa.v dsa aux
    layer: int
    offset: int
    items: int
    item_bytes: int

    @property
    def nbytes(self) -> int:
        return self.items * self.item_bytes


class RankLayout:
    """One rank's pools of the model, carved out of one allocation, in the planner's region order."""

    def __init__(self, model: Model, tp: int, rank: int, layout: Layout, pools: Pools) -> None:
        self.model, self.tp, self.rank, self.layout, self.pools = model, tp, rank, layout, pools
        m = model
        self.heads = heads_held(tp, rank, m.heads)
        h = self.heads[1] - self.heads[0]
        self.kv_item = m.page * h * m.head_bytes
        self.conv_axis = m.conv_channels // tp
        self.temporal_axis = m.temporal_heads // tp
        self.dsa_item = m.page * m.dsa_token_bytes
        specs = [  # tensor, layers, items, item bytes
            ("kv.k", m.layers, pools.pages, self.kv_item),
            ("kv.v", m.layers, pools.pages, self.kv_item),
            ("conv", m.mamba_layers, pools.slots, self.conv_axis * m.conv_unit),
            ("temporal", m.mamba_layers, pools.slots, self.temporal_axis * m.temporal_unit),
            ("swa.k", m.swa_layers, pools.swa_pages, self.kv_item),
            ("swa.v", m.swa_layers, pools.swa_pages, self.kv_item),
            ("dsa", m.dsa_layers, pools.pages, self.dsa_item),
            ("aux", 1, pools.aux_items, m.aux_item),
        ]
        self.buffers: list[Buffer] = []
        offset = 0
        for tensor, layers, items, item in specs:
            if item % 8:
                raise ValueError(f"{tensor}: item of {item} bytes is not a multiple of 8")
            for layer in range(layers):
                self.buffers.append(Buffer(tensor, layer, offset, items, item))
                offset += -(-(items * item) // ALIGN) * ALIGN
        self.nbytes = offset

    def of(self, tensor: str) -> list[Buffer]:
        return [b for b in self.buffers if b.tensor == tensor]

    def memory(self, base: int) -> RankMemory:
        """The planner's description of this rank with the allocation at ``base``."""
        m, dram = self.model, MemoryKind.DRAM
        h = self.heads[1] - self.heads[0]

        def bases(tensor: str) -> tuple[int, ...]:
            return tuple(base + b.offset for b in self.of(tensor))

        def lens(tensor: str) -> tuple[int, ...]:
            return tuple(b.nbytes for b in self.of(tensor))

        def tensor(name: str, key: str, item: int, axis: int | None = None, blocks=None) -> StateTensor:  # type: ignore[no-untyped-def]
            return StateTensor(name, bases(key), lens(key), item, axis, blocks)

        kv = KvPool(
            bases("kv.k"), bases("kv.v"), lens("kv.k"), self.kv_item, m.page, self.layout, h, m.heads,
            m.head_bytes, memory_kind=dram,
        )  # fmt: skip
        mamba = StatePool(
            StateKind.MAMBA, Indexing.SLOT,
            (
                tensor("conv", "conv", self.conv_axis * m.conv_unit, self.conv_axis, m.conv_blocks),
                tensor("temporal", "temporal", self.temporal_axis * m.temporal_unit, self.temporal_axis),
            ),
            memory_kind=dram,
        )  # fmt: skip
        swa = StatePool(
            StateKind.SWA, Indexing.PAGE,
            (tensor("k", "swa.k", self.kv_item), tensor("v", "swa.v", self.kv_item)),
            heads=HeadGeometry(m.page, self.layout, h, m.heads, m.head_bytes), memory_kind=dram,
        )  # fmt: skip
        dsa = StatePool(
            StateKind.DSA, Indexing.PAGE, (tensor("indexer", "dsa", self.dsa_item),), replicated=True,
            memory_kind=dram,
        )  # fmt: skip
        (aux,) = self.of("aux")
        out = AuxBuffer("output", base + aux.offset, aux.nbytes, m.aux_item)
        return RankMemory(ParallelRank(self.tp, self.rank), kv, (mamba, swa, dsa), (out,))


# --------------------------------------------------------------------------- content


def splitmix(n: int, seed: int) -> U64:
    """``n`` hashed words: splitmix64 of ``seed + i`` (wrapping uint64 arithmetic)."""
    z = (np.arange(n, dtype=np.uint64) + np.uint64(seed & (2**64 - 1))) * np.uint64(0x9E3779B97F4A7C15)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


class Content:
    """The full (unsharded) content of one request, per tensor and layer (see the module notes)."""

    def __init__(self, model: Model, tokens: int, seed: int = 1) -> None:
        self.model, self.tokens, self.seed = model, tokens, seed
        m = model
        self.pages, self.swa_pages = request_pages(m, tokens)
        words = m.head_bytes // 8
        # token-major full KV of one layer: [tokens, heads, words]; SWA covers the window's last tokens
        self._kv = splitmix(tokens * m.heads * words, seed * 7 + 1).reshape(tokens, m.heads, words)
        swa_tokens = self.swa_pages * m.page
        self._swa = splitmix(swa_tokens * m.heads * words, seed * 7 + 2).reshape(swa_tokens, m.heads, words)
        self._dsa = splitmix(tokens * m.dsa_token_bytes // 8, seed * 7 + 3)
        self._conv = splitmix(m.conv_channels * m.conv_unit // 8, seed * 7 + 4)
        self._temporal = splitmix(m.temporal_heads * m.temporal_unit // 8, seed * 7 + 5)
        self._aux = splitmix(m.aux_item // 8, seed * 7 + 6)

    def const(self, tensor: str, layer: int) -> np.uint64:
        return np.uint64(int(splitmix(1, (zlib.crc32(tensor.encode()) << 20) + layer + self.seed)[0]))

    def items(self, lay: RankLayout, buf: Buffer) -> U64:
        """This rank's shard of the request's content of ``buf``, as items ``[n, item_bytes / 8]``
        in request order (pages, SWA pages, the slot, the aux item)."""
        m, c = self.model, self.const(buf.tensor, buf.layer)
        lo, hi = lay.heads
        if buf.tensor in ("kv.k", "kv.v", "swa.k", "swa.v"):
            full = self._kv if buf.tensor.startswith("kv") else self._swa
            pages = len(full) // m.page
            shard = full[:, lo:hi].reshape(pages, m.page, hi - lo, -1)
            if lay.layout is Layout.HND:
                shard = shard.transpose(0, 2, 1, 3)
            return (shard ^ c).reshape(pages, -1)
        if buf.tensor == "dsa":
            return (self._dsa ^ c).reshape(self.pages, -1)
        if buf.tensor == "conv":
            channels = (self._conv ^ c).view(np.uint8).reshape(m.conv_channels, m.conv_unit)
            parts, offset = [], 0
            for block in m.conv_blocks:  # q|k|v: each sub-block sharded on its own
                per = block // lay.tp
                parts.append(channels[offset + lay.rank * per : offset + (lay.rank + 1) * per])
                offset += block
            return np.concatenate(parts).reshape(-1).view(np.uint64).reshape(1, -1)
        if buf.tensor == "temporal":
            heads = (self._temporal ^ c).reshape(m.temporal_heads, -1)
            per = lay.temporal_axis
            return np.ascontiguousarray(heads[lay.rank * per : (lay.rank + 1) * per]).reshape(1, -1)
        assert buf.tensor == "aux"
        return (self._aux ^ c).reshape(1, -1)


def indices_of(tensor: str, where: Placement) -> I32:
    if tensor in ("kv.k", "kv.v", "dsa"):
        return where.pages
    if tensor in ("swa.k", "swa.v"):
        return where.swa_pages
    if tensor == "aux":
        return np.asarray([where.aux], np.int32)
    return np.asarray([where.slot], np.int32)


def _items_view(arena: npt.NDArray[np.uint8], buf: Buffer) -> U64:
    return arena[buf.offset : buf.offset + buf.nbytes].view(np.uint64).reshape(buf.items, -1)


def fill(lay: RankLayout, arena: npt.NDArray[np.uint8], content: Content, where: Placement) -> None:
    """Write this (prefill) rank's shard of the request into its source items."""
    for buf in lay.buffers:
        _items_view(arena, buf)[indices_of(buf.tensor, where)] = content.items(lay, buf)


def reset(arena: npt.NDArray[np.uint8]) -> None:
    """Every byte of a decode rank back to the sentinel (before each run)."""
    arena.view(np.uint64)[:] = SENTINEL


def verify(
    lay: RankLayout, arena: npt.NDArray[np.uint8], content: Content, where: Placement
) -> tuple[int, list[str]]:
    """Every destination item of this (decode) rank equals its expected shard and every other item
    of every pool still holds the sentinel; returns (bytes checked, one line per mismatch)."""
    problems: list[str] = []
    checked = 0
    for buf in lay.buffers:
        view = _items_view(arena, buf)
        idx = indices_of(buf.tensor, where)
        want = content.items(lay, buf)
        got = view[idx]
        bad = got != want
        if bad.any():
            item, word = (int(x) for x in np.argwhere(bad)[0])
            problems.append(
                f"{buf.tensor} layer {buf.layer}: {int(bad.sum())} of {bad.size} words differ "
                f"(first: item {int(idx[item])} word {word}: got {int(got[item, word]):#x}, "
                f"want {int(want[item, word]):#x})"
            )
        rest = np.ones(buf.items, bool)
        rest[idx] = False
        stray = view[rest] != SENTINEL
        if stray.any():
            problems.append(
                f"{buf.tensor} layer {buf.layer}: {int(stray.sum())} words written outside the request"
            )
        checked += buf.nbytes
    return checked, problems


def request_bytes(lay: RankLayout, where: Placement) -> Iterator[tuple[str, int]]:
    """(tensor, bytes) this decode rank receives for one request."""
    for buf in lay.buffers:
        yield buf.tensor, len(indices_of(buf.tensor, where)) * buf.item_bytes
