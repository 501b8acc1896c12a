"""One background thread that runs a backend's transfer jobs in order.

Used by engines whose calls block (Mooncake's sync batch writes, the local memmove loop):
the owner thread posts a job and polls its status, so ``post`` and ``poll`` never block.
A job function must check ``job.cancel`` between bounded steps and must not raise
(anything it raises is turned into FAILED so the thread never dies).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pdwire.runtime.backends.base import PENDING, TransferStatus, failed


@dataclass(eq=False)
class Job:
    run: Callable[[Job], TransferStatus]
    cancel: bool = False
    status: TransferStatus = field(default=PENDING)
    finished: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> TransferStatus:
        return self.status if self.finished.is_set() else PENDING

    def abort(self, wait_s: float) -> None:
        """Ask the job to stop and wait up to ``wait_s`` for the worker to leave it."""
        self.cancel = True
        self.finished.wait(timeout=wait_s)


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
