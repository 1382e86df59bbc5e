"""Timing one operation with care: warm-up, repeated trials, a robust statistic.

On CUDA each trial is bracketed by CUDA events and the device is synchronised before reading them,
so the time is the GPU's, not the launch queue's. On CPU each trial is a ``time.perf_counter`` wall
clock. Tiny operations are repeated inside a trial until the trial lasts at least ``min_time_s``, so
clock resolution and per-trial overhead do not dominate; the reported time is per call. The statistic
is the median over trials (robust to a trial disturbed by another process), with the inter-quartile
range as the spread.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class TimingResult:
    """Per-call seconds: ``median_s`` over trials, ``iqr_s`` their inter-quartile range."""

    median_s: float
    iqr_s: float
    trials: list[float] = field(default_factory=list)
    calls_per_trial: int = 1

    @property
    def min_s(self) -> float:
        return min(self.trials) if self.trials else self.median_s


def sync(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu" and hasattr(torch, "xpu"):  # pragma: no cover - no XPU here
        torch.xpu.synchronize(device)


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def _run_calls(fn: Callable[[], object], calls: int) -> None:
    for _ in range(calls):
        fn()


def _time_calls(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds for ``calls`` back-to-back calls of ``fn`` (device-side time on CUDA)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        _run_calls(fn, calls)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    sync(device)
    t0 = time.perf_counter()
    _run_calls(fn, calls)
    sync(device)
    return time.perf_counter() - t0


def time_fn(
    fn: Callable[[], object],
    *,
    device: torch.device,
    warmup: int = 2,
    trials: int = 5,
    min_time_s: float = 0.0,
    max_calls_per_trial: int = 100_000,
) -> TimingResult:
    """Time ``fn()`` on ``device``: ``warmup`` untimed calls, then ``trials`` timed trials.

    Each trial repeats ``fn`` ``calls`` times, with ``calls`` chosen (from the warm-up timings) so a
    trial lasts at least ``min_time_s``; the per-call time of a trial is its time / ``calls``.
    Returns the median per-call time over trials and their inter-quartile range.
    """
    if trials < 1:
        raise ValueError(f"trials={trials} must be at least 1")
    device = torch.device(device)
    # warm-up: caches, allocator, kernel selection, lazy initialisation; also sizes the inner loop
    single = math.inf
    for _ in range(max(warmup, 2 if min_time_s > 0 else 0)):  # min of 2+: one hiccup must not size the loop
        single = min(single, _time_calls(fn, 1, device))
    calls = 1
    if min_time_s > 0 and math.isfinite(single):
        calls = max(1, min(max_calls_per_trial, math.ceil(min_time_s / max(single, 1e-9))))
        # one timed calibration trial at that count: the first estimate may include one-off costs
        if calls > 1:
            per = _time_calls(fn, calls, device) / calls
            calls = max(1, min(max_calls_per_trial, math.ceil(min_time_s / max(per, 1e-9))))
    times = [_time_calls(fn, calls, device) / calls for _ in range(trials)]
    return TimingResult(
        median_s=statistics.median(times), iqr_s=_iqr(times), trials=times, calls_per_trial=calls
    )
