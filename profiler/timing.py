"""Timing one operation with care: warm-up, repeated trials, a robust statistic.

On CUDA each trial is bracketed by CUDA events and the device is synchronised before reading them,
so the time is the GPU's, not the launch queue's; an operation the host launches more slowly than
the GPU runs it is queued behind a spin kernel first, so its calls run back to back
(:func:`hold_seconds`). On CPU each trial is a ``time.perf_counter`` wall clock. Tiny operations are
repeated inside a trial until the trial lasts at least ``min_time_s``, so clock resolution and
per-trial overhead do not dominate; the reported time is per call. Each result holds the median over
trials with the inter-quartile range as the spread, and the statistic a profile records
(:func:`estimate`): the median on a GPU, the fastest trial on a CPU, whose wall clocks a busy host
only ever slows. :func:`time_rounds` times many operations with their trials interleaved in rounds,
within a time :class:`Budget` if given.
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
    """Per-call seconds: ``median_s`` over trials, ``iqr_s`` their inter-quartile range, and
    ``estimate_s``, the statistic a profile records (:func:`estimate`)."""

    median_s: float
    iqr_s: float
    trials: list[float] = field(default_factory=list)
    calls_per_trial: int = 1
    device_type: str = "cpu"  # what timed the trials: a wall clock ("cpu") or CUDA events

    @property
    def min_s(self) -> float:
        return min(self.trials) if self.trials else self.median_s

    @property
    def estimate_s(self) -> float:
        return estimate(self.trials, self.device_type) if self.trials else self.median_s


def estimate(trials: list[float], device_type: str) -> float:
    """The time a profile records from a shape's trials: the fastest on a CPU, the median on a GPU.

    A CPU trial is a wall clock, and on a shared host other work only ever adds to it (a preempted
    thread, caches refilled after a neighbour): the fastest trial is what the machine does when
    left alone, and it repeats; the median follows the host's load at the moment. On a busy 2-vCPU
    VM (``benchmarks/cpu_statistic.py``, both statistics from the same trials) the quick grid's fp32
    GEMMs priced 30 held-out shapes measured right after 29 of 30 within 15% from fastest trials
    against 19 of 30 from medians, bf16 23 against 12 (README, "Profile a cluster"). CUDA events time the GPU, which
    a host's load does not slow, and whose fastest trial would catch the clock at its highest: the
    median there."""
    return min(trials) if device_type == "cpu" else statistics.median(trials)


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


# CUDA: an operation whose launch takes the host longer than the GPU takes to run it (a 512³ GEMM:
# 10-16 µs per call from the host on the H200 machine, a few µs of GPU) would be timed at the host's
# pace, the GPU idle between calls; in training its kernels queue behind earlier work and run back to
# back. Such an operation's trials are queued behind a spin kernel (torch.cuda._sleep) that holds the
# GPU until the host has queued them, so the events time the GPU alone; launch latency is the
# planner's own term (Assumptions.kernel_overhead_s). A held trial has at most HOLD_MAX_CALLS calls:
# a stream's launch queue is finite (about a thousand launches by NVIDIA forum reports; not measured
# here), and a host blocked on it paces the GPU again. An operation that blocks the host anyway (it
# synchronises: a pageable copy) is not held.
HOLD_WHEN_HOST_OVER = 0.9  # hold when queueing a call takes the host over 90% of its GPU time
HOLD_MARGIN = 1.5  # the hold: this many times the host's queueing time of the trial's calls ...
HOLD_EXTRA_S = 50e-6  # ... plus this much (the events and the spin kernel's own launch)
HOLD_MAX_S = 0.25
HOLD_MAX_CALLS = 256
_SLEEP_CYCLES_PER_S: dict[int, float] = {}
HOLD_STATS = {"held": 0, "host_paced": 0}  # operations held; held trials still paced by the host (reset by callers)


def _hold_covering(host_s: float) -> float:
    """A hold long enough for the host to queue calls that took it ``host_s`` to queue."""
    return min(HOLD_MAX_S, HOLD_MARGIN * host_s + HOLD_EXTRA_S)


def hold_seconds(calls: int, host_per_call_s: float, device_per_call_s: float) -> float:
    """How long to hold the GPU before a trial of ``calls`` calls (0: the GPU keeps ahead of the host anyway)."""
    if host_per_call_s <= HOLD_WHEN_HOST_OVER * device_per_call_s:
        return 0.0
    return _hold_covering(calls * host_per_call_s)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _sleep_cycles_per_s(device: torch.device) -> float:
    """Clock cycles per second of ``torch.cuda._sleep`` on ``device``: timed once after a spin that
    wakes the clocks, then updated from every held trial (:func:`_time_cuda`), since the clocks move."""
    index = _device_index(device)
    if index not in _SLEEP_CYCLES_PER_S:
        with torch.cuda.device(index):
            stream = torch.cuda.current_stream(index)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)
            start.record(stream)
            torch.cuda._sleep(20_000_000)
            end.record(stream)
            end.synchronize()
            _SLEEP_CYCLES_PER_S[index] = 20_000_000 / max(start.elapsed_time(end) / 1e3, 1e-6)
    return _SLEEP_CYCLES_PER_S[index]


def _time_cuda(fn: Callable[[], object], calls: int, device: torch.device, hold_s: float) -> tuple[float, float, float]:
    """(GPU seconds of ``calls`` back-to-back calls, host seconds spent queueing them, seconds the GPU
    was held before them), on the stream the calls' kernels go to: the current stream of the
    tensors' device (which need not be the current device)."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    held, cycles = None, 0
    if hold_s > 0:
        cycles = max(1, int(hold_s * _sleep_cycles_per_s(device)))  # calibrated before the hold starts
        held = torch.cuda.Event(enable_timing=True)
        held.record(stream)
        with torch.cuda.device(device):
            torch.cuda._sleep(cycles)
    start.record(stream)
    t0 = time.perf_counter()
    _run_calls(fn, calls)
    host_s = time.perf_counter() - t0
    end.record(stream)
    end.synchronize()
    held_s = 0.0
    if held is not None:
        held_s = held.elapsed_time(start) / 1e3
        _SLEEP_CYCLES_PER_S[_device_index(device)] = cycles / max(held_s, 1e-6)  # the clocks as they are now
    return start.elapsed_time(end) / 1e3, host_s, held_s


