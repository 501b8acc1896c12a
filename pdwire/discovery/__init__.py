"""Discovery: ranks announce themselves and learn about each other (static list or etcd).

See :mod:`.base` for the interface, :mod:`.entry` for what a rank registers and how it is
validated, :mod:`.membership` for the pure view built from registry events, and
:func:`open_discovery` for the spec strings (``etcd://...``, ``static:PATH``).
"""

from pdwire.discovery.base import Discovery, DiscoveryError
from pdwire.discovery.config import open_discovery
from pdwire.discovery.entry import (
    DEFAULT_PREFIX,
    Geometry,
    RankEntry,
    RegistryEntryError,
    decode_entry,
    encode_entry,
    entry_key,
    rank_name,
    role_name,
)
from pdwire.discovery.etcd import EtcdDiscovery
from pdwire.discovery.membership import (
    Change,
    EngineGroup,
    Joined,
    Left,
    Membership,
    RegistryBack,
    RegistryLost,
    Rejected,
    Restarted,
    Updated,
)
from pdwire.discovery.static import StaticDiscovery, parse_engine_flag, static_entries

__all__ = [
    "DEFAULT_PREFIX",
    "Change",
    "Discovery",
    "DiscoveryError",
    "EngineGroup",
    "EtcdDiscovery",
    "Geometry",
    "Joined",
    "Left",
    "Membership",
    "RankEntry",
    "RegistryBack",
    "RegistryEntryError",
    "RegistryLost",
    "Rejected",
    "Restarted",
    "StaticDiscovery",
    "Updated",
    "decode_entry",
    "encode_entry",
    "entry_key",
    "open_discovery",
    "parse_engine_flag",
    "rank_name",
    "role_name",
    "static_entries",
]
