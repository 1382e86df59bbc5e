"""Pipeline schedules, one row each (:data:`SCHEDULES`): how per-stage forward/backward times compose into
one step, how many micro-batches a stage holds, and what runs it.

For stage times ``t_i = f_i + b_i`` (one micro-batch, all of the stage's chunks), ``m``
micro-batches, ``p`` stages and ``v`` virtual stages per rank, the step is ``m·max t_i + bubble``:

- GPipe and 1F1B: bubble ``Σ t_i - max t_i`` — for equal stages ``(p - 1)·t``, ``(p - 1)/m`` of the work
  (Narayanan et al. 2021, §2.2).
- Interleaved 1F1B: bubble ``(Σ t_i - max t_i)/v`` — for equal stages ``(p-1)·t/v``.
- Zero-bubble ZB-H1 (Qi et al. 2024): the weight-gradient half of backward ``W`` fills the cool-down,
  bubble ``(p - 1)(F + B - W)``; with ``B = W = b/2`` that is ``Σ_{i≠max} f_i``.

Micro-batches whose activations stage ``i`` holds at its peak, in whole-stage units: GPipe all ``m``;
1F1B and zero-bubble (ZB-H1) ``p - i``; interleaved 1F1B: Megatron's warm-up runs ``(v-1)·p + 2·(p-1-i)``
chunk forwards before the first backward, and each chunk holds ``1/v`` of the stage's activations, so with
the chunk in progress ``((v-1)p + 2(p-1-i) + 1)/v = p + (p - 1 - 2i)/v``; stage 0 holds
``p·(1 + (p-1)/(p·v))`` (Korthikanti et al. §3). Each capped at ``m``.

A new schedule is a row here, its objective in the CP-SAT model (:mod:`planner.search.cpsat`) and its
lower bound in the search (:func:`planner.search.bound.schedule_bound`), and a refusal row in each target's
table (:mod:`planner.targets`) that cannot run it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.contracts import Schedule


def _bubble_sequential(totals: list[float], forward_s: list[float], virtual: int) -> float:
    return sum(totals) - max(totals)


def _bubble_interleaved(totals: list[float], forward_s: list[float], virtual: int) -> float:
    return (sum(totals) - max(totals)) / virtual


def _bubble_zero(totals: list[float], forward_s: list[float], virtual: int) -> float:
    # the slowest stage; among equally slow ones the one whose forward is longest (its forwards are the
    # ones that do not fill another stage's bubble)
    i_max = max(range(len(totals)), key=lambda i: (totals[i], forward_s[i]))
    return sum(f for i, f in enumerate(forward_s) if i != i_max)


def _in_flight_all(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(m)


def _in_flight_warmup(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(min(m, pp - stage))


def _in_flight_interleaved(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(min(m, pp + (pp - 1 - 2 * stage) / virtual))


@dataclass(frozen=True)
class ScheduleFacts:
    """One pipeline schedule: its bubble and in-flight formulas (above), and the names that run it."""

    bubble: Callable[[list[float], list[float], int], float]  # (stage totals, stage forwards, v) -> seconds
    in_flight: Callable[[int, int, int, int], float]  # (stage, pp, m, v) -> micro-batches held at the peak
    torch_class: str  # torch.distributed.pipelining's schedule class the executor runs
    looped: bool  # that class takes every stage of the rank (several chunks), not one
    torchtitan: str | None  # torchtitan's --parallelism.pipeline_parallel_schedule (None: not exported)


SCHEDULES: dict[Schedule, ScheduleFacts] = {
    Schedule.gpipe: ScheduleFacts(_bubble_sequential, _in_flight_all, "ScheduleGPipe", False, "GPipe"),
    Schedule.one_f_one_b: ScheduleFacts(_bubble_sequential, _in_flight_warmup, "Schedule1F1B", False, "1F1B"),
    Schedule.interleaved_1f1b: ScheduleFacts(_bubble_interleaved, _in_flight_interleaved, "ScheduleInterleaved1F1B",
                                             True, "Interleaved1F1B"),
    Schedule.zero_bubble: ScheduleFacts(_bubble_zero, _in_flight_warmup, "ScheduleInterleavedZeroBubble", True, None),
}


def pipeline_time_s(
    schedule: Schedule, forward_s: list[float], backward_s: list[float], num_micro_batches: int, virtual: int = 1
) -> tuple[float, float]:
    """(time of the forward/backward phase of one step, bubble time) for the stage times given."""
    totals = [f + b for f, b in zip(forward_s, backward_s)]
    critical = num_micro_batches * max(totals)
    if len(totals) == 1:
        return critical, 0.0
    bubble = SCHEDULES[schedule].bubble(totals, forward_s, virtual)
    return critical + bubble, bubble


def microbatches_in_flight(schedule: Schedule, stage: int, pp: int, num_micro_batches: int, virtual: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak, in whole-stage units (module doc)."""
    return SCHEDULES[schedule].in_flight(stage, pp, num_micro_batches, virtual)
