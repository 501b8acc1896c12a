"""Conversions between SGLang 0.5.23's messages (``pdwire.wire.sglang``) and pdwire's own.

Both sides are the newest models (``pdwire.wire`` and ``pdwire.wire.sglang``), so a schema
bump that renames or retypes a field used here fails this module's type check and tests.

Lossless where both sides carry the information; a :class:`ConversionError` naming the
missing or unrepresentable fields otherwise. What each side lacks:

* SGLang's register carries no page size, KV layout, head counts, layer range, region or
  aux lengths, state types, PP/DP position or engine id: :func:`to_register_info` takes them
  from a :class:`RegisterSupplement` and refuses (listing every missing one) without them.
  SGLang-only register content with no RegisterInfo field (KV layer ids, gpu id, nil
  descriptor slots) is refused when present rather than dropped, except the staging ring,
  which is an optional optimisation and is dropped. State layer ids become the components'
  ``layer_ids`` and MoRI's aux descriptors ``aux_mem_descs`` (both from pdwire 1.2/1.3).
* pdwire's TransferRequest has no session id / agent name / engine key (the SGLang frame
  names the decode engine there): :func:`from_transfer_request` takes it as ``agent``.
* On the SGLang wire a None state component and an empty one are the same bytes (NIXL and
  MoRI send None as ``[]``; Mooncake's builder crashes on None, so converting one for
  Mooncake is refused); a converted request reads back with ``[]`` for it.
* Dummy targets: Mooncake and MoRI infer "dummy" from empty frames; a request whose content
  would read back with the other dummy-ness is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeAlias

import numpy as np

from pdwire import wire as pw
from pdwire.wire import sglang as sg
from pdwire.wirecore.positional.errors import ConversionError

PROFILE = "sglang"
_I32 = (-(2**31), 2**31 - 1)
TransferInfo: TypeAlias = sg.MooncakeTransferInfo | sg.NixlTransferInfo | sg.MoriTransferInfo
Status: TypeAlias = sg.MooncakeStatus | sg.NixlStatus | sg.MoriStatus
Register: TypeAlias = sg.MooncakeRegister | sg.NixlRegister | sg.MoriRegister


def _err(
    problem: str, backend: str, message: str, field: str | None = None, missing: tuple[str, ...] = ()
) -> ConversionError:
    return ConversionError(
        problem, profile=PROFILE, backend=backend, message=message, field=field, missing=missing
    )


def _split_endpoint(endpoint: str, backend: str, message: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 2**16:
        raise _err(f"endpoint {endpoint!r} is not host:port", backend, message, "sender")
    return host, int(port)


def _u64(values: Sequence[int] | np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.asarray(values, dtype=np.uint64)


# --- transfer info ------------------------------------------------------------------------------
def to_transfer_request(msg: TransferInfo) -> pw.TransferRequest:
    """SGLang transfer info -> TransferRequest (the session id / agent name / engine key stays behind)."""
    if isinstance(msg, sg.MooncakeTransferInfo) and len(msg.device_kv_indices):
        raise _err(
            "TransferRequest has no device KV indices; they would be lost",
            msg.BACKEND,
            type(msg).__name__,
            "device_kv_indices",
        )
    aux = -1 if msg.aux_index is None else msg.aux_index
    if not _I32[0] <= aux <= _I32[1]:
        raise _err(
            f"aux index {aux} does not fit TransferRequest's i32",
            msg.BACKEND,
            type(msg).__name__,
            "aux_index",
        )
    return pw.TransferRequest(
        room=msg.room,
        sender=f"{msg.local_ip}:{msg.rank_port}",
        dst_kv_indices=np.asarray(msg.kv_indices, dtype=np.int32),
        dst_aux_index=aux,
        required_dst_info_num=msg.required_dst_info_num,
        decode_prefix_len=msg.decode_prefix_len,
        is_dummy=msg.is_dummy,
        state_indices=[np.asarray(s, dtype=np.int32) for s in msg.state_indices],
    )


def from_transfer_request(req: pw.TransferRequest, backend: str, *, agent: str) -> TransferInfo:
    """TransferRequest -> the backend's transfer info.

    ``agent`` is what the frame names the decode engine by: the Mooncake session id, the
    NIXL agent name or the MoRI engine key.
    """
    name = {"mooncake": "MooncakeTransferInfo", "nixl": "NixlTransferInfo", "mori": "MoriTransferInfo"}.get(
        backend
    )
    if name is None:
        raise _err("unknown backend (mooncake, nixl or mori)", backend, "TransferInfo")
    ip, port = _split_endpoint(req.sender, backend, name)
    if backend == "mooncake" and any(s is None for s in req.state_indices):
        raise _err(
            "a None state component cannot be sent (SGLang's Mooncake builder crashes)",
            backend,
            name,
            "state_indices",
        )
    state = [np.empty(0, np.int32) if s is None else s for s in req.state_indices]
    kv = req.dst_kv_indices
    if req.is_dummy and (len(kv) or any(len(s) for s in state)):
        raise _err(
            "a dummy request carries no KV or state indices (the builder sends empty frames)",
            backend,
            name,
            "dst_kv_indices",
        )
    common: dict[str, Any] = dict(
        room=req.room,
        local_ip=ip,
        rank_port=port,
        kv_indices=kv,
        required_dst_info_num=req.required_dst_info_num,
        decode_prefix_len=req.decode_prefix_len,
        state_indices=[] if req.is_dummy else state,
    )
    if backend == "mooncake":
        # dummy <=> frames 4 and 5 both empty; a real request always carries its aux index
        return sg.MooncakeTransferInfo(
            session_id=agent, aux_index=None if req.is_dummy else req.dst_aux_index, **common
        )
    if backend == "nixl":
        return sg.NixlTransferInfo(
            agent_name=agent, aux_index=req.dst_aux_index, is_dummy_rank=req.is_dummy, **common
        )
    aux = None if req.is_dummy or req.dst_aux_index == -1 else req.dst_aux_index
    out = sg.MoriTransferInfo(engine_key=agent, aux_index=aux, **common)
    if out.is_dummy != req.is_dummy:
        raise _err(
            f"MoRI infers dummy={out.is_dummy} from empty KV, no aux and no prefix, but the request says "
            f"is_dummy={req.is_dummy}",
            backend,
            name,
            "is_dummy",
        )
    if req.is_dummy and req.decode_prefix_len:
        raise _err("a MoRI dummy request has no decode prefix", backend, name, "decode_prefix_len")
    return out


# --- status ---------------------------------------------------------------------------------------
def to_transfer_status(msg: Status) -> pw.TransferStatus:
    return pw.TransferStatus(
        room=msg.room,
        status=pw.Status(int(msg.status)),
        sender_rank=msg.prefill_rank,
        reason=msg.reason or "",
    )


def from_transfer_status(st: pw.TransferStatus, backend: str) -> Status:
    """TransferStatus -> the backend's status; Mooncake carries a reason as its optional frame 3."""
    common: dict[str, Any] = dict(
        room=st.room, status=sg.KVPoll(int(st.status)), prefill_rank=st.sender_rank, reason=st.reason or None
    )
    if backend == "mooncake":
        return sg.MooncakeStatus(**common)
    if backend == "nixl":
        return sg.NixlStatus(**common)
    if backend == "mori":
        return sg.MoriStatus(**common)
    raise _err("unknown backend (mooncake, nixl or mori)", backend, "Status")


