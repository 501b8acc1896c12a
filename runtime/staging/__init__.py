"""Staged transfers: many small descriptor rows moved as few large engine writes.

Pure parts: :mod:`.transform` (a table rewritten into gather / write / scatter steps, each a
descriptor table), :mod:`.cost` (direct or staged, per part, from measured costs),
:mod:`.arena` (the bounded, reused staging buffer). :mod:`.copy` executes a local step on host
memory (the place a device copier plugs in).
"""

from pdwire.runtime.staging.arena import StagingArena
from pdwire.runtime.staging.copy import Copier, CopyError, HostCopier
from pdwire.runtime.staging.cost import COSTS, Choice, CostModel, Costs
from pdwire.runtime.staging.transform import (
    Mode,
    StagedPlan,
    both,
    direct,
    gather,
    merge_runs,
    runs,
    scatter,
    scatter_copy,
    scatter_write,
)

__all__ = [
    "COSTS",
    "Choice",
    "Copier",
    "CopyError",
    "CostModel",
    "Costs",
    "HostCopier",
    "Mode",
    "StagedPlan",
    "StagingArena",
    "both",
    "direct",
    "gather",
    "merge_runs",
    "runs",
    "scatter",
    "scatter_copy",
    "scatter_write",
]
