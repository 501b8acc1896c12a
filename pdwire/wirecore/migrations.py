"""Hand-written steps between versions of the pdwire protocol, called by generated code.

The generator copies every field two versions share; a version listing a message under
``migrate:`` in the schema additionally calls ``upgrade_<Message>_<to>(old, new_module)``
(returns the new version's added fields) and ``downgrade_<Message>_<to>(new, old_module)``
(returns the old version's fields that the new version dropped). ``new_module`` and
``old_module`` are the generated version modules, passed in to avoid an import cycle.

1.0 -> 1.1: the flat state (one state type, flat indices) becomes per-component state.
Upgrading turns a flat state into one component; downgrading refuses, with
:class:`DowngradeError`, anything 1.0 cannot carry (several components, sub-blocks,
memory descriptors).

1.1 -> 1.2: additions only (RegisterAck, FailureKind, TransferStatus.failure_kind,
RegisterInfo.aux_mem_descs, StateComponent self-description). Upgrading fills defaults, so a
1.1 registration reads as "not self-described" and the runtime borrows the structure from its
own model, as 1.1 did. Downgrading drops the self-description and failure_kind mechanically
and refuses what would be lost in a way that matters: a ``failure_kind`` other than
unspecified (1.1 carries the kind as a ``"<kind>: "`` prefix of ``reason``, a shared field a
hook cannot rewrite; the runtime writes that form for older peers) and non-empty
``aux_mem_descs``: 1.1 carries aux descriptors at the tail of ``kv_mem_descs``, and a hook
cannot rewrite a field both versions share (the generator copies shared fields verbatim),
so the runtime writes the 1.1 form itself when it agreed on 1.1. Refusing instead of
dropping keeps a peer from silently losing the descriptors of its aux buffers.

1.2 -> 1.3: additions only (StateComponent.layer_ids, StateType nsa, and the fence promise,
which is behaviour, not bytes). Upgrading fills the default (no layer ids: layers 0..n-1).
Downgrading drops layer ids that say exactly that and refuses any others: a 1.2 reader would
place the entries on layers 0..n-1, which for a PP stage are another stage's layers. The
generated step refuses nsa by itself (an enum value 1.2 does not have).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .errors import DowngradeError


def upgrade_RegisterInfo_1_1(old: Any, new: ModuleType) -> dict[str, Any]:
    # "no state" in 1.0 is every flat field at its default; anything else is one component
    has_state = int(old.flat_state_type) != 0 or any(
        len(a)
        for a in (
            old.flat_state_base_addrs,
            old.flat_state_region_lens,
            old.flat_state_bytes_per_slot,
            old.flat_state_shard_axis_sizes,
        )
    )
    if not has_state:
        return {"state_components": []}
    comp = new.StateComponent(
        type=new.StateType(int(old.flat_state_type)),
        base_addrs=old.flat_state_base_addrs,
        region_lens=old.flat_state_region_lens,
        bytes_per_slot=old.flat_state_bytes_per_slot,
        shard_axis_sizes=old.flat_state_shard_axis_sizes,
    )
    return {"state_components": [comp]}


def downgrade_RegisterInfo_1_0(msg: Any, old: ModuleType) -> dict[str, Any]:
    comps = msg.state_components
    if not comps:
        return {}
    if len(comps) > 1:
        raise DowngradeError(
            f"{len(comps)} state components cannot be carried by version 1.0 (one flat state at most)",
            message="RegisterInfo",
            field="state_components",
        )
    c = comps[0]
    if any(len(b) for b in c.sub_blocks) or c.mem_descs:
        raise DowngradeError(
            "sub_blocks and mem_descs of a state component cannot be carried by version 1.0",
            message="RegisterInfo",
            field="state_components[0]",
        )
    return {
        "flat_state_type": old.StateType(int(c.type)),
        "flat_state_base_addrs": c.base_addrs,
        "flat_state_region_lens": c.region_lens,
        "flat_state_bytes_per_slot": c.bytes_per_slot,
        "flat_state_shard_axis_sizes": c.shard_axis_sizes,
    }


def upgrade_TransferRequest_1_1(old: Any, new: ModuleType) -> dict[str, Any]:
    # 1.0 had no way to say "component present but empty": an empty flat list means no state.
    flat = old.flat_state_indices
    return {"state_indices": [flat] if len(flat) else []}


def downgrade_TransferRequest_1_0(msg: Any, old: ModuleType) -> dict[str, Any]:
    comps = msg.state_indices
    if len(comps) > 1:
        raise DowngradeError(
            f"{len(comps)} state index lists cannot be carried by version 1.0 (one flat list at most)",
            message="TransferRequest",
            field="state_indices",
        )
    if not comps or comps[0] is None:
        return {}
    return {"flat_state_indices": comps[0]}


def upgrade_RegisterInfo_1_2(old: Any, new: ModuleType) -> dict[str, Any]:
    # 1.1 keeps aux descriptors at the tail of kv_mem_descs; splitting them off would need
    # rewriting kv_mem_descs, which the generated step copies verbatim, so they stay there and
    # the runtime's join accepts either form.
    return {}


def downgrade_RegisterInfo_1_1(msg: Any, old: ModuleType) -> dict[str, Any]:
    if msg.aux_mem_descs:
        raise DowngradeError(
            f"{len(msg.aux_mem_descs)} aux memory descriptors cannot be carried by version 1.1 in "
            "their own list; a 1.1 writer appends them to kv_mem_descs",
            message="RegisterInfo",
            field="aux_mem_descs",
        )
    return {}


def upgrade_TransferStatus_1_2(old: Any, new: ModuleType) -> dict[str, Any]:
    # The kind of a 1.1 failure stays in its reason prefix; the runtime parses it (it owns the
    # kind names), so the upgrade fills the default.
    return {}


def downgrade_TransferStatus_1_1(msg: Any, old: ModuleType) -> dict[str, Any]:
    if int(msg.failure_kind) != 0:
        raise DowngradeError(
            f"failure_kind {msg.failure_kind.name.lower()} cannot be carried by version 1.1; "
            'a 1.1 writer prefixes the reason with "<kind>: " and leaves failure_kind unspecified',
            message="TransferStatus",
            field="failure_kind",
        )
    return {}


def upgrade_StateComponent_1_3(old: Any, new: ModuleType) -> dict[str, Any]:
    return {}  # no layer ids: layers 0..n-1, which is what a 1.2 component meant


def downgrade_StateComponent_1_2(msg: Any, old: ModuleType) -> dict[str, Any]:
    ids = msg.layer_ids
    if len(ids) and [int(x) for x in ids] != list(range(len(ids))):
        raise DowngradeError(
            f"layer ids {[int(x) for x in ids]} cannot be carried by version 1.2, which places a "
            "component's entries on layers 0..n-1",
            message="StateComponent",
            field="layer_ids",
        )
    return {}
