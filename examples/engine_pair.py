"""A prefill engine (TP 1) and a decode engine (TP 2) written against pdwire's engine API alone.

Each rank lays out its own hybrid-model cache (GQA KV pages, a Mamba state with a conv whose
channels are q|k|v sub-blocks, a temporal state, one aux item per request) in memory from its
transfer backend, describes it with the planner's model, and runs a worker. The two engines lay
their memory out differently. Decode packs every tensor on its own. Prefill does what vLLM does:
per layer one pool of blocks shared by attention and Mamba (the two groups alias the same
memory; a request's pages and its Mamba slot are different blocks of it), K and V interleaved in
a block (a page stride of twice the page, V at an offset), and a Mamba block holding the conv
state and, at an offset after it, the temporal state, with the rest of the block unused. The prefill worker
runs on its own thread (the way a scheduler would call it); the decode workers are stepped from
this loop. Two requests move; the second says decode already holds its first two pages
(``decode_prefix_len``), and those pages must stay untouched. Every destination byte is then
compared with the shard numpy slicing says that decode rank must hold.

Runs anywhere pdwire installs: no torch, no demo code, the dependency-free ``local`` backend
(``--backend nixl`` to use NIXL). ``python examples/engine_pair.py`` prints one line per
request and exits 0 when every byte matches.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from pdwire.runtime import engine as pd

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 8, 4  # KV: NHD pages of PAGE tokens x heads x HEAD_DIM
CONV_BLOCKS, CONV_WIDTH = (8, 8, 16), 4  # Mamba conv: q|k|v channels, each split over TP
SSM_HEADS, SSM_STATE = 4, 8  # Mamba temporal state: heads split over TP
PAGES, SLOTS, ITEMS, AUX_BYTES = 16, 4, 4, 32  # per rank: KV pages, Mamba slots, aux items
BLOCKS = 24  # prefill: blocks per layer, shared by KV pages and Mamba slots
SENTINEL = 0xA5A5  # every decode byte nobody may write
MODEL = pd.ModelFingerprint(model_name="example-hybrid", revision="v1", dtype="uint16", num_layers=LAYERS)


@dataclass
class Rank:
    """One rank's memory: numpy views into one buffer from its backend, and their description."""

    backend: pd.Backend
    k: list[np.ndarray]  # per layer [pages, PAGE, heads, HEAD_DIM]
    v: list[np.ndarray]
    conv: list[np.ndarray]  # per layer [slots, conv channels of this rank, CONV_WIDTH]
    ssm: list[np.ndarray]  # per layer [slots, ssm heads of this rank, SSM_STATE]
    aux: np.ndarray  # [items, AUX_BYTES]
    memory: pd.RankMemory


def addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def bases(layers: list[np.ndarray]) -> tuple[int, ...]:
    return tuple(addr(a) for a in layers)


def shared_blocks(backend: pd.Backend) -> Rank:
    """The prefill rank (TP 1): per layer one pool of blocks; attention reads a block as
    ``[2, PAGE, HEADS, HEAD_DIM]`` (K then V), Mamba as conv, then temporal state, then slack."""
    conv_ch = sum(CONV_BLOCKS)
    page = PAGE * HEADS * HEAD_DIM * 2
    conv_bytes, ssm_bytes = conv_ch * CONV_WIDTH * 2, SSM_HEADS * SSM_STATE * 2
    block = 2 * page  # holds a K page and a V page, or a Mamba slot (conv + ssm <= 2 pages)
    assert conv_bytes + ssm_bytes <= block
    buf = backend.allocate("blocks", LAYERS * BLOCKS * block + ITEMS * AUX_BYTES).array
    pools = [buf[i * BLOCKS * block : (i + 1) * BLOCKS * block].reshape(BLOCKS, block) for i in range(LAYERS)]
    kv = [p.view(np.uint16).reshape(BLOCKS, 2, PAGE, HEADS, HEAD_DIM) for p in pools]
    conv = [p[:, :conv_bytes].view(np.uint16).reshape(BLOCKS, conv_ch, CONV_WIDTH) for p in pools]
    ssm = [
        p[:, conv_bytes : conv_bytes + ssm_bytes].view(np.uint16).reshape(BLOCKS, SSM_HEADS, SSM_STATE)
        for p in pools
    ]
    aux = buf[LAYERS * BLOCKS * block :].reshape(ITEMS, AUX_BYTES)
    span = (BLOCKS * block,) * LAYERS  # every buffer is the whole pool of its layer
    kv_pool = pd.KvPool(
        k_base_addrs=bases(pools), v_base_addrs=bases(pools), region_lens=span,
        bytes_per_page=page, page_size=PAGE, layout=pd.Layout.NHD, kv_heads_per_rank=HEADS,
        total_kv_heads=HEADS, bytes_per_head=HEAD_DIM * 2, memory_kind=pd.MemoryKind.DRAM,
        page_stride=block, k_offset=0, v_offset=page,  # K and V interleaved per block
    )  # fmt: skip
    conv_t = pd.StateTensor(
        "conv", bases(pools), span, conv_bytes, conv_ch, CONV_BLOCKS, slot_stride=block, offset=0
    )
    ssm_t = pd.StateTensor(
        "ssm", bases(pools), span, ssm_bytes, SSM_HEADS, slot_stride=block, offset=conv_bytes
    )
    mamba = pd.StatePool(
        pd.StateKind.MAMBA, pd.Indexing.SLOT, (conv_t, ssm_t), memory_kind=pd.MemoryKind.DRAM
    )
    aux_buf = pd.AuxBuffer("first_token", addr(aux), aux.nbytes, AUX_BYTES)
    memory = pd.RankMemory(pd.ParallelRank(1, 0), kv_pool, (mamba,), (aux_buf,))
    return Rank(backend, [a[:, 0] for a in kv], [a[:, 1] for a in kv], conv, ssm, aux, memory)


