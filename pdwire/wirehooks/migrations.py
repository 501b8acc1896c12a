"""Hand-written steps between minors of the pdwire protocol, called by the generated codec
(``schema/pdwire.yaml`` names this module under ``migrations:``).

One model per major (``pdwire.wire.v1``): a message of an older minor is the same struct
with the fields that minor lacks at their defaults. For a version listing a message under
``migrate:`` the generated code calls, below that version,

* ``downgrade_<Message>_<M>_<m>(msg, model) -> dict`` when writing minor ``m`` or older:
  raise :class:`DowngradeError` for what minor ``m`` cannot carry, and return the values
  that differ there: fields of the model to replace, and the fields of minor ``m`` the model
  no longer has (a legacy layout writes those). The fields added at ``M.(m+1)`` are the
  hook's to judge: after it returns they are dropped (set to their defaults).
* ``upgrade_<Message>_<M>_<m>(old, model) -> dict`` when reading a minor before ``M.m``
  whose body still carries fields removed at ``M.m``: ``old`` holds those fields (decoded);
  return the values of the fields added at ``M.m``.

``model`` is the generated major module (``pdwire.wire.v1``), passed in to avoid an import
cycle. Nested messages reach a hook already converted to the target minor.

1.0 -> 1.1: the flat state (one state type, flat indices) becomes per-component state.
Reading 1.0 turns a flat state into one component; writing 1.0 refuses what it cannot carry
(several components, sub-blocks, memory descriptors).

1.1 -> 1.2: additions only. Writing 1.1 drops the component self-description (the schema
marks it ``downgrade: drop``: 1.1 peers borrow that structure from their own model) and
refuses a ``failure_kind`` other than unspecified and non-empty ``aux_mem_descs``: 1.1 carries
those in fields both versions share (a ``"<kind>: "`` prefix of ``reason``, the tail of
``kv_mem_descs``), so the runtime writes the 1.1 form itself when it agreed on 1.1; refusing
keeps a peer from silently losing them.

1.2 -> 1.3: additions only (StateComponent.layer_ids, StateType nsa, and the fence promise,
which is behaviour, not bytes). Writing 1.2 drops layer ids that say exactly 0..n-1 (the only
meaning 1.2 has) and refuses any others: a 1.2 reader would place the entries on layers
0..n-1, which for a PP stage are another stage's layers. The generated code refuses nsa by
itself (an enum value 1.2 does not have).

1.3 -> 1.4: additions only (RegisterInfo.kv_page_stride, k_page_offset, v_page_offset,
kv_head_stride and the receive staging buffer; StateComponent.tensor_layouts; Notification's
several parts and scattered pages; RegisterAck's layers and head geometry; TransferRequest's
staging range; SGLang's state kinds; StateIndexing row). Reading 1.3 fills the defaults, which
are the 1.3 meaning (packed items and heads, tensors at offset 0, the sharded axis first, one
part per notification, no staging). Writing 1.3 refuses every value that is not that meaning:
a 1.3 reader would place the items at the wrong addresses, count the first part of a
notification alone, or never copy staged bytes into place. The hooks below name those fields
(a hook's message's fields added at 1.4 are dropped after it returns, so it must refuse each
one); the generated code refuses the rest and the new enum values by itself. Aliased
registrations (buffers whose extents overlap) are bytes 1.3 carries unchanged; what a 1.3 peer
lacks is behaviour (one registration, destinations kept apart per request), so the handshake,
not the codec, refuses a 1.3 peer of memory that aliases; the runtime posts parts separately
for a 1.3 peer.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from pdwire.wirecore.errors import DowngradeError


def upgrade_RegisterInfo_1_1(old: Any, model: ModuleType) -> dict[str, Any]:
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
        return {}
    comp = model.StateComponent(
        type=model.StateType(int(old.flat_state_type)),
        base_addrs=old.flat_state_base_addrs,
        region_lens=old.flat_state_region_lens,
        bytes_per_slot=old.flat_state_bytes_per_slot,
        shard_axis_sizes=old.flat_state_shard_axis_sizes,
    )
    return {"state_components": [comp]}


def downgrade_RegisterInfo_1_0(msg: Any, model: ModuleType) -> dict[str, Any]:
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
        "flat_state_type": model.StateType(int(c.type)),
        "flat_state_base_addrs": c.base_addrs,
        "flat_state_region_lens": c.region_lens,
        "flat_state_bytes_per_slot": c.bytes_per_slot,
        "flat_state_shard_axis_sizes": c.shard_axis_sizes,
    }


def upgrade_TransferRequest_1_1(old: Any, model: ModuleType) -> dict[str, Any]:
    # 1.0 had no way to say "component present but empty": an empty flat list means no state.
    flat = old.flat_state_indices
    return {"state_indices": [flat]} if len(flat) else {}


def downgrade_TransferRequest_1_0(msg: Any, model: ModuleType) -> dict[str, Any]:
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


def downgrade_RegisterInfo_1_1(msg: Any, model: ModuleType) -> dict[str, Any]:
    if msg.aux_mem_descs:
        raise DowngradeError(
            f"{len(msg.aux_mem_descs)} aux memory descriptors cannot be carried by version 1.1 in "
            "their own list; a 1.1 writer appends them to kv_mem_descs",
            message="RegisterInfo",
            field="aux_mem_descs",
        )
    return {}


def downgrade_TransferStatus_1_1(msg: Any, model: ModuleType) -> dict[str, Any]:
    if int(msg.failure_kind) != 0:
        kind = str(getattr(msg.failure_kind, "name", msg.failure_kind)).lower()
        raise DowngradeError(
            f"failure_kind {kind} cannot be carried by version 1.1; a 1.1 writer prefixes the "
            'reason with "<kind>: " and leaves failure_kind unspecified',
            message="TransferStatus",
            field="failure_kind",
        )
    return {}


def downgrade_StateComponent_1_2(msg: Any, model: ModuleType) -> dict[str, Any]:
    ids = msg.layer_ids
    if len(ids) and [int(x) for x in ids] != list(range(len(ids))):
        raise DowngradeError(
            f"layer ids {[int(x) for x in ids]} cannot be carried by version 1.2, which places a "
            "component's entries on layers 0..n-1",
            message="StateComponent",
            field="layer_ids",
        )
    return {}


def _refuse_set(msg: Any, message: str, groups: tuple[tuple[tuple[str, ...], str], ...]) -> None:
    """Refuse the fields of ``groups`` that are set (not 0, not empty), naming each: version 1.3
    lacks them, and each group's text says what a 1.3 reader does instead."""
    named = []
    for fields, why in groups:
        for field in fields:
            value = getattr(msg, field)
            if value if isinstance(value, int) else len(value):
                shown = value if isinstance(value, int) else f"of {len(value)} items"
                named.append((field, f"{field} {shown} cannot be carried by version 1.3, {why}"))
    if named:
        raise DowngradeError("; ".join(text for _, text in named), message=message, field=named[0][0])


