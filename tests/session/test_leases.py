"""Leases, pure: the decode side's renewal book (:mod:`pdwire.runtime.session.leases`), the prefill
session renewing rooms nobody asked for yet, and the connections carrying both at 1.5 (and not
at 1.4)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdwire import wire
from pdwire.runtime.session.actions import PeerRef, ReleaseRoom, SendStatus
from pdwire.runtime.session.events import LeaseRenewed
from pdwire.runtime.session.failures import FailureKind
from pdwire.runtime.session.hello import LEASES_SINCE
from pdwire.runtime.session.leases import RENEWALS_PER_LEASE, Leases, Renew, renewal_interval
from pdwire.runtime.session.prefill_connection import PrefillConnection
from pdwire.runtime.session.prefill_session import PrefillSession
from pdwire.runtime.session.status import Status
from tests.session.test_connections import decode_local, handshake, prefill_local, trip
from tests.session.test_prefill_room import chunk, target

ROOM = 42
D0, D1, OTHER = PeerRef("d", 0), PeerRef("d", 1), PeerRef("other", 0)


# -------------------------------------------------------------------- the decode side's book


def test_a_group_is_renewed_at_once_then_once_per_interval_naming_every_held_room() -> None:
    book: Leases[str] = Leases()
    book.hold(1, "g")
    book.hold(2, "g")
    book.hold(3, "h")
    every = {"g": 1.0, "h": 2.0}.get
    assert book.due(0.0, every) == [Renew("g", (1, 2)), Renew("h", (3,))]
    assert book.due(0.5, every) == []  # one renewal per group and interval, however many rooms
    book.hold(4, "g")  # a room held between renewals waits for its group's next one
    assert book.due(1.0, every) == [Renew("g", (1, 2, 4))]
    assert book.due(2.0, every) == [Renew("g", (1, 2, 4)), Renew("h", (3,))]


def test_a_dropped_room_is_renewed_no_more_and_an_empty_group_starts_afresh() -> None:
    book: Leases[str] = Leases()
    book.hold(1, "g")
    book.hold(2, "g")
    assert book.due(0.0, lambda g: 1.0) == [Renew("g", (1, 2))]
    assert book.drop(1) == "g" and book.drop(1) is None and 1 not in book
    assert book.due(1.0, lambda g: 1.0) == [Renew("g", (2,))]
    book.drop(2)
    assert len(book) == 0 and book.groups == ()
    book.hold(5, "g")  # the group's clock went with its last room: renewed at once
    assert book.due(1.1, lambda g: 1.0) == [Renew("g", (5,))]


def test_a_room_held_again_moves_to_its_new_group() -> None:
    book: Leases[str] = Leases()
    book.hold(1, "g")
    book.hold(1, "h")
    assert book.due(0.0, lambda g: 1.0) == [Renew("h", (1,))]


def test_a_group_that_cannot_be_renewed_keeps_its_rooms_until_forgotten() -> None:
    book: Leases[str] = Leases()
    book.hold(1, "connecting")
    assert book.due(0.0, lambda g: None) == []  # not ready (or no rank takes leases): nothing sent
    assert book.due(5.0, lambda g: 1.0) == [Renew("connecting", (1,))]  # ready now: at once
    assert book.forget("connecting") == (1,) and len(book) == 0
    assert book.due(10.0, lambda g: 1.0) == []


def test_the_interval_is_a_share_of_the_shortest_lease_of_ranks_that_take_leases() -> None:
    assert renewal_interval([]) is None and renewal_interval([0.0, 0.0]) is None  # 1.4 ranks only
    assert renewal_interval([30.0, 0.0, 6.0]) == pytest.approx(6.0 / RENEWALS_PER_LEASE)


# -------------------------------------------------------------------- the prefill session


def timed_out(actions: list[object]) -> bool:
    rel = [a for a in actions if isinstance(a, ReleaseRoom)]
    return bool(rel) and rel[0].failure is not None and rel[0].failure.kind is FailureKind.TIMEOUT


def test_a_renewed_room_outlives_its_timeout_and_expires_a_lease_after_the_last_renewal() -> None:
    s = PrefillSession(room_timeout_s=10.0)
    chunk(s, (0, 4, True))  # produced at 0: due at 10 without renewal
    assert s.on_lease([ROOM], D0, 8.0) == 1
    assert s.on_tick(12.0) == [] and s.status(ROOM) is Status.BOOTSTRAPPING
    assert s.on_lease([ROOM], D0, 15.0) == 1
    assert s.on_tick(24.9) == []
    assert timed_out(s.on_tick(25.0))  # nobody renewed it for a lease: its pages are freed
    assert s.on_lease([ROOM], D0, 26.0) == 0  # over: a late renewal changes nothing
    assert s.status(ROOM) is Status.FAILED


def test_a_renewal_never_shortens_a_room() -> None:
    s = PrefillSession(room_timeout_s=10.0)
    chunk(s, (0, 4, True))
    s.rooms[ROOM].deadline = 50.0
    assert s.on_lease([ROOM], D0, 1.0) == 1 and s.rooms[ROOM].deadline == 50.0


def test_renewals_leave_unknown_requested_and_other_engines_rooms_alone() -> None:
    s = PrefillSession(room_timeout_s=10.0)
    assert s.on_lease([7], D0, 5.0) == 0 and 7 not in s.rooms  # never produced: not created
    chunk(s, (0, 4, True))
    s.on_request(ROOM, target(D0, False, pages=4), 2, 0.0)  # one of two decode ranks asked
    assert s.on_lease([ROOM], OTHER, 5.0) == 0  # another engine's renewal: not its room
    assert s.on_lease([ROOM], D1, 5.0) == 1  # the same engine's other rank still queues it
    s.on_request(ROOM, target(D1, False, pages=4), 2, 0.0)
    assert s.status(ROOM) is not Status.BOOTSTRAPPING
    before = s.rooms[ROOM].deadline if ROOM in s.rooms else None
    assert s.on_lease([ROOM], D0, 50.0) == 0  # every request in: its deadline is the transfer's
    assert (s.rooms[ROOM].deadline if ROOM in s.rooms else None) == before


def test_a_declined_room_is_not_brought_back_by_a_renewal() -> None:
    s = PrefillSession(room_timeout_s=10.0)
    chunk(s, (0, 4, True))
    s.on_abort(ROOM, D0)
    assert s.on_lease([ROOM], D0, 1.0) == 0 and ROOM not in s.rooms
    late = s.on_request(ROOM, target(D0, False, pages=4), 1, 2.0)
    assert isinstance(late[0], SendStatus) and late[0].status is Status.FAILED


# -------------------------------------------------------------------- the connections


def test_at_1_5_the_registration_answer_names_the_lease_and_a_lease_reaches_the_session() -> None:
    p_local = dataclasses.replace(prefill_local(), lease_s=4.5)
    h = handshake(p_local, decode_local())
    h.run()
    assert h.d.ready and h.d.version is not None and h.d.version >= LEASES_SINCE
    assert h.d.lease_s == pytest.approx(4.5)
    msg = h.d.lease([3, 2**64 - 1])
    got = trip(msg, h.d.version)
    assert isinstance(got, wire.Lease)
    assert h.p.receive(got) == [LeaseRenewed((3, 2**64 - 1), PeerRef("dec", 0))]


def test_a_1_4_pair_carries_no_lease_and_encodes_as_before() -> None:
    p_local = dataclasses.replace(prefill_local(versions=((1, 4),)), lease_s=4.5)
    h = handshake(p_local, decode_local())
    h.run()
    assert h.d.ready and h.d.version == (1, 4) and h.d.lease_s == 0.0
    acks = [m for way, m, _ in h.crossed if isinstance(m, wire.RegisterAck)]
    assert acks and all(int(a.lease_ms) == 0 for a in acks)
    with pytest.raises(wire.DowngradeError):  # a 1.4 reader cannot read one: never sent to it
        wire.encode(h.d.lease([3]), (1, 4))


def test_a_lease_before_any_hello_is_ignored() -> None:
    conn = PrefillConnection(prefill_local())
    assert conn.receive(wire.Lease(rooms=np.asarray([1], np.uint64))) == []


def test_a_prefill_without_leases_says_so() -> None:
    h = handshake(prefill_local(), decode_local())  # lease_s 0: an engine that renews nothing
    h.run()
    assert h.d.ready and h.d.lease_s == 0.0
