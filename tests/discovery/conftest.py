"""A real etcd server per test module, on 127.0.0.1 with free ports; tests use unique prefixes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.etcd_server import EtcdServer

_prefixes = itertools.count(1)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A server of this test alone, for tests that stop, pause or restart it."""
    with EtcdServer(tmp_path) as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"/t{next(_prefixes)}"
