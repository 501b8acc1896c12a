"""Conversions to and from pdwire's own messages, and `pdwire inspect` on captured frames."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import msgspec
import numpy as np
import pytest

import pdwire.wire as pw
from pdwire.cli import main
from pdwire.protocols.sglang import convert as cv
from pdwire.wire import sglang
from pdwire.wirecore.positional.errors import ConversionError

GOLDEN = json.loads((Path(__file__).parents[1] / "golden" / "sglang" / "frames.json").read_text("utf-8"))


def _golden(backend: str, message: str, name: str) -> list[bytes]:
    case = next(
        c
        for c in GOLDEN
        if (c["backend"], c["message"], c["name"], c["version"]) == (backend, message, name, "2.0")
    )
    return [bytes.fromhex(h) for h in case["frames"]]


@pytest.mark.parametrize(
    ("backend", "message", "name"),
    [
        ("mooncake", "MooncakeTransferInfo", "no_components"),
        ("mooncake", "MooncakeTransferInfo", "one_empty_component"),
        ("mooncake", "MooncakeTransferInfo", "dummy_rank"),
        ("mooncake", "MooncakeTransferInfo", "full_prefix_hit"),
        ("nixl", "NixlTransferInfo", "dummy_rank_keeps_aux"),
        ("nixl", "NixlTransferInfo", "full_prefix_hit"),
        ("mori", "MoriTransferInfo", "normal"),
        ("mori", "MoriTransferInfo", "full_prefix_hit"),
    ],
)
def test_transfer_info_round_trips_through_transfer_request(backend: str, message: str, name: str) -> None:
    frames = _golden(backend, message, name)
    msg = sglang.decode(frames, backend)
    req = cv.to_transfer_request(msg)
    assert req.is_dummy == msg.is_dummy and req.room == msg.room
    agent = {"mooncake": "sess-7", "nixl": "agent-5f0c", "mori": "engine-key-1"}[backend]
    back = cv.from_transfer_request(req, backend, agent=agent)
    assert back == msg
    assert sglang.encode(back) == frames
    assert pw.decode(pw.encode(req)) == req  # the pdwire side is a valid pdwire message


def test_transfer_request_content_a_backend_cannot_carry_is_refused() -> None:
    with_device = sglang.decode(_golden("mooncake", "MooncakeTransferInfo", "normal"), "mooncake")
    with pytest.raises(ConversionError, match="device KV indices") as info:
        cv.to_transfer_request(with_device)
    assert info.value.field == "device_kv_indices"
    req = pw.TransferRequest(room=1, sender="h:1", dst_kv_indices=np.int32([1]), state_indices=[None])
    with pytest.raises(ConversionError, match="Mooncake builder crashes"):
        cv.from_transfer_request(req, "mooncake", agent="s")
    nixl = cv.from_transfer_request(req, "nixl", agent="a")
    assert [len(s) for s in nixl.state_indices] == [0]  # None travels as [] (SGLang's NIXL builder)
    empty = pw.TransferRequest(room=1, sender="h:1", dst_kv_indices=np.int32([]), dst_aux_index=-1)
    with pytest.raises(ConversionError, match="MoRI infers dummy=True"):
        cv.from_transfer_request(empty, "mori", agent="k")
    with pytest.raises(ConversionError, match="host:port"):
        cv.from_transfer_request(
            pw.TransferRequest(room=1, sender="nohost", dst_kv_indices=np.int32([])), "nixl", agent="a"
        )


@pytest.mark.parametrize("backend", ["mooncake", "nixl", "mori"])
@pytest.mark.parametrize("reason", ["", "délai ✗"])
def test_status_converts_losslessly(backend: str, reason: str) -> None:
    st = pw.TransferStatus(room=2**64 - 1, status=pw.Status.FAILED, sender_rank=5, reason=reason)
    msg = cv.from_transfer_status(st, backend)
    back = sglang.decode(sglang.encode(msg), backend)
    assert cv.to_transfer_status(back) == st
    if backend == "mooncake" and not reason:
        assert len(sglang.encode(msg)) == 3  # what 0.5.23 sends


def test_register_needs_the_information_sglang_does_not_send() -> None:
    msg = sglang.decode(_golden("nixl", "NixlRegister", "normal"), "nixl")
    with pytest.raises(ConversionError) as info:
        cv.to_register_info(msg, cv.RegisterSupplement())
    assert "page_size" in info.value.missing and "kv_layout" in info.value.missing
    assert "num_pages" not in info.value.missing  # NIXL sends num_slots


def test_nixl_register_round_trips_through_register_info() -> None:
    msg = sglang.NixlRegister(
        local_ip="10.0.0.2",
        rank_port=7000,
        agent_name="ag",
        agent_metadata=b"\x01md",
        kv_data_ptrs=[2**63, 2**63 + 4096],
        aux_data_ptrs=[0x5000],
        state_data_ptrs=[[0x7000]],
        gpu_id=0,
        attn_tp_size=2,
        engine_rank=1,
        kv_item_len=4096,
        state_item_lens=[[512]],
        state_dim_per_tensor=[[8]],
        num_slots=100,
        kv_mem_kinds=[],
        kv_item_lens=[4096, 4096],
        state_data_lens=[[2**20]],
    )
    sup = cv.RegisterSupplement(
        engine_id="e",
        pp_size=1,
        pp_rank=0,
        dp_size=1,
        dp_rank=0,
        first_layer=0,
        num_layers=1,
        region_lens=[409600],
        page_size=16,
        kv_layout=pw.KvLayout.NHD,
        kv_heads_per_rank=4,
        kv_heads_total=8,
        bytes_per_head=64,
        is_mla=False,
        aux_lens=[1024],
        aux_item_lens=[64],
        state_types=[pw.StateType.MAMBA],
    )
    info = cv.to_register_info(msg, sup)
    assert [int(x) for x in info.k_base_addrs] == [2**63] and [int(x) for x in info.v_base_addrs] == [
        2**63 + 4096
    ]
    assert (info.geometry.tp_size, info.geometry.tp_rank, info.num_pages) == (2, 1, 100)
    assert [int(x) for x in info.state_components[0].shard_axis_sizes] == [16]  # per-rank 8 x tp 2
    back = cv.from_register_info(info, "nixl", cv.RegisterExtras(gpu_id=0))
    assert sglang.encode(back) == sglang.encode(msg)


# --- pdwire inspect ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: f"{c['message']}-{c['version']}-{c['name']}")
def test_inspect_decodes_every_golden_message(
    case: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frames = [bytes.fromhex(h) for h in case["frames"]]  # type: ignore[attr-defined]
    lp = tmp_path / "capture.bin"
    lp.write_bytes(b"".join(struct.pack("<I", len(f)) + f for f in frames))
    rc = main(["inspect", "--json", "--profile-version", str(case["version"]), str(lp)])
    (out,) = json.loads(capsys.readouterr().out)["messages"]
    assert rc == 0 and (out["backend"], out["message"]) == (case["backend"], case["message"])
    values = {k: _plain(v) for k, v in (out["fields"] | out.get("derived", {})).items()}
    assert {k: values[k] for k in case["fields"]} == case["fields"]  # type: ignore[attr-defined]


def _plain(value: object) -> object:
    """inspect's JSON values as the golden file writes them: pointers as ints, blobs as hex."""
    if isinstance(value, str) and value.startswith("0x"):
        return int(value, 16)
    if isinstance(value, dict) and set(value) == {"bytes", "hex"}:
        return value["hex"]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def test_inspect_hex_table_and_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frames = _golden("nixl", "NixlStatus", "non_ascii_reason")
    hexfile = tmp_path / "status.hex"
    hexfile.write_text("# captured\n" + "\n".join(f.hex() or "-" for f in frames) + "\n")
    assert main(["inspect", str(hexfile)]) == 0
    table = capsys.readouterr().out
    assert "nixl NixlStatus: 5 frames" in table and "échec" in table and '"FAILED"' in table
    bad = tmp_path / "bad.hex"
    bad.write_text("4b565f535441545553\n39\n37\n30\n-\n")  # KV_STATUS with status 7
    assert main(["inspect", str(bad)]) == 1
    assert "NixlStatus.status (frame 2)" in capsys.readouterr().err
    nothing = tmp_path / "nothing.hex"
    nothing.write_text("00\n")
    assert main(["inspect", "--backend", "mori", str(nothing)]) == 1
    assert "no message matches" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.hex")]) == 2
    trunc = tmp_path / "trunc.bin"
    trunc.write_bytes(b"\xff\x00\x00\x00ab\x80")
    assert main(["inspect", "--format", "lp", str(trunc)]) == 2
    assert "runs past the end" in capsys.readouterr().err


