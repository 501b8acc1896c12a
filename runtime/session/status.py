"""Room status: the wire's own ``Status`` (SGLang's KVPoll numbers)."""

from __future__ import annotations

from pdwire.wire import Status

__all__ = ["Status", "is_terminal"]


def is_terminal(status: Status) -> bool:
    """Failed or Success: the room is over."""
    return status in (Status.FAILED, Status.SUCCESS)
