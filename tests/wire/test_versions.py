"""The cross-version matrix, the 1.0 -> 1.1, 1.1 -> 1.2 and 1.2 -> 1.3 steps, and version agreement."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pdwire.wire as w
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdwire.wire import strategies as S
from pdwire.wire import v1_0, v1_1, v1_2

from pdwire.wirecore.header import MAGIC, pack_header
from tests.wire.compat import is_newer_enum_value

OLD, NEW = (1, 0), (1, 1)  # the flat-state step
# every (older, newer) pair of one major: the matrix runs both directions for each
PAIRS = [(a, b) for a in w.VERSIONS for b in w.VERSIONS if a[0] == b[0] and a < b]
OLDER = [v for v in w.VERSIONS if v < w.NEWEST and v[0] == w.NEWEST[0]]
assert PAIRS and (1, 1) in OLDER, "the matrix must cover every released minor"


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
def test_older_minor_decodes_into_newest_model_and_back(
    old: tuple[int, int], name: str, data: st.DataObject
) -> None:
    old_msg = data.draw(S.STRATEGIES[old][name]())
    frames = _b(getattr(w, f"v{old[0]}_{old[1]}").encode(old_msg))
    upgraded, version = w.decode_versioned(frames)
    assert version == old
    assert type(upgraded) is getattr(w, name)  # the newest model, newer fields at their defaults
    # a newest writer talking to an older peer writes exactly what the older writer wrote
    assert _b(w.encode(upgraded, old)) == frames


@pytest.mark.parametrize(
    ("pair", "name"),
    [(p, n) for p in PAIRS for n in S.STRATEGIES[p[1]]],
    ids=lambda x: "-".join(map(_vid, x)) if isinstance(x, tuple) else x,
)
@settings(max_examples=30)
@given(data=st.data())
def test_older_generated_decoder_reads_newer_minor(
    pair: tuple[tuple[int, int], tuple[int, int]], name: str, data: st.DataObject
) -> None:
    old, new = pair
    new_msg = data.draw(S.STRATEGIES[new][name]())
    frames = _b(getattr(w, f"v{new[0]}_{new[1]}").encode(new_msg))
    old_module = getattr(w, f"v{old[0]}_{old[1]}")
    if name not in S.STRATEGIES[old]:  # a message new in a later minor: refused by type, never guessed
        with pytest.raises(w.UnknownMessageType):
            old_module.decode(frames)
        return
    try:
        old_view = old_module.decode(frames)  # skips the positions the older version does not know
    except w.BadEnumValue as e:  # an enum value the older minor lacks (tests/wire/compat.py)
        assert is_newer_enum_value(e, new, old), str(e)
        return
    assert type(old_view) is getattr(old_module, name)
    _assert_known_part_equal(old_view, new_msg, name)


def _assert_known_part_equal(old: object, new: object, where: str) -> None:
    """Fields the older struct knows equal the newer struct's, nested messages included."""
    fields = getattr(old, "__struct_fields__", None)
    if fields is not None:
        for f in fields:
            if hasattr(new, f):
                _assert_known_part_equal(getattr(old, f), getattr(new, f), f"{where}.{f}")
    elif isinstance(old, list) and old and hasattr(old[0], "__struct_fields__"):
        assert isinstance(new, list) and len(new) == len(old), where
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            _assert_known_part_equal(a, b, f"{where}[{i}]")
    else:
        assert _same(old, new), where


def _same(a: object, b: object) -> bool:
    from pdwire.wirecore.arrays import values_equal

    return values_equal(a, b)


