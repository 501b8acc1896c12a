"""Background threads that run a backend's transfer jobs in order of submission.

Used by engines whose calls block (Mooncake's sync batch writes, the local copy loop):
the owner thread posts a job and polls its status, so ``post`` and ``poll`` never block.
A worker has one thread or several (jobs then run side by side, started in order).
A job function must check ``job.cancel`` between bounded steps and must not raise
(anything it raises is turned into FAILED so the thread never dies). A job's status is
published only when the worker has left it, which is what makes a final state the
engine's confirmation that the job no longer touches memory.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdwire.runtime.backends.values import PENDING, PollResult, TransferHandle, failed


@dataclass(eq=False)
class Job:
    run: Callable[[Job], PollResult]
    cancel: bool = False
    status: PollResult = field(default=PENDING)
    finished: threading.Event = field(default_factory=threading.Event)
    started_at: float | None = None  # time.monotonic() when a thread took it up

    def poll(self) -> PollResult:
        return self.status if self.finished.is_set() else PENDING


class JobThread:
    def __init__(self, name: str, threads: int = 1, on_done: Callable[[], None] | None = None) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._on_done = on_done  # told after each job's final status is published (a wake-up)
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, run: Callable[[Job], PollResult]) -> Job:
        job = Job(run)
        self._jobs.put(job)
        return job

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.started_at = time.monotonic()
            try:
                job.status = failed("cancelled") if job.cancel else job.run(job)
            except Exception as exc:  # report, never die
                job.status = failed(f"{type(exc).__name__}: {exc}")
            job.finished.set()
            if self._on_done is not None:
                self._on_done()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Let every thread finish its job and end; waits at most ``timeout_s`` in all (a
        thread stuck inside an engine call is left behind: it is a daemon)."""
        for _ in self._threads:
            self._jobs.put(None)
        end = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()))


class JobTransfers:
    """The poll/cancel/release hooks of a backend whose transfers run as :class:`Job` s.

    Mix in before :class:`~pdwire.runtime.backends.contract.Backend`; ``_post`` stores the job
    :meth:`_submit` returned in ``handle.private``. Cancelling only raises the job's flag: a
    queued job is skipped, a running one stops at its next check (a Mooncake chunk in flight
    runs to its end first), and the job reports final once the worker left it. A job's
    transfer timeout counts from when a thread took it up: time queued behind other jobs is
    the caller's backlog, not the engine's slowness (a queued job ends when it is cancelled).
    """

    transfer_timeout_s: float
    _worker: JobThread

    def _submit(self, handle: TransferHandle, run: Callable[[Job], PollResult]) -> Job:
        """Queue ``run`` for ``handle``; engines with more than one worker pick one here."""
        return self._worker.submit(run)

    def _deadline(self, handle: TransferHandle) -> float:
        job: Job | None = handle.private
        if job is None or job.started_at is None:
            return math.inf
        return job.started_at + self.transfer_timeout_s

    def _poll(self, handle: TransferHandle) -> PollResult:
        job: Job = handle.private
        return job.poll()

    def _cancel(self, handle: TransferHandle) -> None:
        job: Job | None = handle.private
        if job is not None:
            job.cancel = True

    def _release(self, handle: TransferHandle) -> None:
        handle.private = None
