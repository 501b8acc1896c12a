"""Plain, frozen descriptions of one rank's transfer memory, shared by both sides.

The prefill rank describes its own pools with these types; the decode rank's registration
(``RegisterInfo`` on the wire) maps onto the very same types, field for field, so the planner
never has to know which side a geometry came from. Addresses are Python ints (absolute virtual
addresses, up to 2**64 - 1); nothing here computes anything.

Every buffer (one KV layer's K or V, one state tensor-layer, one aux buffer) is a registered
extent ``[base, base + region_len)`` holding items (pages, slots or rows) at a fixed stride:
item ``i`` of a tensor occupies ``[base + offset + i * stride, + item_bytes)``. The stride
defaults to the item size and the offset to 0, which is a packed array of items. A stride larger
than the item and an offset inside it describe engines that put several tensors into one page
or slot (vLLM: K and V interleaved per block, a Mamba layer's conv and SSM state in one page).

Buffers whose extents overlap are one registration (``regions`` registers it once): several
components, groups or tensors may address the same memory, as vLLM's KV cache groups do. Within
one request no two destination items may overlap (``PeerPlan.check_request`` refuses them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pdwire.runtime.config import ParallelRank
from pdwire.runtime.descriptors import MemoryKind


class Layout(StrEnum):
    """Byte order of one KV page of one layer."""

    NHD = "NHD"  # token-major: page = [page_size][heads][bytes_per_head]
    HND = "HND"  # head-major inside the page: page = [heads][page_size][bytes_per_head]


class StateKind(StrEnum):
    """What a state component is. Components are matched by position and must agree in kind.

    The kind is a label both sides must agree on; how a component is addressed and split is its
    ``Indexing`` and sharding, never inferred from the kind. The values are SGLang 0.5.23's
    ``StateType`` values (plus ``nsa``, its earlier name of ``dsa``). ``dsa_tail`` is known so
    that it can be refused by name: its request indices are a ring row plus two live segments of
    it whose ring sizes may differ per side, not a list of items (``UNPLANNABLE_KINDS``).
    """

    MAMBA = "mamba"
    SWA = "swa"
    DSA = "dsa"
    NSA = "nsa"
    QSA_PENDING = "qsa_pending"
    QSA_COMPRESSED = "qsa_compressed"
    DSA_TAIL = "dsa_tail"
    MINIMAX_INDEX_K = "minimax_index_k"
    MINIMAX_DENSE_KV = "minimax_dense_kv"
    SWA_RING = "swa_ring"
    C128_STATE = "c128_state"
    REQUEST_ROW = "request_row"
    BLOCK_SCALE = "block_scale"
    BLOCK_SCALE_SWA = "block_scale_swa"


# Kinds whose request indices are not items of a tensor (slot, page or row): refused, never planned.
UNPLANNABLE_KINDS: dict[StateKind, str] = {
    StateKind.DSA_TAIL: (
        "its request indices are (row, ring offset, count, ring offset, count, ring size) "
        "tuples addressing live segments of a ring whose size may differ per side, not items"
    ),
}


class Indexing(StrEnum):
    """How a request addresses a state component.

    All three name whole items by index and are matched position by position; they differ in what
    an index means and how many a request gives.
    """

    SLOT = "slot"  # exactly one index per side (a Mamba slot)
    PAGE = "page"  # a list of page ids, one per page, equal lengths on both sides
    ROW = "row"  # a list of rows (ring rows, request rows), matched by position, equal lengths


@dataclass(frozen=True, slots=True)
class KvPool:
    """The paged KV cache of one rank: per held layer one K and one V buffer (MLA: one latent).

    ``bytes_per_head`` is per token and head; for MLA it is the latent bytes per token and the head
    fields describe the single replicated latent (``kv_heads_per_rank == total_kv_heads == 1``).
    ``region_lens[l]`` is the registered length of layer l's K buffer and of its V buffer.

    ``page_stride`` is the distance between two pages of one buffer (None: ``bytes_per_page``);
    ``k_offset`` / ``v_offset`` are where K and V start inside a page stride. K and V interleaved
    per block (vLLM's ``[blocks, 2, block_size, heads, head_size]``) is ``k_base_addrs ==
    v_base_addrs``, ``page_stride = 2 * bytes_per_page``, ``v_offset = bytes_per_page``.

    Inside a page, token ``t`` of head ``h`` (``bytes_per_head`` bytes of K, and again of V) is at
    ``h * head_stride + t * token_stride`` from K's (or V's) offset. The layout says which axis is
    outer and gives the defaults (packed): HND ``token_stride = bytes_per_head``, ``head_stride =
    page_size * token_stride``; NHD ``head_stride = bytes_per_head``, ``token_stride =
    kv_heads_per_rank * head_stride``. Wider strides leave room for other bytes (V) in between:
    vLLM's CPU attention ``[blocks, heads, block_size * 2, head_size]`` holds per head its K and
    then its V (HND, ``head_stride = 2 * page_size * bytes_per_head``, ``v_offset = page_size *
    bytes_per_head``); vLLM's GPU backends keep K and V side by side per token and head
    (``[blocks, heads, block_size, 2 * head_size]`` in LBHNC or LBNHC order: ``v_offset =
    bytes_per_head``, the strides of that view). A head slice is one segment per run of units
    contiguous on both sides (``patterns.head_slice``).
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
    page_stride: int | None = None
    k_offset: int = 0
    v_offset: int = 0
    head_stride: int | None = None
    token_stride: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.k_base_addrs)

    @property
    def stride(self) -> int:
        return self.bytes_per_page if self.page_stride is None else self.page_stride

    @property
    def heads(self) -> HeadGeometry:
        """The pool's head sharding (what a head slice of another TP size is cut from)."""
        return HeadGeometry(
            self.page_size, self.layout, self.kv_heads_per_rank, self.total_kv_heads, self.bytes_per_head,
            self.head_stride, self.token_stride,
        )  # fmt: skip

    @property
    def head_span(self) -> int:
        """Bytes one head's part of a page uses: ``page_size * bytes_per_head``."""
        return self.page_size * self.bytes_per_head

    @property
    def packed(self) -> bool:
        """K (and V) of a page are ``bytes_per_page`` contiguous bytes (no other bytes between)."""
        return self.is_mla or self.heads.packed

    @property
    def page_extent(self) -> int:
        """Bytes from the first to the last byte of K (or V) in one page: ``bytes_per_page`` when
        packed, more with wider strides (other bytes, e.g. V, lie between the units)."""
        return self.bytes_per_page if self.packed else self.heads.item_extent

    def head_windows(self, offset: int) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` inside a page stride of every contiguous run of K or V at ``offset``:
        one window when packed."""
        if self.packed:
            return ((offset, self.bytes_per_page),)
        return tuple((offset + start, length) for start, length in self.heads.runs())


@dataclass(frozen=True, slots=True)
class HeadGeometry:
    """Head sharding of a paged component laid out like KV (non-MLA SWA K and V).

    ``head_stride`` / ``token_stride``: where token ``t`` of head ``h`` starts inside a page,
    ``h * head_stride + t * token_stride``; None: the layout's packed default (see ``KvPool``)."""

    page_size: int
    layout: Layout
    kv_heads_per_rank: int
    total_kv_heads: int
    bytes_per_head: int
    head_stride: int | None = None
    token_stride: int | None = None

    @property
    def head_step(self) -> int:
        if self.head_stride is not None:
            return self.head_stride
        return self.page_size * self.token_step if self.layout is Layout.HND else self.bytes_per_head

    @property
    def token_step(self) -> int:
        if self.token_stride is not None:
            return self.token_stride
        return self.bytes_per_head if self.layout is Layout.HND else self.kv_heads_per_rank * self.head_step

    @property
    def packed(self) -> bool:
        """The page's units are one contiguous run (units never overlap: validation checks it)."""
        return self.item_extent == self.kv_heads_per_rank * self.page_size * self.bytes_per_head

    @property
    def item_extent(self) -> int:
        """Bytes from the first to the last byte of one page's heads."""
        return (
            (self.kv_heads_per_rank - 1) * self.head_step
            + (self.page_size - 1) * self.token_step
            + self.bytes_per_head
        )

    def runs(self) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` of the contiguous runs of one page's units, in address order."""
        starts = sorted(
            h * self.head_step + t * self.token_step
            for h in range(self.kv_heads_per_rank)
            for t in range(self.page_size)
        )
        out: list[list[int]] = []
        for start in starts:
            if out and out[-1][0] + out[-1][1] == start:
                out[-1][1] += self.bytes_per_head
            else:
                out.append([start, self.bytes_per_head])
        return tuple((a, n) for a, n in out)


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One tensor of a state component: per layer one buffer of equal-sized slots or pages.

    A slot (``bytes_per_slot`` bytes used) is ``[outer_rows][axis][inner bytes]``: the TP-sharded
    axis may be any per-slot axis, with ``outer_rows`` rows before it (the product of the axes in
    front, 1 when it is the first) and ``inner = bytes_per_slot / (outer_rows * axis)`` bytes per
    axis element after it. ``sharded_axis_size`` is this rank's length of that axis; each row holds
    the rank's share of it. A GDN conv state ``[dim/TP, kernel-1]`` is ``outer_rows=1``; stored
    transposed ``[kernel-1, dim/TP]`` (Kimi-Linear) it is ``outer_rows=kernel-1``, inner = one
    element. ``sub_block_sizes`` are the FULL (unsharded) sizes of independently sharded sub-blocks
    concatenated on that axis, e.g. the ``[q, k, v]`` conv channels of GDN; None means one block
    (or, when only one side declares them, the other side's split). ``replicated`` marks a tensor
    that holds identical bytes on every rank inside an axis-sharded component (SGLang's dim 0).
    A sharded tensor with neither axis size nor ``replicated`` has unknown sharding, which is
    refused when TP sizes differ.

    ``slot_stride`` is the distance between two slots of one buffer (None: ``bytes_per_slot``) and
    ``offset`` where this tensor starts inside a slot stride: tensors sharing one slot (vLLM's conv
    and SSM state in one page) name the same base addresses with different offsets.
    """

    name: str
    base_addrs: tuple[int, ...]
    region_lens: tuple[int, ...]
    bytes_per_slot: int
    sharded_axis_size: int | None = None
    sub_block_sizes: tuple[int, ...] | None = None
    slot_stride: int | None = None
    offset: int = 0
    outer_rows: int = 1
    replicated: bool = False

    @property
    def stride(self) -> int:
        return self.bytes_per_slot if self.slot_stride is None else self.slot_stride


@dataclass(frozen=True, slots=True)
class StatePool:
    """One hybrid-state component (Mamba, SWA, DSA, ...), matched by position across sides: the
    memory of it (the wire's ``StateComponent`` is the message that describes one to a peer).

    Sharding across TP is one of: ``replicated`` (every rank holds identical bytes: MLA SWA, DSA
    indexer), ``heads`` (paged K/V-like tensors sliced by KV head, non-MLA SWA), or per tensor
    ``sharded_axis_size`` (Mamba; a tensor may be ``replicated`` on its own). ``layer_ids`` are the
    global layer ids of the per-layer entries; None means ``0 .. n-1``. A PP stage must pass them
    so that it lands on the right decode layers.
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

    position: ParallelRank  # the planner reads TP and PP; a worker's is its configured rank
    kv: KvPool | None = None
    state: tuple[StatePool, ...] = field(default=())
    aux: tuple[AuxBuffer, ...] = field(default=())
    first_layer: int = 0  # global id of the first KV layer this rank holds (a PP stage holds a slice)
