"""What an engine hands a worker per request: model-agnostic indices, and the room a request is.

A request lives in a *room*, a u64 both sides agree on (SGLang's ``bootstrap_room``); room 0 is
reserved (before protocol 1.2 the answer to a registration is a status for room 0).
:class:`RequestIndices` is the decode side's request (see there); prefill gives its source
indices chunk by chunk (``PrefillWorker.send_chunk``) with the same conventions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

RESERVED_ROOM = 0  # before 1.2 the registration answer is a TransferStatus for room 0
MAX_ROOM = (1 << 63) - 1  # SGLang draws bootstrap rooms from [0, 2**63); the wire field is u64
I32 = npt.NDArray[np.int32]
_I32_MAX = np.iinfo(np.int32).max


class IndicesError(ValueError):
    """Request indices that cannot be sent: wrong shape or dtype, negative, out of int32 range."""


def room_for_request(request_id: str) -> int:
    """The room of an engine's string request id: a stable 63-bit hash, never 0 (reserved).

    Deterministic across processes and hosts (BLAKE2b of the UTF-8 id), so both engines derive
    the same room from the same id. Two ids sharing a room are refused as a duplicate room, by
    name, before anything is written.
    """
    if not isinstance(request_id, str) or not request_id:
        raise IndicesError(f"a request id must be a non-empty string, got {request_id!r}")
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8, person=b"pdwire-room").digest()
    return int.from_bytes(digest, "little") % MAX_ROOM + 1  # 1 .. 2**63 - 1


def check_room(room: int) -> int:
    """``room`` as an int in [1, 2**64); raises :class:`IndicesError` otherwise."""
    if isinstance(room, bool) or not isinstance(room, int | np.integer):
        raise IndicesError(f"a room is an integer, got {type(room).__name__}")
    room = int(room)
    if room == RESERVED_ROOM:
        raise IndicesError(f"room {RESERVED_ROOM} is reserved for registration answers; rooms start at 1")
    if not 0 < room < 1 << 64:
        raise IndicesError(f"room {room} is outside the u64 range")
    return room


def as_index_array(values: Any, what: str) -> I32:
    """A one-dimensional int32 copy of ``values`` (what the wire carries), checked."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise IndicesError(f"{what} must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int32)
    if array.dtype.kind not in "iu":
        raise IndicesError(f"{what} must be integers, got dtype {array.dtype}")
    lo, hi = int(array.min()), int(array.max())
    if lo < 0:
        raise IndicesError(f"{what}: index {lo} at position {int(np.argmin(array))} is negative")
    if hi > _I32_MAX:
        raise IndicesError(f"{what}: index {hi} at position {int(np.argmax(array))} exceeds int32")
    out = np.ascontiguousarray(array, dtype=np.int32)
    return out.copy() if out is array else out


def as_state_indices(state: Sequence[Any | None], what: str) -> tuple[I32 | None, ...]:
    """Per-component index arrays; ``None`` stays ``None`` (absent)."""
    if isinstance(state, np.ndarray) or not isinstance(state, Sequence):
        raise IndicesError(f"{what} must be a sequence with one entry (or None) per state component")
    return tuple(None if s is None else as_index_array(s, f"{what}[{i}]") for i, s in enumerate(state))


def as_aux_index(aux_index: int | None, what: str) -> int | None:
    if aux_index is None:
        return None
    if isinstance(aux_index, bool) or not isinstance(aux_index, int | np.integer):
        raise IndicesError(f"{what} must be an integer or None, got {type(aux_index).__name__}")
    if not 0 <= int(aux_index) <= _I32_MAX:
        raise IndicesError(f"{what} must be in [0, 2**31), got {int(aux_index)}")
    return int(aux_index)


@dataclass(frozen=True, slots=True, init=False)
class RequestIndices:
    """One request's destination on a decode rank: where its KV pages, state and aux item go.

    ``kv_pages``: KV page ids after ``decode_prefix_len``, the prompt tokens decode already holds
    (its prefix cache: a multiple of the page size; prefill writes nothing into it). ``state``:
    per state component in ``RankMemory.state`` order an index array, or None when the component
    is *absent* from the request (the wire's null); an empty array means it is part of the
    request with nothing to send, and a slot component (Mamba) takes exactly one index.
    ``aux_index``: the aux item (None: no aux for this request).
    """

    kv_pages: I32
    state: tuple[I32 | None, ...] = field(default=())
    aux_index: int | None = None
    decode_prefix_len: int = 0

    def __init__(
        self,
        kv_pages: Any,
        state: Sequence[Any | None] = (),
        aux_index: int | None = None,
        decode_prefix_len: int = 0,
    ) -> None:
        object.__setattr__(self, "kv_pages", as_index_array(kv_pages, "RequestIndices.kv_pages"))
        object.__setattr__(self, "state", as_state_indices(state, "RequestIndices.state"))
        object.__setattr__(self, "aux_index", as_aux_index(aux_index, "RequestIndices.aux_index"))
        if isinstance(decode_prefix_len, bool) or not isinstance(decode_prefix_len, int | np.integer):
            raise IndicesError(f"RequestIndices.decode_prefix_len must be an int, got {decode_prefix_len!r}")
        if int(decode_prefix_len) < 0:
            raise IndicesError(f"RequestIndices.decode_prefix_len must be >= 0, got {decode_prefix_len}")
        object.__setattr__(self, "decode_prefix_len", int(decode_prefix_len))

    def sent_components(self) -> tuple[int, ...]:
        """Components with something to send (present and non-empty)."""
        return tuple(i for i, s in enumerate(self.state) if s is not None and len(s) > 0)
