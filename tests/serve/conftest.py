"""A real etcd server per module (127.0.0.1, free ports) for the serve tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.etcd_server import EtcdServer


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server
