"""A registry entry: what one rank tells the others about itself, and its key
``<prefix>/<role>/<engine_id>/<rank>`` (docs/deployment.md, "What a rank registers").

An entry is data from the network, so it is decoded like a wire message: strict msgspec types
first (never coerced), then the rules types cannot say; every refusal is one
:class:`RegistryEntryError` naming the key and the field. ``format`` is the entry's own
version: this build refuses another one by name and ignores fields it does not know, so a
later format 1 writer may add optional fields.
"""

from __future__ import annotations

import re

import msgspec

from pdwire import wire
from pdwire.runtime.endpoints import EndpointError, check_advertisable, parse_zmq_endpoint

ENTRY_FORMAT = 1
MAX_ENTRY_BYTES = 16 * 1024
DEFAULT_PREFIX = "/pdwire"

ROLES: tuple[wire.Role, ...] = tuple(wire.Role)  # the wire's roles: the registry keeps no type of its own

_ENGINE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")
_VERSION = re.compile(r"^(0|[1-9][0-9]{0,4})\.(0|[1-9][0-9]{0,4})$")
_PREFIX = re.compile(r"^(/[A-Za-z0-9._-]+)+$")


class RegistryEntryError(ValueError):
    """A registry entry (or its key) that this build refuses; the text names key and field."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"registry entry {key}: {detail}")
        self.key = key
        self.detail = detail


class Geometry(msgspec.Struct, frozen=True):
    """Where the rank sits in its engine's parallel grid (the wire's ParallelGeometry)."""

    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0


class RankEntry(msgspec.Struct, frozen=True):
    """One rank, as registered. ``control`` is required of prefill ranks (decode listens on
    nothing); ``backend``, ``protocol`` (``"major.minor"``, as its Hello) and ``model`` let a peer
    skip an engine it cannot talk to before connecting (the handshake still checks everything;
    empty means "not stated"); another ``incarnation`` under the same key is a restarted rank.
    """

    role: wire.Role  # spelled by name in keys and JSON (:func:`role_name`), never by number
    engine_id: str
    geometry: Geometry
    incarnation: str
    control: str = ""
    backend: str = ""
    protocol: tuple[str, ...] = ()
    model: str = ""
    host: str = ""  # the host name, for people reading logs
    pid: int = 0
    format: int = ENTRY_FORMAT

    @property
    def rank(self) -> str:
        return rank_name(self.geometry)

    @property
    def label(self) -> str:
        """``prefill prefill-a tp1.pp0``: how logs name the rank."""
        return f"{role_name(self.role)} {self.engine_id} {self.rank}"


def role_name(role: wire.Role) -> str:
    """How keys, JSON, static lists and flags spell ``role``: ``prefill``, ``decode``."""
    return role.name.lower()


def role_named(text: object, where: str, at: str = "") -> wire.Role:
    """The role spelled ``text``; a :class:`RegistryEntryError` naming ``where`` (and ``at``) if none is."""
    for role in ROLES:
        if text == role_name(role):
            return role
    names = ", ".join(map(role_name, ROLES))
    raise RegistryEntryError(where, f"{at}role {text!r} is not one of {names}")


def rank_name(g: Geometry) -> str:
    """``tp{t}.pp{p}``, plus ``.cp{c}`` / ``.dp{d}`` when those sizes are above 1."""
    name = f"tp{g.tp_rank}.pp{g.pp_rank}"
    if g.cp_size > 1:
        name += f".cp{g.cp_rank}"
    if g.dp_size > 1:
        name += f".dp{g.dp_rank}"
    return name


def check_prefix(prefix: str) -> str:
    """A registry prefix: ``/a/b`` (no trailing slash); raises ValueError otherwise."""
    if not _PREFIX.match(prefix):
        raise ValueError(f"registry prefix {prefix!r} must look like /name or /name/sub (no trailing '/')")
    return prefix


def entry_key(prefix: str, entry: RankEntry) -> str:
    return f"{prefix}/{role_name(entry.role)}/{entry.engine_id}/{entry.rank}"


def role_prefix(prefix: str, role: wire.Role) -> str:
    """The key prefix a watcher of ``role`` ranks reads (with its trailing slash)."""
    return f"{prefix}/{role_name(role)}/"


def _fail(key: str, field: str, detail: str) -> RegistryEntryError:
    return RegistryEntryError(key, f"RankEntry.{field}: {detail}")


def validate(entry: RankEntry, key: str) -> RankEntry:
    """``entry`` if it obeys every rule types cannot express; else one RegistryEntryError."""
    if entry.format != ENTRY_FORMAT:
        raise _fail(key, "format", f"format {entry.format} is not {ENTRY_FORMAT} (written by another build)")
    if not _ENGINE_ID.match(entry.engine_id):
        raise _fail(key, "engine_id", f"{entry.engine_id!r} is not 1-128 of [A-Za-z0-9._:@+-]")
    g = entry.geometry
    for axis in ("tp", "pp", "cp", "dp"):
        size, rank = getattr(g, f"{axis}_size"), getattr(g, f"{axis}_rank")
        if not 1 <= size <= 65536:
            raise _fail(key, f"geometry.{axis}_size", f"{size} is outside 1..65536")
        if not 0 <= rank < size:
            raise _fail(key, f"geometry.{axis}_rank", f"{rank} is not below {axis}_size {size}")
    if entry.control or entry.role is wire.Role.PREFILL:  # decode ranks listen on nothing
        try:
            check_advertisable(parse_zmq_endpoint(entry.control), "control endpoint")
        except EndpointError as exc:
            raise _fail(key, "control", str(exc)) from None
    if not entry.incarnation or len(entry.incarnation) > 128:
        raise _fail(key, "incarnation", "must be 1-128 characters")
    for v in entry.protocol:
        if not _VERSION.match(v):
            raise _fail(key, "protocol", f"{v!r} is not major.minor")
    if len(entry.protocol) > 64:
        raise _fail(key, "protocol", f"{len(entry.protocol)} versions (at most 64)")
    for name in ("backend", "model", "host"):
        if len(getattr(entry, name)) > 256:
            raise _fail(key, name, "longer than 256 characters")
    if not 0 <= entry.pid < 1 << 32:
        raise _fail(key, "pid", f"{entry.pid} is not a process id")
    return entry


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()  # to builtins: the role is read by name (:func:`_entry_of`)


def _entry_of(data: object, where: str) -> RankEntry:
    """Decoded JSON (or a static file's item) as a RankEntry: strict msgspec types (a string
    where a number belongs is refused, never coerced), the role by its name only."""
    if isinstance(data, dict) and "role" in data:
        data = {**data, "role": role_named(data["role"], where, "RankEntry: at `$.role`: ")}
    try:
        return msgspec.convert(data, RankEntry, strict=True)
    except msgspec.ValidationError as exc:
        # msgspec names the path: "Expected `int`, got `str` - at `$.geometry.tp_size`"
        raise RegistryEntryError(where, f"RankEntry: {exc}") from None


def encode_entry(entry: RankEntry, prefix: str = DEFAULT_PREFIX) -> tuple[str, bytes]:
    """(key, value) for ``entry``, validated first: this rank never writes what peers refuse."""
    key = entry_key(check_prefix(prefix), entry)
    validate(entry, key)
    return key, _ENCODER.encode({**msgspec.structs.asdict(entry), "role": role_name(entry.role)})


def decode_entry(key: str, value: bytes, prefix: str = DEFAULT_PREFIX) -> RankEntry:
    """The entry stored under ``key``, or a RegistryEntryError naming key and field."""
    if len(value) > MAX_ENTRY_BYTES:
        raise RegistryEntryError(key, f"{len(value)} bytes (at most {MAX_ENTRY_BYTES})")
    try:
        data = _DECODER.decode(value)
    except msgspec.DecodeError as exc:
        raise RegistryEntryError(key, f"not a JSON object: {exc}") from None
    entry = validate(_entry_of(data, key), key)
    expected = entry_key(prefix, entry)
    if key != expected:
        raise RegistryEntryError(
            key, f"the entry describes {entry.label}, whose key is {expected}: key and entry disagree"
        )
    return entry


def entry_from_dict(data: object, where: str) -> RankEntry:
    """An entry from already-parsed data (a static file's list item), with the same checks."""
    return validate(_entry_of(data, where), where)
