"""A bounded pool for plan searches: ``plan_workers`` search at once, ``plan_queue`` more wait; beyond that the
service is saturated and answers 503 with ``Retry-After`` at once, instead of letting every request's latency grow
(a search takes its whole time budget of CPU; a queue without a bound turns a burst into minutes of p99)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Saturated(Exception):
    """Every search slot is busy and the queue is full: retry after ``retry_after_s``."""

    def __init__(self, retry_after_s: int, running: int, waiting: int) -> None:
        super().__init__(f"{running} plan searches running and {waiting} waiting: the service is saturated")
        self.retry_after_s, self.running, self.waiting = retry_after_s, running, waiting


class SearchSlots:
    """``workers`` slots and a queue of ``queue`` waiters; a waiter gives up after ``wait_s`` (Saturated)."""

    def __init__(self, workers: int, queue: int, wait_s: float) -> None:
        self.workers, self.queue, self.wait_s = workers, queue, wait_s
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.mean_s = 1.0  # recent searches' wall time (moving average)

    def retry_after(self) -> int:
        """Seconds until the queue ahead has drained through the slots at the recent searches' pace."""
        return max(1, math.ceil(self.mean_s * (1 + self.waiting / self.workers)))

    @contextmanager
    def slot(self) -> Iterator[None]:
        with self._lock:
            if self.running >= self.workers and self.waiting >= self.queue:
                raise Saturated(self.retry_after(), self.running, self.waiting)
            self.waiting += 1
        got = self._slots.acquire(timeout=self.wait_s)
        with self._lock:
            self.waiting -= 1
            if not got:
                raise Saturated(self.retry_after(), self.running, self.waiting)
            self.running += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.running -= 1
                self.mean_s = 0.8 * self.mean_s + 0.2 * (time.perf_counter() - t0)
            self._slots.release()
