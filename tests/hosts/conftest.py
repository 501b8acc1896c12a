"""Two hosts (network namespaces joined by a veth pair) per test; see tests/support/netns.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.netns import TwoHosts


@pytest.fixture
def net(tmp_path: Path) -> Iterator[TwoHosts]:
    with TwoHosts(tmp_path / "hosts") as two:
        yield two
