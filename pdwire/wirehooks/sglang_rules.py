"""Cross-frame rules of SGLang's frames, named by ``schema/sglang.yaml``.

Two kinds of function, both taking a decoded message of any profile version (fields a
version lacks are read with ``getattr`` defaults):

* checks (``checks:``) return ``(field, problem)`` pairs for content SGLang's parser would
  crash on or silently ignore; the generated codec raises them as the typed error of that
  field's frame, on decode and on encode alike;
* derived properties (``derived:``) apply SGLang's parse-side rules (each backend's dummy
  rule, NIXL's item-length and memory-kind fallbacks) to the faithful wire values.
"""

from __future__ import annotations

from typing import Any

Problems = list[tuple[str, str]]
MEM_KINDS = frozenset({"VRAM", "DRAM"})


# --- Mooncake -----------------------------------------------------------------------------------
def mooncake_register_staging(m: Any) -> Problems:
    slots = getattr(m, "staging_slot_layer_ids", ())
    staging_on = m_get(m, "staging_base_ptr") is not None or bool(m_get(m, "staging_total_size"))
    if len(slots) and not staging_on:
        return [
            (
                "staging_slot_layer_ids",
                "sent while staging is off (frames 14 and 15 empty): SGLang ignores it",
            )
        ]
    return []


def mooncake_is_dummy(m: Any) -> bool:
    """Frames 4 (KV indices) and 5 (aux index) both empty."""
    return len(m.kv_indices) == 0 and m.aux_index is None


def mooncake_transfer_dummy(m: Any) -> Problems:
    if m.aux_index is None and len(m.kv_indices):
        return [("aux_index", "empty aux frame with KV indices: SGLang's parser crashes on int(b'')")]
    if mooncake_is_dummy(m):
        for name in ("state_indices", "flat_state_indices", "device_kv_indices"):
            if len(getattr(m, name, ())):
                return [(name, "a dummy request (frames 4 and 5 empty) carries none; SGLang ignores it")]
    return []


# --- NIXL ---------------------------------------------------------------------------------------
def nixl_register_kv(m: Any) -> Problems:
    lens = getattr(m, "kv_item_lens", ())
    if len(lens) and len(lens) != len(m.kv_data_ptrs):
        return [
            (
                "kv_item_lens",
                f"{len(lens)} item lengths for {len(m.kv_data_ptrs)} KV pointers (SGLang raises ValueError)",
            )
        ]
    bad = [k for k in getattr(m, "kv_mem_kinds", ()) if k not in MEM_KINDS]
    if bad:
        return [("kv_mem_kinds", f"unknown memory kind {bad[0]!r} (VRAM or DRAM)")]
    return []


def nixl_effective_kv_item_lens(m: Any) -> list[int]:
    """Frame 19, or ``[kv_item_len] * len(kv_data_ptrs)`` when it is missing or empty."""
    lens = getattr(m, "kv_item_lens", ())
    if len(lens):
        return [int(x) for x in lens]
    return [int(m.kv_item_len)] * len(m.kv_data_ptrs)


def nixl_effective_kv_mem_kinds(m: Any) -> list[str]:
    """Frame 18, or all ``VRAM`` when it is missing or empty."""
    kinds = list(getattr(m, "kv_mem_kinds", []))
    return kinds or ["VRAM"] * len(m.kv_data_ptrs)


def nixl_is_dummy(m: Any) -> bool:
    """The explicit flag (frame 10); if missing or empty: no KV indices and no decode prefix."""
    flag = getattr(m, "is_dummy_rank", None)
    if flag is not None:
        return bool(flag)
    return len(m.kv_indices) == 0 and m.decode_prefix_len == 0


# --- MoRI ---------------------------------------------------------------------------------------
def mori_is_dummy(m: Any) -> bool:
    """No KV indices, no aux index (parsed as -1) and no decode prefix."""
    aux = m.aux_index
    return len(m.kv_indices) == 0 and (aux is None or aux < 0) and not m.decode_prefix_len


def m_get(m: Any, name: str) -> Any:
    return getattr(m, name, None)