# --- register -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegisterSupplement:
    """RegisterInfo content SGLang's register message does not carry; None = not known."""

    engine_id: str | None = None
    pp_size: int | None = None
    pp_rank: int | None = None
    dp_size: int | None = None
    dp_rank: int | None = None
    first_layer: int | None = None
    num_layers: int | None = None
    region_lens: Sequence[int] | None = None
    num_pages: int | None = None
    page_size: int | None = None
    kv_layout: pw.KvLayout | None = None
    kv_heads_per_rank: int | None = None
    kv_heads_total: int | None = None
    bytes_per_head: int | None = None
    is_mla: bool | None = None
    aux_lens: Sequence[int] | None = None
    aux_item_lens: Sequence[int] | None = None
    state_types: Sequence[pw.StateType] | None = None
    state_region_lens: Sequence[Sequence[int]] | None = None  # NIXL sends these itself
    agent_name: str | None = None  # MoRI's register names no engine key outside its opaque EngineDesc


def _need(sup: RegisterSupplement, names: list[str], backend: str, message: str) -> None:
    missing = tuple(n for n in names if getattr(sup, n) is None)
    if missing:
        raise _err(
            f"SGLang's register carries no {', '.join(missing)}; supply them",
            backend,
            message,
            missing=missing,
        )


