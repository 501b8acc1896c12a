"""Prefill and decode groups as separate processes, over NIXL and the local backend: every TP
pair moves hybrid-model requests that each decode rank verifies byte for byte."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Pool, assert_pair_byte_exact

PAIRS = [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("mla", [False, True], ids=["gqa-mamba-swa", "mla-swa-dsa"])
@pytest.mark.parametrize(("p", "d"), PAIRS, ids=[f"P{p}-D{d}" for p, d in PAIRS])
def test_requests_arrive_byte_exact(pool: Pool, p: int, d: int, mla: bool) -> None:
    assert_pair_byte_exact(pool, p, d, mla)
