"""One background thread that runs a backend's transfer jobs in order.

Used by engines whose calls block (Mooncake's sync batch writes, the local memmove loop):
the owner thread posts a job and polls its status, so ``post`` and ``poll`` never block.
A job function must check ``job.cancel`` between bounded steps and must not raise
(anything it raises is turned into FAILED so the thread never dies). A job's status is
published only when the worker has left it, which is what makes a final state the
engine's confirmation that the job no longer touches memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pdwire.runtime.backends.base import PENDING, TransferHandle, TransferStatus, failed


@dataclass(eq=False)
class Job:
    run: Callable[[Job], TransferStatus]
    cancel: bool = False
    status: TransferStatus = field(default=PENDING)
    finished: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> TransferStatus:
        return self.status if self.finished.is_set() else PENDING


class JobWorker:
    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[Job], TransferStatus]) -> Job:
        job = Job(run)
        self._jobs.put(job)
        return job

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.status = failed("cancelled") if job.cancel else job.run(job)
            except Exception as exc:  # report, never die
                job.status = failed(f"{type(exc).__name__}: {exc}")
            job.finished.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)


class JobTransfers:
    """The poll/cancel/release hooks of a backend whose transfers run as :class:`Job` s.

    Mix in before :class:`~pdwire.runtime.backends.base.Backend`; ``_post`` stores the
    submitted job in ``handle.engine``. Cancelling only raises the job's flag: a queued job
    is skipped, a running one stops at its next check (a Mooncake chunk in flight runs to
    its end first), and the job reports final once the worker left it.
    """

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        job: Job = handle.engine
        return job.poll()

    def _cancel(self, handle: TransferHandle) -> None:
        job: Job | None = handle.engine
        if job is not None:
            job.cancel = True

    def _release(self, handle: TransferHandle) -> None:
        handle.engine = None
