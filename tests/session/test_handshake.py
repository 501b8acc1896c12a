"""Hello checks and the RegisterInfo adapter, through the generated codec (no sockets)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from pdwire.runtime.demo_model import Capacity, ModelSpec, build_caches, bytes_needed
from pdwire.runtime.planner import prepare_peer
from pdwire.runtime.session.failures import HandshakeError
from pdwire.runtime.session.handshake import Identity, check_hello, register_info, remote_memory

from pdwire import wire

CAP = Capacity(pages=8, slots=3, swa_pages=4, aux_items=2)
SMALL = ModelSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, conv_blocks=(8, 8, 16), ssm_heads=4)


def model(name: str = "demo", rev: str = "r1") -> wire.ModelFingerprint:
    return wire.ModelFingerprint(model_name=name, revision=rev, dtype="int16", num_layers=2)


def ident(role: wire.Role, tp: int = 2, **kw: object) -> Identity:
    return Identity(role, f"{role.name.lower()}-engine", tp, 0, kw.pop("m", model()), **kw)  # type: ignore[arg-type]


def caches(spec: ModelSpec, tp: int, rank: int):  # type: ignore[no-untyped-def]
    backing = np.zeros(bytes_needed(spec, tp, rank, CAP), dtype=np.uint8)
    return build_caches(spec, tp, rank, CAP, backing), backing


def roundtrip(msg: wire.Message, version: tuple[int, int]) -> wire.Message:
    frames = [bytes(f) for f in wire.encode(msg, version)]
    return wire.decode(frames)


def test_compatible_hellos_agree_on_the_newest_common_version() -> None:
    p, d = ident(wire.Role.PREFILL).hello(), ident(wire.Role.DECODE, tp=4).hello()
    assert check_hello(p, d) == check_hello(d, p) == (1, 2)
    older = ident(wire.Role.DECODE, versions=((1, 1),)).hello()
    assert check_hello(p, roundtrip(older, (1, 1))) == (1, 1)  # type: ignore[arg-type]
    old = ident(wire.Role.DECODE, versions=((1, 0),)).hello()
    assert check_hello(p, roundtrip(old, (1, 0))) == (1, 0)  # type: ignore[arg-type]


def test_other_major_is_refused_naming_both_versions() -> None:
    p = ident(wire.Role.PREFILL).hello()
    future = ident(wire.Role.DECODE, versions=((2, 0),)).hello()
    with pytest.raises(HandshakeError) as e:
        check_hello(p, future)
    assert "1.0-1.2" in str(e.value) and "2.0" in str(e.value)


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


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 4), (4, 2)])
def test_register_info_rebuilds_the_decode_memory_exactly(p: int, d: int, mla: bool) -> None:
    spec = replace(SMALL, mla=mla)
    pre, _a = caches(spec, p, 0)
    dec, _b = caches(spec, d, d - 1)
    info = register_info(
        dec.memory, endpoint="tcp://127.0.0.1:1", engine_id="e", agent_name="a", agent_metadata=b"x"
    )
    got = remote_memory(roundtrip(info, (1, 1)), pre.memory)  # type: ignore[arg-type]
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
