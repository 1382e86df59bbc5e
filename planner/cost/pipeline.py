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

Each schedule's step formula has four forms, all in its row: the exact one above (``bubble``); a lower
bound from two ranks' lower-bounded times (``two_rank_floor``, the search's split bound); a lower bound
from the ranks' summed work and the slowest rank (``work_floor``, the search's leaf bound,
:class:`PipeWork`); and the CP-SAT objective (``cpsat``, :mod:`planner.search.cpsat`, built with the
model's own methods: this module does not import OR-Tools). A new schedule is one row here (and a member
of :class:`~planner.contracts.Schedule`); a target that cannot run it refuses it in its own table
(:mod:`planner.targets`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.contracts import Schedule


@dataclass(frozen=True)
class PipeWork:
    """What the search knows of a candidate's ranks before their split (one micro-batch): ``minmax`` a lower
    bound of the slowest rank's ``f + b``; ``total`` the ranks' summed ``f + b`` with their per-micro-batch
    collectives, ``fwd`` the summed forwards and ``compute`` the summed forward + backward work without
    those collectives; ``rho_min``/``rho`` the least and largest forward share of any block, embedding or
    head; ``send_s`` one pipeline send."""

    m: int
    p: int
    v: int
    minmax: float
    total: float
    fwd: float
    compute: float
    rho_min: float
    rho: float
    send_s: float


def _bubble_sequential(totals: list[float], forward_s: list[float], virtual: int) -> float:
    return sum(totals) - max(totals)


def _bubble_interleaved(totals: list[float], forward_s: list[float], virtual: int) -> float:
    return (sum(totals) - max(totals)) / virtual


def _bubble_zero(totals: list[float], forward_s: list[float], virtual: int) -> float:
    # the slowest stage; among equally slow ones the one whose forward is longest (its forwards are the
    # ones that do not fill another stage's bubble)
    i_max = max(range(len(totals)), key=lambda i: (totals[i], forward_s[i]))
    return sum(f for i, f in enumerate(forward_s) if i != i_max)


def _two_sequential(t0: float, t1: float, f0: float, f1: float, m: int, v: int) -> float:
    top = max(t0, t1)
    return (m - 1) * top + t0 + t1


def _two_interleaved(t0: float, t1: float, f0: float, f1: float, m: int, v: int) -> float:
    top = max(t0, t1)
    return m * top + (t0 + t1 - top) / v


def _two_zero(t0: float, t1: float, f0: float, f1: float, m: int, v: int) -> float:
    # m·T* + Σ_{i≠i*} f_i >= m·max T + the smaller forward (the slowest rank is not known from bounds)
    return m * max(t0, t1) + min(f0, f1)


def _work_sequential(w: PipeWork) -> float:
    return (w.m - 1) * w.minmax + w.total


def _work_interleaved(w: PipeWork) -> float:
    return (w.m - 1 / w.v) * w.minmax + w.total / w.v


def _work_zero(w: PipeWork) -> float:
    # m·T* + Σ_{i≠i*} f_i: every other rank's forward is at least the smallest forward share ρ_min of its
    # compute (recompute included), which sums to at least compute - T*; the expression increases with T*
    # (m >= 1 > ρ_min), so the lower bound of T* may stand in
    others = w.m * w.minmax + w.rho_min * max(0.0, w.compute - w.minmax)
    # the slowest rank's forward compute is at most ρ of its compute (recompute only lowers it), which is
    # at most T* - 2vt: f* = fc* + vt + g* with g* its exposed forward collective. Every rank's forward
    # holds its own g_i, so Σ_{i≠i*} f_i = Σf - f* >= fwd + g* - f* = fwd - fc* - vt >= fwd - ρ(T* - 2vt) - vt,
    # and m·T* + Σ_{i≠i*} f_i >= (m - ρ)·T* + fwd + (2ρ - 1)·vt, which grows with T* (m >= 1 > ρ): with or
    # without collectives in the stages
    return max((w.m - w.rho) * w.minmax + w.fwd + (2 * w.rho - 1) * w.v * w.send_s, others)


# CP-SAT objectives: ``T``/``F`` the ranks' time and forward variables, ``t_max`` a variable at least every
# ``T``, ``tail`` the slowest tail's, ``big`` the variables' domain end; the objective is the step x scale
def _cpsat_sequential(mdl, T, F, t_max, tail, m: int, v: int, big: int):  # noqa: ANN001, ANN202, N803
    return (m - 1) * t_max + sum(T) + tail, 1


def _cpsat_interleaved(mdl, T, F, t_max, tail, m: int, v: int, big: int):  # noqa: ANN001, ANN202, N803
    return (v * m - 1) * t_max + sum(T) + v * tail, v


def _cpsat_zero(mdl, T, F, t_max, tail, m: int, v: int, big: int):  # noqa: ANN001, ANN202, N803
    z = [mdl.NewBoolVar(f"z{r}") for r in range(len(T))]
    mdl.AddExactlyOne(z)
    f_star = mdl.NewIntVar(0, big, "Fstar")
    for r, zr in enumerate(z):
        mdl.Add(T[r] >= t_max).OnlyEnforceIf(zr)
        mdl.Add(f_star <= F[r]).OnlyEnforceIf(zr)
    # redundant (F* is the forward of a rank at t_max, and a rank's forward is part of its time), but
    # without it the LP relaxation lets F* run to its domain's end and the objective bound goes negative:
    # the solver then proves optimality by search alone (0.25-0.5 s for DeepSeek-V3's pp32 leaves; 0.06 s)
    mdl.Add(f_star <= t_max)
    return m * t_max + sum(F) - f_star + tail, 1


def _in_flight_all(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(m)


def _in_flight_warmup(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(min(m, pp - stage))


def _in_flight_interleaved(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(min(m, pp + (pp - 1 - 2 * stage) / virtual))


@dataclass(frozen=True)
class ScheduleFacts:
    """One pipeline schedule: its step formula in four forms (module doc), micro-batches in flight, how the
    search treats it, and the names that run it."""

    bubble: Callable[[list[float], list[float], int], float]  # (stage totals, stage forwards, v) -> seconds
    two_rank_floor: Callable[[float, float, float, float, int, int], float]  # (t0, t1, f0, f1, m, v) -> pipeline
    max_factor: Callable[[int], int]  # m -> the pipeline term is at least this many times the slowest rank
    work_floor: Callable[[PipeWork], float]  # lower bound of the pipeline phase
    cpsat: Callable  # (model, T, F, t_max, tail, m, v, big) -> (objective, scale): the step x scale
    in_flight: Callable[[int, int, int, int], float]  # (stage, pp, m, v) -> micro-batches held at the peak
    virtual: bool  # the search picks a depth v >= 2 of chunks per rank (micro-batches a multiple of pp)
    dominated_by: Schedule | None  # a schedule with the same step and no more in flight: searched instead
    torch_class: str  # torch.distributed.pipelining's schedule class the executor runs
    looped: bool  # that class takes every stage of the rank (several chunks), not one
    torchtitan: str | None  # torchtitan's --parallelism.pipeline_parallel_schedule (None: not exported)


_SEQUENTIAL = {"bubble": _bubble_sequential, "two_rank_floor": _two_sequential, "max_factor": lambda m: m - 1,
               "work_floor": _work_sequential, "cpsat": _cpsat_sequential}

SCHEDULES: dict[Schedule, ScheduleFacts] = {
    Schedule.gpipe: ScheduleFacts(**_SEQUENTIAL, in_flight=_in_flight_all, virtual=False,
                                  dominated_by=Schedule.one_f_one_b, torch_class="ScheduleGPipe", looped=False,
                                  torchtitan="GPipe"),
    Schedule.one_f_one_b: ScheduleFacts(**_SEQUENTIAL, in_flight=_in_flight_warmup, virtual=False, dominated_by=None,
                                        torch_class="Schedule1F1B", looped=False, torchtitan="1F1B"),
    Schedule.interleaved_1f1b: ScheduleFacts(
        _bubble_interleaved, _two_interleaved, lambda m: m, _work_interleaved, _cpsat_interleaved,
        _in_flight_interleaved, virtual=True, dominated_by=None, torch_class="ScheduleInterleaved1F1B", looped=True,
        torchtitan="Interleaved1F1B"),
    Schedule.zero_bubble: ScheduleFacts(
        _bubble_zero, _two_zero, lambda m: m, _work_zero, _cpsat_zero, _in_flight_warmup, virtual=False,
        dominated_by=None, torch_class="ScheduleInterleavedZeroBubble", looped=True, torchtitan=None),
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
