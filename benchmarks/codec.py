"""Codec benchmark: pdwire's generated codecs against today's hand-written positional frames.

    .venv/bin/python benchmarks/codec.py [--repeat 21] [--quick] [--timer cpu] [--sglang]

Messages: RegisterInfo (64 layers, 3 state components) and TransferRequest (2048 KV pages;
components mamba [1 slot], swa [64 pages], dsa [2048 pages]). The baseline encodes the same
content (every field pdwire's message carries; checked in the run) the way SGLang writes it
today: positional ZMQ frames, ASCII integers, pointer lists packed with ``struct.pack``,
per-component lists (and lists of buffers) packed with ``struct.pack`` into count + lengths
+ payload and unpacked back to lists. The floor row writes and reads the same frames with only
the msgspec and numpy calls this layout needs and no checks (see ``request_floor``). Each cell
is the median of ``--repeat`` interleaved rounds (each the mean over many calls, every codec
taking turns in the same process); "fastest" is the best round.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
from _common import codec_arguments, interleaved_us, machine, reference_loop, reference_text, table_row
from baseline_frames import (
    ascii_int,
    native_u64,
    pack_int_lists,
    pack_list_of_buffers,
    unpack_int_lists,
    unpack_list_of_buffers,
    unpack_u64,
)

import pdwire.wire as w

# ---------------------------------------------------------------------------- baseline codec


def baseline_request_encode(req: dict[str, Any]) -> list[bytes]:
    return [
        ascii_int(req["room"]),
        req["sender"].encode("ascii"),
        req["kv"].astype(np.int32).tobytes(),
        ascii_int(req["aux"]),
        pack_int_lists(req["state"], "i"),
        ascii_int(req["required_dst_info_num"]),
        ascii_int(req["decode_prefix_len"]),
        ascii_int(int(req["is_dummy"])),
    ]


def baseline_request_decode(msg: list[bytes]) -> tuple[Any, ...]:
    return (
        int(msg[0].decode("ascii")),
        msg[1].decode("ascii"),
        np.frombuffer(msg[2], dtype=np.int32),
        int(msg[3].decode("ascii")),
        unpack_int_lists(msg[4], "i"),
        int(msg[5].decode("ascii")),
        int(msg[6].decode("ascii")),
        bool(int(msg[7].decode("ascii"))),
    )


_GEOMETRY = ("tp_size", "tp_rank", "pp_size", "pp_rank", "cp_size", "cp_rank", "dp_size", "dp_rank")
_REG_INTS = ("num_pages", "page_size", "kv_layout", "kv_heads_per_rank", "kv_heads_total", "bytes_per_head")
_REG_PTRS = ("k_ptrs", "v_ptrs", "bytes_per_page", "region_lens", "aux_ptrs", "aux_lens", "aux_item_lens")
_STATE_LISTS = ("state_ptrs", "state_region_lens", "state_item_lens", "state_dims")


def baseline_register_encode(r: dict[str, Any]) -> list[bytes]:
    """Every field pdwire's RegisterInfo carries, one positional frame each, as SGLang writes them."""
    return [
        r["endpoint"].encode("ascii"),
        r["engine_id"].encode("ascii"),
        r["agent_name"].encode("ascii"),
        r["agent_metadata"],
        *(ascii_int(r["geometry"][g]) for g in _GEOMETRY),
        ascii_int(r["first_layer"]),
        ascii_int(r["num_layers"]),
        *(native_u64(r[k]) for k in _REG_PTRS),
        *(ascii_int(r[k]) for k in _REG_INTS),
        ascii_int(int(r["is_mla"])),
        pack_list_of_buffers(r["kv_mem_descs"]),
        ",".join(str(t) for t in r["state_types"]).encode("ascii"),
        *(pack_int_lists(r[k], "Q") for k in _STATE_LISTS),
        pack_list_of_buffers([pack_int_lists(per_comp, "Q") for per_comp in r["state_sub_blocks"]]),
        pack_list_of_buffers([pack_list_of_buffers(per_comp) for per_comp in r["state_mem_descs"]]),
    ]


