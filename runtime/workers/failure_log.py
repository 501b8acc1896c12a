"""A bounded log of what went wrong on a rank, for ``stats.failures``.

Peers can make a rank log without end (a flood of garbage, 10k hostile sockets): the log keeps
the newest :data:`FAILURE_LOG_LIMIT` entries and counts the ones it dropped, so memory stays
flat while the operator still sees the latest causes and how many there were in all.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import SupportsIndex

FAILURE_LOG_LIMIT = 1000

log = logging.getLogger("pdwire.failures")


class FailureLog(list[str]):
    """A list of failure texts that keeps the newest ``limit``; ``total`` counts all of them."""

    def __init__(self, entries: Iterable[str] = (), limit: int = FAILURE_LOG_LIMIT) -> None:
        # ``entries``: dataclasses.asdict rebuilds a list field as type(field)(generator)
        kept = list(entries)
        super().__init__(kept[-limit:])
        self.limit = limit
        self.total = len(kept)

    @property
    def dropped(self) -> int:
        return self.total - len(self)

    def append(self, text: str) -> None:
        self.total += 1
        log.debug("%s", text)
        super().append(text)
        if len(self) > self.limit:
            del self[: len(self) - self.limit]

    def insert(self, index: SupportsIndex, text: str) -> None:  # keeps the bound for any writer
        self.total += 1
        super().insert(index, text)
        if len(self) > self.limit:
            del self[: len(self) - self.limit]
