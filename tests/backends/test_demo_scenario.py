"""The full demo scenario over every backend: prefill and decode groups as processes, hybrid
requests verified byte for byte on every decode rank, untouched memory checked at shutdown.

The backend list is the registry's (:func:`known_backends`): a new backend joins this suite
by being registered, nothing here changes. An engine that does not import here FAILS.
Both hybrid models (GQA KV + Mamba conv q|k|v and temporal + SWA; MLA + SWA + DSA) run on
every TP pair. Small on purpose (2 layers, 4-token pages, 3 requests per case): all four
backends take about 40 s on a 2-core machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdwire.runtime.backends import available_backends
from pdwire.runtime.backends.registry import known_backends
from tests.e2e.conftest import Pool, assert_pair_byte_exact, running_pool

PAIRS = [(1, 2), (2, 1), (2, 4)]


@pytest.fixture(
    scope="module", params=[pytest.param(b, marks=pytest.mark.engine(b), id=b) for b in known_backends()]
)
def pool(request: pytest.FixtureRequest) -> Iterator[Pool]:
    name = request.param
    if name not in available_backends():
        pytest.fail(f"backend {name} does not import here: CI must install its engine (./dev setup)")
    with running_pool(name) as p:  # checks for no stray byte and no logged failure at the end
        yield p


@pytest.mark.slow
@pytest.mark.parametrize("mla", [False, True], ids=["gqa-mamba-swa", "mla-swa-dsa"])
@pytest.mark.parametrize(("p", "d"), PAIRS, ids=[f"P{p}-D{d}" for p, d in PAIRS])
def test_demo_scenario(pool: Pool, p: int, d: int, mla: bool) -> None:
    assert_pair_byte_exact(pool, p, d, mla)