def baseline_register_decode(msg: list[bytes]) -> dict[str, Any]:
    it = iter(msg)
    out: dict[str, Any] = {
        "endpoint": next(it).decode("ascii"),
        "engine_id": next(it).decode("ascii"),
        "agent_name": next(it).decode("ascii"),
        "agent_metadata": next(it),
    }
    out["geometry"] = {g: int(next(it).decode("ascii")) for g in _GEOMETRY}
    out["first_layer"] = int(next(it).decode("ascii"))
    out["num_layers"] = int(next(it).decode("ascii"))
    for k in _REG_PTRS:
        out[k] = unpack_u64(next(it))
    for k in _REG_INTS:
        out[k] = int(next(it).decode("ascii"))
    out["is_mla"] = bool(int(next(it).decode("ascii")))
    out["kv_mem_descs"] = unpack_list_of_buffers(next(it))
    types = next(it).decode("ascii")
    out["state_types"] = [int(t) for t in types.split(",")] if types else []
    for k in _STATE_LISTS:
        out[k] = unpack_int_lists(next(it), "Q")
    out["state_sub_blocks"] = [unpack_int_lists(b, "Q") for b in unpack_list_of_buffers(next(it))]
    out["state_mem_descs"] = [unpack_list_of_buffers(b) for b in unpack_list_of_buffers(next(it))]
    return out


# ---------------------------------------------------------------------------- content

LAYERS = 64
BASE = 0x7F00_0000_0000


def register_content() -> tuple[w.RegisterInfo, dict[str, Any]]:
    u64 = np.uint64
    k = np.arange(LAYERS, dtype=u64) * u64(1 << 30) + u64(BASE)
    v = k + u64(1 << 29)
    comps = [
        # mamba: conv (x|B|C sub-blocks) and temporal state per layer
        w.StateComponent(
            type=w.StateType.MAMBA,
            base_addrs=np.arange(2 * LAYERS, dtype=u64) * u64(1 << 24) + u64(BASE >> 1),
            region_lens=np.full(2 * LAYERS, 1 << 24, dtype=u64),
            bytes_per_slot=np.tile(np.array([24576, 262144], dtype=u64), LAYERS),
            shard_axis_sizes=np.tile(np.array([6144, 64], dtype=u64), LAYERS),
            sub_blocks=[np.array([4096, 1024, 1024], dtype=u64), np.zeros(0, dtype=u64)] * LAYERS,
        ),
        w.StateComponent(
            type=w.StateType.SWA,
            base_addrs=np.arange(2 * LAYERS, dtype=u64) * u64(1 << 26) + u64(BASE >> 2),
            region_lens=np.full(2 * LAYERS, 1 << 26, dtype=u64),
            bytes_per_slot=np.full(2 * LAYERS, 8192, dtype=u64),
            shard_axis_sizes=np.full(2 * LAYERS, 8, dtype=u64),
        ),
        w.StateComponent(
            type=w.StateType.DSA,
            base_addrs=np.arange(LAYERS, dtype=u64) * u64(1 << 22) + u64(BASE >> 3),
            region_lens=np.full(LAYERS, 1 << 22, dtype=u64),
            bytes_per_slot=np.full(LAYERS, 8448, dtype=u64),
        ),
    ]
    meta = bytes(range(256)) * 4
    msg = w.RegisterInfo(
        endpoint="10.0.0.2:17001",
        engine_id="decode-0",
        agent_name="10.0.0.2:17001",
        agent_metadata=meta,
        geometry=w.ParallelGeometry(tp_size=8, tp_rank=3),
        first_layer=0,
        num_layers=LAYERS,
        k_base_addrs=k,
        v_base_addrs=v,
        bytes_per_page=np.full(LAYERS, 8192, dtype=u64),
        region_lens=np.full(LAYERS, 1 << 29, dtype=u64),
        num_pages=65536,
        page_size=16,
        kv_layout=w.KvLayout.HND,
        kv_heads_per_rank=1,
        kv_heads_total=8,
        bytes_per_head=256,
        is_mla=False,
        aux_base_addrs=np.array([BASE >> 4], dtype=u64),
        aux_lens=np.array([1 << 20], dtype=u64),
        aux_item_lens=np.array([64], dtype=u64),
        state_components=comps,
    )
    return msg, register_raw(msg)


def register_raw(m: w.RegisterInfo) -> dict[str, Any]:
    """The same content as ``m`` in the Python lists and ints today's senders hold."""
    comps = m.state_components
    fields = ("endpoint", "engine_id", "agent_name", "agent_metadata", "first_layer", "num_layers", "is_mla")
    raw = {k: getattr(m, k) for k in fields} | {k: int(getattr(m, k)) for k in _REG_INTS}
    raw["geometry"] = {g: getattr(m.geometry, g) for g in _GEOMETRY}
    arrays = ("k_base_addrs", "v_base_addrs", "bytes_per_page", "region_lens", "aux_base_addrs", "aux_lens")
    raw |= {k: getattr(m, a).tolist() for k, a in zip(_REG_PTRS, (*arrays, "aux_item_lens"), strict=True)}
    raw["kv_mem_descs"] = list(m.kv_mem_descs)
    raw["state_types"] = [int(c.type) for c in comps]
    per_comp = ("base_addrs", "region_lens", "bytes_per_slot", "shard_axis_sizes")
    raw |= {k: [getattr(c, a).tolist() for c in comps] for k, a in zip(_STATE_LISTS, per_comp, strict=True)}
    raw["state_sub_blocks"] = [[b.tolist() for b in c.sub_blocks] for c in comps]
    raw["state_mem_descs"] = [list(c.mem_descs) for c in comps]
    return raw


