"""SGLang profile benchmark: generated ``pdwire.wire.sglang`` codecs against hand-written frame code.

    .venv/bin/python benchmarks/codec_sglang.py [--repeat 21] [--quick] [--timer cpu]

(``benchmarks/codec.py --sglang`` runs it after pdwire's own rows.) Messages, SGLang 0.5.23
layouts: NIXL register (64 KV layers, 2 state components, opaque 1 KiB agent metadata),
Mooncake transfer info (2048 KV pages; components mamba [1], swa [64], dsa [2048]), MoRI
transfer info (same indices), NIXL status. The baseline is SGLang-style hand-written code:
builders with ``struct.pack``/``tobytes``/``pack_int_lists`` and parsers with ``int()``,
``struct.unpack`` and ``np.frombuffer`` (lists unpacked to Python lists, as SGLang does),
with none of the generated codec's validation. Both produce the same frames (asserted).
Each cell is the median of ``--repeat`` interleaved rounds (``_common.interleaved_us``),
each the mean over many calls, same process; ``--timer cpu`` counts this process's CPU time only
(a run descheduled on a shared machine does not count the time it waited).
"""

from __future__ import annotations

import os
import statistics
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import codec_arguments, interleaved_us, reference_loop, table_row
from baseline_frames import native_u64, pack_int_lists, unpack_int_lists, unpack_u64

from pdwire.wire import sglang

IP = b"10.0.0.2"
TABLE_HEAD = (
    "| message | codec | encode µs | decode µs | enc+dec µs | speed-up | bytes on wire | frames |\n"
    "|---|---|---|---|---|---|---|---|"
)


# ---------------------------------------------------------------------------- hand-written baseline
def base_nixl_register_encode(c: dict[str, Any]) -> list[bytes]:
    return [
        b"NixlMsgGuard",
        b"None",
        IP,
        b"7000",
        b"agent-1",
        c["meta"],
        native_u64(c["kv"]),
        native_u64(c["aux"]),
        pack_int_lists(c["state"], "Q"),
        b"0",
        b"4",
        b"1",
        str(c["item_lens"][0]).encode(),
        pack_int_lists(c["state_item_lens"], "I"),
        pack_int_lists(c["dims"], "I"),
        b"",
        b"",
        b"4096",
        b"",
        native_u64(c["item_lens"]),
        pack_int_lists(c["state_layers"], "I"),
        b"".join(struct.pack("I", x) for x in c["kv_layers"]),
        b"1",
        b"0",
        pack_int_lists(c["state_lens"], "Q"),
    ]


def base_nixl_register_decode(m: list[bytes]) -> dict[str, Any]:
    assert m[0] == b"NixlMsgGuard"
    m = m[1:]
    return {
        "ip": m[1].decode("ascii"),
        "port": int(m[2].decode("ascii")),
        "agent": m[3].decode("ascii"),
        "meta": m[4],
        "kv": unpack_u64(m[5]),
        "aux": unpack_u64(m[6]),
        "state": unpack_int_lists(m[7], "Q"),
        "gpu": int(m[8]),
        "tp": int(m[9]),
        "rank": int(m[10]),
        "item_len": int(m[11]),
        "state_item_lens": unpack_int_lists(m[12], "I"),
        "dims": unpack_int_lists(m[13], "I"),
        "staging": unpack_u64(m[14]) if m[14] else None,
        "staging_size": int(m[15]) if m[15] else 0,
        "slots": int(m[16]),
        "kinds": m[17].decode().split(",") if m[17] else [],
        "item_lens": unpack_u64(m[18]),
        "state_layers": unpack_int_lists(m[19], "I"),
        "kv_layers": list(struct.unpack(f"{len(m[20]) // 4}I", m[20])),
        "dcp": (int(m[21]), int(m[22])),
        "state_lens": unpack_int_lists(m[23], "Q") if len(m) > 23 else [],
    }


