"""Which prefill ranks one decode rank reads a request from, derived once per prefill group.

At connect time the decode rank knows the prefill group's topology (TP, PP), its own position
and, per link, the agreed version; the planner's rank routing (``route_decode_rank``) says which
prefill TP ranks and PP stages it contacts, which of them are dummies (MLA with prefill TP >
decode TP: told, but they write nothing), how many decode ranks each prefill rank waits for,
and the aux owner (the first rank of the group, in the last PP stage the decode rank reads).
:class:`GroupRoute` holds that once; :meth:`GroupRoute.plan` turns one request into the
session's sender plans and the TransferRequests to send, with the component set taken from the
request alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdwire.runtime.indices import RequestIndices
from pdwire.runtime.planner import DecodeRoute
from pdwire.runtime.session.actions import PeerRef, SendRequest
from pdwire.runtime.session.decode_room import SenderPlan


@dataclass(frozen=True, slots=True)
class SenderRoute:
    """One prefill rank that feeds this decode rank."""

    peer: PeerRef
    sender_rank: int  # as it signs statuses and notifications
    is_dummy: bool
    owns_aux: bool  # writes the aux item when the request has one
    fences: bool  # its Failed status and AbortAck certify that its writes stopped (its version)


@dataclass(frozen=True, slots=True)
class GroupRoute:
    senders: tuple[SenderRoute, ...]
    required_dst_info_num: int

    @classmethod
    def of(
        cls,
        route: DecodeRoute,
        pp_size: int,
        links: Mapping[tuple[int, int], tuple[PeerRef, int, bool]],
    ) -> GroupRoute:
        """``links``: (prefill TP rank, PP stage) -> (peer, sender rank, fences) for every rank
        the route contacts."""
        senders = []
        for p in route.prefill_ranks:
            for stage in route.prefill_pp_stages:
                peer, sender_rank, fences = links[(p, stage)]
                # the last stage this rank reads (each decode PP stage its own): as the planner's
                owns_aux = p == route.prefill_ranks[0] and stage == route.prefill_pp_stages[-1]
                senders.append(
                    SenderRoute(peer, sender_rank, p in route.dummy_prefill_ranks, owns_aux, fences)
                )
        return cls(tuple(senders), route.required_dst_info_num)

    @property
    def peers(self) -> tuple[PeerRef, ...]:
        return tuple(s.peer for s in self.senders)

    def plan(self, room: int, indices: RequestIndices) -> tuple[list[SenderPlan], list[SendRequest]]:
        """What each sender owes for ``room`` and the request each is sent."""
        comps = indices.sent_components()
        aux = indices.aux_index is not None
        plans = [
            SenderPlan(
                s.sender_rank,
                s.peer,
                s.is_dummy,
                () if s.is_dummy else comps,
                aux and s.owns_aux and not s.is_dummy,
                fences=s.fences,
            )
            for s in self.senders
        ]
        requests = [
            SendRequest(s.peer, room, s.is_dummy, self.required_dst_info_num, indices) for s in self.senders
        ]
        return plans, requests
