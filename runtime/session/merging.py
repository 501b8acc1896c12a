"""Which posts of one batch ride on one engine write: pure, values in and values out.

The prefill session emits one :class:`~.actions.PostTransfer` per part. Parts of one room for
one decode rank that are ready in the same batch (a chunk's KV and the last chunk's state and
aux; the chunks produced before the last request arrived) complete together, so from protocol
1.4 they go as one engine write whose one notification names them all (``chunk_count``,
``also_components``, ``also_aux``). One notification carries one run of consecutive KV chunks,
so a run ends where a chunk id skips.

:func:`group_posts` keeps the batch's order except that it gathers the posts of one
(room, peer) between two other actions: a non-post action (a cancel, a status) stays between
what came before it and what came after it. :func:`runs` cuts one group's parts into runs one
notification can name.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdwire.runtime.session.actions import Action, KvPart, Part, PostTransfer


def group_posts(actions: Sequence[Action]) -> list[Action | list[PostTransfer]]:
    """``actions`` with each stretch of consecutive posts grouped by (room, peer), groups in
    the order of their first post."""
    out: list[Action | list[PostTransfer]] = []
    stretch: dict[tuple[int, object], list[PostTransfer]] = {}
    for a in actions:
        if isinstance(a, PostTransfer):
            stretch.setdefault((a.room, a.peer), []).append(a)
            continue
        out += stretch.values()
        stretch = {}
        out.append(a)
    out += stretch.values()
    return out


def runs(parts: Sequence[Part]) -> list[list[int]]:
    """Indices of ``parts`` cut into runs one notification names: each run holds KV chunks of
    consecutive ids in order (at most one run of them) and any state and aux parts; those join
    the run before them (the run of the last chunk they came with)."""
    out: list[list[int]] = []
    last_kv: int | None = None
    for i, p in enumerate(parts):
        if isinstance(p, KvPart):
            if not out or last_kv is None or p.chunk_id != last_kv + 1 or _has_state_or_aux(parts, out[-1]):
                out.append([i])
            else:
                out[-1].append(i)
            last_kv = p.chunk_id
        elif out:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _has_state_or_aux(parts: Sequence[Part], run: list[int]) -> bool:
    # a KV chunk after state or aux in one run would make the run's parts out of order
    return any(not isinstance(parts[j], KvPart) for j in run)
