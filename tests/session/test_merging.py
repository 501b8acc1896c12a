"""Which posts of a batch join one engine write (pure)."""

from __future__ import annotations

from pdwire.runtime.session.actions import AuxPart, CancelTransfers, KvPart, PeerRef, PostTransfer, StatePart
from pdwire.runtime.session.merging import group_posts, runs

A, B = PeerRef("d", 0), PeerRef("d", 1)


def kv(c: int, last: bool = False) -> KvPart:
    return KvPart(c, 8 * c, 8 * c + 8, last)


def test_posts_group_by_room_and_peer_between_other_actions() -> None:
    p = [
        PostTransfer(i, room, peer, kv(i)) for i, (room, peer) in enumerate([(1, A), (1, B), (1, A), (2, A)])
    ]
    cancel = CancelTransfers(1, (0,))
    late = PostTransfer(9, 1, A, kv(9))
    assert group_posts([*p, cancel, late]) == [[p[0], p[2]], [p[1]], [p[3]], cancel, [late]]
    assert group_posts([]) == []


def test_runs_hold_one_run_of_consecutive_chunks_and_the_parts_after_it() -> None:
    parts = [kv(0), kv(1), kv(3), kv(4, True), StatePart(0), StatePart(2), AuxPart()]
    assert runs(parts) == [[0, 1], [2, 3, 4, 5, 6]]
    assert runs([StatePart(1), AuxPart()]) == [[0, 1]]
    assert runs([StatePart(1), kv(0)]) == [[0], [1]]  # a chunk never follows state in one run
    assert runs([kv(2), kv(1)]) == [[0], [1]]