def base_mooncake_transfer_encode(room: int, kv: np.ndarray[Any, Any], state: list[list[int]]) -> list[bytes]:
    return [
        str(room).encode(),
        IP,
        b"7000",
        b"sess-1",
        kv.tobytes(),
        b"3",
        pack_int_lists(state, "i"),
        b"1",
        b"0",
        b"",
    ]


def base_mooncake_transfer_decode(m: list[bytes]) -> dict[str, Any]:
    dummy = not m[4] and not m[5]
    return {
        "room": int(m[0]),
        "ip": m[1].decode(),
        "port": int(m[2]),
        "session": m[3].decode(),
        "kv": np.frombuffer(m[4], dtype=np.int32),
        "aux": None if dummy else int(m[5]),
        "state": [] if dummy else unpack_int_lists(m[6], "i"),
        "req": int(m[7]),
        "prefix": int(m[8]) if len(m) > 8 else 0,
        "device": np.frombuffer(m[9], dtype=np.int32) if len(m) > 9 and m[9] else None,
    }


def base_mori_transfer_encode(room: int, kv: np.ndarray[Any, Any], state: list[list[int]]) -> list[bytes]:
    return [
        b"MoriMsgGuard",
        str(room).encode(),
        IP,
        b"7000",
        b"engine-1",
        np.asarray(kv, dtype=np.int32).tobytes(),
        b"3",
        pack_int_lists(state, "i"),
        b"1",
        b"",
    ]


def base_mori_transfer_decode(m: list[bytes]) -> dict[str, Any]:
    assert m[0] == b"MoriMsgGuard"
    m = m[1:]
    return {
        "room": int(m[0]),
        "ip": m[1].decode(),
        "port": int(m[2]),
        "key": m[3].decode(),
        "kv": np.frombuffer(m[4], dtype=np.int32),
        "aux": int(m[5]) if m[5] else -1,
        "state": unpack_int_lists(m[6], "i"),
        "req": int(m[7]) if len(m) > 7 else 1,
        "prefix": int(m[8]) if len(m) > 8 and m[8] else None,
    }


def base_status_encode(room: int, reason: str) -> list[bytes]:
    return [b"KV_STATUS", str(room).encode(), b"0", b"5", reason.encode("utf-8")]


def base_status_decode(m: list[bytes]) -> tuple[int, int, int, str | None]:
    return int(m[1]), int(m[2]), int(m[3]), m[4].decode("utf-8") or None


# ---------------------------------------------------------------------------- content
def contents() -> dict[str, Any]:
    rng = np.random.default_rng(6)
    kv = [0x7F00_0000_0000 + i * (1 << 26) for i in range(128)]
    state = [
        [0x7E00_0000_0000 + i * 4096 for i in range(96)],
        [0x7D00_0000_0000 + i * 4096 for i in range(32)],
    ]
    reg = {
        "meta": bytes(rng.integers(0, 256, 1024, dtype=np.uint8)),
        "kv": kv,
        "aux": [0x5000_0000],
        "state": state,
        "item_lens": [65536] * 128,
        "state_item_lens": [[2048] * 96, [65536] * 32],
        "dims": [[16] * 96, []],
        "state_layers": [list(range(48)), list(range(16))],
        "kv_layers": list(range(64)),
        "state_lens": [[1 << 30] * 96, [1 << 32] * 32],
    }
    pages = np.sort(rng.choice(1 << 20, 2048, replace=False)).astype(np.int32)
    idx = [[17], [int(x) for x in pages[-64:]], [int(x) for x in pages]]
    return {"reg": reg, "kv": pages, "state": idx}


