"""Pure transfer planner: rank geometry + request indices -> coalesced descriptor tables.

No I/O, no torch, no transfer backend: numpy only. Prepare once per (prefill rank, decode rank) peer with
``prepare_peer``, then plan each request with ``PeerPlan.plan_kv_chunk`` / ``plan_state`` /
``plan_aux``.
"""

from pdwire.runtime.config import ParallelRank
from pdwire.runtime.planner.errors import (
    DuplicateDestination,
    GeometryMismatch,
    IndexListMismatch,
    IndexOutOfRange,
    MissingShardingInfo,
    OverlappingDestination,
    PlanError,
    TopologyError,
    UnsupportedTransfer,
)
from pdwire.runtime.planner.kernel import check_unique_destinations
from pdwire.runtime.planner.model import (
    UNPLANNABLE_KINDS,
    AuxBuffer,
    HeadGeometry,
    Indexing,
    KvPool,
    Layout,
    RankMemory,
    StateKind,
    StatePool,
    StateTensor,
)
from pdwire.runtime.planner.peer import has_tp_sharded_state
from pdwire.runtime.planner.plan import GroupKind, PeerPlan, Plan, PlanGroup, prepare_peer
from pdwire.runtime.planner.regions import RegionIndex, region_index, regions
from pdwire.runtime.planner.routing import DecodeRoute, decode_ranks_of_prefill, heads_held, route_decode_rank

__all__ = [
    "UNPLANNABLE_KINDS",
    "AuxBuffer",
    "DecodeRoute",
    "DuplicateDestination",
    "GeometryMismatch",
    "GroupKind",
    "HeadGeometry",
    "IndexListMismatch",
    "IndexOutOfRange",
    "Indexing",
    "KvPool",
    "Layout",
    "MissingShardingInfo",
    "OverlappingDestination",
    "ParallelRank",
    "PeerPlan",
    "Plan",
    "PlanError",
    "PlanGroup",
    "RankMemory",
    "RegionIndex",
    "StateKind",
    "StatePool",
    "StateTensor",
    "TopologyError",
    "UnsupportedTransfer",
    "check_unique_destinations",
    "decode_ranks_of_prefill",
    "has_tp_sharded_state",
    "heads_held",
    "prepare_peer",
    "region_index",
    "regions",
    "route_decode_rank",
]
