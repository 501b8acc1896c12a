"""The demo's hybrid model as a ``pdwire serve`` memory model (``memory: {model: demo}``).

:class:`DemoServeMemory` implements :class:`~pdwire.serve.memory.ServeMemory` with the
demo's caches (:mod:`.model`), its deterministic content and byte-for-byte verification
(:mod:`.content`); ``pdwire serve`` registers it as ``demo``. For each room the content of
every cache tensor is a deterministic function of ``(seed, room, tokens)``: prefill writes its
TP shard into source slots, decode checks its shard on arrival.
"""

from __future__ import annotations

from typing import Any

from pdwire import wire
from pdwire.demo.content import (
    RoomSlots,
    fill,
    fill_sentinel,
    full_tensors,
    pages_for,
    reset,
    verify,
)
from pdwire.demo.model import Capacity, ModelSpec, RankCaches, build_caches, bytes_needed
from pdwire.demo.rank import SlotPool, model_fingerprint
from pdwire.runtime import engine as pd
from pdwire.serve.config import MemorySettings


def spec_of(m: MemorySettings) -> ModelSpec:
    return ModelSpec(
        layers=m.layers, kv_heads=m.kv_heads, head_dim=m.head_dim, page_size=m.page_size, mla=m.mla
    )


def capacity_of(m: MemorySettings) -> Capacity:
    return Capacity(pages=m.pages, slots=m.slots, swa_pages=m.swa_pages, aux_items=m.aux_items)


class DemoServeRank:
    """One rank: the demo's caches carved out of backend memory, and its slot pool."""

    def __init__(self, caches: RankCaches, pool: SlotPool) -> None:
        self.caches = caches
        self.pool = pool

    @property
    def memory(self) -> pd.RankMemory:
        return self.caches.memory

    def take(self, tokens: int) -> RoomSlots:
        return self.pool.take(self.caches.spec, tokens)

    def give(self, lease: RoomSlots) -> None:
        self.pool.give(lease)

    def request(self, lease: RoomSlots) -> pd.RequestIndices:
        return lease.request(self.caches.spec)

    def fill(self, lease: RoomSlots, content: Any) -> None:
        fill(self.caches, lease, content)

    def verify(self, lease: RoomSlots, content: Any) -> list[str]:
        return verify(self.caches, lease, content)

    def clear(self, lease: RoomSlots) -> None:
        reset(self.caches, lease)

    def prepare(self) -> None:
        fill_sentinel(self.caches)


class DemoServeMemory:
    """The demo model, shaped by the serve config's ``memory`` settings."""

    def __init__(self, settings: MemorySettings) -> None:
        self.settings = settings
        self.spec = spec_of(settings)
        self.capacity = capacity_of(settings)

    @property
    def fingerprint(self) -> wire.ModelFingerprint:
        return model_fingerprint(self.spec)

    def check_tp(self, tp: int) -> None:
        self.spec.check_tp(tp)

    def pages_needed(self, tokens: int) -> int:
        return pages_for(self.spec, tokens)[0]

    def open_rank(self, tp: int, tp_rank: int, backend: pd.Backend, seed: int) -> DemoServeRank:
        import torch

        # one loop drives every rank of the process: intra-op threads would only spin against it
        torch.set_num_threads(1)
        buf = backend.allocate("caches", bytes_needed(self.spec, tp, tp_rank, self.capacity))
        caches = build_caches(self.spec, tp, tp_rank, self.capacity, buf.array)
        return DemoServeRank(caches, SlotPool(self.capacity, seed))

    def content(self, room: int, tokens: int) -> Any:
        return full_tensors(self.spec, self.settings.seed, room, tokens)