def run(repeat: int, quick: bool, timer: str = "wall") -> tuple[list[str], list[float]]:
    """The table rows, and the reference loop's per-round times (for the header line)."""
    c = contents()
    reg = c["reg"]
    nixl_reg = sglang.NixlRegister(
        local_ip=IP.decode(),
        rank_port=7000,
        agent_name="agent-1",
        agent_metadata=reg["meta"],
        kv_data_ptrs=reg["kv"],
        aux_data_ptrs=reg["aux"],
        state_data_ptrs=reg["state"],
        gpu_id=0,
        attn_tp_size=4,
        engine_rank=1,
        kv_item_len=reg["item_lens"][0],
        state_item_lens=reg["state_item_lens"],
        state_dim_per_tensor=reg["dims"],
        num_slots=4096,
        kv_mem_kinds=[],
        kv_item_lens=reg["item_lens"],
        state_layer_ids=reg["state_layers"],
        kv_layer_ids=reg["kv_layers"],
        state_data_lens=reg["state_lens"],
    )
    mc = sglang.MooncakeTransferInfo(
        room=2**63 + 5,
        local_ip=IP.decode(),
        rank_port=7000,
        session_id="sess-1",
        kv_indices=c["kv"],
        aux_index=3,
        required_dst_info_num=1,
        state_indices=[np.asarray(s, np.int32) for s in c["state"]],
    )
    mori = sglang.MoriTransferInfo(
        room=2**63 + 5,
        local_ip=IP.decode(),
        rank_port=7000,
        engine_key="engine-1",
        kv_indices=c["kv"],
        aux_index=3,
        state_indices=mc.state_indices,
    )
    st = sglang.NixlStatus(
        room=2**63 + 5, status=sglang.KVPoll.FAILED, prefill_rank=5, reason="délai dépassé"
    )
    cases: list[tuple[str, Any, Callable[[], list[bytes]], Callable[[list[bytes]], object]]] = [
        ("NixlRegister", nixl_reg, lambda: base_nixl_register_encode(reg), base_nixl_register_decode),
        (
            "MooncakeTransferInfo",
            mc,
            lambda: base_mooncake_transfer_encode(mc.room, c["kv"], c["state"]),
            base_mooncake_transfer_decode,
        ),
        (
            "MoriTransferInfo",
            mori,
            lambda: base_mori_transfer_encode(mori.room, c["kv"], c["state"]),
            base_mori_transfer_decode,
        ),
        ("NixlStatus", st, lambda: base_status_encode(st.room, "délai dépassé"), base_status_decode),
    ]
    fns: dict[tuple[str, str, str], Callable[[], object]] = {("reference", "", ""): reference_loop}
    sizes = {}
    for name, msg, base_enc, base_dec in cases:
        frames = sglang.encode(msg)
        assert base_enc() == frames, name  # the same bytes on the wire
        assert sglang.to_dict(sglang.decode(frames)) == sglang.to_dict(msg)
        sizes[name] = (sum(len(f) for f in frames), len(frames))
        for codec, enc, dec in (
            ("pdwire", lambda m=msg: sglang.encode(m), sglang.decode),
            ("hand-written", base_enc, base_dec),
        ):
            fns[(name, codec, "encode")] = enc
            fns[(name, codec, "decode")] = lambda dec=dec, f=frames: dec(f)
    runs = interleaved_us(fns, repeat, quick, timer)
    rows = []
    for name, *_ in cases:
        cells = {
            codec: [statistics.median(runs[(name, codec, op)]) for op in ("encode", "decode")]
            for codec in ("pdwire", "hand-written")
        }
        base = sum(cells["hand-written"])
        for codec, (e, d) in cells.items():
            speed = f"{base / (e + d):.1f}x"
            cells = [f"sglang {name}", codec, f"{e:.2f}", f"{d:.2f}", f"{e + d:.2f}", speed, *sizes[name]]
            rows.append(table_row(cells))
    return rows, runs[("reference", "", "")]


def main(argv: list[str] | None = None) -> int:
    from codec import machine_line

    args = codec_arguments(__doc__).parse_args(argv)
    load = os.getloadavg()[0]
    rows, reference = run(args.repeat, args.quick, args.timer)
    print(machine_line(args.repeat, args.timer, load, reference))
    print()
    print("\n".join([TABLE_HEAD, *rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
