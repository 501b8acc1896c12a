"""Planner benchmark: plan time and descriptor count of one 32k-token hybrid request, per peer.

    .venv/bin/python benchmarks/planner.py [--repeats N] [--baseline-repeats N]

Model (the constants below): page 64; 64 KV layers of 8 KV heads x 128 dims bf16; 48 Mamba layers
(GDN conv q|k|v 2048|2048|4096 channels x 3 taps bf16, temporal 32 heads x 128 x 128 fp32); SWA (16
layers, window 4096 tokens); DSA indexer (64 layers, replicated, 132 B per token); one aux buffer.
For each case the planner is timed against a baseline written as a plain per-page,
per-token Python loop (SGLang's formulas, #30997 scatter fix) that must produce the same
descriptors; both are timed in the same run, medians reported.

Layout ``vllm`` is the same model laid out the way vLLM's hybrid allocator does it: K and V
interleaved per block (one buffer per layer, page stride = K + V), the Mamba conv state stored
``[kernel-1, channels/TP]`` (the sharded axis after 3 rows, as Kimi-Linear) sharing one slot with
the temporal state at an offset. Its loop adds the strides and offsets to SGLang's formulas and
merges rows adjacent on both sides in one final sorted pass, as the planner does.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from _common import arguments, head, machine, median_s

from pdwire.runtime.descriptors import DescriptorTable
from pdwire.runtime.planner import (
    AuxBuffer,
    HeadGeometry,
    Indexing,
    KvPool,
    Layout,
    ParallelRank,
    PeerPlan,
    RankMemory,
    StateKind,
    StatePool,
    StateTensor,
    decode_ranks_of_prefill,
    prepare_peer,
)

TOKENS, PAGE, LAYERS, HEADS, HEAD_BYTES = 32 * 1024, 64, 64, 8, 128 * 2
MAMBA_LAYERS, CONV_BLOCKS, CONV_UNIT = 48, (2048, 2048, 4096), 3 * 2
TEMPORAL_HEADS, TEMPORAL_UNIT = 32, 128 * 128 * 4
SWA_LAYERS, SWA_WINDOW, DSA_LAYERS, DSA_TOKEN_BYTES, AUX_ITEM = 16, 4096, 64, 132, 4096
POOL_PAGES, MAMBA_SLOTS = 4096, 64
PAGES = TOKENS // PAGE

Rows = list[tuple[int, int, int]]


def _bases(start: int, count: int, stride: int) -> tuple[int, ...]:
    return tuple(start + i * stride for i in range(count))


CONV_ROWS = 3  # the vllm layout's conv state: [kernel-1, channels/TP] of bf16


def memory(tp: int, rank: int, layout: Layout, base: int, vllm: bool = False) -> RankMemory:
    per_rank = HEADS // tp if tp <= HEADS else 1
    item = PAGE * per_rank * HEAD_BYTES
    stride = 1 << 32
    k_bases = _bases(base, LAYERS, stride)
    v_bases = k_bases if vllm else _bases(base + (1 << 40), LAYERS, stride)
    lens = (item * POOL_PAGES * (2 if vllm else 1),) * LAYERS
    interleaved = {"page_stride": 2 * item, "v_offset": item} if vllm else {}  # K and V in one block
    kv = KvPool(k_bases, v_bases, lens, item, PAGE, layout, per_rank, HEADS, HEAD_BYTES, **interleaved)

    def tensor(
        name: str,
        region: int,
        layers: int,
        per_item: int,
        items: int,
        axis: int | None = None,
        blocks: tuple[int, ...] | None = None,
    ) -> StateTensor:
        """``layers`` buffers of ``items`` items of ``per_item`` bytes, in address region ``region``."""
        bases = _bases(base + (region << 40), layers, stride)
        return StateTensor(name, bases, (per_item * items,) * layers, per_item, axis, blocks)

    conv_axis, temporal_axis = sum(CONV_BLOCKS) // tp, TEMPORAL_HEADS // tp
    conv_item, temporal_item = conv_axis * CONV_UNIT, temporal_axis * TEMPORAL_UNIT
    conv = tensor("conv", 2, MAMBA_LAYERS, conv_item, MAMBA_SLOTS, conv_axis, CONV_BLOCKS)
    temporal = tensor("temporal", 3, MAMBA_LAYERS, temporal_item, MAMBA_SLOTS, temporal_axis)
    if vllm:  # one slot holds conv [rows][axis][2 bytes], then temporal
        slot = conv_item + temporal_item
        conv = replace(conv, region_lens=(slot * MAMBA_SLOTS,) * MAMBA_LAYERS, slot_stride=slot,
                       outer_rows=CONV_ROWS)  # fmt: skip
        temporal = replace(temporal, base_addrs=conv.base_addrs, region_lens=conv.region_lens,
                           slot_stride=slot, offset=conv_item)  # fmt: skip
    mamba = StatePool(StateKind.MAMBA, Indexing.SLOT, (conv, temporal))
    swa_geometry = HeadGeometry(PAGE, layout, per_rank, HEADS, HEAD_BYTES)
    swa_kv = (tensor("k", 4, SWA_LAYERS, item, POOL_PAGES), tensor("v", 5, SWA_LAYERS, item, POOL_PAGES))
    swa = StatePool(StateKind.SWA, Indexing.PAGE, swa_kv, heads=swa_geometry)
    indexer = tensor("indexer", 6, DSA_LAYERS, PAGE * DSA_TOKEN_BYTES, POOL_PAGES)
    dsa = StatePool(StateKind.DSA, Indexing.PAGE, (indexer,), replicated=True)
    aux = (AuxBuffer("output", base + (7 << 40), AUX_ITEM * 256, AUX_ITEM),)
    return RankMemory(ParallelRank(tp, rank), kv, (mamba, swa, dsa), aux)


def fragmented_pages(rng: np.random.Generator, count: int) -> np.ndarray:
    """Free-list-like page ids: runs of 1-8 consecutive pages at random places, no repeats."""
    runs, total = [], 0
    while total < count:
        length = min(int(rng.integers(1, 9)), count - total)
        runs.append(length)
        total += length
    starts = rng.choice(POOL_PAGES // 8, size=len(runs), replace=False) * 8
    return np.concatenate([np.arange(s, s + n) for s, n in zip(starts, runs, strict=True)]).astype(np.int32)


# ---- baseline: plain Python loops with SGLang's formulas ---------------------------------------


def _append(rows: Rows, s: int, d: int, n: int) -> None:
    if rows and rows[-1][0] + rows[-1][2] == s and rows[-1][1] + rows[-1][2] == d:
        rows[-1] = (rows[-1][0], rows[-1][1], rows[-1][2] + n)
    else:
        rows.append((s, d, n))


def _head_starts(p_tp: int, p: int, d_tp: int, d: int) -> tuple[int, int, int]:
    src_h, dst_h = max(1, HEADS // p_tp), max(1, HEADS // d_tp)
    if p_tp > d_tp:
        src_rep = max(1, p_tp // HEADS)
        return 0, ((p % (p_tp // d_tp) // src_rep) * src_h) % dst_h, src_h
    dst_rep = max(1, d_tp // HEADS)
    return ((d // dst_rep) * dst_h) % src_h, 0, dst_h


def baseline_paged_heads(
    src: list[int],
    dst: list[int],
    s_bases: tuple[int, ...],
    d_bases: tuple[int, ...],
    s_item: int,
    d_item: int,
    starts: tuple[int, int, int],
    layout: Layout,
    strides: tuple[int, int] | None = None,
) -> Rows:
    """``s_bases``/``d_bases``: address of item 0 of each buffer; ``strides``: page strides."""
    src_start, dst_start, heads = starts
    s_stride, d_stride = strides or (s_item, d_item)
    s_tok, d_tok = s_item // PAGE, d_item // PAGE
    order = sorted(range(len(dst)), key=dst.__getitem__)
    rows: Rows = []
    for sb, db in zip(s_bases, d_bases, strict=True):
        layer_rows: Rows = []
        for i in order:
            if s_item == d_item and heads * HEAD_BYTES == s_tok:  # whole pages
                _append(layer_rows, sb + src[i] * s_stride, db + dst[i] * d_stride, s_item)
            elif layout is Layout.NHD:
                for t in range(PAGE):
                    _append(
                        layer_rows,
                        sb + src[i] * s_stride + t * s_tok + src_start * HEAD_BYTES,
                        db + dst[i] * d_stride + t * d_tok + dst_start * HEAD_BYTES,
                        heads * HEAD_BYTES,
                    )
            else:
                _append(
                    layer_rows,
                    sb + src[i] * s_stride + src_start * PAGE * HEAD_BYTES,
                    db + dst[i] * d_stride + dst_start * PAGE * HEAD_BYTES,
                    heads * PAGE * HEAD_BYTES,
                )
        rows += layer_rows
    return rows


def baseline_mamba(
    tensor_s: StateTensor,
    tensor_d: StateTensor,
    blocks: tuple[int, ...],
    plan: PeerPlan,
    unit: int,
    s_slot: int,
    d_slot: int,
) -> Rows:
    p_tp, p = plan.local.position.tp_size, plan.local.position.tp_rank
    d_tp, d = plan.remote.position.tp_size, plan.remote.position.tp_rank
    rows: Rows = []
    for sb, db in zip(tensor_s.base_addrs, tensor_d.base_addrs, strict=True):
        layer_rows: Rows = []
        s_off = d_off = 0
        pieces = []
        for full in blocks:
            src_sub, dst_sub = full // p_tp, full // d_tp
            if p_tp > d_tp:
                pieces.append((s_off, d_off + (p % (p_tp // d_tp)) * src_sub, src_sub))
            else:
                pieces.append((s_off + (d * dst_sub) % src_sub, d_off, dst_sub))
            s_off, d_off = s_off + src_sub, d_off + dst_sub
        s_row, d_row = s_off * unit, d_off * unit  # bytes of one row on each side
        for row in range(tensor_s.outer_rows):
            for s, dd, n in sorted(pieces, key=lambda piece: piece[1]):
                _append(
                    layer_rows,
                    sb + tensor_s.offset + s_slot * tensor_s.stride + row * s_row + s * unit,
                    db + tensor_d.offset + d_slot * tensor_d.stride + row * d_row + dd * unit,
                    n * unit,
                )
        rows += layer_rows
    return rows


def merge_adjacent(rows: Rows) -> Rows:
    """Rows sorted by destination, merged where one ends where the next starts on both sides."""
    merged: Rows = []
    for s, d, n in sorted(rows, key=lambda row: row[1]):
        _append(merged, s, d, n)
    return merged


def baseline(
    plan: PeerPlan,
    src_pages: list[int],
    dst_pages: list[int],
    state_src: list[list[int]],
    state_dst: list[list[int]],
) -> Rows:
    local, remote = plan.local, plan.remote
    lp, rp = local.position, remote.position
    starts = _head_starts(lp.tp_size, lp.tp_rank, rp.tp_size, rp.tp_rank)
    assert local.kv is not None and remote.kv is not None
    lkv, rkv = local.kv, remote.kv
    vllm = lkv.page_stride is not None
    s_bases = lkv.k_base_addrs + tuple(b + lkv.v_offset for b in lkv.v_base_addrs)
    d_bases = rkv.k_base_addrs + tuple(b + rkv.v_offset for b in rkv.v_base_addrs)
    items, strides = (lkv.bytes_per_page, rkv.bytes_per_page), (lkv.stride, rkv.stride)
    rows = baseline_paged_heads(src_pages, dst_pages, s_bases, d_bases, *items, starts, lkv.layout, strides)
    if vllm:  # K and V of one block meet, and so do consecutive blocks
        rows = merge_adjacent(rows)
    mamba_s, swa_s, dsa_s = local.state
    mamba_d, swa_d, dsa_d = remote.state
    mamba_rows: Rows = []
    for ts, td in zip(mamba_s.tensors, mamba_d.tensors, strict=True):
        blocks = ts.sub_block_sizes or (ts.bytes_per_slot // (TEMPORAL_UNIT) * lp.tp_size,)
        unit = CONV_UNIT if ts.name == "conv" else TEMPORAL_UNIT
        if ts.name == "conv" and ts.outer_rows > 1:
            unit = CONV_UNIT // ts.outer_rows  # the rows split the conv taps off the channel axis
        mamba_rows += baseline_mamba(ts, td, blocks, plan, unit, state_src[0][0], state_dst[0][0])
    rows += merge_adjacent(mamba_rows) if vllm else mamba_rows  # conv's last row meets temporal
    for ts, td in zip(swa_s.tensors, swa_d.tensors, strict=True):
        items = (ts.bytes_per_slot, td.bytes_per_slot)
        rows += baseline_paged_heads(
            state_src[1], state_dst[1], ts.base_addrs, td.base_addrs, *items, starts, lkv.layout
        )
    if plan.route.prefill_ranks[0] == lp.tp_rank:  # replicated DSA: first rank of the group writes
        ts, td = dsa_s.tensors[0], dsa_d.tensors[0]
        order = sorted(range(len(state_dst[2])), key=state_dst[2].__getitem__)
        for sb, db in zip(ts.base_addrs, td.base_addrs, strict=True):
            layer_rows: Rows = []
            item = ts.bytes_per_slot
            for i in order:
                _append(layer_rows, sb + state_src[2][i] * item, db + state_dst[2][i] * item, item)
            rows += layer_rows
    if plan.writes_aux:
        rows.append((local.aux[0].base_addr + 3 * AUX_ITEM, remote.aux[0].base_addr + 5 * AUX_ITEM, AUX_ITEM))
    return rows


def _sorted_rows(table: DescriptorTable) -> np.ndarray:
    stacked = np.stack([table.src_addr, table.dst_addr, table.length], axis=1)
    return stacked[np.lexsort((stacked[:, 1], stacked[:, 0]))]


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline-repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    src_pages, dst_pages = fragmented_pages(rng, PAGES), fragmented_pages(rng, PAGES)
    swa_pages = SWA_WINDOW // PAGE
    state_src = [[7], src_pages[-swa_pages:].tolist(), src_pages.tolist()]
    state_dst = [[9], dst_pages[-swa_pages:].tolist(), dst_pages.tolist()]
    print(machine())
    print(f"request: {TOKENS} tokens = {PAGES} pages of {PAGE} (fragmented), one peer\n")
    print(
        head("case", "layout", "descriptors", "kv", "state", "planner ms", "loop ms", "speed-up", "Mdesc/s")
    )
    cases = [
        (p, d, layout, False) for p, d in ((4, 4), (2, 4), (4, 2)) for layout in (Layout.NHD, Layout.HND)
    ]
    cases += [(p, d, Layout.NHD, True) for p, d in ((4, 4), (2, 4), (4, 2))]
    for p_tp, d_tp, layout, vllm in cases:
        local = memory(p_tp, 1, layout, 1 << 44, vllm)
        remote = memory(d_tp, decode_ranks_of_prefill(p_tp, d_tp, 1)[-1], layout, 1 << 50, vllm)
        plan = prepare_peer(local, remote)

        def run_planner(plan: PeerPlan = plan) -> object:
            return plan.plan_request(src_pages, dst_pages, state_src, state_dst, aux=(3, 5))

        result = plan.plan_request(src_pages, dst_pages, state_src, state_dst, aux=(3, 5))
        loop_rows = baseline(plan, src_pages.tolist(), dst_pages.tolist(), state_src, state_dst)
        expected = np.asarray(loop_rows, dtype=np.uint64)
        expected = expected[np.lexsort((expected[:, 1], expected[:, 0]))]
        assert np.array_equal(_sorted_rows(result.table()), expected), "planner and loop disagree"
        assert len(result.table().mergeable_pairs()) == 0
        planner_s = median_s(run_planner, args.repeats)
        loop_s = median_s(
            lambda plan=plan: baseline(plan, src_pages.tolist(), dst_pages.tolist(), state_src, state_dst),
            args.baseline_repeats,
        )
        counts = result.counts()
        total = result.descriptor_count
        print(
            f"| P={p_tp} -> D={d_tp} | {'vllm' if vllm else layout.value} | {total} | {counts['kv']} | "
            f"{counts['state']} | {planner_s * 1e3:.2f} | {loop_s * 1e3:.1f} | {loop_s / planner_s:.0f}x | "
            f"{total / planner_s / 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
