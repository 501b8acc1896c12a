"""The metadata envelope a backend publishes (``PeerMetadata.agent_metadata``), and the pid probe.

Every backend wraps its engine's own metadata in one envelope: backend name, agent name, pid,
the region list in registration order and the few values some backends add, so the receiving
side refuses a peer of another backend or envelope major by name before it touches the engine.
The envelope is described in ``schema/backend_metadata.yaml`` and its codec generated
(``pdwire.wire.backend_metadata``, single-buffer form: header + body), so it evolves under the
schema rules and the compatibility gate like the control protocol. The local engines (same
host) also use the pid to notice a peer process that is gone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pdwire.runtime.backends.errors import PeerError
from pdwire.runtime.backends.values import PeerMetadata
from pdwire.runtime.descriptors import MemoryKind, Region
from pdwire.wire import backend_metadata as _bm

# what a backend may add beside the regions: envelope field -> the Python type it holds
_EXTRA: dict[str, type] = {
    "inbox": str,
    "window": list,
    "ucx_devices": str,
    "addresses": list,
    "proof": bytes,  # local: proof of possession of the inbox (runtime/backends/possession.py)
}


def encode_envelope(
    backend: str,
    agent_name: str,
    regions: Sequence[Region],
    engine: bytes,
    extra: dict[str, Any] | None = None,
) -> bytes:
    """``extra`` holds what a backend adds (``inbox``, ``window``, ``ucx_devices``,
    ``addresses``, ``proof``); any other key is a programming error (the schema has no place for it)."""
    unknown = sorted(set(extra or {}) - _EXTRA.keys())
    if unknown:
        raise ValueError(f"backend metadata has no field {', '.join(unknown)} (schema/backend_metadata.yaml)")
    window = (extra or {}).get("window", [])
    if not isinstance(window, list) or not all(type(d) is int and 0 <= d < 1 << 64 for d in window):
        # (the generated encoder checks scalar fields; a list's items are checked here)
        raise _bm.EncodeError("window offsets must be u64 values", message="AgentMetadata", field="window")
    rows = [
        _bm.RegionRow(base=r.base, length=r.length, kind=r.kind.value, device_id=r.device_id, name=r.name)
        for r in regions
    ]
    msg = _bm.AgentMetadata(
        backend=backend, agent_name=agent_name, pid=os.getpid(), regions=rows, engine=engine, **(extra or {})
    )
    return _bm.encode_bytes(msg)


@dataclass(frozen=True, slots=True)
class DecodedMetadata:
    agent_name: str
    pid: int
    regions: tuple[Region, ...]
    engine: bytes
    extra: dict[str, Any]  # the backend's additions that are set (see ``_EXTRA``)
    window: npt.NDArray[np.uint64] | None = None  # per region, from ``extra["window"]``


def decode_envelope(backend: str, md: PeerMetadata) -> DecodedMetadata:
    try:
        env = _bm.decode_bytes(md.agent_metadata)
    except _bm.WireError as exc:
        raise PeerError(f"agent metadata of {md.agent_name!r} is not a pdwire envelope: {exc}") from None
    if not isinstance(env, _bm.AgentMetadata):  # a newer minor's other message
        raise PeerError(f"agent metadata of {md.agent_name!r} is a {type(env).__name__}, not AgentMetadata")
    if env.backend != backend:
        raise PeerError(f"peer {md.agent_name!r} runs backend {env.backend!r}, this side runs {backend!r}")
    if env.agent_name != md.agent_name:
        raise PeerError(f"metadata names agent {env.agent_name!r} but was sent as {md.agent_name!r}")
    if not 0 < env.pid < _PID_LIMIT:
        raise PeerError(f"metadata of {md.agent_name!r} names pid {env.pid}, not a process id")
    regions = tuple(_region(md.agent_name, i, row) for i, row in enumerate(env.regions))
    extra = {name: getattr(env, name) for name in _EXTRA if getattr(env, name)}
    return DecodedMetadata(env.agent_name, env.pid, regions, env.engine, extra, _window(md, env, regions))


_PID_LIMIT = 1 << 22  # Linux's PID_MAX_LIMIT: no process id reaches it
_KINDS = {k.value: k for k in MemoryKind}


def _region(agent: str, i: int, row: _bm.RegionRow) -> Region:
    """One region row of a peer's metadata, in range for the engines (which take them as u64
    addresses and lengths; the codec checked each value's type), or a PeerError naming it."""
    if row.base + row.length > 1 << 64:
        raise PeerError(f"metadata of {agent!r}: region {i} [{row.base}, +{row.length}) is not a u64 range")
    if row.kind not in _KINDS:
        raise PeerError(f"metadata of {agent!r}: region {i} has unknown memory kind {row.kind!r}")
    return Region(row.base, row.length, _KINDS[row.kind], row.device_id, row.name)


def _window(
    md: PeerMetadata, env: _bm.AgentMetadata, regions: tuple[Region, ...]
) -> npt.NDArray[np.uint64] | None:
    """The per-region window offsets a target gave this peer (``local_metadata(for_peer=...)``)."""
    if not env.window:
        return None
    if len(env.window) != len(regions):
        raise PeerError(
            f"metadata of {md.agent_name!r}: window offsets must be {len(regions)} u64 values, one per region"
        )
    return np.array(env.window, dtype=np.uint64) if any(env.window) else None


def pid_alive(pid: int) -> bool:
    """Whether a process of this host still exists (the local engines' liveness probe)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
