"""Shared process clusters: starting rank processes is the expensive part, so groups are started
once per module and reused by every case that needs the same (engine, TP, model)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest
from pdwire.runtime.demo_cluster import Cluster, Group, RoomResult
from pdwire.runtime.demo_model import Capacity, ModelSpec

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# Small on purpose: every byte is generated, moved and verified on a 2-core machine.
SPEC = ModelSpec(
    layers=2, kv_heads=4, head_dim=16, page_size=4, conv_blocks=(8, 8, 16), ssm_heads=4, swa_window_pages=3
)
CAP = Capacity(pages=256, slots=24, swa_pages=64, aux_items=24)


@dataclass
class Pool:
    """Groups of one cluster, started on first use and connected on first use."""

    cluster: Cluster
    groups: dict[tuple[str, int, bool], Group] = field(default_factory=dict)
    connected: set[tuple[str, str]] = field(default_factory=set)
    next_room: int = 1

    def group(self, role: str, tp: int, mla: bool) -> Group:
        key = (role, tp, mla)
        if key not in self.groups:
            engine = f"{role}-tp{tp}-{'mla' if mla else 'gqa'}"
            self.groups[key] = self.cluster.start(role, tp, engine, spec=replace(SPEC, mla=mla))
        return self.groups[key]

    def pair(self, p: int, d: int, mla: bool) -> tuple[Group, Group]:
        pre, dec = self.group("prefill", p, mla), self.group("decode", d, mla)
        if (dec.engine_id, pre.engine_id) not in self.connected:
            assert self.cluster.connect(dec, pre) == [""] * d
            self.connected.add((dec.engine_id, pre.engine_id))
        return pre, dec

    def rooms(self, dec: Group, pre: Group, lengths: list[int]) -> list[RoomResult]:
        out = []
        for n in lengths:
            out.append(self.cluster.submit(dec, pre, self.next_room, n))
            self.next_room += 1
        return self.cluster.wait_rooms(out, 120)


def assert_clean_shutdown(pool: Pool) -> None:
    """Every decode rank's memory outside verified rooms is untouched; no rank logged a failure."""
    for g in list(pool.groups.values()):
        finals = pool.cluster.stop(g)
        for rank, (stats, problems) in finals.items():
            assert problems == [], f"{g.engine_id} rank {rank}: {problems}"
            assert stats["failures"] == [], f"{g.engine_id} rank {rank}: {stats['failures']}"


@pytest.fixture(scope="module", params=["nixl", "local"])
def pool(request: pytest.FixtureRequest) -> Iterator[Pool]:
    from pdwire.runtime.backends import available_backends

    if request.param not in available_backends():
        pytest.fail(f"backend {request.param} does not import here: CI must install it (./dev setup)")
    with Cluster(SPEC, CAP, request.param, room_timeout_s=30.0) as cluster:
        p = Pool(cluster)
        yield p
        assert_clean_shutdown(p)
