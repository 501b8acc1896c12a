"""Which prefill ranks feed which decode rank, and who owns which KV heads.

All of it is a function of (prefill TP, decode TP, total KV heads, MLA, PP sizes) only, computed
identically on both sides. Heads follow QKVParallelLinear semantics: with ``H >= T`` heads rank r
holds heads ``[r*H/T, (r+1)*H/T)``; with ``H < T`` ranks share heads and rank r holds the single head
``r // (T/H)`` (division, never modulo: the modulo form is SGLang bug #23746, fixed in #30997).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdwire.runtime.planner.errors import TopologyError


def check_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    """Both sizes positive and one divides the other; anything else mis-maps ranks silently."""
    if prefill_tp < 1 or decode_tp < 1:
        raise TopologyError(f"TP sizes must be >= 1, got prefill {prefill_tp}, decode {decode_tp}")
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        raise TopologyError(f"TP sizes must divide one another, got prefill {prefill_tp}, decode {decode_tp}")


def heads_held(tp_size: int, tp_rank: int, total_heads: int) -> tuple[int, int]:
    """Global KV head range ``[lo, hi)`` held by one rank."""
    if total_heads >= tp_size:
        per_rank = total_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    head = tp_rank // (tp_size // total_heads)
    return head, head + 1


def decode_ranks_of_prefill(prefill_tp: int, decode_tp: int, prefill_rank: int) -> tuple[int, ...]:
    """Decode TP ranks that one prefill TP rank sends to (its TransferInfo senders)."""
    check_tp_sizes(prefill_tp, decode_tp)
    if decode_tp >= prefill_tp:
        fan = decode_tp // prefill_tp
        return tuple(range(prefill_rank * fan, (prefill_rank + 1) * fan))
    return (prefill_rank // (prefill_tp // decode_tp),)


@dataclass(frozen=True, slots=True)
class DecodeRoute:
    """What one decode TP rank does for one request.

    ``prefill_ranks``: prefill TP ranks it contacts (in every prefill PP stage when decode PP is 1).
    ``dummy_prefill_ranks``: the subset that transfers nothing (MLA with P > D and no TP-sharded
    state: the latent and replicated state come from the first rank of the group) but must still be told,
    explicitly, so that its request state advances. ``required_dst_info_num``: how many decode ranks
    each contacted prefill rank waits for before it starts. ``expected_responses``: completions
    decode waits for (one per non-dummy sender, per prefill PP stage).
    """

    decode_rank: int
    prefill_ranks: tuple[int, ...]
    dummy_prefill_ranks: tuple[int, ...]
    required_dst_info_num: int
    expected_responses: int
    prefill_pp_stages: tuple[int, ...]


def route_decode_rank(
    prefill_tp: int,
    decode_tp: int,
    decode_rank: int,
    *,
    is_mla: bool,
    prefill_pp: int = 1,
    decode_pp: int = 1,
    decode_pp_rank: int = 0,
    sharded_state: bool = False,
) -> DecodeRoute:
    """The route of one decode rank. ``sharded_state``: the model has TP-sharded state (Mamba
    conv/temporal, head-sharded components; ``has_tp_sharded_state(memory)``). With MLA and
    P > D every prefill rank of a group then writes its own state shard, so none is a dummy
    and decode waits for all of them; the replicated latent still comes from the first rank
    alone. Both sides must pass the same value (it is a property of the model)."""
    check_tp_sizes(prefill_tp, decode_tp)
    if not 0 <= decode_rank < decode_tp:
        raise TopologyError(f"decode TP rank {decode_rank} outside TP size {decode_tp}")
    if decode_pp not in (1, prefill_pp):
        raise TopologyError(f"decode PP must be 1 or equal prefill PP {prefill_pp}, got {decode_pp}")
    if not 0 <= decode_pp_rank < decode_pp:
        raise TopologyError(f"decode PP rank {decode_pp_rank} outside PP size {decode_pp}")
    stages = tuple(range(prefill_pp)) if decode_pp == 1 else (decode_pp_rank,)
    if prefill_tp > decode_tp:
        fan_in = prefill_tp // decode_tp
        ranks = tuple(range(decode_rank * fan_in, (decode_rank + 1) * fan_in))
        one_writer = is_mla and not sharded_state
        dummies = ranks[1:] if one_writer else ()
        responses = (1 if one_writer else fan_in) * len(stages)
        return DecodeRoute(decode_rank, ranks, dummies, 1, responses, stages)
    fan_out = decode_tp // prefill_tp
    return DecodeRoute(decode_rank, (decode_rank // fan_out,), (), fan_out, len(stages), stages)
