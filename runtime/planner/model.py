"""Plain, frozen descriptions of one rank's transfer memory, shared by both sides.

The prefill rank describes its own pools with these types; the decode rank's registration
(``RegisterInfo`` on the wire) maps onto the very same types, field for field, so the planner
never has to know which side a geometry came from. Addresses are Python ints (absolute virtual
addresses, up to 2**64 - 1); nothing here computes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pdwire.runtime.descriptors import MemoryKind


class Layout(StrEnum):
    """Byte order of one KV page of one layer."""

    NHD = "NHD"  # token-major: page = [page_size][heads][bytes_per_head]
    HND = "HND"  # head-major inside the page: page = [heads][page_size][bytes_per_head]


class StateKind(StrEnum):
    """What a state component is. Components are matched by position and must agree in kind."""

    MAMBA = "mamba"
    SWA = "swa"
    DSA = "dsa"
    NSA = "nsa"


class Indexing(StrEnum):
    """How a request addresses a state component."""

    SLOT = "slot"  # exactly one index per side (a Mamba slot)
    PAGE = "page"  # a list of page ids, one per page, equal lengths on both sides


@dataclass(frozen=True, slots=True)
class RankPosition:
    """Where a rank sits in its TP x PP grid and which layers it holds."""

    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    first_layer: int = 0  # global id of the first KV layer this rank holds


@dataclass(frozen=True, slots=True)
class KvPool:
    """The paged KV cache of one rank: per held layer one K and one V buffer (MLA: one latent).

    ``bytes_per_head`` is per token and head; for MLA it is the latent bytes per token and the head
    fields describe the single replicated latent (``kv_heads_per_rank == total_kv_heads == 1``).
    ``region_lens[l]`` is the registered length of layer l's K buffer and of its V buffer.
    """

    k_base_addrs: tuple[int, ...]
    v_base_addrs: tuple[int, ...]  # () for MLA
    region_lens: tuple[int, ...]
    bytes_per_page: int
    page_size: int
    layout: Layout
    kv_heads_per_rank: int
    total_kv_heads: int
    bytes_per_head: int
    is_mla: bool = False
    memory_kind: MemoryKind = MemoryKind.VRAM
    device_id: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.k_base_addrs)


@dataclass(frozen=True, slots=True)
class HeadGeometry:
    """Head sharding of a paged component laid out like KV (non-MLA SWA K and V)."""

    page_size: int
    layout: Layout
    kv_heads_per_rank: int
    total_kv_heads: int
    bytes_per_head: int


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One tensor of a state component: per layer one buffer of equal-sized slots or pages.

    ``sharded_axis_size`` is this rank's size of the TP-sharded axis (the first per-slot axis, so a
    rank's share of a slot is ``bytes_per_slot`` split evenly along it). ``sub_block_sizes`` are the
    FULL (unsharded) sizes of independently sharded sub-blocks concatenated on that axis, e.g. the
    ``[q, k, v]`` conv channels of GDN; None means one block. Both None on a sharded tensor means the
    sharding is unknown, which is refused when TP sizes differ.
    """

    name: str
    base_addrs: tuple[int, ...]
    region_lens: tuple[int, ...]
    bytes_per_slot: int
    sharded_axis_size: int | None = None
    sub_block_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class StateComponent:
    """One hybrid-state component (Mamba, SWA, DSA, ...), matched by position across sides.

    Sharding across TP is one of: ``replicated`` (every rank holds identical bytes: MLA SWA, DSA
    indexer), ``heads`` (paged K/V-like tensors sliced by KV head, non-MLA SWA), or per tensor
    ``sharded_axis_size`` (Mamba). ``layer_ids`` are the global layer ids of the per-layer entries;
    None means ``0 .. n-1``. A PP stage must pass them so that it lands on the right decode layers.
    """

    kind: StateKind
    indexing: Indexing
    tensors: tuple[StateTensor, ...]
    replicated: bool = False
    heads: HeadGeometry | None = None
    layer_ids: tuple[int, ...] | None = None
    memory_kind: MemoryKind = MemoryKind.VRAM
    device_id: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.tensors[0].base_addrs) if self.tensors else 0

    def global_layer_ids(self) -> tuple[int, ...]:
        return self.layer_ids if self.layer_ids is not None else tuple(range(self.num_layers))


@dataclass(frozen=True, slots=True)
class AuxBuffer:
    """A host-memory buffer of per-request items (output ids, logprobs, ...), one item per request."""

    name: str
    base_addr: int
    region_len: int
    bytes_per_item: int


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Everything one rank registers for transfers. Decode's registration maps onto this type."""

    position: RankPosition
    kv: KvPool | None = None
    state: tuple[StateComponent, ...] = field(default=())
    aux: tuple[AuxBuffer, ...] = field(default=())
