"""The ``kv_transfer_params`` a prefill engine returns and the proxy copies into the decode request.

The proxy treats them as opaque JSON (the keys are :meth:`PrefillHandle.to_params`'s, the
table in docs/vllm.md). Decode checks them (:func:`parse`) before it allocates anything for
them; a bad value is one :class:`TransferParamsError` naming the key, and the request is
computed locally instead.

Every value survives a router that holds JSON numbers as doubles (Go's ``map[string]any``,
JavaScript), as NixlConnector's do (block ids, a port): the room, a 63-bit number, travels as
a decimal string, so such a router cannot round it into another request's room.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROOM = "pdwire_room"
# set on the decode request once its room started, so a rescheduled request never starts it twice
STARTED = "_pdwire_started"


class TransferParamsError(ValueError):
    """``kv_transfer_params`` that do not describe a pdwire prefill; names the key."""


@dataclass(frozen=True)
class PrefillHandle:
    """Where a request's KV waits on the prefill side, as the decode side needs it."""

    room: int
    engine_id: str
    endpoints: tuple[str, ...]
    pp_size: int
    num_tokens: int
    block_size: int

    def to_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            ROOM: str(self.room),  # a decimal string: exact through any JSON router (above)
            "pdwire_engine_id": self.engine_id,
            "pdwire_endpoints": list(self.endpoints),
            "pdwire_pp_size": self.pp_size,
            "pdwire_num_tokens": self.num_tokens,
            "pdwire_block_size": self.block_size,
        }


def is_pdwire_prefill(params: Mapping[str, Any] | None) -> bool:
    """Decode side: the request's KV comes from a pdwire prefill and was not asked for yet."""
    if not params or ROOM not in params:
        return False
    return not params.get(STARTED) and bool(params.get("do_remote_prefill"))


def _int(params: Mapping[str, Any], key: str, lo: int, hi: int = 2**64 - 1) -> int:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TransferParamsError(f"kv_transfer_params[{key!r}] must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise TransferParamsError(f"kv_transfer_params[{key!r}] = {value} is outside [{lo}, {hi}]")
    return value


def _room(params: Mapping[str, Any]) -> int:
    """The room: a decimal string, or an int (what an older prefill sends) as well."""
    value = params.get(ROOM)
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit()):
            raise TransferParamsError(
                f"kv_transfer_params[{ROOM!r}] must be a decimal string, got {value!r:.40}"
            )
        return _int({ROOM: int(value)}, ROOM, 1)
    return _int(params, ROOM, 1)


def parse(params: Mapping[str, Any]) -> PrefillHandle:
    """The prefill handle in ``params``; raises :class:`TransferParamsError` naming a bad key."""
    if not isinstance(params, Mapping):
        raise TransferParamsError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    room = _room(params)
    engine_id = params.get("pdwire_engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        raise TransferParamsError(
            f"kv_transfer_params['pdwire_engine_id'] must be a non-empty string, got {engine_id!r}"
        )
    endpoints = params.get("pdwire_endpoints")
    if (
        not isinstance(endpoints, list | tuple)
        or not endpoints
        or not all(isinstance(e, str) and e.startswith("tcp://") for e in endpoints)
    ):
        raise TransferParamsError(
            "kv_transfer_params['pdwire_endpoints'] must be a non-empty list of tcp:// endpoints, "
            f"got {endpoints!r}"
        )
    pp = _int(params, "pdwire_pp_size", 1, 1024)
    if len(endpoints) % pp:
        raise TransferParamsError(
            f"kv_transfer_params['pdwire_endpoints']: {len(endpoints)} endpoints do not split "
            f"into {pp} PP stages"
        )
    return PrefillHandle(
        room=room,
        engine_id=engine_id,
        endpoints=tuple(endpoints),
        pp_size=pp,
        num_tokens=_int(params, "pdwire_num_tokens", 1, 2**31 - 1),
        block_size=_int(params, "pdwire_block_size", 1, 2**20),
    )