def request_content() -> tuple[w.TransferRequest, dict[str, Any]]:
    rng = np.random.default_rng(0)
    kv = rng.permutation(1 << 16)[:2048].astype(np.int32)
    mamba = np.array([17], dtype=np.int32)
    swa = kv[-64:].copy()
    dsa = rng.permutation(1 << 16)[:2048].astype(np.int32)
    msg = w.TransferRequest(
        room=(1 << 63) + 12345,
        sender="10.0.0.2:17001",
        dst_kv_indices=kv,
        dst_aux_index=5,
        state_indices=[mamba, swa, dsa],
    )
    raw = {
        "room": msg.room,
        "sender": msg.sender,
        "kv": kv,
        "aux": msg.dst_aux_index,
        "state": [mamba.tolist(), swa.tolist(), dsa.tolist()],
        "required_dst_info_num": msg.required_dst_info_num,
        "decode_prefix_len": msg.decode_prefix_len,
        "is_dummy": msg.is_dummy,
    }
    return msg, raw


# ---------------------------------------------------------------------------- the floor


def request_floor(req: w.TransferRequest) -> tuple[Callable[[], list[Any]], Callable[[list[bytes]], object]]:
    """TransferRequest's frames with only the library calls any codec of this layout must make.

    Encode: the header, msgspec on the body (small arrays copied in with ``tobytes``, the
    cheapest way) and the two large arrays themselves as side frames (any buffer-protocol
    object is a ZMQ frame; ``.data`` would add a memoryview per array); decode: msgspec into the
    typed body, four ``np.frombuffer`` views and the message struct. No type, dtype, order or
    frame-count checks, no dispatch: what is left when every check pdwire makes is removed.
    """
    mc = w.REGISTRY.by_class[w.TransferRequest]
    header, body_decode, encode_body = mc.headers[2], mc.decoder.decode, msgspec.msgpack.Encoder().encode
    i32, fb = np.dtype("<i4"), np.frombuffer

    def encode() -> list[Any]:
        m = req
        mamba, swa, dsa = m.state_indices
        assert mamba is not None and swa is not None and dsa is not None
        fields = [m.room, m.sender, 2, m.dst_aux_index, b"", m.required_dst_info_num, m.decode_prefix_len]
        scatter = [m.scatter_offset, m.scatter_page_bytes, m.scatter_pages]
        body = encode_body([*fields, m.is_dummy, [mamba.tobytes(), swa.tobytes(), 3], *scatter])
        return [header, body, m.dst_kv_indices, dsa]

    def decode(f: list[bytes]) -> object:
        b = body_decode(f[1])
        mamba, swa, _ = b.state_indices
        return w.TransferRequest(
            room=b.room,
            sender=b.sender,
            dst_kv_indices=fb(f[2], i32),
            dst_aux_index=b.dst_aux_index,
            required_dst_info_num=b.required_dst_info_num,
            decode_prefix_len=b.decode_prefix_len,
            is_dummy=b.is_dummy,
            state_indices=[fb(mamba, i32), fb(swa, i32), fb(f[3], i32)],
            scatter_offset=b.scatter_offset,
            scatter_page_bytes=b.scatter_page_bytes,
            scatter_pages=b.scatter_pages,
        )

    return encode, decode


# ---------------------------------------------------------------------------- timing


