"""Protocol 1.4 at the handshake: engine memory layouts, any sharded state axis and SGLang's state
kinds travel in RegisterInfo and rebuild the decode memory exactly; a peer before 1.4 is refused
by name when a layout in use needs 1.4; a layout outside the model is refused at the handshake,
never planned."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import numpy as np
import pytest

from pdwire import wire
from pdwire.runtime.planner import (
    AuxBuffer,
    Indexing,
    KvPool,
    Layout,
    ParallelRank,
    PlanError,
    RankMemory,
    StateKind,
    StatePool,
    StateTensor,
    prepare_peer,
    regions,
)
from pdwire.runtime.session.failures import HandshakeError
from pdwire.runtime.session.registration import (
    check_layout_version,
    join_region_descs,
    register_info,
    remote_memory,
)

V13 = (1, 3)
PAGE, HEADS, HEAD_BYTES, LAYERS = 4, 4, 8, 2
CONV_BLOCKS, ROWS, TEMPORAL = (8, 8, 16), 3, 8


def memory(
    tp: int,
    rank: int,
    *,
    base: int = 1 << 36,
    vllm: bool = False,
    mla: bool = False,
    kimi: bool = True,
    extra_kinds: bool = True,
    declare_blocks: bool = True,
) -> RankMemory:
    """One rank of a hybrid model. ``vllm``: K and V interleaved per block with padding, and the
    Mamba layers' conv and temporal state in the same blocks (aliased registrations, offsets)."""
    heads = 1 if mla else HEADS // tp
    item = PAGE * heads * HEAD_BYTES
    conv_axis, temporal_axis = sum(CONV_BLOCKS) // tp, TEMPORAL // tp
    rows = ROWS if kimi else 1
    conv_item, temporal_item = rows * conv_axis * 2, temporal_axis * 16
    blocks = 16
    if vllm:
        stride = max(2 * item, conv_item + temporal_item) + 64
        k = tuple(base + layer * (1 << 24) for layer in range(LAYERS))
        kv = KvPool(
            k, () if mla else k, (stride * blocks,) * LAYERS, item, PAGE, Layout.NHD, heads,
            1 if mla else HEADS, HEAD_BYTES, mla, page_stride=stride, v_offset=0 if mla else item,
        )  # fmt: skip
        conv_bases = temporal_bases = k
        conv_kw = {"slot_stride": stride}
        temporal_kw = {"slot_stride": stride, "offset": conv_item}
        lens = (stride * blocks,) * LAYERS
        conv_lens = temporal_lens = lens
    else:
        k = tuple(base + layer * (1 << 24) for layer in range(LAYERS))
        v = () if mla else tuple(base + (1 << 30) + layer * (1 << 24) for layer in range(LAYERS))
        kv = KvPool(k, v, (item * blocks,) * LAYERS, item, PAGE, Layout.NHD, heads, 1 if mla else HEADS,
                    HEAD_BYTES, mla)  # fmt: skip
        conv_bases = tuple(base + (2 << 30) + layer * (1 << 24) for layer in range(LAYERS))
        temporal_bases = tuple(base + (3 << 30) + layer * (1 << 24) for layer in range(LAYERS))
        conv_kw, temporal_kw = {}, {}
        conv_lens, temporal_lens = (conv_item * blocks,) * LAYERS, (temporal_item * blocks,) * LAYERS
    conv = StateTensor(
        "conv", conv_bases, conv_lens, conv_item, conv_axis, CONV_BLOCKS if declare_blocks else None,
        outer_rows=rows, **conv_kw,  # type: ignore[arg-type]
    )  # fmt: skip
    temporal = StateTensor(
        "temporal", temporal_bases, temporal_lens, temporal_item, temporal_axis, **temporal_kw
    )  # type: ignore[arg-type]
    norm_base = base + (4 << 30)
    norm = StateTensor("norm", tuple(norm_base + layer * 4096 for layer in range(LAYERS)), (64,) * LAYERS, 4,
                       replicated=True)  # fmt: skip
    state = [StatePool(StateKind.MAMBA, Indexing.SLOT, (conv, temporal, norm))]
    if extra_kinds:
        ring = StateTensor("ring", (base + (5 << 30),), (32 * 8,), 8)
        state.append(StatePool(StateKind.SWA_RING, Indexing.ROW, (ring,), replicated=True))
        scale = StateTensor("scale", (base + (6 << 30),), (16 * 4,), 4)
        state.append(StatePool(StateKind.BLOCK_SCALE, Indexing.PAGE, (scale,), replicated=True))
    aux = (AuxBuffer("out", base + (7 << 30), 4 * 16, 16),)
    return RankMemory(ParallelRank(tp, rank), kv, tuple(state), aux)