def _time_calls(fn: Callable[[], object], calls: int, device: torch.device, hold_s: float = 0.0) -> float:
    """Seconds for ``calls`` back-to-back calls of ``fn`` (device-side time on CUDA, the GPU held
    ``hold_s`` first: :func:`hold_seconds`; a hold that ended before the host had queued the calls
    is lengthened and the trial run again, twice at most, then counted in ``HOLD_STATS``)."""
    if device.type == "cuda":
        for _ in range(3):
            gpu_s, host_s, held_s = _time_cuda(fn, calls, device, hold_s)
            if hold_s <= 0 or host_s <= held_s:
                return gpu_s
            hold_s = _hold_covering(host_s)
        HOLD_STATS["host_paced"] += 1
        return gpu_s
    sync(device)
    t0 = time.perf_counter()
    _run_calls(fn, calls)
    sync(device)
    return time.perf_counter() - t0


@dataclass
class Budget:
    """A time budget for a walk over operations in order of cost (:func:`time_rounds`).

    The walk stops at the first operation whose warm-up calls take longer than ``max_call_s`` (the
    first and a second that confirms it: a first call may carry one-off costs, such as autograd's
    first backward: 0.27 s for an SDPA backward that then takes 0.32 ms, b=1 s=128 2 heads d=64 fp32),
    or whose timing would take the walk's projected time (warm-ups spent plus ``trials`` trials of every
    operation kept) past ``max_total_s``: that operation and every later one are not timed. The walk's
    first group of operations (a GEMM, or an attention forward with its backward) is always kept,
    however slow, so a table is never empty (an empty one would leave the planner a stand-in rate). One
    budget may span several :func:`time_rounds` calls (batches of one walk); once stopped, it stays
    stopped. ``stopped``: (group of the operation it stopped at, seconds of one call of it, why)."""

    max_call_s: float | None = None
    max_total_s: float | None = None
    spent_s: float = 0.0  # projected seconds of the operations kept so far
    kept: int = 0
    stopped: tuple[int, float, str] | None = None
    # the group of the walk's first operation, kept whatever it costs; None once another group came
    # (group ids may repeat across time_rounds calls)
    first_group: int | None = None

    def call_limit_s(self, group: int) -> float | None:
        """Seconds of one call past which an operation of ``group`` is not warmed up further (None: none)."""
        if self.stopped is not None or not self.kept or group == self.first_group:
            return None
        return self.max_call_s

    def admit(self, group: int, single_s: float, projected_s: float) -> bool:
        """Keep an operation whose call takes ``single_s`` and whose timing costs ``projected_s`` in all?"""
        if self.stopped is not None:
            return False
        if not self.kept or group == self.first_group:  # the first group: kept whatever it costs
            if not self.kept:
                self.first_group = group
            self.spent_s += projected_s
            self.kept += 1
            return True
        self.first_group = None
        if self.max_call_s is not None and single_s > self.max_call_s:
            self.stopped = (group, single_s, f"one call took {single_s:.3g} s, over the {self.max_call_s:g} s a call "
                                              "budget")
            return False
        if self.max_total_s is not None and self.spent_s + projected_s > self.max_total_s:
            self.stopped = (group, single_s, f"timing it would take the table past its {self.max_total_s:.3g} s "
                                              "budget")
            return False
        self.spent_s += projected_s
        self.kept += 1
        return True


