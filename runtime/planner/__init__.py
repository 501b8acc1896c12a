"""Pure transfer planner: rank geometry + request indices -> coalesced descriptor tables.

No I/O, no torch, no engine: numpy only. Prepare once per (prefill rank, decode rank) peer with
``prepare_peer``, then plan each request with ``PeerPlan.plan_kv_chunk`` / ``plan_state`` /
``plan_aux``.
"""

from pdwire.runtime.planner.errors import (
    DuplicateDestination,
    GeometryMismatch,
    IndexListMismatch,
    IndexOutOfRange,
    MissingShardingInfo,
    PlanError,
    TopologyError,
    UnsupportedTransfer,
)
from pdwire.runtime.planner.kernel import check_unique_destinations
from pdwire.runtime.planner.model import (
    AuxBuffer,
    HeadGeometry,
    Indexing,
    KvPool,
    Layout,
    RankMemory,
    RankPosition,
    StateComponent,
    StateKind,
    StateTensor,
)
from pdwire.runtime.planner.plan import GroupKind, PeerPlan, Plan, PlanGroup, prepare_peer
from pdwire.runtime.planner.regions import RegionIndex, region_index, regions
from pdwire.runtime.planner.routing import DecodeRoute, decode_ranks_of_prefill, heads_held, route_decode_rank

__all__ = [
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
    "PeerPlan",
    "Plan",
    "PlanError",
    "PlanGroup",
    "RankMemory",
    "RankPosition",
    "RegionIndex",
    "StateComponent",
    "StateKind",
    "StateTensor",
    "TopologyError",
    "UnsupportedTransfer",
    "check_unique_destinations",
    "decode_ranks_of_prefill",
    "heads_held",
    "prepare_peer",
    "region_index",
    "regions",
    "route_decode_rank",
]
