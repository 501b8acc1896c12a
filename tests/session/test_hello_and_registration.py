"""Hello checks and the RegisterInfo adapter, through the generated codec (no sockets)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdwire import wire
from pdwire.demo.model import Capacity, ModelSpec, build_caches, bytes_needed
from pdwire.runtime.config import ParallelRank
from pdwire.runtime.planner import Indexing, StateKind, prepare_peer
from pdwire.runtime.session.failures import (
    Failure,
    FailureKind,
    HandshakeError,
    RegistrationMismatch,
    failure_from_wire,
    failure_to_wire,
)
from pdwire.runtime.session.hello import Identity, check_hello
from pdwire.runtime.session.registration import register_info, remote_memory

CAP = Capacity(pages=8, slots=3, swa_pages=4, aux_items=2)
SMALL = ModelSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, conv_blocks=(8, 8, 16), ssm_heads=4)


def model(name: str = "demo", rev: str = "r1") -> wire.ModelFingerprint:
    return wire.ModelFingerprint(model_name=name, revision=rev, dtype="int16", num_layers=2)


def ident(role: wire.Role, tp: int = 2, **kw: object) -> Identity:
    return Identity(role, f"{role.name.lower()}-engine", ParallelRank(tp, 0), kw.pop("m", model()), **kw)  # type: ignore[arg-type]


def caches(spec: ModelSpec, tp: int, rank: int):  # type: ignore[no-untyped-def]
    backing = np.zeros(bytes_needed(spec, tp, rank, CAP), dtype=np.uint8)
    return build_caches(spec, tp, rank, CAP, backing), backing


def roundtrip(msg: wire.Message, version: tuple[int, int]) -> wire.Message:
    frames = [bytes(f) for f in wire.encode(msg, version)]
    return wire.decode(frames)


def test_compatible_hellos_agree_on_the_newest_common_version() -> None:
    p, d = ident(wire.Role.PREFILL).hello(), ident(wire.Role.DECODE, tp=4).hello()
    assert check_hello(p, d) == check_hello(d, p) == wire.NEWEST
    older = ident(wire.Role.DECODE, versions=((1, 1),)).hello()
    assert check_hello(p, roundtrip(older, (1, 1))) == (1, 1)  # type: ignore[arg-type]
    old = ident(wire.Role.DECODE, versions=((1, 0),)).hello()
    assert check_hello(p, roundtrip(old, (1, 0))) == (1, 0)  # type: ignore[arg-type]


def test_other_major_is_refused_naming_both_versions() -> None:
    p = ident(wire.Role.PREFILL).hello()
    future = ident(wire.Role.DECODE, versions=((2, 0),)).hello()
    with pytest.raises(HandshakeError) as e:
        check_hello(p, future)
    assert f"1.0-1.{wire.NEWEST[1]}" in str(e.value) and "2.0" in str(e.value)


@pytest.mark.parametrize(
    ("remote", "needle"),
    [
        (ident(wire.Role.DECODE, m=model(rev="r2")), "model differs"),
        (ident(wire.Role.PREFILL), "both peers are prefill"),
        (ident(wire.Role.DECODE, tp=3), "do not divide"),
    ],
)
def test_mismatches_are_refused_by_name(remote: Identity, needle: str) -> None:
    with pytest.raises(HandshakeError, match=needle):
        check_hello(ident(wire.Role.PREFILL).hello(), remote.hello())


@pytest.mark.parametrize("version", [(1, 1), (1, 2)], ids=["1.1-borrowed", "1.2-self-described"])
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 4), (4, 2)])
def test_register_info_rebuilds_the_decode_memory_exactly(
    p: int, d: int, mla: bool, version: tuple[int, int]
) -> None:
    spec = replace(SMALL, mla=mla)
    pre, _a = caches(spec, p, 0)
    dec, _b = caches(spec, d, d - 1)
    info = register_info(
        dec.memory, endpoint="tcp://127.0.0.1:1", engine_id="e", agent_name="a", agent_metadata=b"x"
    )
    sent = roundtrip(info, version)
    assert isinstance(sent, wire.RegisterInfo)
    assert all(bool(c.tensor_names) == (version >= (1, 2)) for c in sent.state_components)
    got = remote_memory(sent, pre.memory)  # type: ignore[arg-type]
    assert got == dec.memory


def test_version_1_0_carries_a_single_component_model() -> None:
    spec = replace(SMALL, mamba_layers=0)  # SWA only: what the flat 1.0 state can describe
    pre, _a = caches(spec, 2, 1)
    dec, _b = caches(spec, 1, 0)
    info = register_info(dec.memory, endpoint="e", engine_id="e", agent_name="a", agent_metadata=b"")
    got = remote_memory(roundtrip(info, (1, 0)), pre.memory)  # type: ignore[arg-type]
    assert got == dec.memory
    prepare_peer(pre.memory, got)  # and the planner accepts it


def test_register_info_with_the_wrong_component_count_is_refused() -> None:
    pre, _a = caches(SMALL, 1, 0)
    dec, _b = caches(replace(SMALL, swa_layers=0), 1, 0)
    info = register_info(dec.memory, endpoint="e", engine_id="e", agent_name="a", agent_metadata=b"")
    with pytest.raises(HandshakeError, match="peer has 1 components, this side 2"):
        remote_memory(info, pre.memory)


def _tamper(memory, ci: int, **changes: object):  # type: ignore[no-untyped-def]
    """``memory`` with state component ``ci`` changed (what a skewed decode build would register)."""
    state = list(memory.state)
    state[ci] = replace(state[ci], **changes)
    return replace(memory, state=tuple(state))


def _register(memory, version: tuple[int, int] = wire.NEWEST) -> wire.RegisterInfo:  # type: ignore[no-untyped-def]
    info = register_info(
        memory, endpoint="e", engine_id="e", agent_name="a", agent_metadata=b"", version=version
    )
    got = roundtrip(info, version)
    assert isinstance(got, wire.RegisterInfo)
    return got


def test_a_self_described_component_that_disagrees_is_refused_by_component_tensor_and_field() -> None:
    pre, _a = caches(SMALL, 2, 0)
    dec, _b = caches(SMALL, 2, 1)
    mamba, swa = dec.memory.state  # GQA model: Mamba (axis-sharded, slots), SWA (head-sharded pages)
    renamed = _tamper(dec.memory, 0, tensors=(replace(mamba.tensors[0], name="conv_x"), mamba.tensors[1]))
    with pytest.raises(
        RegistrationMismatch, match=r"state_components\[0\] \(mamba\), field tensor_names"
    ) as e:
        remote_memory(_register(renamed), pre.memory)
    assert (e.value.component, e.value.tensor, e.value.field) == (
        "state_components[0] (mamba)",
        "",
        "tensor_names",
    )
    assert "conv_x" in str(e.value)
    # a 1.1 peer cannot say so: its structure is borrowed from this side's model (documented)
    assert remote_memory(_register(renamed, (1, 1)), pre.memory).state[0].tensors[0].name == "conv"

    blocks = _tamper(
        dec.memory, 0, tensors=(replace(mamba.tensors[0], sub_block_sizes=(16, 16)), mamba.tensors[1])
    )
    with pytest.raises(RegistrationMismatch) as e:
        remote_memory(_register(blocks), pre.memory)
    assert (e.value.tensor, e.value.field) == ("conv", "sub_blocks")

    temporal = mamba.tensors[1]  # twice the bytes over the same sharded axis: a different state dtype
    wider = _tamper(
        dec.memory,
        0,
        tensors=(mamba.tensors[0], replace(temporal, bytes_per_slot=2 * temporal.bytes_per_slot)),
    )
    with pytest.raises(RegistrationMismatch) as e:
        remote_memory(_register(wider), pre.memory)
    assert (e.value.tensor, e.value.field) == ("temporal", "bytes_per_slot")

    assert swa.heads is not None
    replicated = _tamper(dec.memory, 1, heads=None, replicated=True)
    with pytest.raises(
        RegistrationMismatch,
        match=r"state_components\[1\] \(swa\), field sharding: peer is replicated, this side heads",
    ):
        remote_memory(_register(replicated), pre.memory)
    by_slot = _tamper(dec.memory, 1, indexing=Indexing.SLOT)
    with pytest.raises(RegistrationMismatch, match="field indexing: peer indexes by slot, this side by page"):
        remote_memory(_register(by_slot), pre.memory)
    fatter = _tamper(dec.memory, 1, heads=replace(swa.heads, bytes_per_head=2 * swa.heads.bytes_per_head))
    with pytest.raises(RegistrationMismatch, match=r"field heads\.bytes_per_head"):
        remote_memory(_register(fatter), pre.memory)
    # the untampered registration is accepted and is exactly the decode rank's memory
    assert remote_memory(_register(dec.memory), pre.memory) == dec.memory


def test_a_self_description_that_contradicts_itself_is_refused() -> None:
    pre, _a = caches(SMALL, 1, 0)
    dec, _b = caches(SMALL, 1, 0)
    info = _register(dec.memory)
    swa = info.state_components[1]
    no_heads = replace_struct(info, 1, heads=None)
    with pytest.raises(RegistrationMismatch, match="field heads: absent with sharding heads"):
        remote_memory(no_heads, pre.memory)
    unindexed = replace_struct(info, 1, indexing=wire.StateIndexing.UNSPECIFIED)
    with pytest.raises(RegistrationMismatch, match="field indexing: unspecified"):
        remote_memory(unindexed, pre.memory)
    three = replace_struct(info, 1, tensor_names=["k", "v", "x"])
    with pytest.raises(
        HandshakeError, match=f"{len(swa.base_addrs)} tensor entries do not split into 3 tensors"
    ):
        remote_memory(three, pre.memory)


@pytest.mark.parametrize("version", [(1, 2), (1, 1)])
def test_per_layer_values_that_differ_within_one_tensor_are_refused(version: tuple[int, int]) -> None:
    # the planner keeps one slot size per tensor: planning with layer 0's would misplace layer 1's bytes
    pre, _a = caches(SMALL, 1, 0)
    dec, _b = caches(SMALL, 1, 0)
    info = _register(dec.memory, version)
    mamba = info.state_components[0]
    per_slot = np.array(mamba.bytes_per_slot, dtype=np.uint64)
    assert len(per_slot) >= 2  # conv spans at least two layers
    per_slot[1] = per_slot[1] // 2
    with pytest.raises(RegistrationMismatch) as e:
        remote_memory(replace_struct(info, 0, bytes_per_slot=per_slot), pre.memory)
    assert (e.value.tensor, e.value.field) == ("conv", "bytes_per_slot")
    assert "layers differ" in str(e.value)


def replace_struct(info: wire.RegisterInfo, ci: int, **changes: object) -> wire.RegisterInfo:
    import msgspec

    comps = list(info.state_components)
    comps[ci] = msgspec.structs.replace(comps[ci], **changes)
    return msgspec.structs.replace(info, state_components=comps)


@pytest.mark.parametrize("kind", list(FailureKind))
def test_failures_travel_typed_from_1_2_and_as_a_reason_prefix_before(kind: FailureKind) -> None:
    f = Failure(kind, "detail: with a colon")
    wk, reason = failure_to_wire(f, (1, 2))
    if kind is FailureKind.UNSPECIFIED:  # a failure of unknown kind: its detail alone, at every version
        assert (wk, reason) == (wire.FailureKind.UNSPECIFIED, f.reason)
    else:
        assert wk.name == kind.name and reason == f.detail
    for version in ((1, 2), (1, 1), (1, 0)):
        kind_sent, reason_sent = failure_to_wire(f, version)
        status = wire.TransferStatus(
            room=9, status=wire.Status.FAILED, sender_rank=0, failure_kind=kind_sent, reason=reason_sent
        )
        got = roundtrip(status, version)  # a 1.1 writer's encoder would refuse a typed kind
        assert isinstance(got, wire.TransferStatus)
        assert failure_from_wire(got.failure_kind, got.reason) == f
    assert failure_to_wire(f, None) == (wire.FailureKind.UNSPECIFIED, f.reason)  # version not agreed yet


def test_a_huge_failure_text_is_clipped_before_it_reaches_the_peer() -> None:
    """A reason quoting a peer's input must not outgrow the peer's socket limit (decode drops a
    prefill rank that sends a frame over PREFILL_MAX_MESSAGE)."""
    from pdwire.runtime.session.failures import REASON_MAX
    from pdwire.runtime.workers.decode import PREFILL_MAX_MESSAGE

    huge = Failure(FailureKind.VALIDATION, "x" * (4 * PREFILL_MAX_MESSAGE))
    for version in (None, (1, 1), wire.NEWEST):
        _, reason = failure_to_wire(huge, version)
        assert reason.endswith(" more characters)") and len(reason) < REASON_MAX + 64
        status = wire.TransferStatus(room=1, status=wire.Status.FAILED, sender_rank=0, reason=reason)
        assert sum(len(f) for f in wire.encode(status)) < PREFILL_MAX_MESSAGE
    assert failure_to_wire(Failure(FailureKind.VALIDATION, "short"), wire.NEWEST)[1] == "short"


@pytest.mark.parametrize("field", ["aux_lens", "aux_item_lens"])
@pytest.mark.parametrize("count", [0, 2])
def test_aux_lists_that_do_not_line_up_with_the_buffers_are_refused_by_field(field: str, count: int) -> None:
    import msgspec

    pre, _a = caches(SMALL, 1, 0)
    dec, _b = caches(SMALL, 1, 0)
    info = _register(dec.memory)
    assert len(info.aux_base_addrs) == 1  # the demo model's aux buffer
    bad = msgspec.structs.replace(info, **{field: np.full(count, 64, dtype=np.uint64)})
    with pytest.raises(HandshakeError, match=rf"RegisterInfo\.{field}: {count} entries for 1 aux buffers"):
        remote_memory(roundtrip(bad, wire.NEWEST), pre.memory)  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [(1, 2), (1, 1)], ids=["1.2-self-described", "1.1-borrowed"])
@pytest.mark.parametrize("field", ["region_lens", "bytes_per_slot", "shard_axis_sizes", "sub_blocks"])
def test_per_entry_state_lists_that_do_not_line_up_are_refused_by_field(
    field: str, version: tuple[int, int]
) -> None:
    pre, _a = caches(SMALL, 2, 0)
    dec, _b = caches(SMALL, 2, 1)
    info = _register(dec.memory, version)
    mamba = info.state_components[0]
    n = len(mamba.base_addrs)
    short = list(getattr(mamba, field))[:1]  # one entry for several tensors x layers
    value = short if field == "sub_blocks" else np.asarray(short, dtype=np.uint64)
    with pytest.raises(
        HandshakeError, match=rf"state_components\[0\]\.{field}: 1 entries for {n} base addresses"
    ):
        remote_memory(replace_struct(info, 0, **{field: value}), pre.memory)


@pytest.mark.parametrize("version", [(1, 2), (1, 1)], ids=["1.2-self-described", "1.1-borrowed"])
def test_a_sharded_axis_the_peers_tp_does_not_divide_is_refused(version: tuple[int, int]) -> None:
    pre, _a = caches(SMALL, 1, 0)
    dec, _b = caches(SMALL, 2, 1)
    info = _register(dec.memory, version)
    mamba = info.state_components[0]
    odd = np.array(mamba.shard_axis_sizes, dtype=np.uint64)
    odd[odd > 0] += 1  # every sharded tensor's full axis one longer: odd, and TP is 2
    with pytest.raises(RegistrationMismatch, match="cannot be split over the peer's TP 2") as e:
        remote_memory(replace_struct(info, 0, shard_axis_sizes=odd), pre.memory)
    assert (e.value.tensor, e.value.field) == ("conv", "shard_axis_sizes")


def _staged(memory, stage: int, stages: int = 2):  # type: ignore[no-untyped-def]
    """``memory`` as PP stage ``stage``: its state components name their layers."""
    state = tuple(
        replace(c, layer_ids=tuple(stage * c.num_layers + i for i in range(c.num_layers)))
        for c in memory.state
    )
    position = replace(memory.position, pp_size=stages, pp_rank=stage)
    return replace(memory, position=position, state=state)


def test_a_pp_stage_registers_its_state_layers_from_1_3() -> None:
    pre, _a = caches(SMALL, 1, 0)
    dec, _b = caches(SMALL, 1, 0)
    stage1 = _staged(dec.memory, 1)
    got = remote_memory(_register(stage1), _staged(pre.memory, 1))
    assert got == stage1 and got.state[0].layer_ids == (2, 3)
    # a 1.2 peer would put them on layers 0 and 1: the codec refuses to drop them
    with pytest.raises(wire.DowngradeError, match=r"StateComponent\.layer_ids"):
        wire.encode(
            register_info(stage1, endpoint="e", engine_id="e", agent_name="a", agent_metadata=b""), (1, 2)
        )
    # stage 0's ids are 0..n-1, which a 1.2 peer means too: they travel, and PP still needs them
    stage0 = _staged(dec.memory, 0)
    older = _register(stage0, (1, 2))
    assert all(len(c.layer_ids) == 0 for c in older.state_components)
    with pytest.raises(HandshakeError, match=r"state_components\[0\]\.layer_ids: none from PP stage of 2"):
        remote_memory(older, _staged(pre.memory, 0))
    assert remote_memory(_register(stage0), _staged(pre.memory, 0)) == stage0


@pytest.mark.parametrize("ids", [[2], [2, 2], [2, 3, 4]], ids=["too-few", "repeated", "too-many"])
def test_layer_ids_that_do_not_name_each_layer_once_are_refused(ids: list[int]) -> None:
    pre, _a = caches(SMALL, 1, 0)
    dec, _b = caches(SMALL, 1, 0)
    info = _register(_staged(dec.memory, 1))
    bad = replace_struct(info, 0, layer_ids=np.array(ids, dtype=np.uint32))
    with pytest.raises(
        HandshakeError, match=r"state_components\[0\]\.layer_ids: .* one distinct id per layer"
    ):
        remote_memory(bad, _staged(pre.memory, 1))


def test_an_nsa_component_registers_from_1_3() -> None:
    pre, _a = caches(SMALL, 1, 0)
    dec, _b = caches(SMALL, 1, 0)
    as_nsa = {"kind": StateKind.NSA}
    got = remote_memory(_register(_tamper(dec.memory, 1, **as_nsa)), _tamper(pre.memory, 1, **as_nsa))
    assert got.state[1].kind is StateKind.NSA
    # named at the handshake before the codec's DowngradeError would be
    with pytest.raises(
        HandshakeError, match=r"RegisterInfo 1\.2 cannot describe .*state kind nsa \(from 1\.3\)"
    ):
        _register(_tamper(dec.memory, 1, **as_nsa), (1, 2))
