"""The demo's hybrid model as one rank's memory: its caches (:mod:`.model`), a slot pool, its
deterministic content and byte-for-byte verification (:mod:`.content`).

The demo's rank processes (:mod:`.rank`) hold it, and ``pdwire serve`` runs it as memory model
``demo`` (:class:`~pdwire.serve.memory.ServeMemory`): a room's content is a function of
``(seed, room, tokens)``, so prefill writes its TP shard and decode checks its shard on arrival.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdwire import wire
from pdwire.demo.content import RoomSlots, fill, fill_sentinel, full_tensors, pages_for, reset, verify
from pdwire.demo.model import Capacity, ModelSpec, RankCaches, build_caches, bytes_needed
from pdwire.runtime import engine as pd
from pdwire.serve.config import MemorySettings


def model_fingerprint(spec: ModelSpec) -> wire.ModelFingerprint:
    return wire.ModelFingerprint(
        model_name="pdwire-demo-hybrid-mla" if spec.mla else "pdwire-demo-hybrid",
        revision=spec.fingerprint().hex(),
        dtype="int16",
        num_layers=spec.layers,
        num_attention_layers=spec.layers,
        num_state_layers=spec.mamba_layers,
    )


class SlotPool:
    """Free pages/slots of one rank; random picks, so rooms are scattered through the pools."""

    def __init__(self, cap: Capacity, seed: int) -> None:
        self.pages = list(range(cap.pages))
        self.slots = list(range(1, cap.slots))  # slot 0 is the dummy Mamba slot
        self.swa = list(range(cap.swa_pages))
        self.aux = list(range(cap.aux_items))
        self.rng = np.random.default_rng(seed)

    def _take(self, free: list[int], n: int, what: str) -> list[int]:
        if n > len(free):
            raise MemoryError(f"out of {what}: need {n}, {len(free)} free")
        picks = sorted(self.rng.choice(len(free), size=n, replace=False).tolist(), reverse=True)
        return [free.pop(i) for i in picks]

    def take(self, spec: ModelSpec, tokens: int) -> RoomSlots:
        pages, swa = pages_for(spec, tokens)
        if pages > len(self.pages) or swa > len(self.swa) or not self.slots or not self.aux:
            raise MemoryError(
                f"out of memory for {tokens} tokens: {len(self.pages)} KV pages, {len(self.slots)} Mamba "
                f"slots, {len(self.swa)} SWA pages, {len(self.aux)} aux items free"
            )
        return RoomSlots(
            np.asarray(self._take(self.pages, pages, "KV pages"), dtype=np.int32),
            self._take(self.slots, 1, "Mamba slots")[0],
            np.asarray(self._take(self.swa, swa, "SWA pages"), dtype=np.int32),
            self._take(self.aux, 1, "aux items")[0],
        )

    def give(self, s: RoomSlots) -> None:
        self.pages += s.pages.tolist()
        self.slots.append(s.slot)
        self.swa += s.swa_pages.tolist()
        self.aux.append(s.aux)


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
    """The demo model of one shape, its pools of one capacity, its content of one seed."""

    def __init__(self, spec: ModelSpec, capacity: Capacity, seed: int) -> None:
        self.spec = spec
        self.capacity = capacity
        self.seed = seed

    @classmethod
    def of(cls, m: MemorySettings) -> DemoServeMemory:
        """The model a serve config's ``memory`` settings describe."""
        spec = ModelSpec(
            layers=m.layers, kv_heads=m.kv_heads, head_dim=m.head_dim, page_size=m.page_size, mla=m.mla
        )
        return cls(spec, Capacity(m.pages, m.slots, m.swa_pages, m.aux_items), m.seed)

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
        return full_tensors(self.spec, self.seed, room, tokens)