def roundtrip(msg: wire.Message, version: tuple[int, int] = wire.NEWEST) -> wire.Message:
    return wire.decode([bytes(f) for f in wire.encode(msg, version)])


def info_of(mem: RankMemory, **kw: object) -> wire.RegisterInfo:
    return register_info(mem, endpoint="tcp://h:1", engine_id="d", agent_name="a", agent_metadata=b"", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("vllm", [False, True], ids=["packed", "vllm"])
@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("mla", [False, True])
def test_1_4_registration_rebuilds_strided_aliased_and_kimi_memory_exactly(
    p: int, d: int, vllm: bool, mla: bool
) -> None:
    prefill = memory(p, 0, mla=mla)
    decode = memory(d, d - 1, base=1 << 44, vllm=vllm, mla=mla)
    sent = roundtrip(info_of(decode))
    assert isinstance(sent, wire.RegisterInfo)
    got = remote_memory(sent, prefill)
    assert got == decode
    plan = prepare_peer(replace(prefill, position=ParallelRank(p, p - 1)), got)
    assert not plan.is_dummy  # MLA with TP-sharded state from a larger prefill TP: every rank writes


def test_sub_blocks_declared_by_prefill_only_are_taken_from_prefill() -> None:
    # SGLang's decode never registers the conv split; the fingerprints matched, so it is the model's
    prefill = memory(1, 0)
    decode = memory(2, 1, base=1 << 44, declare_blocks=False)
    got = remote_memory(roundtrip(info_of(decode)), prefill)
    assert got.state[0].tensors[0].sub_block_sizes is None
    table = prepare_peer(prefill, got).plan_state([[1], [], []], [[2], [], []])[0].table
    with_split = memory(2, 1, base=1 << 44)
    expected = prepare_peer(prefill, with_split).plan_state([[1], [], []], [[2], [], []])[0].table
    assert table.dst_addr.tolist() == expected.dst_addr.tolist()
    assert table.src_addr.tolist() == expected.src_addr.tolist()


def test_aliased_registrations_join_one_descriptor_per_registration() -> None:
    decode = memory(1, 0, base=1 << 44, vllm=True)
    count = len(regions(decode))
    blobs = [f"region{i}".encode() for i in range(count)]
    info = roundtrip(info_of(decode, region_descs=blobs))
    assert isinstance(info, wire.RegisterInfo)
    assert join_region_descs(info, remote_memory(info, memory(1, 0))) == tuple(blobs)
    assert len(join_region_descs(info)) > count  # per buffer without the memory: aliases repeat


# ---- peers before 1.4 ---------------------------------------------------------------------------


def test_a_1_3_peer_is_refused_by_name_for_every_layout_it_cannot_describe() -> None:
    decode = memory(2, 0, base=1 << 44, vllm=True)
    with pytest.raises(HandshakeError) as caught:
        check_layout_version(V13, decode, "prefill-0", own_layout=True, prefill_tp=2, decode_tp=2)
    text = str(caught.value)
    for needle in (
        "'prefill-0' agreed on 1.3",
        "KV page stride",
        "K/V offsets",
        "slot stride",
        "aliased registrations",
        "sharded axis after 3 rows",
        "norm: replicated",
        "state kind swa_ring",
        "row indexing",
        "state kind block_scale",
        "both peers must speak 1.4",
    ):
        assert needle in text, needle
    with pytest.raises(HandshakeError, match=r"RegisterInfo 1\.3 cannot describe KV page stride"):
        info_of(decode, version=V13)
    # the codec refuses it too, should a caller skip both
    with pytest.raises(wire.DowngradeError):
        wire.encode(info_of(decode), V13)


def test_a_1_3_peer_is_fine_when_nothing_needs_1_4() -> None:
    plain = memory(2, 0, kimi=False, extra_kinds=False)
    plain = replace(plain, state=(replace(plain.state[0], tensors=plain.state[0].tensors[:2]),))
    check_layout_version(V13, plain, "p", own_layout=True, prefill_tp=2, decode_tp=2)
    info = roundtrip(info_of(plain, version=V13), V13)
    assert isinstance(info, wire.RegisterInfo) and remote_memory(info, plain) == plain
    # where the prefill side keeps its own items is its business: only the model's structure counts
    strided = memory(2, 0, vllm=True, kimi=False, extra_kinds=False)
    strided = replace(strided, state=(replace(strided.state[0], tensors=strided.state[0].tensors[:2]),))
    check_layout_version(V13, strided, "d", own_layout=False, prefill_tp=2, decode_tp=2)


def test_mla_with_sharded_state_from_a_larger_prefill_tp_needs_1_4() -> None:
    mla = memory(4, 0, mla=True, kimi=False, extra_kinds=False)
    mla = replace(mla, state=(replace(mla.state[0], tensors=mla.state[0].tensors[:2]),))
    with pytest.raises(HandshakeError, match="MLA with TP-sharded state from prefill TP 4 to decode TP 2"):
        check_layout_version(V13, mla, "d", own_layout=False, prefill_tp=4, decode_tp=2)
    check_layout_version(V13, mla, "d", own_layout=False, prefill_tp=2, decode_tp=4)
    check_layout_version(wire.NEWEST, mla, "d", own_layout=False, prefill_tp=4, decode_tp=2)


# ---- 1.4: KV pages whose heads lie apart (vLLM CPU) ------------------------------------------------


def _heads_apart(tp: int, rank: int, base: int) -> RankMemory:
    """vLLM CPU attention: per block and head, the head's K page then its V page (4 heads)."""
    heads, span, blocks = 4 // tp, 4 * 8, 6
    kv = KvPool(
        (base,), (base,), (blocks * heads * 2 * span,), heads * span, 4, Layout.HND, heads, 4, 8,
        page_stride=heads * 2 * span, v_offset=span, head_stride=2 * span,
    )  # fmt: skip
    return RankMemory(ParallelRank(tp, rank), kv)


def test_1_4_registration_carries_the_head_stride_and_a_1_3_peer_is_refused_by_name() -> None:
    decode = _heads_apart(1, 0, 1 << 44)
    sent = roundtrip(info_of(decode))
    assert isinstance(sent, wire.RegisterInfo) and sent.kv_head_stride == 64
    assert remote_memory(sent, _heads_apart(2, 0, 1 << 40)) == decode
    with pytest.raises(HandshakeError, match=r"agreed on 1\.3.*KV head stride 64.*speak 1\.4"):
        check_layout_version(V13, decode, "prefill-0", own_layout=True, prefill_tp=2, decode_tp=1)
    with pytest.raises(wire.DowngradeError, match="kv_head_stride"):
        wire.encode(info_of(decode), V13)
    # one head per rank: the stride moves no address, so the registration carries none
    one = _heads_apart(4, 1, 1 << 44)
    back = roundtrip(info_of(one))
    assert isinstance(back, wire.RegisterInfo) and back.kv_head_stride == 0
    got = remote_memory(back, _heads_apart(2, 0, 1 << 40))
    assert replace(got, kv=replace(got.kv, head_stride=64)) == one  # type: ignore[arg-type]


def _side_by_side(tp: int, rank: int, base: int, layout: Layout) -> RankMemory:
    """vLLM's GPU backends: per block, K and V of each token and head side by side (4 heads of 8
    bytes, 4 tokens), heads outer in LBHNC (HND), tokens outer in LBNHC (NHD)."""
    heads, unit, tokens, blocks = 4 // tp, 8, 4, 6
    head_stride, token_stride = (
        (tokens * 2 * unit, 2 * unit) if layout is Layout.HND else (2 * unit, heads * 2 * unit)
    )
    kv = KvPool(
        (base,), (base,), (blocks * heads * tokens * 2 * unit,), heads * tokens * unit, tokens, layout,
        heads, 4, unit, page_stride=heads * tokens * 2 * unit, v_offset=unit,
        head_stride=head_stride, token_stride=token_stride,
    )  # fmt: skip
    return RankMemory(ParallelRank(tp, rank), kv)


@pytest.mark.parametrize("layout", list(Layout))
def test_1_5_registration_carries_both_unit_strides_and_a_1_4_peer_is_refused_by_name(layout: Layout) -> None:
    decode = _side_by_side(1, 0, 1 << 44, layout)
    sent = roundtrip(info_of(decode))
    assert isinstance(sent, wire.RegisterInfo) and sent.kv_token_stride == decode.kv.token_stride  # type: ignore[union-attr]
    assert remote_memory(sent, _side_by_side(2, 0, 1 << 40, layout)) == decode
    with pytest.raises(HandshakeError, match=r"agreed on 1\.4.*KV token stride.*speak 1\.5"):
        check_layout_version((1, 4), decode, "prefill-0", own_layout=True, prefill_tp=2, decode_tp=1)
    with pytest.raises(wire.DowngradeError, match="kv_token_stride"):
        wire.encode(info_of(decode), (1, 4))


# ---- layouts outside the model: refused at the handshake, never planned --------------------------


def _sent(decode: RankMemory) -> wire.RegisterInfo:
    info = roundtrip(info_of(decode))
    assert isinstance(info, wire.RegisterInfo)
    return info


def _component(info: wire.RegisterInfo, ci: int, **changes: object) -> wire.RegisterInfo:
    comps = list(info.state_components)
    comps[ci] = msgspec.structs.replace(comps[ci], **changes)
    return msgspec.structs.replace(info, state_components=comps)


def _layouts(info: wire.RegisterInfo, ti: int, **changes: object) -> wire.RegisterInfo:
    layouts = list(info.state_components[0].tensor_layouts)
    layouts[ti] = msgspec.structs.replace(layouts[ti], **changes)
    return _component(info, 0, tensor_layouts=layouts)


def _u64(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


def _outside_the_model() -> list[tuple[str, wire.RegisterInfo, str]]:
    base = _sent(memory(2, 0, base=1 << 44, vllm=True))
    mamba = base.state_components[0]
    no_split = [_u64()] * 4  # temporal and norm entries
    stride = msgspec.structs.replace
    return [
        ("a V page that overlaps K", stride(base, v_page_offset=5), "k and v overlap"),
        ("an item past its stride", stride(base, kv_page_stride=8), "does not fit a stride"),
        ("conv and temporal on one byte", _layouts(base, 1, offset=1), "overlap inside one item"),
        ("rows of another layout", _layouts(base, 0, outer_rows=1), "outer_rows"),
        ("a replicated tensor with an axis", _layouts(base, 1, replicated=True), "replicated with"),
        (
            "a layout per tensor missing",
            _component(base, 0, tensor_layouts=mamba.tensor_layouts[:2]),
            "3 tensors",
        ),
        (
            "sub-blocks not summing to the axis",
            _component(base, 0, sub_blocks=[_u64(8, 8, 8)] * 2 + no_split),
            "8, 8",
        ),
        (
            "a conv split of another model",
            _component(base, 0, sub_blocks=[_u64(16, 8, 8)] * 2 + no_split),
            "sub_blocks",
        ),
        (
            "an axis TP does not divide",
            _component(base, 0, shard_axis_sizes=_u64(33, 33, 8, 8, 0, 0)),
            "cannot be split",
        ),
        (
            "slot sizes differing per layer",
            _component(base, 0, bytes_per_slot=_u64(144, 145, 64, 64, 4, 4)),
            "differ",
        ),
        (
            "a dsa_tail component",
            _component(base, 1, type=wire.StateType.DSA_TAIL),
            "dsa_tail cannot be moved",
        ),
        (
            "a kind this model lacks",
            _component(base, 2, type=wire.StateType.BLOCK_SCALE_SWA),
            "BLOCK_SCALE_SWA",
        ),
        ("row indexing of a paged kind", _component(base, 2, indexing=wire.StateIndexing.ROW), "indexing"),
    ]


CASES = _outside_the_model()


@pytest.mark.parametrize(("case", "info", "needle"), CASES, ids=[c[0] for c in CASES])
def test_a_layout_outside_the_model_is_refused_at_the_handshake(
    case: str, info: wire.RegisterInfo, needle: str
) -> None:
    prefill = memory(1, 0, vllm=True)
    with pytest.raises((HandshakeError, PlanError)) as caught:  # what the prefill worker answers with
        prepare_peer(prefill, remote_memory(roundtrip(info), prefill))
    assert needle in str(caught.value), (case, str(caught.value))


def test_a_dsa_tail_component_is_refused_by_name_on_both_sides() -> None:
    tail = StatePool(StateKind.DSA_TAIL, Indexing.ROW, (StateTensor("k", (1 << 40,), (4096,), 64),))
    mem = replace(memory(1, 0, extra_kinds=False), state=(tail,))
    with pytest.raises(HandshakeError, match=r"state_components\[0\]: state kind dsa_tail cannot be moved"):
        info_of(mem)
    with pytest.raises(HandshakeError, match="dsa_tail"):
        remote_memory(_sent(memory(1, 0, extra_kinds=False)), mem)