def packed(backend: pd.Backend, tp: int, rank: int) -> Rank:
    """A decode rank: every tensor of every layer packed on its own."""
    heads, ssm = HEADS // tp, SSM_HEADS // tp
    conv = sum(CONV_BLOCKS) // tp
    shapes = [("k", (PAGES, PAGE, heads, HEAD_DIM))] * LAYERS + [
        ("v", (PAGES, PAGE, heads, HEAD_DIM))
    ] * LAYERS
    shapes += [("conv", (SLOTS, conv, CONV_WIDTH))] * LAYERS + [("ssm", (SLOTS, ssm, SSM_STATE))] * LAYERS
    sizes = [int(np.prod(s)) * 2 for _, s in shapes] + [ITEMS * AUX_BYTES]
    buf = backend.allocate("cache", sum(-(-n // 64) * 64 for n in sizes)).array
    views: dict[str, list[np.ndarray]] = {"k": [], "v": [], "conv": [], "ssm": []}
    offset = 0
    for (name, shape), n in zip(shapes, sizes, strict=False):
        views[name].append(buf[offset : offset + n].view(np.uint16).reshape(shape))
        offset += -(-n // 64) * 64
    aux = buf[offset : offset + ITEMS * AUX_BYTES].reshape(ITEMS, AUX_BYTES)

    def lens(layers: list[np.ndarray]) -> tuple[int, ...]:
        return tuple(a.nbytes for a in layers)

    page_bytes = PAGE * heads * HEAD_DIM * 2
    kv = pd.KvPool(
        k_base_addrs=bases(views["k"]),
        v_base_addrs=bases(views["v"]),
        region_lens=(PAGES * page_bytes,) * LAYERS,
        bytes_per_page=page_bytes,
        page_size=PAGE,
        layout=pd.Layout.NHD,
        kv_heads_per_rank=heads,
        total_kv_heads=HEADS,
        bytes_per_head=HEAD_DIM * 2,
        memory_kind=pd.MemoryKind.DRAM,
    )
    # a state tensor: name, per-layer bases and lengths, bytes of one slot, this rank's share of
    # the TP-split axis and (conv) the full sizes of the sub-blocks that are split on their own
    conv_t = pd.StateTensor(
        "conv", bases(views["conv"]), lens(views["conv"]), conv * CONV_WIDTH * 2, conv, CONV_BLOCKS
    )
    ssm_t = pd.StateTensor("ssm", bases(views["ssm"]), lens(views["ssm"]), ssm * SSM_STATE * 2, ssm)
    mamba = pd.StatePool(
        pd.StateKind.MAMBA, pd.Indexing.SLOT, (conv_t, ssm_t), memory_kind=pd.MemoryKind.DRAM
    )
    aux_buf = pd.AuxBuffer("first_token", addr(aux), aux.nbytes, AUX_BYTES)
    memory = pd.RankMemory(pd.ParallelRank(tp, rank), kv, (mamba,), (aux_buf,))
    return Rank(backend, views["k"], views["v"], views["conv"], views["ssm"], aux, memory)


# --------------------------------------------------------------------------- content and shards


def full_content(seed: int, tokens: int) -> dict[str, np.ndarray]:
    """What a TP 1 model holds for one request: per layer, unsharded."""
    rng = np.random.default_rng(seed)
    u16 = np.iinfo(np.uint16).max
    return {
        "k": rng.integers(0, u16, (LAYERS, tokens, HEADS, HEAD_DIM), dtype=np.uint16),
        "v": rng.integers(0, u16, (LAYERS, tokens, HEADS, HEAD_DIM), dtype=np.uint16),
        "conv": rng.integers(0, u16, (LAYERS, sum(CONV_BLOCKS), CONV_WIDTH), dtype=np.uint16),
        "ssm": rng.integers(0, u16, (LAYERS, SSM_HEADS, SSM_STATE), dtype=np.uint16),
        "aux": rng.integers(0, 255, AUX_BYTES, dtype=np.uint8),
    }


def shard(full: dict[str, np.ndarray], tp: int, rank: int) -> dict[str, np.ndarray]:
    """The part of ``full`` TP rank ``rank`` of ``tp`` holds, by plain slicing."""
    h = HEADS // tp
    blocks, start = [], 0
    for b in CONV_BLOCKS:  # each of q|k|v is split on its own
        per = b // tp
        blocks.append(full["conv"][:, start + rank * per : start + (rank + 1) * per])
        start += b
    s = SSM_HEADS // tp
    return {
        "k": full["k"][:, :, rank * h : (rank + 1) * h],
        "v": full["v"][:, :, rank * h : (rank + 1) * h],
        "conv": np.concatenate(blocks, axis=1),
        "ssm": full["ssm"][:, rank * s : (rank + 1) * s],
        "aux": full["aux"],
    }


def place(r: Rank, part: dict[str, np.ndarray], pages: np.ndarray, slot: int, item: int) -> None:
    """Write a request's shard into its pages, slot and aux item (what prefill computes)."""
    for layer in range(LAYERS):
        for name, dst in (("k", r.k[layer]), ("v", r.v[layer])):
            tokens = part[name][layer]
            padded = np.zeros((len(pages) * PAGE, *tokens.shape[1:]), np.uint16)
            padded[: len(tokens)] = tokens
            dst[pages] = padded.reshape(len(pages), PAGE, *tokens.shape[1:])
        r.conv[layer][slot] = part["conv"][layer]
        r.ssm[layer][slot] = part["ssm"][layer]
    r.aux[item] = part["aux"]


def mismatches(
    r: Rank, part: dict[str, np.ndarray], pages: np.ndarray, skip: int, slot: int, item: int
) -> list[str]:
    """Where decode rank ``r``'s destination differs from its shard (pages from ``skip`` on), and
    any byte of the skipped prefix pages that is not the sentinel any more."""
    out = []
    for layer in range(LAYERS):
        for name, arr in (("k", r.k[layer]), ("v", r.v[layer])):
            tokens = part[name][layer]
            got = arr[pages].reshape(len(pages) * PAGE, *tokens.shape[1:])
            lo, hi = skip * PAGE, len(tokens)
            if not np.array_equal(got[lo:hi], tokens[lo:hi]):
                out.append(f"{name} layer {layer}")
            if skip and not (arr[pages[:skip]] == SENTINEL).all():
                out.append(f"{name} layer {layer}: a prefix page decode already held was written")
        if not np.array_equal(r.conv[layer][slot], part["conv"][layer]):
            out.append(f"conv layer {layer}")
        if not np.array_equal(r.ssm[layer][slot], part["ssm"][layer]):
            out.append(f"ssm layer {layer}")
    if not np.array_equal(r.aux[item], part["aux"]):
        out.append("aux")
    return out


# --------------------------------------------------------------------------- the two engines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", default="local")
    args = parser.parse_args(argv)
    p_tp, d_tp = 1, 2

    # prefill: one rank, on its own thread; released rooms are handed over through a list
    pre_rank = shared_blocks(pd.create_backend(args.backend, agent_name="example-prefill"))
    released: list[tuple[int, pd.Status]] = []
    lock = threading.Lock()

    def on_released(room: int, status: pd.Status, failure: pd.Failure | None) -> None:
        with lock:
            released.append((room, status))

    # the control plane is authenticated (CURVE): here one generated key for both engines; a
    # deployment makes one with `pdwire keys generate DIR` (ControlAuth.from_directory(DIR))
    auth = pd.ControlAuth.generate()
    pre_cfg = pd.PrefillConfig(
        engine_id="prefill-0", rank=pd.ParallelRank(p_tp, 0), model=MODEL, control_auth=auth
    )
    prefill = pd.PrefillWorker(pre_cfg, pre_rank.memory, backend=pre_rank.backend, on_released=on_released)

    # decode: two ranks, stepped from this loop
    finished: dict[tuple[int, int], tuple[pd.Status, pd.Failure | None]] = {}
    dec_ranks, decoders = [], []
    for r in range(d_tp):
        rank = packed(pd.create_backend(args.backend, agent_name=f"example-decode{r}"), d_tp, r)
        for arr in (*rank.k, *rank.v, *rank.conv, *rank.ssm):
            arr.fill(SENTINEL)
        cfg = pd.DecodeConfig(
            engine_id="decode-0", rank=pd.ParallelRank(d_tp, r), model=MODEL, control_auth=auth
        )
        worker = pd.DecodeWorker(
            cfg,
            rank.memory,
            backend=rank.backend,
            on_finished=lambda room, st, f, r=r: finished.update({(r, room): (st, f)}),
        )
        dec_ranks.append(rank)
        decoders.append(worker)

    try:
        ok = run(prefill, decoders, pre_rank, dec_ranks, finished)
        with lock:
            ok &= len(released) == 2 and all(status is pd.Status.SUCCESS for _, status in released)
    finally:
        for d in decoders:
            d.close()
        for rank in (pre_rank, *dec_ranks):
            rank.backend.close()
    print("result:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


def run(
    prefill: pd.PrefillWorker,
    decoders: list[pd.DecodeWorker],
    pre_rank: Rank,
    dec_ranks: list[Rank],
    finished: dict[tuple[int, int], tuple[pd.Status, pd.Failure | None]],
) -> bool:
    """Connect, move two requests, check every destination byte; the prefill worker runs on its
    own thread (closed with it), the decode workers are stepped here."""
    d_tp = len(decoders)
    ok = True
    with pd.WorkerThread(prefill) as pre_thread:
        # connect() returns at once; each decode rank runs its handshake from its own steps
        # (wait_ready(group) is the blocking form). A room could be started on a group still
        # connecting: it would wait inside its deadline.
        groups = [d.connect([prefill.endpoint]) for d in decoders]
        while any(g.state is pd.GroupState.CONNECTING for g in groups):
            for d in decoders:
                d.step(5)
        for g in groups:
            if g.failed:
                raise pd.HandshakeError(g.error or "handshake failed")
        requests = [("example-request-1", 11, 0), ("example-request-2", 14, 2 * PAGE)]
        for n, (request_id, tokens, prefix) in enumerate(requests):
            room = pd.room_for_request(request_id)
            pages_needed = -(-tokens // PAGE)
            # prefill's blocks: the request's KV pages, then its Mamba slot, from one block space
            src_pages = np.arange(pages_needed, dtype=np.int32) + 8 * n
            src_slot = 8 * n + pages_needed
            content = full_content(seed=n, tokens=tokens)
            place(pre_rank, shard(content, 1, 0), src_pages, slot=src_slot, item=n)
            # decode's pages, downwards from the top of its pool, none shared by the two requests
            dst_pages = PAGES - 1 - (np.arange(pages_needed, dtype=np.int32) + 4 * n)
            skip = prefix // PAGE  # the pages decode already holds
            for d, group in zip(decoders, groups, strict=True):
                indices = pd.RequestIndices(
                    dst_pages[skip:], state=[[n]], aux_index=ITEMS - 1 - n, decode_prefix_len=prefix
                )
                d.start_room(room, indices, group)
            # chunked prefill: two chunks, the last one with the Mamba slot and the aux item
            half = pages_needed // 2
            pre_thread.submit(prefill.send_chunk, room, src_pages[:half], last=False).result()
            pre_thread.submit(
                prefill.send_chunk, room, src_pages[half:], last=True, state=[[src_slot]], aux_index=n
            ).result()
            deadline = time.monotonic() + 30
            while not all((r, room) in finished for r in range(d_tp)):
                if time.monotonic() > deadline:
                    print(f"{request_id}: not finished in time", file=sys.stderr)
                    return False
                for d in decoders:
                    d.step(5)
            for r, rank in enumerate(dec_ranks):
                status, failure = finished[(r, room)]
                bad = []
                if status is pd.Status.SUCCESS:
                    bad = mismatches(
                        rank, shard(content, d_tp, r), dst_pages, skip, slot=n, item=ITEMS - 1 - n
                    )
                ok &= status is pd.Status.SUCCESS and not bad
                why = failure.reason if failure else ", ".join(bad) or "byte for byte"
                print(f"{request_id} (room {room}) decode rank {r}/{d_tp}: {status.name}, {why}")
        # prefill releases a room's source pages once nothing of it is in flight
        deadline = time.monotonic() + 30
        while pre_thread.submit(prefill.status, room).result() is not pd.Status.SUCCESS:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
    return ok


if __name__ == "__main__":
    sys.exit(main())