def test_flat_state_becomes_one_component() -> None:
    old = v1_0.RegisterInfo(
        **_register_kwargs(v1_0),
        flat_state_type=v1_0.StateType.MAMBA,
        flat_state_base_addrs=np.array([10, 20], dtype=np.uint64),
        flat_state_region_lens=np.array([100, 200], dtype=np.uint64),
        flat_state_bytes_per_slot=np.array([4, 8], dtype=np.uint64),
        flat_state_shard_axis_sizes=np.array([16, 0], dtype=np.uint64),
    )
    new = w.decode(w.REGISTRY.encode(old))
    assert isinstance(new, w.RegisterInfo)
    (comp,) = new.state_components
    assert comp.type == w.StateType.MAMBA
    assert comp.base_addrs.tolist() == [10, 20] and comp.shard_axis_sizes.tolist() == [16, 0]
    req = v1_0.TransferRequest(
        room=3,
        sender="d",
        dst_kv_indices=np.arange(4, dtype=np.int32),
        flat_state_indices=np.array([7], dtype=np.int32),
    )
    new_req = w.decode(w.REGISTRY.encode(req))
    assert isinstance(new_req, w.TransferRequest)
    assert [x.tolist() for x in new_req.state_indices if x is not None] == [[7]]
    empty = w.decode(
        w.REGISTRY.encode(
            v1_0.TransferRequest(room=3, sender="d", dst_kv_indices=np.arange(2, dtype=np.int32))
        )
    )
    assert isinstance(empty, w.TransferRequest) and empty.state_indices == []


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
    two = w.RegisterInfo(**_register_kwargs(v1_1), state_components=[comp, comp])
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
        w.encode(w.RegisterInfo(**_register_kwargs(v1_1), state_components=[blocks]), OLD)
    one = w.RegisterInfo(**_register_kwargs(v1_1), state_components=[comp])
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
    with pytest.raises(w.UnsupportedVersion, match=r"cannot be read by the 1\.1 model"):
        v1_1.decode(_with_version(frames, 1, 0))


# --- 1.1 -> 1.2: self-describing registration, typed failures, RegisterAck -------------------
V11 = (1, 1)


def _described_component(heads: bool = True) -> v1_2.StateComponent:
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
    info = w.RegisterInfo(**_register_kwargs(v1_2), state_components=[_described_component()])
    frames = _b(w.encode(info, V11))
    old = v1_1.decode(frames)
    assert isinstance(old, v1_1.RegisterInfo) and old.state_components[0].base_addrs.tolist() == [0, 1, 2, 3]
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
    info = w.RegisterInfo(**_register_kwargs(v1_2), kv_mem_descs=[b"k"] * 8, aux_mem_descs=[b"a"])
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
        v1_1.decode(_b(w.encode(ack)))


# --- 1.2 -> 1.3: state layer ids, nsa ---------------------------------------------------------
V12 = (1, 2)


def test_layer_ids_reach_a_1_2_peer_only_when_they_say_what_1_2_assumes() -> None:
    plain = _described_component()
    assert len(plain.layer_ids) == 0  # the default: layers 0..n-1
    counted = msgspec.structs.replace(plain, layer_ids=np.arange(2, dtype=np.uint32))
    staged = msgspec.structs.replace(plain, layer_ids=np.array([2, 3], dtype=np.uint32))
    for comp in (plain, counted):
        info = w.RegisterInfo(**_register_kwargs(v1_2), state_components=[comp])
        old = v1_2.decode(_b(w.encode(info, V12)))
        assert isinstance(old, v1_2.RegisterInfo) and not hasattr(old.state_components[0], "layer_ids")
        back = w.decode(_b(w.encode(info, V12)))  # upgraded again: the default, which means the same
        assert isinstance(back, w.RegisterInfo) and len(back.state_components[0].layer_ids) == 0
    info = w.RegisterInfo(**_register_kwargs(v1_2), state_components=[staged])
    assert w.decode(w.encode(info)) == info  # 1.3 carries them
    # a 1.2 reader would put a PP stage's layers 2 and 3 on 0 and 1: refused, never dropped
    with pytest.raises(w.DowngradeError, match=r"StateComponent\.layer_ids: layer ids \[2, 3\]"):
        w.encode(info, V12)
    with pytest.raises(w.DowngradeError, match=r"StateComponent\.layer_ids"):
        w.encode(info, OLD)


def test_nsa_components_exist_from_1_3() -> None:
    comp = msgspec.structs.replace(_described_component(heads=False), type=w.StateType.NSA)
    info = w.RegisterInfo(**_register_kwargs(v1_2), state_components=[comp])
    assert w.decode(w.encode(info)) == info
    for older in (V12, V11):
        with pytest.raises(w.DowngradeError, match=r"StateComponent\.type: value .*NSA.* does not exist"):
            w.encode(info, older)
