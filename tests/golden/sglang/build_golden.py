"""Writes frames.json: SGLang's frames assembled the way SGLang 0.5.23's builders assemble them.

Run by hand (``.venv/bin/python tests/golden/sglang/build_golden.py``) and committed; the
tests never run it. It uses only ``struct``, numpy's ``tobytes`` and msgspec's msgpack, as
SGLang's builders do, and none of pdwire's codecs, so the golden frames check the generated
codecs independently. ``fields`` is what pdwire's decode must return (``to_dict`` form:
arrays as lists, blobs as hex, enums by name).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import msgspec
import numpy as np


def dec(x: int) -> bytes:
    return str(x).encode("ascii")


def nQ(xs: list[int]) -> bytes:
    return b"".join(struct.pack("Q", x) for x in xs)


def nI(xs: list[int]) -> bytes:
    return b"".join(struct.pack("I", x) for x in xs)


def i32raw(xs: list[int]) -> bytes:
    return np.asarray(xs, dtype=np.int32).tobytes()


def pack_int_lists(lists: list[list[int]], fmt: str) -> bytes:
    if not lists:
        return b""
    bufs = [struct.pack(f"<{len(a)}{fmt}", *a) for a in lists]
    return struct.pack(f"<{len(bufs) + 1}I", len(bufs), *(len(b) for b in bufs)) + b"".join(bufs)


def mp(blobs: list[Any]) -> bytes:
    return msgspec.msgpack.encode(blobs) if blobs else b""


CASES: list[dict[str, Any]] = []


def case(
    name: str, backend: str, message: str, version: str, frames: list[bytes], fields: dict[str, Any]
) -> None:
    CASES.append(
        {
            "name": name,
            "backend": backend,
            "message": message,
            "version": version,
            "frames": [f.hex() for f in frames],
            "fields": fields,
        }
    )


HI = 2**64 - 1
TOP = 2**63
IP = "10.1.2.3"


# ------------------------------------------------------------------ Mooncake register (2.0)
def mooncake_register(
    name: str,
    *,
    kv: list[int],
    aux: list[int],
    state: list[list[int]],
    item_lens: list[list[int]],
    dims: list[list[int]],
    kv_layers: list[int],
    state_layers: list[list[int]],
    staging: tuple[int, int, list[int]] | None,
    kv_item_lens: list[int],
    rank: int = 3,
    tp: int = 4,
) -> None:
    kv_item_len = kv_item_lens[0] if kv_item_lens else 0
    frames = [
        b"None",
        IP.encode(),
        dec(17001),
        b"10.1.2.3:15000",
        nQ(kv),
        nQ(aux),
        pack_int_lists(state, "Q"),
        dec(rank),
        dec(tp),
        dec(kv_item_len),
        pack_int_lists(item_lens, "I"),
        pack_int_lists(dims, "I"),
        nI(kv_layers),
        pack_int_lists(state_layers, "I"),
        nQ([staging[0]]) if staging else b"",
        dec(staging[1]) if staging else b"",
        dec(1),
        dec(0),
        nQ(staging[2]) if staging else b"",
        struct.pack(f"{len(kv_item_lens)}Q", *kv_item_lens),
    ]
    case(
        name,
        "mooncake",
        "MooncakeRegister",
        "2.0",
        frames,
        {
            "local_ip": IP,
            "rank_port": 17001,
            "session_id": "10.1.2.3:15000",
            "kv_data_ptrs": kv,
            "aux_data_ptrs": aux,
            "state_data_ptrs": state,
            "dst_tp_rank": rank,
            "attn_tp_size": tp,
            "kv_item_len": kv_item_len,
            "state_item_lens": item_lens,
            "state_dim_per_tensor": dims,
            "kv_layer_ids": kv_layers,
            "state_layer_ids": state_layers,
            "staging_base_ptr": staging[0] if staging else None,
            "staging_total_size": staging[1] if staging else None,
            "dcp_size": 1,
            "dcp_rank": 0,
            "staging_slot_layer_ids": staging[2] if staging else [],
            "kv_item_lens": kv_item_lens,
        },
    )


mooncake_register(
    "normal",
    kv=[0x7F0000000000, 0x7F0000100000],
    aux=[0x600000],
    state=[[0x7E00, 0x7F00], [0x9000]],
    item_lens=[[256, 4096], [8192]],
    dims=[[16, 32], []],
    kv_layers=[0, 1],
    state_layers=[[2, 3], [4]],
    staging=None,
    kv_item_lens=[8192, 8192],
)
mooncake_register(
    "staging_and_pointer_limits",
    kv=[HI, TOP],
    aux=[TOP + 1],
    state=[[HI]],
    item_lens=[[2**32 - 1]],
    dims=[[1]],
    kv_layers=[2**32 - 1],
    state_layers=[[0]],
    staging=(TOP + 5, 1 << 40, [0, 1, 2]),
    kv_item_lens=[HI, 1],
)
mooncake_register(
    "empty_component",
    kv=[4096],
    aux=[],
    state=[[]],
    item_lens=[[]],
    dims=[[]],
    kv_layers=[0],
    state_layers=[[]],
    staging=None,
    kv_item_lens=[64],
)
mooncake_register(
    "no_components_no_kv",
    kv=[],
    aux=[],
    state=[],
    item_lens=[],
    dims=[],
    kv_layers=[],
    state_layers=[],
    staging=None,
    kv_item_lens=[],
)


# ------------------------------------------------------------------ Mooncake transfer info (2.0)
def mooncake_transfer(
    name: str,
    *,
    room: int,
    kv: list[int] | None,
    aux: int | None,
    state: list[list[int]] | None,
    req: int = 1,
    prefix: int | None = None,
    device: list[int] | None = None,
) -> None:
    dummy = kv is None
    frames = [
        dec(room),
        IP.encode(),
        dec(17001),
        b"sess-7",
        b"" if dummy else i32raw(kv or []),
        b"" if dummy else str(aux).encode("ascii"),
        b"" if dummy or not state else pack_int_lists(state, "i"),
        dec(req),
        str(prefix or 0).encode("ascii"),
        b"" if device is None or dummy else i32raw(device),
    ]
    case(
        name,
        "mooncake",
        "MooncakeTransferInfo",
        "2.0",
        frames,
        {
            "room": room,
            "local_ip": IP,
            "rank_port": 17001,
            "session_id": "sess-7",
            "kv_indices": [] if dummy else kv,
            "aux_index": None if dummy else aux,
            "required_dst_info_num": req,
            "decode_prefix_len": prefix or 0,
            "state_indices": [] if dummy or not state else state,
            "device_kv_indices": [] if device is None or dummy else device,
            "is_dummy": dummy,
        },
    )


mooncake_transfer("normal", room=12345, kv=[7, 8, 9], aux=3, state=[[5], [], [10, 11]], device=[1, 2])
mooncake_transfer("dummy_rank", room=2**63 - 1, kv=None, aux=None, state=None, req=2)
mooncake_transfer("full_prefix_hit", room=HI, kv=[], aux=4, state=[[1]], prefix=4096)
mooncake_transfer("no_components", room=0, kv=[2**31 - 1, -(2**31)], aux=0, state=None, prefix=None)
mooncake_transfer("one_empty_component", room=1, kv=[1], aux=1, state=[[]])

# ------------------------------------------------------------------ Mooncake status
case(
    "success",
    "mooncake",
    "MooncakeStatus",
    "2.0",
    [dec(HI), dec(4), dec(5)],
    {"room": HI, "status": "SUCCESS", "prefill_rank": 5, "reason": None},
)
case(
    "failed_with_reason_frame",
    "mooncake",
    "MooncakeStatus",
    "2.0",
    [dec(77), dec(0), dec(0), "délai dépassé ✗".encode()],
    {"room": 77, "status": "FAILED", "prefill_rank": 0, "reason": "délai dépassé ✗"},
)


# ------------------------------------------------------------------ NIXL register (2.0)
def nixl_register(
    name: str,
    *,
    kv: list[int],
    state: list[list[int]],
    item_lens: list[list[int]],
    dims: list[list[int]],
    state_lens: list[list[int]],
    kinds: list[str],
    kv_item_lens: list[int],
    staging: tuple[int, int] | None = None,
) -> None:
    kv_item_len = kv_item_lens[0] if kv_item_lens else 0
    frames = [
        b"NixlMsgGuard",
        b"None",
        IP.encode(),
        dec(17002),
        b"agent-5f0c",
        b"\x00META\xffblob",
        nQ(kv),
        nQ([0x500000]),
        pack_int_lists(state, "Q"),
        dec(1),
        dec(2),
        dec(1),
        dec(kv_item_len),
        pack_int_lists(item_lens, "I"),
        pack_int_lists(dims, "I"),
        nQ([staging[0]]) if staging else b"",
        dec(staging[1]) if staging else b"",
        dec(1000 if kv else 0),
        ",".join(kinds).encode("ascii"),
        nQ(kv_item_lens),
        pack_int_lists([[3]] if state else [], "I"),
        nI([0, 1] if kv else []),
        dec(1),
        dec(0),
        pack_int_lists(state_lens, "Q"),
    ]
    n = len(kv)
    case(
        name,
        "nixl",
        "NixlRegister",
        "2.0",
        frames,
        {
            "local_ip": IP,
            "rank_port": 17002,
            "agent_name": "agent-5f0c",
            "agent_metadata": b"\x00META\xffblob".hex(),
            "kv_data_ptrs": kv,
            "aux_data_ptrs": [0x500000],
            "gpu_id": 1,
            "attn_tp_size": 2,
            "engine_rank": 1,
            "kv_item_len": kv_item_len,
            "staging_base_ptr": staging[0] if staging else None,
            "staging_total_size": staging[1] if staging else None,
            "num_slots": 1000 if kv else 0,
            "state_data_ptrs": state,
            "state_item_lens": item_lens,
            "state_dim_per_tensor": dims,
            "kv_mem_kinds": kinds,
            "kv_item_lens": kv_item_lens,
            "state_layer_ids": [[3]] if state else [],
            "kv_layer_ids": [0, 1] if kv else [],
            "dcp_size": 1,
            "dcp_rank": 0,
            "state_data_lens": state_lens,
            "effective_kv_item_lens": kv_item_lens or [kv_item_len] * n,
            "effective_kv_mem_kinds": kinds or ["VRAM"] * n,
        },
    )


nixl_register(
    "normal",
    kv=[0x7F0000000000, TOP],
    state=[[0x7E00, HI]],
    item_lens=[[256, 512]],
    dims=[[8, 8]],
    state_lens=[[2**40, 2**41]],
    kinds=["VRAM", "DRAM"],
    kv_item_lens=[4096, 4096],
    staging=(TOP, 2**30),
)
nixl_register(
    "no_components_all_vram",
    kv=[4096],
    state=[],
    item_lens=[],
    dims=[],
    state_lens=[],
    kinds=[],
    kv_item_lens=[],
)
nixl_register(
    "empty_component",
    kv=[],
    state=[[]],
    item_lens=[[]],
    dims=[[]],
    state_lens=[[]],
    kinds=[],
    kv_item_lens=[],
)


# ------------------------------------------------------------------ NIXL transfer info (2.0)
def nixl_transfer(
    name: str,
    *,
    room: int,
    kv: list[int],
    aux: int,
    state: list[list[int] | None] | None,
    prefix: int | None,
    dummy: bool,
) -> None:
    state_frame = b"" if dummy or not state else pack_int_lists([s or [] for s in state], "i")
    frames = [
        b"NixlMsgGuard",
        dec(room),
        IP.encode(),
        dec(17002),
        b"agent-5f0c",
        b"" if dummy else i32raw(kv),
        str(aux).encode("ascii"),
        dec(2),
        state_frame,
        str(prefix or 0).encode("ascii"),
        b"1" if dummy else b"0",
    ]
    case(
        name,
        "nixl",
        "NixlTransferInfo",
        "2.0",
        frames,
        {
            "room": room,
            "local_ip": IP,
            "rank_port": 17002,
            "agent_name": "agent-5f0c",
            "kv_indices": [] if dummy else kv,
            "aux_index": aux,
            "required_dst_info_num": 2,
            "decode_prefix_len": prefix or 0,
            "state_indices": [] if dummy or not state else [s or [] for s in state],
            "is_dummy_rank": dummy,
            "is_dummy": dummy,
        },
    )


nixl_transfer(
    "normal_none_component_as_empty",
    room=HI,
    kv=[3, 4],
    aux=2,
    state=[[9], None, [1, 2]],
    prefix=None,
    dummy=False,
)
nixl_transfer("dummy_rank_keeps_aux", room=42, kv=[], aux=6, state=None, prefix=None, dummy=True)
nixl_transfer("full_prefix_hit", room=43, kv=[], aux=6, state=[[1]], prefix=2048, dummy=False)

# ------------------------------------------------------------------ NIXL status
case(
    "no_reason",
    "nixl",
    "NixlStatus",
    "2.0",
    [b"KV_STATUS", dec(9), dec(3), dec(5), b""],
    {"room": 9, "status": "TRANSFERRING", "prefill_rank": 5, "reason": None},
)
case(
    "non_ascii_reason",
    "nixl",
    "NixlStatus",
    "2.0",
    [b"KV_STATUS", dec(HI), dec(0), dec(2), "échec: 内存不足".encode()],
    {"room": HI, "status": "FAILED", "prefill_rank": 2, "reason": "échec: 内存不足"},
)


# ------------------------------------------------------------------ MoRI register (2.0)
def mori_register(
    name: str,
    *,
    kv: list[bytes],
    state: list[list[bytes | None]],
    item_lens: list[list[int]],
    dims: list[list[int]],
    kv_layers: list[int],
) -> None:
    engine = msgspec.msgpack.encode(["engine-key-1", "host-a", "10.1.2.3", 9000])
    frames = [
        b"MoriMsgGuard",
        b"None",
        IP.encode(),
        dec(17003),
        engine,
        mp(kv),
        mp([b"\x93aux"]),
        mp(state),
        dec(0),
        dec(8),
        dec(7),
        dec(16384),
        pack_int_lists(item_lens, "I"),
        pack_int_lists(dims, "I"),
        dec(2),
        dec(1),
        pack_int_lists([[5]] if state else [], "I"),
        struct.pack(f"<{len(kv_layers)}I", *kv_layers),
    ]
    case(
        name,
        "mori",
        "MoriRegister",
        "2.0",
        frames,
        {
            "local_ip": IP,
            "rank_port": 17003,
            "engine_desc": engine.hex(),
            "kv_mem_descs": [b.hex() for b in kv],
            "aux_mem_descs": [b"\x93aux".hex()],
            "gpu_id": 0,
            "attn_tp_size": 8,
            "engine_rank": 7,
            "kv_item_len": 16384,
            "state_mem_descs": [[None if b is None else b.hex() for b in c] for c in state],
            "state_item_lens": item_lens,
            "state_dim_per_tensor": dims,
            "dcp_size": 2,
            "dcp_rank": 1,
            "state_layer_ids": [[5]] if state else [],
            "kv_layer_ids": kv_layers,
        },
    )


mori_register(
    "normal_with_nil_slot",
    kv=[b"\x96desc-k0", b"\x96desc-k1"],
    state=[[b"\x96s0", None], [b"\x96s1"]],
    item_lens=[[128, 256], [64]],
    dims=[[4, 4], []],
    kv_layers=[0, 2**32 - 1],
)
mori_register("no_components", kv=[], state=[], item_lens=[], dims=[], kv_layers=[])
mori_register("empty_component", kv=[b"k"], state=[[]], item_lens=[[]], dims=[[]], kv_layers=[1])


# ------------------------------------------------------------------ MoRI transfer info (2.0)
def mori_transfer(
    name: str,
    *,
    room: int,
    kv: list[int],
    aux: int | None,
    state: list[list[int] | None] | None,
    prefix: int | None,
    dummy: bool = False,
) -> None:
    frames = [
        b"MoriMsgGuard",
        dec(room),
        IP.encode(),
        dec(17003),
        b"engine-key-1",
        b"" if dummy or not kv else np.asarray(kv, dtype=np.int32).tobytes(),
        b"" if dummy or aux is None else dec(aux),
        b"" if dummy or not state else pack_int_lists([s or [] for s in state], "i"),
        dec(1),
        dec(prefix) if prefix and prefix > 0 else b"",
    ]
    case(
        name,
        "mori",
        "MoriTransferInfo",
        "2.0",
        frames,
        {
            "room": room,
            "local_ip": IP,
            "rank_port": 17003,
            "engine_key": "engine-key-1",
            "kv_indices": [] if dummy else kv,
            "aux_index": None if dummy or aux is None else aux,
            "required_dst_info_num": 1,
            "decode_prefix_len": prefix or 0,
            "state_indices": [] if dummy or not state else [s or [] for s in state],
            "is_dummy": dummy or (not kv and aux is None and not prefix),
        },
    )


mori_transfer("normal", room=5, kv=[1, 2, 3], aux=0, state=[[4], None], prefix=None)
mori_transfer("dummy_rank", room=HI, kv=[9], aux=1, state=[[1]], prefix=None, dummy=True)
mori_transfer("full_prefix_hit", room=6, kv=[], aux=2, state=None, prefix=512)

# ------------------------------------------------------------------ MoRI status
case(
    "non_ascii_reason",
    "mori",
    "MoriStatus",
    "2.0",
    [b"MoriMsgGuard", dec(5), dec(0), dec(5), "超时 timeout ✗".encode()],
    {"room": 5, "status": "FAILED", "prefill_rank": 5, "reason": "超时 timeout ✗"},
)
case(
    "success",
    "mori",
    "MoriStatus",
    "2.0",
    [b"MoriMsgGuard", dec(HI), dec(4), dec(0), b""],
    {"room": HI, "status": "SUCCESS", "prefill_rank": 0, "reason": None},
)

# ------------------------------------------------------------------ flat state (1.0)
case(
    "flat_state",
    "mooncake",
    "MooncakeRegister",
    "1.0",
    [
        b"None",
        IP.encode(),
        dec(17001),
        b"sess",
        nQ([TOP]),
        nQ([]),
        nQ([0x7000, HI]),
        dec(0),
        dec(1),
        dec(4096),
        nI([256, 512]),
        nI([16, 16]),
        b"1",
        b"",
        b"",
    ],
    {
        "local_ip": IP,
        "rank_port": 17001,
        "session_id": "sess",
        "kv_data_ptrs": [TOP],
        "aux_data_ptrs": [],
        "flat_state_data_ptrs": [0x7000, HI],
        "dst_tp_rank": 0,
        "attn_tp_size": 1,
        "kv_item_len": 4096,
        "flat_state_item_lens": [256, 512],
        "flat_state_dim_per_tensor": [16, 16],
        "enable_hisparse": "1",
        "flat_staging_base_ptr": None,
        "flat_staging_total_size": None,
    },
)
case(
    "flat_state",
    "mooncake",
    "MooncakeTransferInfo",
    "1.0",
    [dec(8), IP.encode(), dec(17001), b"sess", i32raw([4, 5]), dec(1), i32raw([3]), dec(1), dec(0)],
    {
        "room": 8,
        "local_ip": IP,
        "rank_port": 17001,
        "session_id": "sess",
        "kv_indices": [4, 5],
        "aux_index": 1,
        "flat_state_indices": [3],
        "required_dst_info_num": 1,
        "decode_prefix_len": 0,
        "is_dummy": False,
    },
)
case(
    "flat_state",
    "nixl",
    "NixlRegister",
    "1.0",
    [
        b"NixlMsgGuard",
        b"None",
        IP.encode(),
        dec(1),
        b"ag",
        b"md",
        nQ([1]),
        nQ([2]),
        nQ([3, 4]),
        dec(0),
        dec(1),
        dec(0),
        dec(64),
        nI([8, 8]),
        nI([2, 2]),
        b"",
        b"",
        dec(10),
    ],
    {
        "local_ip": IP,
        "rank_port": 1,
        "agent_name": "ag",
        "agent_metadata": b"md".hex(),
        "kv_data_ptrs": [1],
        "aux_data_ptrs": [2],
        "flat_state_data_ptrs": [3, 4],
        "gpu_id": 0,
        "attn_tp_size": 1,
        "engine_rank": 0,
        "kv_item_len": 64,
        "flat_state_item_lens": [8, 8],
        "flat_state_dim_per_tensor": [2, 2],
        "staging_base_ptr": None,
        "staging_total_size": None,
        "num_slots": 10,
        "effective_kv_item_lens": [64],
        "effective_kv_mem_kinds": ["VRAM"],
    },
)
case(
    "flat_state",
    "nixl",
    "NixlTransferInfo",
    "1.0",
    [b"NixlMsgGuard", dec(3), IP.encode(), dec(1), b"ag", i32raw([1]), dec(0), dec(1), i32raw([2]), dec(0)],
    {
        "room": 3,
        "local_ip": IP,
        "rank_port": 1,
        "agent_name": "ag",
        "kv_indices": [1],
        "aux_index": 0,
        "required_dst_info_num": 1,
        "flat_state_indices": [2],
        "decode_prefix_len": 0,
        "is_dummy": False,
    },
)
case(
    "flat_state",
    "mori",
    "MoriRegister",
    "1.0",
    [
        b"MoriMsgGuard",
        b"None",
        IP.encode(),
        dec(1),
        b"E",
        mp([b"k"]),
        b"",
        mp([b"s0", b"s1"]),
        dec(0),
        dec(1),
        dec(0),
        dec(32),
        nI([4, 4]),
        nI([1, 1]),
    ],
    {
        "local_ip": IP,
        "rank_port": 1,
        "engine_desc": b"E".hex(),
        "kv_mem_descs": [b"k".hex()],
        "aux_mem_descs": [],
        "flat_state_mem_descs": [b"s0".hex(), b"s1".hex()],
        "gpu_id": 0,
        "attn_tp_size": 1,
        "engine_rank": 0,
        "kv_item_len": 32,
        "flat_state_item_lens": [4, 4],
        "flat_state_dim_per_tensor": [1, 1],
    },
)
case(
    "flat_state",
    "mori",
    "MoriTransferInfo",
    "1.0",
    [b"MoriMsgGuard", dec(4), IP.encode(), dec(1), b"key", i32raw([7]), dec(0), i32raw([1]), dec(1), b""],
    {
        "room": 4,
        "local_ip": IP,
        "rank_port": 1,
        "engine_key": "key",
        "kv_indices": [7],
        "aux_index": 0,
        "flat_state_indices": [1],
        "required_dst_info_num": 1,
        "decode_prefix_len": 0,
        "is_dummy": False,
    },
)

if __name__ == "__main__":
    out = Path(__file__).with_name("frames.json")
    out.write_text(json.dumps(CASES, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(CASES)} cases to {out}")