def to_register_info(msg: Register, sup: RegisterSupplement) -> pw.RegisterInfo:
    backend, name = msg.BACKEND, type(msg).__name__
    needed = [f.name for f in fields(RegisterSupplement) if f.name not in ("state_region_lens", "agent_name")]
    if isinstance(msg, sg.NixlRegister) and msg.num_slots:
        needed.remove("num_pages")
    nixl_lens = isinstance(msg, sg.NixlRegister) and len(msg.state_data_lens) == len(msg.state_item_lens)
    if msg.state_item_lens and not nixl_lens:
        needed.append("state_region_lens")
    if isinstance(msg, sg.MoriRegister):
        needed.append("agent_name")
    _need(sup, needed, backend, name)
    if len(msg.kv_layer_ids):
        raise _err("RegisterInfo has no KV layer-id list; it would be lost", backend, name, "kv_layer_ids")
    assert sup.is_mla is not None and sup.state_types is not None
    n = len(msg.kv_data_ptrs) if not isinstance(msg, sg.MoriRegister) else len(msg.kv_mem_descs)
    if isinstance(msg, sg.NixlRegister):
        lens = msg.effective_kv_item_lens
    elif isinstance(msg, sg.MooncakeRegister) and len(msg.kv_item_lens):
        lens = [int(x) for x in msg.kv_item_lens]
    else:
        lens = [msg.kv_item_len] * n
    half = n if sup.is_mla else n // 2
    if not sup.is_mla and (n % 2 or lens[:half] != lens[half:]):
        raise _err(
            "non-MLA KV must be K layers then V layers with equal item lengths", backend, name, "kv_item_lens"
        )
    ptrs = _u64(msg.kv_data_ptrs) if not isinstance(msg, sg.MoriRegister) else _u64([0] * n)
    components = _components(msg, sup, backend, name)
    return pw.RegisterInfo(
        endpoint=f"{msg.local_ip}:{msg.rank_port}",
        engine_id=sup.engine_id or "",
        agent_name=(
            msg.session_id
            if isinstance(msg, sg.MooncakeRegister)
            else msg.agent_name
            if isinstance(msg, sg.NixlRegister)
            else sup.agent_name or ""
        ),
        agent_metadata=(
            msg.agent_metadata
            if isinstance(msg, sg.NixlRegister)
            else msg.engine_desc
            if isinstance(msg, sg.MoriRegister)
            else b""
        ),
        geometry=pw.ParallelGeometry(
            tp_size=msg.attn_tp_size,
            tp_rank=(msg.dst_tp_rank if isinstance(msg, sg.MooncakeRegister) else msg.engine_rank)
            % max(1, msg.attn_tp_size),
            pp_size=sup.pp_size or 1,
            pp_rank=sup.pp_rank or 0,
            cp_size=msg.dcp_size,
            cp_rank=msg.dcp_rank,
            dp_size=sup.dp_size or 1,
            dp_rank=sup.dp_rank or 0,
        ),
        first_layer=sup.first_layer or 0,
        num_layers=sup.num_layers or 0,
        k_base_addrs=ptrs[:half],
        v_base_addrs=ptrs[half:] if not sup.is_mla else _u64([]),
        bytes_per_page=_u64(lens[:half]),
        region_lens=_u64(sup.region_lens or []),
        num_pages=msg.num_slots if isinstance(msg, sg.NixlRegister) and msg.num_slots else sup.num_pages or 0,
        page_size=sup.page_size or 0,
        kv_layout=sup.kv_layout if sup.kv_layout is not None else pw.KvLayout.NHD,
        kv_heads_per_rank=sup.kv_heads_per_rank or 0,
        kv_heads_total=sup.kv_heads_total or 0,
        bytes_per_head=sup.bytes_per_head or 0,
        is_mla=sup.is_mla,
        # MoRI addresses aux buffers by descriptor, like its KV: one zero address per descriptor
        aux_base_addrs=_u64(
            [0] * len(msg.aux_mem_descs) if isinstance(msg, sg.MoriRegister) else msg.aux_data_ptrs
        ),
        aux_lens=_u64(sup.aux_lens or []),
        aux_item_lens=_u64(sup.aux_item_lens or []),
        kv_mem_descs=list(msg.kv_mem_descs) if isinstance(msg, sg.MoriRegister) else [],
        state_components=components,
        aux_mem_descs=list(msg.aux_mem_descs) if isinstance(msg, sg.MoriRegister) else [],
    )