def _calls_for(fn: Callable[[], object], device: torch.device, warmup: int, min_time_s: float,
               max_calls_per_trial: int, at_least_one: bool = False,
               stop_above_s: float | None = None) -> tuple[int, float, float]:
    """Warm ``fn`` up (caches, allocator, kernel selection, lazy initialisation) and size its inner
    loop so a trial lasts at least ``min_time_s``. Returns (calls per trial, seconds of one call,
    seconds spent here); ``at_least_one``: time one warm-up call even when ``warmup`` is 0;
    ``stop_above_s``: return once two calls took longer (a budget will not keep it; the second
    confirms that the first's time was not a one-off cost)."""
    single, spent = math.inf, 0.0
    # min of 2+: one hiccup must not size the loop
    warm = max(warmup, 2 if min_time_s > 0 else 0, 1 if at_least_one else 0)
    for i in range(max(warm, 2 if stop_above_s is not None else 0)):
        if i >= warm and (stop_above_s is None or single <= stop_above_s):
            break  # warmed up: a call past the warm-ups only confirms a slow first one
        t = _time_calls(fn, 1, device)
        single, spent = min(single, t), spent + t
        if stop_above_s is not None and i >= 1 and single > stop_above_s:
            return 1, single, spent
    calls = 1
    if min_time_s > 0 and math.isfinite(single):
        calls = max(1, min(max_calls_per_trial, math.ceil(min_time_s / max(single, 1e-9))))
        # one timed calibration trial at that count: the first estimate may include one-off costs
        if calls > 1:
            t = _time_calls(fn, calls, device)
            per, spent = t / calls, spent + t
            single = min(single, per)
            calls = max(1, min(max_calls_per_trial, math.ceil(min_time_s / max(per, 1e-9))))
    return calls, single, spent


def _hold_for(fn: Callable[[], object], calls: int, device: torch.device) -> tuple[int, float]:
    """(calls per trial, GPU hold before each) for a warmed-up ``fn`` sized to ``calls`` calls a trial:
    ``(calls, 0)`` off CUDA and where the GPU keeps ahead of the host; else at most
    :data:`HOLD_MAX_CALLS` calls behind a hold, unless the host blocks even behind one (``fn``
    synchronises), which no hold can help."""
    if device.type != "cuda" or not hasattr(torch.cuda, "_sleep"):
        return calls, 0.0
    gpu_s, host_s, _ = _time_cuda(fn, calls, device, 0.0)
    held_calls = min(calls, HOLD_MAX_CALLS)
    hold = hold_seconds(held_calls, host_s / calls, gpu_s / calls)
    if hold == 0.0:
        return calls, 0.0
    _, host_s, held_s = _time_cuda(fn, held_calls, device, hold)
    if host_s > held_s:  # the host waited for the GPU behind the hold: fn synchronises
        return calls, 0.0
    HOLD_STATS["held"] += 1
    return held_calls, hold


def time_fn(
    fn: Callable[[], object],
    *,
    device: torch.device,
    warmup: int = 2,
    trials: int = 5,
    min_time_s: float = 0.0,
    max_calls_per_trial: int = 100_000,
    hold: bool = True,
) -> TimingResult:
    """Time ``fn()`` on ``device``: ``warmup`` untimed calls, then ``trials`` timed trials.

    Each trial repeats ``fn`` ``calls`` times, with ``calls`` chosen (from the warm-up timings) so a
    trial lasts at least ``min_time_s``; the per-call time of a trial is its time / ``calls``.
    Returns the median per-call time over trials, their inter-quartile range and the statistic a
    profile records (``estimate_s``: the fastest trial on a CPU, :func:`estimate`). ``hold=False``:
    never hold the GPU (a link's latency is part of what is measured).
    """
    result = time_rounds([fn], device=device, warmup=warmup, trials=trials, min_time_s=min_time_s,
                         max_calls_per_trial=max_calls_per_trial, hold=hold)[0]
    assert result is not None  # no budget: every operation is timed
    return result


