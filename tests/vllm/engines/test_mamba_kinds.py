"""Every Mamba kind vLLM 0.32 builds a ``MambaSpec`` for, across TP sizes, through vLLM's real
spec objects and state shapes (``MambaStateShapeCalculator``) and pdwire's planner, byte for
byte: Mamba1 (one conv section, temporal state by rows), Mamba2 (x | B | C), GDN as in
Qwen3-Next (q | k | v; temporal state by value heads) and short conv. vLLM's CPU build runs
Mamba2 (tests/vllm/engines/test_hybrid.py and test_tp.py); the GDN kernels are GPU-only, so
GDN is proven here at the cache level.

One full logical state per kind (conv ``[kernel - 1, channels]``, vLLM's default SD layout, and
the temporal state) is cut into each rank's share with plain numpy (every conv section split
over TP on its own); after the plan runs, each decode rank's slot must hold exactly its share
and the rest of its page what it held before.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Shapes
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind
from vllm.v1.kv_cache_interface import MambaSpec

from pdwire.integrations.vllm.memory import AttentionGroup, LayerTensor, describe, mamba_group
from pdwire.runtime.planner import PlanError, has_tp_sharded_state, prepare_peer, regions, route_decode_rank
from pdwire.runtime.planner.reference_executor import AddressSpace, execute

F32, BLOCKS, N, C, H = 4, 4, 4, 4, 2  # bytes per element, blocks, tokens per block, head size, KV heads
SRC_SLOT, DST_SLOT = 3, 1
HF = SimpleNamespace(mamba_n_groups=2, mamba_n_heads=4, mamba_d_state=2)  # what Mamba2's split reads

# per kind: (local shapes at TP tp, the full conv sections, the full temporal state's shape or None)
KINDS = {
    Kind.MAMBA1: (lambda tp: Shapes.mamba1_state_shape(tp, 16, 4, 4), (16,), (16, 4)),
    Kind.MAMBA2: (lambda tp: Shapes.mamba2_state_shape(tp, 8, 2, 4, 2, 2, 4), (8, 4, 4), (4, 2, 2)),
    Kind.GDN_ATTN: (lambda tp: Shapes.gated_delta_net_state_shape(tp, 4, 4, 2, 4, 4), (8, 8, 16), (4, 4, 2)),
    Kind.SHORT_CONV: (lambda tp: Shapes.short_conv_state_shape(tp, 16, 4), (16,), None),
}


class Rank:
    """An attention layer and a Mamba layer (its own buffer), as vLLM's CPU build lays them out."""

    def __init__(self, kind: Kind, tp: int, r: int, base: int, seed: int) -> None:
        shapes = tuple(tuple(s) for s in KINDS[kind][0](tp))
        spec = MambaSpec(block_size=N, shapes=shapes, dtypes=(torch.float32,) * len(shapes), mamba_type=kind)
        group = mamba_group(spec, ("model.layers.0.mixer",), tp, HF)
        self.page = spec.page_size_bytes
        hl = max(1, H // tp)
        block = hl * N * 2 * C * F32
        self.space = AddressSpace()
        rng = np.random.default_rng(seed)
        self.attn = self.space.allocate(base, BLOCKS * block, rng)
        self.mamba = self.space.allocate(base + (1 << 32), BLOCKS * self.page, rng).reshape(BLOCKS, self.page)
        tensors = {
            "model.layers.1.attn": LayerTensor(
                "model.layers.1.attn",
                base,
                (block, N * 2 * C * F32, 2 * C * F32, F32),
                (BLOCKS, hl, N, 2 * C),
            ),
            "model.layers.0.mixer": LayerTensor(
                "model.layers.0.mixer", base + (1 << 32), (self.page, 1), (BLOCKS, self.page)
            ),
        }
        attention = AttentionGroup(("model.layers.1.attn",), N, hl, C, F32, total_kv_heads=H)
        layer_ids = {"model.layers.0.mixer": 0, "model.layers.1.attn": 1}
        self.memory = describe(
            [group, attention], tensors, BLOCKS, tp_size=tp, tp_rank=r, layer_ids=layer_ids
        ).memory


def _share(kind: Kind, conv: np.ndarray, temporal: np.ndarray | None, tp: int, r: int) -> np.ndarray:
    """A rank's slot bytes: per conv row each section's share, then its rows of the temporal state."""
    sections = np.cumsum(KINDS[kind][1])[:-1]
    rows = [np.concatenate([np.split(part, tp)[r] for part in np.split(row, sections)]) for row in conv]
    parts = [np.concatenate(rows).reshape(-1)]
    if temporal is not None:
        parts.append(np.split(temporal, tp)[r].reshape(-1))
    return np.concatenate(parts)


def _move(kind: Kind, prefill_tp: int, decode_tp: int) -> None:
    rng = np.random.default_rng(3)
    _, sections, temporal_shape = KINDS[kind]
    kernel_rows = KINDS[kind][0](1)[0][0]  # SD: [kernel - 1, channels]
    conv = rng.integers(0, 256, (kernel_rows, sum(sections), F32), dtype=np.uint8)
    temporal = None
    if temporal_shape is not None:
        temporal = rng.integers(
            0, 256, (temporal_shape[0], int(np.prod(temporal_shape[1:])) * F32), dtype=np.uint8
        )
    prefill = []
    for p in range(prefill_tp):
        rank = Rank(kind, prefill_tp, p, (1 << 40) + p * (1 << 36), p)
        rank.mamba[SRC_SLOT] = _share(kind, conv, temporal, prefill_tp, p)
        prefill.append(rank)
    assert has_tp_sharded_state(prefill[0].memory)
    for d in range(decode_tp):
        rank = Rank(kind, decode_tp, d, (1 << 44) + d * (1 << 36), 100 + d)
        before = rank.mamba.copy()
        route = route_decode_rank(prefill_tp, decode_tp, d, is_mla=False, sharded_state=True)
        for p in route.prefill_ranks:
            src = prefill[p]
            table = (
                prepare_peer(src.memory, rank.memory)
                .plan_request([0], [2], [[SRC_SLOT]], [[DST_SLOT]])
                .table()
            )
            execute(table, src.space, rank.space, regions(src.memory), regions(rank.memory))
        expected = before.copy()
        expected[DST_SLOT] = _share(kind, conv, temporal, decode_tp, d)
        np.testing.assert_array_equal(rank.mamba, expected, err_msg=f"{kind.name} decode rank {d}")


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2)])
def test_every_mamba_kind_moves_byte_for_byte_across_tp(kind: Kind, prefill_tp: int, decode_tp: int) -> None:
    _move(kind, prefill_tp, decode_tp)


@pytest.mark.parametrize("kind", [Kind.MAMBA1, Kind.GDN_ATTN, Kind.SHORT_CONV])
def test_four_ranks_into_two_and_back(kind: Kind) -> None:
    _move(kind, 4, 2)
    _move(kind, 2, 4)


def test_state_whose_split_is_not_clean_is_refused_across_tp_by_name() -> None:
    # Mamba2 with 2 groups over TP 4: vLLM replicates groups over ranks, no clean split
    src = Rank(Kind.MAMBA2, 4, 0, 1 << 40, 0)
    dst = Rank(Kind.MAMBA2, 2, 0, 1 << 44, 1)
    with pytest.raises(PlanError, match="mamba"):
        prepare_peer(src.memory, dst.memory)