def _components(msg: Register, sup: RegisterSupplement, backend: str, name: str) -> list[pw.StateComponent]:
    assert sup.state_types is not None
    count = len(msg.state_item_lens)
    if len(sup.state_types) != count:
        raise _err(
            f"{len(sup.state_types)} state types supplied for {count} components",
            backend,
            name,
            "state_item_lens",
        )
    layer_ids = msg.state_layer_ids
    if len(layer_ids) not in (0, count):
        raise _err(
            f"{len(layer_ids)} state layer-id lists for {count} components", backend, name, "state_layer_ids"
        )
    out = []
    for c in range(count):
        if isinstance(msg, sg.MoriRegister):
            descs = msg.state_mem_descs[c] if c < len(msg.state_mem_descs) else []
            if any(d is None for d in descs):
                raise _err(
                    f"component {c} has a nil descriptor slot; StateComponent.mem_descs cannot hold one",
                    backend,
                    name,
                    "state_mem_descs",
                )
            addrs, blobs = _u64([0] * len(descs)), [d for d in descs if d is not None]
        else:
            addrs, blobs = _u64(msg.state_data_ptrs[c]), []
        if isinstance(msg, sg.NixlRegister) and len(msg.state_data_lens) == count:
            region = _u64(msg.state_data_lens[c])
        else:
            assert sup.state_region_lens is not None
            region = _u64(sup.state_region_lens[c])
        dims = (
            [int(d) * msg.attn_tp_size for d in msg.state_dim_per_tensor[c]]
            if c < len(msg.state_dim_per_tensor)
            else []
        )
        out.append(
            pw.StateComponent(
                type=sup.state_types[c],
                base_addrs=addrs,
                region_lens=region,
                bytes_per_slot=_u64(msg.state_item_lens[c]),
                shard_axis_sizes=_u64(dims),
                mem_descs=blobs,
                layer_ids=np.asarray(layer_ids[c] if layer_ids else [], dtype=np.uint32),
            )
        )
    return out


@dataclass(frozen=True)
class RegisterExtras:
    """SGLang register content RegisterInfo does not carry (used by :func:`from_register_info`)."""

    gpu_id: int = 0
    engine_desc: bytes | None = None  # MoRI: EngineDesc.pack()
    aux_mem_descs: Sequence[bytes] = ()  # MoRI, when the RegisterInfo carries none of its own


