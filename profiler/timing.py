"""Timing one operation with care: warm-up, repeated trials, a robust statistic.

On CUDA each trial is bracketed by CUDA events and the device is synchronised before reading them,
so the time is the GPU's, not the launch queue's. On CPU each trial is a ``time.perf_counter`` wall
clock. Tiny operations are repeated inside a trial until the trial lasts at least ``min_time_s``, so
clock resolution and per-trial overhead do not dominate; the reported time is per call. The statistic
is the median over trials (robust to a trial disturbed by another process), with the inter-quartile
range as the spread. :func:`time_rounds` times many operations with their trials interleaved in rounds.
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
        # on the stream the calls' kernels go to: the current stream of the tensors' device (which
        # need not be the current device)
        stream = torch.cuda.current_stream(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        _run_calls(fn, calls)
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    sync(device)
    t0 = time.perf_counter()
    _run_calls(fn, calls)
    sync(device)
    return time.perf_counter() - t0


def _calls_for(fn: Callable[[], object], device: torch.device, warmup: int, min_time_s: float,
               max_calls_per_trial: int) -> int:
    """Warm ``fn`` up (caches, allocator, kernel selection, lazy initialisation) and size its inner
    loop so a trial lasts at least ``min_time_s``."""
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
    return calls


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
    return time_rounds([fn], device=device, warmup=warmup, trials=trials, min_time_s=min_time_s,
                       max_calls_per_trial=max_calls_per_trial)[0]


def time_rounds(
    fns: list[Callable[[], object]],
    *,
    device: torch.device,
    warmup: int = 2,
    trials: int = 5,
    min_time_s: float = 0.0,
    max_calls_per_trial: int = 100_000,
    on_round: Callable[[int], None] | None = None,
) -> list[TimingResult]:
    """Time several operations as :func:`time_fn` times one, but in rounds: each is warmed up and
    sized first, then round ``r`` times one trial of every operation in turn, ``trials`` rounds.

    A machine whose speed moves over seconds (a shared VM: its neighbours' load, frequency) then
    spreads each operation's trials over the whole measurement instead of one moment of it, so the
    median of each sees the same mix of fast and slow moments, and shapes measured minutes apart
    (a profile, then a check of it) compare like with like. ``on_round(r)`` is called after round ``r``.
    """
    if trials < 1:
        raise ValueError(f"trials={trials} must be at least 1")
    device = torch.device(device)
    calls = [_calls_for(fn, device, warmup, min_time_s, max_calls_per_trial) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for r in range(trials):
        for i, fn in enumerate(fns):
            times[i].append(_time_calls(fn, calls[i], device) / calls[i])
        if on_round is not None:
            on_round(r)
    return [TimingResult(median_s=statistics.median(t), iqr_s=_iqr(t), trials=t, calls_per_trial=c)
            for t, c in zip(times, calls)]
