"""Engine wake-ups: a backend that says it wakes its owner (``wakes_on_completion``,
``wakes_on_notification``) makes ``wakeup_fds`` readable once a posted transfer is final or a
notification arrived, and ``clear_wakeups`` makes them quiet again; one that says nothing offers
no descriptor (its workers poll it)."""

from __future__ import annotations

import gc
import select
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

from pdwire.runtime.backends import TransferState
from pdwire.runtime.backends.wakeup import DatagramWaker, poke
from tests.backends.test_conformance import MiB, mib_table, pair, params


def readable(fds: tuple[int, ...], timeout_s: float) -> bool:
    return bool(fds) and bool(select.select(list(fds), [], [], timeout_s)[0])


@pytest.mark.parametrize("name", params())
def test_wakeup_descriptors_turn_readable_on_completion_and_notification(name: str, backends: Any) -> None:
    a, b, src, dst, peer = pair(name, backends, 2 * MiB)
    if not (a.wakes_on_completion or a.wakes_on_notification):
        assert a.wakeup_fds() == () and b.wakeup_fds() == ()
        return
    a.clear_wakeups()
    b.clear_wakeups()
    assert not readable(a.wakeup_fds(), 0) and not readable(b.wakeup_fds(), 0)
    h = a.post(peer, mib_table(src.address, dst.address, 2 * MiB), b"woken")
    if a.wakes_on_completion:
        assert readable(a.wakeup_fds(), 30)  # no polling needed to learn of it
        assert a.poll(h).state is TransferState.DONE
        a.clear_wakeups()
        assert not readable(a.wakeup_fds(), 0)
    else:
        assert a.wait(h, 30).state is TransferState.DONE
    a.release(h)
    if b.wakes_on_notification:
        assert readable(b.wakeup_fds(), 30)
        b.clear_wakeups()
        assert [n.payload for n in b.receive_notifications()] == [b"woken"]
        assert not readable(b.wakeup_fds(), 0)
    a.close()
    assert a.wakeup_fds() == ()  # a closed backend offers nothing to wait on


def test_the_socket_a_thread_pokes_with_is_closed_when_the_thread_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unraisable: list[BaseException | None] = []  # an unclosed socket warns from its finalizer
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))
    waker = DatagramWaker(str(tmp_path / "wake"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            thread = threading.Thread(target=poke, args=(waker.path,))
            thread.start()
            thread.join()
            gc.collect()
        assert unraisable == []
        assert readable((waker.fd,), 5)  # and the poke arrived
    finally:
        waker.close()
