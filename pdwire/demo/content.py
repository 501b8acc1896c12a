"""Deterministic cache content for the demo, and byte-for-byte verification of it.

For each room there is one "full" (unsharded) tensor per cache tensor, generated from
``(seed, room)`` alone. A prefill rank writes its TP shard of it into the room's source
pages/slots; a decode rank derives the shard it must hold from the same full tensor with
plain torch slicing (independently of the planner), compares its destination slots byte
for byte, and then resets them to the sentinel so that, at the end, every byte of its
pools must be the sentinel again: a write outside a destination slot cannot hide.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pdwire.demo.model import Capacity, ModelSpec, RankCaches, tensor_shapes
from pdwire.demo.spec import pages_for as pages_for  # re-exported: callers import it from here
from pdwire.runtime.engine import RequestIndices
from pdwire.runtime.planner import StateKind, heads_held

SENTINEL = 0x5A5A  # int16 fill of every decode pool byte that no finished room owns
I32 = npt.NDArray[np.int32]
_HND = ("kv.k", "kv.v", "swa.k", "swa.v")


@dataclass(frozen=True, slots=True)
class RoomSlots:
    """Where one room lives on one rank: KV pages, Mamba slot, SWA pages, aux item."""

    pages: I32
    slot: int
    swa_pages: I32
    aux: int

    def indices(self, name: str) -> I32:
        if name.startswith(("kv.", "dsa.")):
            return self.pages
        if name.startswith("swa."):
            return self.swa_pages
        if name.startswith("mamba."):
            return np.asarray([self.slot], dtype=np.int32)
        return np.asarray([self.aux], dtype=np.int32)

    def request(self, spec: ModelSpec) -> RequestIndices:
        """These slots as a decode request's destination."""
        return RequestIndices(self.pages, self.state_indices(spec), self.aux)

    def state_indices(self, spec: ModelSpec) -> list[I32]:
        """Per-component index lists in component order (what a TransferRequest carries)."""
        by_kind = {
            StateKind.MAMBA: np.asarray([self.slot], dtype=np.int32),
            StateKind.SWA: self.swa_pages,
            StateKind.DSA: self.pages,  # the DSA indexer uses the KV page ids
        }
        return [by_kind[k] for k in spec.component_kinds()]


def full_tensors(spec: ModelSpec, seed: int, room: int, tokens: int) -> dict[str, torch.Tensor]:
    """The unsharded content of every cache tensor for one room, layers first, tokens (for a
    page-indexed tensor) second: the pool shapes of TP 1 holding just this room."""
    pages, swa_pages = pages_for(spec, tokens)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, (pool, layers) in tensor_shapes(spec, 1, 0, Capacity(pages, 1, swa_pages, 1)).items():
        if name in _HND:  # [pages, heads, page_size, dim] -> [tokens, heads, dim]
            shapes[name] = (layers, pool[0] * pool[2], pool[1], pool[3])
        elif name.startswith(("kv.", "swa.", "dsa.")):  # [pages, page_size, ...] -> [tokens, ...]
            shapes[name] = (layers, pool[0] * pool[1], *pool[2:])
        else:  # one slot or aux item
            shapes[name] = (layers, *pool[1:])
    g = torch.Generator().manual_seed((seed * 1_000_003 + room) % (1 << 63))
    return {
        k: torch.randint(-(1 << 15), 1 << 15, s, dtype=torch.int16, generator=g) for k, s in shapes.items()
    }


def shard(spec: ModelSpec, name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The part of ``full`` that TP rank ``rank`` of ``tp`` holds (plain slicing, no planner)."""
    if spec.mla or name == "aux":
        return full  # MLA latent, SWA latent, DSA indexer and aux are replicated
    if name in _HND:
        lo, hi = heads_held(tp, rank, spec.kv_heads)
        return full[:, :, lo:hi]
    if name == "mamba.temporal":
        per = spec.ssm_heads // tp
        return full[:, rank * per : (rank + 1) * per]
    if name == "mamba.conv":
        parts, offset = [], 0
        for block in spec.conv_blocks:  # q|k|v: each sub-block is sharded on its own
            per = block // tp
            parts.append(full[:, offset + rank * per : offset + (rank + 1) * per])
            offset += block
        return torch.cat(parts, dim=1)
    raise KeyError(name)


def _rows(idx: I32) -> torch.Tensor:
    """Slot/page ids as a torch index."""
    return torch.from_numpy(idx.astype(np.int64))


def _first(bad: torch.Tensor) -> tuple[int, ...]:
    """Position of the first True element of a mask."""
    return tuple(int(i) for i in bad.nonzero()[0])


def _placed(name: str, view: torch.Tensor, idx: I32, part: torch.Tensor) -> torch.Tensor:
    """One layer's shard ``part`` (tokens first) arranged as the pages/slots of ``view``."""
    if name in _HND:  # [tokens, heads, dim] -> pages of [heads, page_size, dim]
        _, heads, page, dim = view.shape
        return part.reshape(len(idx), page, heads, dim).permute(0, 2, 1, 3)
    return part.reshape((len(idx), *view.shape[1:]))


def _expected(
    caches: RankCaches, slots: RoomSlots, full: dict[str, torch.Tensor]
) -> Iterator[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per cache tensor and layer: (name, layer, view, the room's rows in it, this rank's shard of
    the room's content placed as those rows)."""
    for name, per_layer in caches.tensors.items():
        idx_np = slots.indices(name)
        idx = _rows(idx_np)
        part = shard(caches.spec, name, full[name], caches.tp, caches.rank)
        for layer, view in enumerate(per_layer):
            yield name, layer, view, idx, _placed(name, view, idx_np, part[layer])


def fill(caches: RankCaches, slots: RoomSlots, full: dict[str, torch.Tensor]) -> None:
    """Write this rank's shard of one room's content into its slots (the prefill side)."""
    for _, _, view, idx, want in _expected(caches, slots, full):
        view[idx] = want


def verify(caches: RankCaches, slots: RoomSlots, full: dict[str, torch.Tensor]) -> list[str]:
    """Compare one room's destination slots with the expected shard; one line per mismatch."""
    problems = []
    for name, layer, view, idx, want in _expected(caches, slots, full):
        got = view[idx]
        bad = got != want
        if bool(bad.any()):
            where = _first(bad)
            problems.append(
                f"{name} layer {layer}: {int(bad.sum())} of {bad.numel()} elements differ "
                f"(first at {where}: got {int(got[where])}, want {int(want[where])})"
            )
    return problems


def reset(caches: RankCaches, slots: RoomSlots) -> None:
    """Give a room's slots back to the sentinel (a verified room's pages are free again)."""
    for name, per_layer in caches.tensors.items():
        idx = _rows(slots.indices(name))
        for view in per_layer:
            view[idx] = SENTINEL


def fill_sentinel(caches: RankCaches) -> None:
    for per_layer in caches.tensors.values():
        for view in per_layer:
            view.fill_(SENTINEL)


def untouched_problems(caches: RankCaches) -> list[str]:
    """Every pool byte must be the sentinel once all rooms are verified and reset."""
    out = []
    for name, per_layer in caches.tensors.items():
        for layer, view in enumerate(per_layer):
            bad = view != SENTINEL
            if bool(bad.any()):
                out.append(
                    f"{name} layer {layer}: {int(bad.sum())} elements written outside any room "
                    f"(first {_first(bad)})"
                )
    return out