def _supplement(msg: object, comps: int, **kw: object) -> cv.RegisterSupplement:
    given: dict[str, object] = dict(
        engine_id="e", pp_size=1, pp_rank=0, dp_size=1, dp_rank=0, first_layer=0, num_layers=1,
        region_lens=[1], num_pages=1, page_size=16, kv_layout=pw.KvLayout.NHD, kv_heads_per_rank=1,
        kv_heads_total=1, bytes_per_head=1, is_mla=True, aux_lens=[1], aux_item_lens=[1],
        state_types=[pw.StateType.MAMBA] * comps,
    )  # fmt: skip
    return cv.RegisterSupplement(**{**given, **kw})  # type: ignore[arg-type]


def test_converted_registrations_are_the_newest_model_the_runtime_uses() -> None:
    from pdwire.runtime.session.registration import join_region_descs

    mori = sglang.decode(_golden("mori", "MoriRegister", "empty_component"), "mori")
    mori = msgspec.structs.replace(mori, aux_mem_descs=[b"aux-desc"], kv_layer_ids=np.empty(0, np.uint32))
    sup = _supplement(
        mori,
        len(mori.state_item_lens),
        agent_name="k",
        state_region_lens=[[1] * len(x) for x in mori.state_item_lens],
    )
    info = cv.to_register_info(mori, sup)
    assert type(info) is pw.RegisterInfo  # the newest model, not an older minor's
    assert info.aux_mem_descs == [b"aux-desc"]  # a 1.2 field: no longer refused
    assert pw.decode(pw.encode(info)) == info
    join_region_descs(info)  # the runtime reads the newest fields of it
    back = cv.from_register_info(
        info, "mori", cv.RegisterExtras(engine_desc=mori.engine_desc, gpu_id=mori.gpu_id)
    )
    assert sglang.encode(back) == sglang.encode(mori)

    nixl = sglang.decode(_golden("nixl", "NixlRegister", "normal"), "nixl")
    staged = [np.arange(len(x), dtype=np.uint32) + 4 for x in nixl.state_item_lens]
    nixl = msgspec.structs.replace(nixl, state_layer_ids=staged, kv_layer_ids=np.empty(0, np.uint32))
    info = cv.to_register_info(nixl, _supplement(nixl, len(nixl.state_item_lens), is_mla=False))
    assert [c.layer_ids.tolist() for c in info.state_components] == [x.tolist() for x in staged]  # 1.3
    back = cv.from_register_info(info, "nixl", cv.RegisterExtras(gpu_id=nixl.gpu_id))
    assert [x.tolist() for x in back.state_layer_ids] == [x.tolist() for x in staged]