def from_register_info(
    info: pw.RegisterInfo, backend: str, extras: RegisterExtras = RegisterExtras()
) -> Register:
    name = {"mooncake": "MooncakeRegister", "nixl": "NixlRegister", "mori": "MoriRegister"}.get(
        backend, "Register"
    )
    ip, port = _split_endpoint(info.endpoint, backend, name)
    kv_ptrs = np.concatenate([info.k_base_addrs, info.v_base_addrs]).astype(np.uint64)
    per_layer = (
        info.bytes_per_page if info.is_mla else np.concatenate([info.bytes_per_page, info.bytes_per_page])
    )
    kv_item_len = int(per_layer[0]) if len(per_layer) else 0
    tp = max(1, info.geometry.tp_size)
    dims = []
    for c, comp in enumerate(info.state_components):
        if comp.sub_blocks:
            raise _err(
                f"component {c} has sub-blocks; SGLang 0.5.23 frames carry none",
                backend,
                name,
                "state_dim_per_tensor",
            )
        if any(int(s) % tp for s in comp.shard_axis_sizes):
            raise _err(
                f"component {c}: a shard axis size is not divisible by tp_size {tp}",
                backend,
                name,
                "state_dim_per_tensor",
            )
        dims.append(np.asarray(comp.shard_axis_sizes // np.uint64(tp), dtype=np.uint32))
    item_lens = [np.asarray(comp.bytes_per_slot, dtype=np.uint32) for comp in info.state_components]
    comps = info.state_components
    layer_ids = (
        [np.asarray(c.layer_ids, dtype=np.uint32) for c in comps]
        if any(len(c.layer_ids) for c in comps)
        else []
    )
    common: dict[str, Any] = dict(
        local_ip=ip,
        rank_port=port,
        attn_tp_size=info.geometry.tp_size,
        kv_item_len=kv_item_len,
        state_item_lens=item_lens,
        state_dim_per_tensor=dims,
        dcp_size=info.geometry.cp_size,
        dcp_rank=info.geometry.cp_rank,
        state_layer_ids=layer_ids,
    )
    if backend == "mooncake":
        return sg.MooncakeRegister(
            session_id=info.agent_name,
            kv_data_ptrs=kv_ptrs,
            aux_data_ptrs=info.aux_base_addrs,
            state_data_ptrs=[c.base_addrs for c in info.state_components],
            dst_tp_rank=info.geometry.tp_rank,
            kv_item_lens=per_layer,
            **common,
        )
    if backend == "nixl":
        slots = info.num_pages if len(kv_ptrs) else 0
        return sg.NixlRegister(
            agent_name=info.agent_name,
            agent_metadata=info.agent_metadata,
            kv_data_ptrs=kv_ptrs,
            aux_data_ptrs=info.aux_base_addrs,
            gpu_id=extras.gpu_id,
            engine_rank=info.geometry.tp_rank,
            num_slots=slots,
            state_data_ptrs=[c.base_addrs for c in info.state_components],
            kv_mem_kinds=[],
            kv_item_lens=per_layer,
            state_data_lens=[c.region_lens for c in info.state_components],
            **common,
        )
    if backend == "mori":
        if not len(per_layer):
            raise _err(
                "MoRI's builder needs kv_item_lens[0] (it raises IndexError without KV)",
                backend,
                name,
                "kv_item_len",
            )
        if extras.engine_desc is None:
            raise _err(
                "MoRI's register needs the EngineDesc blob; supply extras.engine_desc",
                backend,
                name,
                "engine_desc",
                missing=("engine_desc",),
            )
        return sg.MoriRegister(
            engine_desc=extras.engine_desc,
            kv_mem_descs=list(info.kv_mem_descs),
            aux_mem_descs=list(info.aux_mem_descs or extras.aux_mem_descs),
            gpu_id=extras.gpu_id,
            engine_rank=info.geometry.tp_rank,
            state_mem_descs=[list(c.mem_descs) for c in info.state_components],
            kv_layer_ids=np.empty(0, np.uint32),
            **common,
        )
    raise _err("unknown backend (mooncake, nixl or mori)", backend, name)
