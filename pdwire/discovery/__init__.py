"""Discovery: ranks announce themselves and learn about each other (static list or etcd): the
interface :mod:`.base`, entries :mod:`.entry`, the pure view :mod:`.membership`, the spec
strings :func:`open_discovery`.
"""

from pdwire.discovery.base import Discovery, DiscoveryError
from pdwire.discovery.config import open_discovery
from pdwire.discovery.entry import Geometry, RankEntry, RegistryEntryError, decode_entry, encode_entry
from pdwire.discovery.etcd import EtcdDiscovery
from pdwire.discovery.membership import Change, EngineGroup, Joined, Left, Membership, Rejected, Restarted
from pdwire.discovery.static import StaticDiscovery, parse_engine_flag

__all__ = [
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
    "RegistryEntryError",
    "Rejected",
    "Restarted",
    "StaticDiscovery",
    "decode_entry",
    "encode_entry",
    "open_discovery",
    "parse_engine_flag",
]
