"""Every minor through one model per major: older minors read and written, the 1.0 -> 1.1,
1.1 -> 1.2 and 1.2 -> 1.3 steps, and version agreement. (That released builds read what this
build writes at each version is tests/wire/test_release_behaviour.py.)"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdwire.wire as w
from pdwire.codegen.loader import load_file
from pdwire.wire import strategies as S
from pdwire.wirecore.envelope.header import MAGIC, pack_header

SCHEMA = load_file(Path(__file__).resolve().parents[2] / "schema" / "pdwire.yaml")
OLD, NEW = (1, 0), (1, 1)  # the flat-state step
OLDER = [v for v in w.VERSIONS if v < w.NEWEST and v[0] == w.NEWEST[0]]
assert (1, 1) in OLDER, "the matrix must cover every released minor"


def _b(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


def _vid(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


@pytest.mark.parametrize(
    ("old", "name"),
    [(v, n) for v in OLDER for n in S.STRATEGIES[v]],
    ids=lambda x: _vid(x) if isinstance(x, tuple) else x,
)
@settings(max_examples=30)
@given(data=st.data())
def test_an_older_minor_reads_into_the_model_and_writes_back_the_same_bytes(
    old: tuple[int, int], name: str, data: st.DataObject
) -> None:
    msg = data.draw(S.STRATEGIES[old][name]())
    frames = _b(w.encode(msg, old))
    back, version = w.decode_versioned(frames)
    assert version == old
    assert type(back) is getattr(w, name)  # the model of the major, later fields at their defaults
    assert back == msg
    assert _b(w.encode(back, old)) == frames
    # the body is exactly that minor's: as long as its body, never a position more
    assert len(msgspec.msgpack.decode(frames[1])) == len(SCHEMA.messages[name].slots_at(old))


def _body(frames: list[Any]) -> list[Any]:
    return list(msgspec.msgpack.decode(bytes(frames[1])))


def _reheader(frames: list[bytes], minor: int) -> list[bytes]:
    _, pid, major, _, tid, side = struct.unpack("<4sHBBHH", frames[0])
    return [pack_header(MAGIC, pid, major, minor, tid, side), *frames[1:]]


def test_a_message_claiming_an_older_minor_may_not_carry_what_it_lacks() -> None:
    status = w.TransferStatus(
        room=5, status=w.Status.FAILED, sender_rank=1, reason="x", failure_kind=w.FailureKind.TIMEOUT
    )
    frames = _b(w.encode(status))
    with pytest.raises(
        w.BodyError, match=r"TransferStatus\.failure_kind \(frame 1\): carries what version 1\.1"
    ):
        w.decode(_reheader(frames, 1))
    # the same bytes as a newer minor are read (what this build does not know is skipped)
    assert w.decode(_reheader(frames, 9)) == status


def test_flat_state_becomes_one_component() -> None:
    # a 1.0 writer's registration: positions 22..26 carry one flat state
    plain = w.RegisterInfo(**_register_kwargs(w))
    frames = _b(w.encode(plain, OLD))
    body = _body(frames)
    assert len(body) == 27 and body[22:27] == [0, b"", b"", b"", b""]
    u64 = [np.array(x, dtype="<u8").tobytes() for x in ([10, 20], [100, 200], [4, 8], [16, 0])]
    body[22:27] = [int(w.StateType.MAMBA), *u64]
    new = w.decode([frames[0], msgspec.msgpack.encode(body)])
    assert isinstance(new, w.RegisterInfo)
    (comp,) = new.state_components
    assert comp.type == w.StateType.MAMBA
    assert comp.base_addrs.tolist() == [10, 20] and comp.shard_axis_sizes.tolist() == [16, 0]
    # and this build writes the same flat form for a 1.0 peer
    assert _b(w.encode(new, OLD)) == [frames[0], msgspec.msgpack.encode(body)]
    req = w.TransferRequest(room=3, sender="d", dst_kv_indices=np.arange(4, dtype=np.int32))
    frames = _b(w.encode(req, OLD))
    body = _body(frames)
    assert len(body) == 8 and body[4] == b""
    body[4] = np.array([7], dtype="<i4").tobytes()
    new_req = w.decode([frames[0], msgspec.msgpack.encode(body)])
    assert isinstance(new_req, w.TransferRequest)
    assert [x.tolist() for x in new_req.state_indices if x is not None] == [[7]]
    assert w.decode(frames) == req and req.state_indices == []


def _register_kwargs(mod: Any) -> dict[str, Any]:
    u64 = np.arange(4, dtype=np.uint64)
    return dict(
        endpoint="h:1",
        engine_id="e",
        agent_name="a",
        agent_metadata=b"m",
        geometry=mod.ParallelGeometry(),
        first_layer=0,
        num_layers=4,
        k_base_addrs=u64,
        v_base_addrs=u64,
        bytes_per_page=u64,
        region_lens=u64,
        num_pages=8,
        page_size=16,
        kv_layout=mod.KvLayout.HND,
        kv_heads_per_rank=2,
        kv_heads_total=8,
        bytes_per_head=256,
        is_mla=False,
    )


def test_downgrade_refuses_what_1_0_cannot_carry() -> None:
    comp = w.StateComponent(
        type=w.StateType.SWA,
        base_addrs=np.arange(2, dtype=np.uint64),
        region_lens=np.arange(2, dtype=np.uint64),
        bytes_per_slot=np.arange(2, dtype=np.uint64),
    )
    two = w.RegisterInfo(**_register_kwargs(w), state_components=[comp, comp])
    with pytest.raises(w.DowngradeError, match=r"RegisterInfo\.state_components: 2 state components"):
        w.encode(two, OLD)
    blocks = w.StateComponent(
        type=w.StateType.MAMBA,
        base_addrs=comp.base_addrs,
        region_lens=comp.region_lens,
        bytes_per_slot=comp.bytes_per_slot,
        sub_blocks=[np.array([8, 8, 16], dtype=np.uint64)],
    )
    with pytest.raises(w.DowngradeError, match="sub_blocks"):
        w.encode(w.RegisterInfo(**_register_kwargs(w), state_components=[blocks]), OLD)
    one = w.RegisterInfo(**_register_kwargs(w), state_components=[comp])
    assert w.decode(w.encode(one, OLD)) == one
    req = w.TransferRequest(
        room=1,
        sender="d",
        dst_kv_indices=np.arange(2, dtype=np.int32),
        state_indices=[np.arange(1, dtype=np.int32), np.arange(3, dtype=np.int32)],
    )
    with pytest.raises(w.DowngradeError, match=r"TransferRequest\.state_indices"):
        w.encode(req, OLD)
    with pytest.raises(w.DowngradeError):
        w.encode_bytes(req, OLD)
    with pytest.raises(w.EncodeError, match=r"version 2\.0 is not one this build writes"):
        w.encode(req, (2, 0))


def _hello(versions: list[tuple[int, int]], protocol: str = "pdwire") -> w.Hello:
    return w.Hello(
        protocol=protocol,
        versions=[w.Version(major=a, minor=b) for a, b in versions],
        role=w.Role.DECODE,
        engine_id="e",
        geometry=w.ParallelGeometry(),
        model=w.ModelFingerprint(model_name="m", revision="r", dtype="bf16", num_layers=4),
    )


def test_agreement_picks_highest_common_version() -> None:
    assert w.agree(_hello([(1, 1)]), _hello([(1, 0)])) == (1, 0)
    assert w.agree(_hello([(1, 2)]), _hello([(1, 1)])) == (1, 1)
    assert w.agree(_hello([(1, 1), (2, 3)]), _hello([(1, 4), (2, 1)])) == (2, 1)
    assert w.hello_versions() == [w.Version(major=1, minor=w.NEWEST[1])]
    with pytest.raises(
        w.VersionMismatch, match=r"this side reads 1\.0-1\.2, the peer reads 2\.0-2\.2"
    ) as info:
        w.agree(_hello([(1, 2)]), _hello([(2, 2)]))
    assert info.value.theirs == [(2, 2)]
    with pytest.raises(w.ProtocolNameMismatch, match="other"):
        w.agree(_hello([(1, 1)]), _hello([(1, 1)], protocol="other"))


def _with_version(frames: list[bytes], major: int, minor: int, type_id: int | None = None) -> list[bytes]:
    import struct

    _, pid, _, _, tid, side = struct.unpack("<4sHBBHH", frames[0])
    return [pack_header(MAGIC, pid, major, minor, tid if type_id is None else type_id, side), *frames[1:]]


def test_hello_of_a_future_major_is_readable_so_the_refusal_names_versions() -> None:
    future = _b(w.encode(_hello([(3, 2)])))
    peer = w.decode(_with_version(future, 3, 2))
    assert isinstance(peer, w.Hello)
    with pytest.raises(w.VersionMismatch, match=r"3\.0-3\.2"):
        w.agree(_hello([(1, 1)]), peer)


def test_other_messages_of_unknown_versions_are_refused_by_name() -> None:
    frames = _b(w.encode(w.Abort(room=1, sender="x")))
    with pytest.raises(
        w.UnsupportedVersion, match=rf"version 2\.0 is not supported; this build reads 1\.0-1\.{w.NEWEST[1]}"
    ):
        w.decode(_with_version(frames, 2, 0))
    # a newer minor of a known major is read with the newest known layout
    assert w.decode(_with_version(frames, 1, 7)) == w.Abort(room=1, sender="x")
    with pytest.raises(w.UnknownMessageType, match="type 99"):
        w.decode(_with_version(frames, 1, 1, type_id=99))
    with pytest.raises(w.UnknownMessageType, match="type 99"):
        w.decode(_with_version(frames, 1, 9, type_id=99))


# --- 1.1 -> 1.2: self-describing registration, typed failures, RegisterAck -------------------
V11 = (1, 1)


def _described_component(heads: bool = True) -> w.StateComponent:
    u64 = np.arange(4, dtype=np.uint64)
    return w.StateComponent(
        type=w.StateType.SWA,
        base_addrs=u64,
        region_lens=u64,
        bytes_per_slot=u64,
        shard_axis_sizes=np.full(4, 8, dtype=np.uint64),
        tensor_names=["k", "v"],
        indexing=w.StateIndexing.PAGE,
        sharding=w.StateSharding.HEADS if heads else w.StateSharding.REPLICATED,
        heads=w.HeadSharding(
            page_size=16, layout=w.KvLayout.HND, kv_heads_per_rank=2, kv_heads_total=8, bytes_per_head=64
        )
        if heads
        else None,
    )


def test_1_2_registration_downgrades_to_1_1_by_dropping_the_self_description() -> None:
    info = w.RegisterInfo(**_register_kwargs(w), state_components=[_described_component()])
    frames = _b(w.encode(info, V11))
    body = _body(frames)
    assert len(body) == 28 and len(body[27][0]) == 7  # 1.1's RegisterInfo and StateComponent
    back = w.decode(frames)
    assert isinstance(back, w.RegisterInfo)
    (comp,) = back.state_components
    # what a 1.1 peer sends reads as "not self-described": the reader falls back to its own model
    assert comp.tensor_names == [] and comp.indexing == w.StateIndexing.UNSPECIFIED
    assert comp.sharding == w.StateSharding.UNSPECIFIED and comp.heads is None
    assert comp.shard_axis_sizes.tolist() == [8] * 4 and back.aux_mem_descs == []
    # and the 1.2 form round-trips whole
    assert w.decode(w.encode(info)) == info


def test_1_2_refuses_to_drop_aux_descriptors_or_a_failure_kind_for_1_1() -> None:
    info = w.RegisterInfo(**_register_kwargs(w), kv_mem_descs=[b"k"] * 8, aux_mem_descs=[b"a"])
    with pytest.raises(w.DowngradeError, match=r"RegisterInfo\.aux_mem_descs: 1 aux memory descriptors"):
        w.encode(info, V11)
    with pytest.raises(w.DowngradeError, match=r"RegisterInfo\.aux_mem_descs"):
        w.encode(info, OLD)
    failed = w.TransferStatus(
        room=5, status=w.Status.FAILED, sender_rank=1, reason="x", failure_kind=w.FailureKind.TIMEOUT
    )
    with pytest.raises(w.DowngradeError, match=r"TransferStatus\.failure_kind: failure_kind timeout"):
        w.encode(failed, V11)
    with pytest.raises(w.DowngradeError, match=r"TransferStatus\.failure_kind"):
        w.encode_bytes(failed, OLD)
    # the 1.1 form (kind in the reason, failure_kind unspecified) goes through unchanged
    legacy = w.TransferStatus(room=5, status=w.Status.FAILED, sender_rank=1, reason="timeout: x")
    assert w.decode(w.encode(legacy, V11)) == legacy
    assert w.decode(w.encode(legacy, OLD)) == legacy


def test_register_ack_exists_only_from_1_2() -> None:
    ack = w.RegisterAck(accepted=False, sender_rank=3, failure_kind=w.FailureKind.HANDSHAKE, reason="no")
    assert w.decode(w.encode(ack)) == ack
    assert w.decode_versioned(w.encode(ack))[1] == w.NEWEST
    assert w.decode_versioned(w.encode(ack, (1, 2))) == (ack, (1, 2))
    for older in (V11, OLD):
        where = rf"RegisterAck: does not exist at version {older[0]}\.{older[1]}"
        with pytest.raises(w.DowngradeError, match=where):
            w.encode(ack, older)
    with pytest.raises(w.UnknownMessageType, match="type 8"):
        w.decode(_with_version(_b(w.encode(ack)), 1, 1))


# --- 1.2 -> 1.3: state layer ids, nsa ---------------------------------------------------------
V12 = (1, 2)


def test_layer_ids_reach_a_1_2_peer_only_when_they_say_what_1_2_assumes() -> None:
    plain = _described_component()
    assert len(plain.layer_ids) == 0  # the default: layers 0..n-1
    counted = msgspec.structs.replace(plain, layer_ids=np.arange(2, dtype=np.uint32))
    staged = msgspec.structs.replace(plain, layer_ids=np.array([2, 3], dtype=np.uint32))
    for comp in (plain, counted):
        info = w.RegisterInfo(**_register_kwargs(w), state_components=[comp])
        assert len(_body(w.encode(info, V12))[27][0]) == 11  # 1.2's StateComponent: no layer ids
        back = w.decode(_b(w.encode(info, V12)))  # read again: the default, which means the same
        assert isinstance(back, w.RegisterInfo) and len(back.state_components[0].layer_ids) == 0
    info = w.RegisterInfo(**_register_kwargs(w), state_components=[staged])
    assert w.decode(w.encode(info)) == info  # 1.3 carries them
    # a 1.2 reader would put a PP stage's layers 2 and 3 on 0 and 1: refused, never dropped
    with pytest.raises(w.DowngradeError, match=r"StateComponent\.layer_ids: layer ids \[2, 3\]"):
        w.encode(info, V12)
    with pytest.raises(w.DowngradeError, match=r"StateComponent\.layer_ids"):
        w.encode(info, OLD)


def test_nsa_components_exist_from_1_3() -> None:
    comp = msgspec.structs.replace(_described_component(heads=False), type=w.StateType.NSA)
    info = w.RegisterInfo(**_register_kwargs(w), state_components=[comp])
    assert w.decode(w.encode(info)) == info
    for older in (V12, V11):
        with pytest.raises(w.DowngradeError, match=r"StateComponent\.type: value .*NSA.* does not exist"):
            w.encode(info, older)


# --- 1.3 -> 1.4: memory layouts, any sharded axis, SGLang's state kinds -----------------------
V13 = (1, 3)


def test_1_4_layout_defaults_mean_what_1_3_means_and_reach_a_1_3_peer() -> None:
    default = w.StateTensorLayout()
    assert (default.slot_stride, default.offset, default.outer_rows, default.replicated) == (0, 0, 1, False)
    comp = msgspec.structs.replace(_described_component(), tensor_layouts=[default, default])
    info = w.RegisterInfo(**_register_kwargs(w), state_components=[comp])
    assert (info.kv_page_stride, info.k_page_offset, info.v_page_offset) == (0, 0, 0)
    back, version = w.decode_versioned(_b(w.encode(info, V13)))  # all defaults: nothing lost at 1.3
    assert version == V13 and isinstance(back, w.RegisterInfo)
    assert back.state_components[0].tensor_layouts == [] and back.kv_page_stride == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_page_stride", 4096), ("k_page_offset", 64), ("v_page_offset", 2048)],
)
def test_a_kv_page_layout_is_refused_for_a_1_3_peer(field: str, value: int) -> None:
    info = w.RegisterInfo(**_register_kwargs(w), **{field: value})
    assert getattr(w.decode(w.encode(info)), field) == value  # 1.4 carries it
    for older in (V13, V12, OLD):
        with pytest.raises(w.DowngradeError, match=rf"RegisterInfo\.{field}"):
            w.encode(info, older)


def test_a_kv_head_stride_is_refused_for_a_1_3_peer() -> None:
    info = w.RegisterInfo(**_register_kwargs(w), kv_head_stride=512)
    assert w.decode(w.encode(info)).kv_head_stride == 512  # 1.4 carries it
    packed = w.decode_versioned(_b(w.encode(w.RegisterInfo(**_register_kwargs(w)), V13)))
    assert packed[1] == V13 and packed[0].kv_head_stride == 0  # packed heads travel at 1.3
    for older in (V13, V12, OLD):
        with pytest.raises(w.DowngradeError, match=r"RegisterInfo\.kv_head_stride"):
            w.encode(info, older)


@pytest.mark.parametrize(
    ("message", "field", "value"),
    [
        ("RegisterInfo", "scatter_base", 1 << 20),
        ("RegisterInfo", "scatter_len", 4096),
        ("RegisterInfo", "scatter_mem_descs", [b"desc"]),
        ("TransferRequest", "scatter_offset", 0),
        ("TransferRequest", "scatter_page_bytes", 512),
        ("TransferRequest", "scatter_pages", 2),
        ("Notification", "scatter_pages", 2),
        ("Notification", "scatter_first_page", 1),
        ("RegisterAck", "kv_layers", np.array([0, 1], dtype=np.uint32)),
        ("RegisterAck", "state_layers", [np.array([0], dtype=np.uint32)]),
        (
            "RegisterAck",
            "kv_heads",
            w.HeadSharding(
                page_size=4, layout=w.KvLayout.NHD, kv_heads_per_rank=1, kv_heads_total=2, bytes_per_head=32
            ),
        ),
    ],
)
def test_scatter_and_held_layers_are_refused_for_a_1_3_peer(message: str, field: str, value: Any) -> None:
    base: dict[str, Any] = {
        "RegisterInfo": lambda: w.RegisterInfo(**_register_kwargs(w)),
        "TransferRequest": lambda: w.TransferRequest(
            room=1, sender="d", dst_kv_indices=np.arange(4, dtype=np.int32)
        ),
        "Notification": lambda: w.Notification(room=1, kind=w.NotificationKind.KV),
        "RegisterAck": lambda: w.RegisterAck(accepted=True, sender_rank=0),
    }
    msg = msgspec.structs.replace(base[message](), **{field: value})
    assert w.decode(w.encode(msg)) == msg  # 1.4 carries it
    assert type(w.decode(w.encode(base[message](), V13))).__name__ == message  # the defaults travel at 1.3
    with pytest.raises(w.DowngradeError, match=rf"{message}\.{field}"):
        w.encode(msg, V13)


@pytest.mark.parametrize(
    "layout",
    [
        w.StateTensorLayout(slot_stride=4096),
        w.StateTensorLayout(offset=16),
        w.StateTensorLayout(outer_rows=3),
        w.StateTensorLayout(replicated=True),
    ],
)
def test_a_tensor_layout_is_refused_for_a_1_3_peer(layout: Any) -> None:
    comp = msgspec.structs.replace(_described_component(), tensor_layouts=[w.StateTensorLayout(), layout])
    info = w.RegisterInfo(**_register_kwargs(w), state_components=[comp])
    assert w.decode(w.encode(info)) == info
    for older in (V13, V12):
        with pytest.raises(w.DowngradeError, match=r"StateComponent\.tensor_layouts"):
            w.encode(info, older)


@pytest.mark.parametrize("kind", [k for k in w.StateType if k.value >= w.StateType.QSA_PENDING.value])
def test_sglang_state_kinds_exist_from_1_4(kind: Any) -> None:
    comp = msgspec.structs.replace(_described_component(heads=False), type=kind)
    info = w.RegisterInfo(**_register_kwargs(w), state_components=[comp])
    assert w.decode(w.encode(info)) == info
    with pytest.raises(w.DowngradeError, match=r"StateComponent\.type: value .* does not exist"):
        w.encode(info, V13)


def test_row_indexing_exists_from_1_4() -> None:
    comp = msgspec.structs.replace(_described_component(heads=False), indexing=w.StateIndexing.ROW)
    info = w.RegisterInfo(**_register_kwargs(w), state_components=[comp])
    assert w.decode(w.encode(info)) == info
    with pytest.raises(w.DowngradeError, match=r"StateComponent\.indexing: value .*ROW.* does not exist"):
        w.encode(info, V13)
    assert len([k for k in w.StateType if k.value > 0]) == 14  # SGLang 0.5.23's 13 kinds and nsa


def test_1_4_multi_part_notification_refused_at_1_3_and_one_part_kept() -> None:
    one = w.Notification(room=3, kind=w.NotificationKind.KV, chunk_id=2, is_last=True, sender_rank=1)
    # one part: the 1.3 bytes carry it whole, and reading them back fills the one-part defaults
    back = w.decode(w.encode(one, V13))
    assert back == one and back.chunk_count == 1 and len(back.also_components) == 0 and not back.also_aux
    for extra, field in (
        ({"chunk_count": 3}, "chunk_count"),
        ({"also_components": np.array([1, 2], dtype=np.uint32)}, "also_components"),
        ({"also_aux": True}, "also_aux"),
    ):
        many = msgspec.structs.replace(one, **extra)
        with pytest.raises(w.DowngradeError, match=rf"Notification\.{field}"):
            w.encode(many, V13)
        assert w.decode(w.encode(many)) == many  # 1.4 carries it
