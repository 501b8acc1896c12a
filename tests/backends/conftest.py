import os
from collections.abc import Iterator
from typing import Any

import pytest

from pdwire.demo import register_mori_fake

register_mori_fake()  # the demo's backend, tested like the others

# Keep UCX on loopback and NIXL quiet, in this process and in every peer process it spawns.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@pytest.fixture
def backends() -> Iterator[Any]:
    """``backends(name, **kw)`` creates a backend that is closed when the test ends."""
    from pdwire.runtime.backends import Backend, create_backend

    made: list[Backend] = []

    def make(name: str, **kw: Any) -> Backend:
        b = create_backend(name, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()