def downgrade_RegisterInfo_1_3(msg: Any, model: ModuleType) -> dict[str, Any]:
    _refuse_set(
        msg,
        "RegisterInfo",
        (
            (
                ("kv_page_stride", "k_page_offset", "v_page_offset"),
                "which places KV pages packed at offset 0",
            ),
            (("kv_head_stride",), "which places the heads of a page packed"),
            (("scatter_base", "scatter_len", "scatter_mem_descs"), "which has no receive staging buffer"),
        ),
    )
    return {}


def downgrade_StateComponent_1_3(msg: Any, model: ModuleType) -> dict[str, Any]:
    for ti, layout in enumerate(msg.tensor_layouts):
        changed = [
            name
            for name, default in (("slot_stride", 0), ("offset", 0), ("outer_rows", 1), ("replicated", False))
            if getattr(layout, name) != default
        ]
        if changed:
            raise DowngradeError(
                f"tensor {ti}'s {', '.join(changed)} cannot be carried by version 1.3 (packed slots, "
                "the tensor at offset 0, the sharded axis first, no replicated tensor)",
                message="StateComponent",
                field="tensor_layouts",
            )
    return {}


def downgrade_Notification_1_3(msg: Any, model: ModuleType) -> dict[str, Any]:
    """1.3 carries one part per notification: refuse one that names several (a 1.3 reader would
    count the first part alone and the room would wait for the others until its deadline), and
    pages written to a staging range (a 1.3 reader would never copy them into place)."""
    named = [
        field
        for field, extra in (
            ("chunk_count", int(msg.chunk_count) != 1),
            ("also_components", len(msg.also_components) > 0),
            ("also_aux", bool(msg.also_aux)),
        )
        if extra
    ]
    if named:
        raise DowngradeError(
            f"{', '.join(named)}: version 1.3 carries one part per notification; post the parts "
            "separately for a 1.3 peer",
            message="Notification",
            field=named[0],
        )
    _refuse_set(
        msg, "Notification", ((("scatter_pages", "scatter_first_page"), "which writes every page in place"),)
    )
    return {}
