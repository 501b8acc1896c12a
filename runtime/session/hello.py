"""The Hello exchange, pure: values in, values out.

Both peers send a ``Hello`` first and run the same checks on the pair, so both refuse with
the same message: protocol and version agreement (the wire's ``agree``, whose error names
both sides' versions), opposite roles, identical model fingerprint (weights revision
included: KV of different weights must never mix), and TP sizes that divide one another.
A descriptor-addressed backend (MoRI) also refuses a version that cannot carry its memory
descriptors (:func:`check_descriptors`), on both sides alike.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pdwire import wire
from pdwire.runtime.config import ConfigError, ParallelRank
from pdwire.runtime.session.failures import HandshakeError
from pdwire.wire import features


@dataclass(frozen=True, slots=True)
class Identity:
    """What a worker says about itself in its Hello."""

    role: wire.Role
    engine_id: str
    rank: ParallelRank
    model: wire.ModelFingerprint
    versions: tuple[tuple[int, int], ...] = ()  # empty: everything this build supports

    def hello(self) -> wire.Hello:
        versions = (
            [wire.Version(major=a, minor=b) for a, b in self.versions]
            if self.versions
            else wire.hello_versions()
        )
        return wire.Hello(
            protocol=wire.PROTOCOL,
            versions=versions,
            role=self.role,
            engine_id=self.engine_id,
            geometry=geometry_of(self.rank),
            model=self.model,
            capabilities=["per-component-state", "explicit-dummy"],
        )


_AXES = tuple(f.name for f in fields(ParallelRank))


def geometry_of(rank: ParallelRank) -> wire.ParallelGeometry:
    """``rank`` as the wire's ``ParallelGeometry`` (Hello, RegisterInfo): the one place a
    rank's place in the grid becomes a wire struct."""
    return wire.ParallelGeometry(**{axis: getattr(rank, axis) for axis in _AXES})


def rank_of(g: wire.ParallelGeometry, peer: str) -> ParallelRank:
    """``peer``'s place in the grid from its Hello or RegisterInfo; a :class:`HandshakeError`
    naming the bad field (a rank outside its size, a size of 0)."""
    try:
        return ParallelRank(**{axis: int(getattr(g, axis)) for axis in _AXES})
    except ConfigError as exc:
        raise HandshakeError(f"{peer} sent a bad geometry: {exc}") from None


def _fmt_model(m: wire.ModelFingerprint) -> str:
    layers = f"{m.num_layers}/{m.num_attention_layers}/{m.num_state_layers}"
    return f"{m.model_name}@{m.revision} {m.dtype} layers={layers}"


def check_hello(local: wire.Hello, remote: wire.Hello) -> tuple[int, int]:
    """The agreed version, or one :class:`HandshakeError` saying what differs on each side."""
    try:
        version = wire.agree(local, remote)
    except wire.WireError as exc:
        raise HandshakeError(f"{remote.role.name.lower()} {remote.engine_id!r} refused: {exc}") from exc
    if local.role == remote.role:
        raise HandshakeError(
            f"both peers are {local.role.name.lower()} workers ({local.engine_id!r}, {remote.engine_id!r})"
        )
    if local.model != remote.model:
        raise HandshakeError(
            f"model differs: this side serves {_fmt_model(local.model)}, "
            f"peer {remote.engine_id!r} serves {_fmt_model(remote.model)}"
        )
    a, b = local.geometry.tp_size, remote.geometry.tp_size
    if a < 1 or b < 1 or max(a, b) % min(a, b):
        raise HandshakeError(
            f"TP sizes {a} (this side) and {b} (peer {remote.engine_id!r}) do not divide one another"
        )
    return version


# The version gates, from the schema's generated feature table (never typed by hand):
DESCRIPTORS_SINCE = features.field_since("StateComponent", "mem_descs")
SELF_DESCRIBING_SINCE = features.field_since("StateComponent", "tensor_names")  # and aux_mem_descs
REGISTER_ACK_SINCE = features.message_since("RegisterAck")
FENCE_SINCE = features.promise_since("fenced_failures")  # Failed and AbortAck certify writes stopped
# 1.4, one gate for all it added: item layouts and the KV head stride, any sharded state axis,
# SGLang's state kinds and row indexing, aliased registrations, every MLA prefill rank writing
# its state shard, several parts in one write, the layers a prefill rank holds, decode-side scatter
LAYOUTS_SINCE = features.field_since("StateComponent", "tensor_layouts")
# 1.5: a prefill rank says how long it holds a room nobody asked for (RegisterAck.lease_ms) and
# takes Lease, which renews that hold for rooms a decode engine still queues
LEASES_SINCE = features.message_since("Lease")


def check_descriptors(version: tuple[int, int], backend: str, by_descriptor: bool, peer: str) -> None:
    """Refuse a version that cannot carry this backend's memory descriptors, before any request.

    Run by both sides after :func:`check_hello` (both run the same backend: the metadata
    envelope enforces it), so both refuse with the same cause.
    """
    if by_descriptor and version < DESCRIPTORS_SINCE:
        have, need = f"{version[0]}.{version[1]}", f"{DESCRIPTORS_SINCE[0]}.{DESCRIPTORS_SINCE[1]}"
        raise HandshakeError(
            f"backend {backend!r} addresses memory by descriptor, and RegisterInfo {have} (agreed with "
            f"{peer!r}) cannot carry them (StateComponent.mem_descs exists since {need}); "
            f"both peers must speak {need} or newer"
        )
