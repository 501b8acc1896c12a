"""Memory descriptors through RegisterInfo: backend -> wire -> the prefill side's add_peer.

Descriptor-addressed engines (MoRI) publish one blob per region; the session layer splits
them over ``kv_mem_descs`` and ``StateComponent.mem_descs`` and joins them back in region
order. A 1.0 peer, which cannot carry them, is refused at the handshake.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import msgspec
import numpy as np
import pytest

from pdwire import wire
from pdwire.demo.model import Capacity, ModelSpec, RankCaches, build_caches, bytes_needed
from pdwire.runtime.backends import Backend, PeerError, PeerMetadata, create_backend
from pdwire.runtime.session.failures import HandshakeError
from pdwire.runtime.session.hello import check_descriptors
from pdwire.runtime.session.registration import join_region_descs, register_info

CAP = Capacity(pages=8, slots=3, swa_pages=4, aux_items=2)
SPEC = ModelSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, conv_blocks=(8, 8, 16), ssm_heads=4)
MODELS = [pytest.param(False, id="gqa-mamba-swa"), pytest.param(True, id="mla-swa-dsa")]


def caches(mla: bool, tp: int = 2, rank: int = 1) -> RankCaches:
    spec = replace(SPEC, mla=mla)
    return build_caches(spec, tp, rank, CAP, np.zeros(bytes_needed(spec, tp, rank, CAP), dtype=np.uint8))


def roundtrip(info: wire.RegisterInfo, version: tuple[int, int] = wire.NEWEST) -> wire.RegisterInfo:
    msg = wire.decode([bytes(f) for f in wire.encode(info, version)])
    assert isinstance(msg, wire.RegisterInfo)
    return msg


def info_with(
    c: RankCaches, descs: tuple[bytes, ...], version: tuple[int, int] = wire.NEWEST
) -> wire.RegisterInfo:
    return register_info(
        c.memory,
        endpoint="e",
        engine_id="d",
        agent_name="a",
        agent_metadata=b"",
        region_descs=descs,
        version=version,
    )


@pytest.mark.parametrize("version", [(1, 1), (1, 2)], ids=["1.1", "1.2"])
@pytest.mark.parametrize("mla", MODELS)
def test_descriptors_travel_in_region_order(mla: bool, version: tuple[int, int]) -> None:
    c = caches(mla)
    regions = c.regions()
    descs = tuple(f"desc-{i}-{r.name}".encode() for i, r in enumerate(regions))
    info = roundtrip(info_with(c, descs, version), version)
    assert join_region_descs(info) == descs
    # split like the memory: every state component carries exactly its own regions' blobs
    for ci, comp in enumerate(info.state_components):
        assert len(comp.mem_descs) == len(comp.base_addrs) > 0
        assert all(d.split(b"-")[2].startswith(f"state{ci}.".encode()) for d in comp.mem_descs)
    names = [d.split(b"-", 2)[2] for d in info.kv_mem_descs]
    aux = [d.split(b"-", 2)[2] for d in info.aux_mem_descs]
    if version >= (1, 2):  # the aux buffers' own list
        assert aux and all(n.startswith(b"aux.") for n in aux) and all(n.startswith(b"kv.") for n in names)
    else:  # 1.1 has no aux list: they ride at the tail of kv_mem_descs
        assert aux == [] and names[-1].startswith(b"aux.") and all(n.startswith(b"kv.") for n in names[:-1])


def test_address_engines_send_no_descriptors() -> None:
    info = roundtrip(info_with(caches(False), ()))
    assert info.kv_mem_descs == [] and all(c.mem_descs == [] for c in info.state_components)
    assert join_region_descs(info) == ()


def test_a_descriptor_count_that_does_not_match_the_regions_is_refused() -> None:
    c = caches(False)
    n = len(c.regions())
    with pytest.raises(HandshakeError, match=f"{n - 1} memory descriptors for {n} regions"):
        info_with(c, tuple(b"x" for _ in range(n - 1)))
    info = info_with(c, tuple(b"x" for _ in range(n)))
    short = msgspec.structs.replace(
        info.state_components[1], mem_descs=info.state_components[1].mem_descs[:-1]
    )
    bad = msgspec.structs.replace(info, state_components=[info.state_components[0], short])
    with pytest.raises(HandshakeError, match=r"state_components\[1\]\.mem_descs"):
        join_region_descs(bad)
    with pytest.raises(HandshakeError, match="kv_mem_descs"):
        join_region_descs(msgspec.structs.replace(info, kv_mem_descs=info.kv_mem_descs[1:]))


def test_version_1_0_is_refused_for_descriptor_engines_only() -> None:
    with pytest.raises(HandshakeError) as e:
        check_descriptors((1, 0), "mori-fake", True, "prefill-0")
    msg = str(e.value)
    assert "mori-fake" in msg and "1.0" in msg and "mem_descs" in msg and "1.1" in msg
    check_descriptors((1, 1), "mori-fake", True, "prefill-0")
    check_descriptors((1, 0), "nixl", False, "prefill-0")
    # why: the 1.0 encoder cannot carry a component's descriptors at all
    spec10 = replace(SPEC, mamba_layers=0)
    c = build_caches(spec10, 1, 0, CAP, np.zeros(bytes_needed(spec10, 1, 0, CAP), dtype=np.uint8))
    info = info_with(c, tuple(b"x" for _ in c.regions()))
    with pytest.raises(wire.DowngradeError):
        wire.encode(info, (1, 0))


@pytest.fixture
def mori_pair() -> Iterator[tuple[Backend, Backend]]:
    a = create_backend("mori-fake", agent_name="prefill-side")
    b = create_backend("mori-fake", agent_name="decode-side")
    try:
        yield a, b
    finally:
        b.close()
        a.close()


@pytest.mark.parametrize("mla", MODELS)
def test_mori_peer_added_from_a_register_info(mori_pair: tuple[Backend, Backend], mla: bool) -> None:
    """The MoRI adapter checks every descriptor against the region of the same index."""
    pre, dec = mori_pair
    spec = replace(SPEC, mla=mla)
    buf = dec.allocate("caches", bytes_needed(spec, 2, 1, CAP))
    c = build_caches(spec, 2, 1, CAP, buf.array)
    dec.register(c.regions())
    md = dec.local_metadata()
    assert len(md.region_descs) == len(c.regions())
    info = roundtrip(
        register_info(
            c.memory,
            endpoint="e",
            engine_id="d",
            agent_name=md.agent_name,
            agent_metadata=md.agent_metadata,
            region_descs=md.region_descs,
        )
    )
    peer = pre.add_peer(PeerMetadata(info.agent_name, bytes(info.agent_metadata), join_region_descs(info)))
    assert [r.base for r in peer.regions] == [r.base for r in c.regions()]
    # the same blobs in another order are caught by the adapter, not posted into wrong memory
    shuffled = (*md.region_descs[1:], md.region_descs[0])
    with pytest.raises(PeerError, match="does not describe region"):
        pre.add_peer(PeerMetadata(md.agent_name, md.agent_metadata, shuffled))