def frames_bytes(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


TABLE_HEAD = (
    "| message | codec | encode µs | decode µs | enc+dec µs | fastest enc+dec µs | speed-up | bytes on wire "
    "| frames |\n|---|---|---|---|---|---|---|---|---|"
)
Case = tuple[str, str, Callable[[], list[Any]], Callable[[list[bytes]], object]]


def main(argv: list[str] | None = None) -> int:
    ap = codec_arguments(__doc__)
    ap.add_argument("--sglang", action="store_true", help="also the SGLang profile rows (codec_sglang.py)")
    args = ap.parse_args(argv)

    load = os.getloadavg()[0]
    reg, reg_raw = register_content()
    req, req_raw = request_content()
    floor_encode, floor_decode = request_floor(req)
    cases: list[Case] = [
        ("RegisterInfo", "pdwire", lambda: w.encode(reg), w.decode),
        ("RegisterInfo", "baseline", lambda: baseline_register_encode(reg_raw), baseline_register_decode),
        ("TransferRequest", "pdwire", lambda: w.encode(req), w.decode),
        ("TransferRequest", "floor", floor_encode, floor_decode),
        ("TransferRequest", "baseline", lambda: baseline_request_encode(req_raw), baseline_request_decode),
    ]
    check_same_content(reg, reg_raw, req, req_raw, floor_encode, floor_decode)
    received = {(name, codec): frames_bytes(enc()) for name, codec, enc, _ in cases}  # what ZMQ delivers
    fns: dict[tuple[str, str, str], Callable[[], object]] = {("reference", "", ""): reference_loop}
    for name, codec, enc, dec in cases:
        fns[(name, codec, "encode")] = enc
        fns[(name, codec, "decode")] = _bind(dec, received[(name, codec)])
    runs = interleaved_us(fns, args.repeat, args.quick, args.timer)
    # encode + decode of the same round, per row
    both = {
        (name, codec): [
            e + d for e, d in zip(runs[(name, codec, "encode")], runs[(name, codec, "decode")], strict=True)
        ]
        for name, codec, _, _ in cases
    }

    print(machine_line(args.repeat, args.timer, load, runs[("reference", "", "")]))
    print()
    print(TABLE_HEAD)
    for name, codec, _, _ in cases:
        e, d = (statistics.median(runs[(name, codec, op)]) for op in ("encode", "decode"))
        median, fastest = statistics.median(both[(name, codec)]), min(both[(name, codec)])
        speed = statistics.median(both[(name, "baseline")]) / median
        frames = received[(name, codec)]
        cells = [f"{x:.2f}" for x in (e, d, median, fastest)]
        print(table_row([name, codec, *cells, f"{speed:.1f}x", sum(len(f) for f in frames), len(frames)]))
    # the target's ratio, round by round: both rows were timed side by side in each round, so
    # the ratio holds still while this VM's phases move every row together
    pairs = zip(both[("TransferRequest", "pdwire")], both[("TransferRequest", "floor")], strict=True)
    ratios = [p / f for p, f in pairs]
    spread = ""
    if len(ratios) > 1:
        q1, _, q3 = statistics.quantiles(ratios)
        spread = f" (quartiles {q1:.2f}-{q3:.2f}x)"
    median = statistics.median(ratios)
    print(f"\nTransferRequest enc+dec, pdwire / floor per round: median {median:.2f}x{spread}")
    if args.sglang:  # SGLang wire profile rows: generated pdwire.wire.sglang vs hand-written frame code
        from codec_sglang import TABLE_HEAD as SGLANG_HEAD
        from codec_sglang import run as sglang_rows

        print("\n".join(["", SGLANG_HEAD, *sglang_rows(args.repeat, args.quick, args.timer)[0]]))
    return 0


def machine_line(repeat: int, timer: str, load: float, reference: list[float]) -> str:
    """The header line every codec table starts with: machine, library versions, the reference loop."""
    return machine(
        f"msgspec {msgspec.__version__}; medians of {repeat} interleaved rounds ({timer} time)",
        f"load average at start {load:.1f}; {reference_text(reference)}",
    )


def check_same_content(
    reg: w.RegisterInfo,
    reg_raw: dict[str, Any],
    req: w.TransferRequest,
    req_raw: dict[str, Any],
    floor_encode: Callable[[], list[Any]],
    floor_decode: Callable[[list[bytes]], object],
) -> None:
    """Every codec in the table carries the same content: checked before anything is timed."""
    assert w.decode(frames_bytes(w.encode(req))) == req and w.decode(frames_bytes(w.encode(reg))) == reg
    # the floor writes pdwire's exact frames and reads them back into the same message
    assert frames_bytes(floor_encode()) == frames_bytes(w.encode(req))
    assert floor_decode(frames_bytes(w.encode(req))) == req
    # the baseline carries the same content: what it decodes is what pdwire's message holds
    assert baseline_register_decode(frames_bytes(baseline_register_encode(reg_raw))) == reg_raw
    got = baseline_request_decode(frames_bytes(baseline_request_encode(req_raw)))
    assert np.array_equal(got[2], req.dst_kv_indices)
    assert got[:2] + got[3:] == (
        req.room,
        req.sender,
        req.dst_aux_index,
        req_raw["state"],
        req.required_dst_info_num,
        req.decode_prefix_len,
        req.is_dummy,
    )


def _bind(dec: Callable[[list[bytes]], object], received: list[bytes]) -> Callable[[], object]:
    return lambda: dec(received)


if __name__ == "__main__":
    raise SystemExit(main())