def time_rounds(
    fns: list[Callable[[], object]],
    *,
    device: torch.device,
    warmup: int = 2,
    trials: int = 5,
    min_time_s: float = 0.0,
    max_calls_per_trial: int = 100_000,
    on_round: Callable[[int], None] | None = None,
    budget: Budget | None = None,
    groups: list[int] | None = None,
    hold: bool = True,
) -> list[TimingResult | None]:
    """Time several operations as :func:`time_fn` times one, but in rounds: each is warmed up and
    sized first, then round ``r`` times one trial of every operation in turn, ``trials`` rounds.

    A machine whose speed moves over seconds (a shared VM: its neighbours' load, frequency) then
    spreads each operation's trials over the whole measurement instead of one moment of it, so each
    operation's trials see the same mix of fast and slow moments (and its fastest, on a CPU, the
    same quiet ones), and shapes measured minutes apart
    (a profile, then a check of it) compare like with like. ``on_round(r)`` is called after round ``r``.

    With a ``budget`` the operations are taken to come in order of cost, and the walk stops where the
    budget says (:class:`Budget`): those operations get None. ``groups`` (one id per operation,
    consecutive operations sharing one, such as an attention forward and its backward) stand or fall
    together: a stop inside a group drops its earlier operations too; the budget records the group.
    On CUDA an operation the host launches more slowly than the GPU runs it is timed behind a hold
    (:func:`_hold_for`), unless ``hold`` is False.
    """
    if trials < 1:
        raise ValueError(f"trials={trials} must be at least 1")
    device = torch.device(device)
    groups = groups if groups is not None else list(range(len(fns)))
    calls: list[int | None] = []
    for i, fn in enumerate(fns):
        if budget is not None and budget.stopped is not None:
            calls.append(None)
            continue
        n, single, spent = _calls_for(fn, device, warmup, min_time_s, max_calls_per_trial, budget is not None,
                                      budget.call_limit_s(groups[i]) if budget is not None else None)
        if budget is not None and not budget.admit(groups[i], single, spent + trials * n * single):
            calls.append(None)
            for j in range(i - 1, -1, -1):  # the stopped group's earlier operations go too
                if groups[j] != groups[i]:
                    break
                calls[j] = None
            continue
        calls.append(n)
    holds = [0.0] * len(fns)
    if hold:
        for i, (fn, n) in enumerate(zip(fns, calls)):
            if n is not None:
                calls[i], holds[i] = _hold_for(fn, n, device)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(trials):
        for i, fn in enumerate(fns):
            if calls[i] is not None:
                times[i].append(_time_calls(fn, calls[i], device, holds[i]) / calls[i])
        if on_round is not None:
            on_round(r)
    return [None if c is None else TimingResult(median_s=statistics.median(t), iqr_s=_iqr(t), trials=t,
                                                calls_per_trial=c, device_type=device.type)
            for t, c in zip(times, calls)]


def host_sync_s(device: torch.device, reps: int = 50, size: int = 4096) -> float | None:
    """GPU idle time of one device->host synchronisation (``Assumptions.moe_host_sync_s``: a dropless MoE
    dispatcher copies its tokens-per-expert counts to the host and waits). Back-to-back 16-bit GEMMs of
    ``size``³ (longer than a launch, so the queue never runs dry by itself) with and without a
    ``.tolist()`` of a 128-count tensor after each: (with - without) / ``reps``, the median of three
    rounds. None on a CPU, which has no device to idle."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    # before Ampere bf16 is only emulated (is_bf16_supported() says True there): time fp16 on V100 and T4
    dtype = torch.float16 if torch.cuda.get_device_capability(device)[0] < 8 else torch.bfloat16
    a = torch.randn(size, size, device=device, dtype=dtype)
    counts = torch.zeros(128, dtype=torch.int64, device=device)

    def loop(wait: bool) -> float:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ a
            counts.add_(1)
            if wait:
                counts.tolist()
        sync(device)
        return time.perf_counter() - t0

    loop(True), loop(False)  # warm-up: kernels chosen, clocks up
    rounds = [(loop(True) - loop(False)) / reps for _ in range(3)]
    return max(statistics.median(rounds), 0.0)
