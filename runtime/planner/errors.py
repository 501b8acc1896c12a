"""The PlanError family: every way a registration or a request can be refused.

Each error carries the coordinates of what it refuses (component, tensor, layer, index) as
attributes and in its message, so a log line is enough to find the offending buffer.
"""

from __future__ import annotations


class PlanError(ValueError):
    """Base of every planner refusal. Nothing is posted when one is raised."""

    def __init__(
        self,
        message: str,
        *,
        component: str | None = None,
        tensor: str | None = None,
        layer: int | None = None,
        index: int | None = None,
    ) -> None:
        self.component = component
        self.tensor = tensor
        self.layer = layer
        self.index = index
        where = ", ".join(f"{key}={value}" for key, value in vars(self).items() if value is not None)
        super().__init__(f"{message} [{where}]" if where else message)


class TopologyError(PlanError):
    """TP/PP sizes or ranks that cannot be mapped onto each other (non-divisible, out of range)."""


class GeometryMismatch(PlanError):
    """The two sides disagree on the bytes of one slot, page, head or layer set (dtype or shape skew)."""


class MissingShardingInfo(PlanError):
    """TP sizes differ but a TP-sharded tensor does not say how it is sharded; copying whole slots
    would corrupt the destination, so the plan is refused instead."""


class UnsupportedTransfer(PlanError):
    """A combination the planner deliberately does not do (for example a dummy rank that holds
    TP-sharded state)."""


class IndexListMismatch(PlanError):
    """Source and destination index lists of one component differ in length or count."""


class IndexOutOfRange(PlanError):
    """An index addresses bytes outside the registered region on one side."""


class DuplicateDestination(PlanError):
    """Two indices of one request target the same destination item: two writers would race."""


class OverlappingDestination(DuplicateDestination):
    """Two destination items of one request share bytes through registrations that alias (several
    components, groups or tensors addressing the same memory)."""
