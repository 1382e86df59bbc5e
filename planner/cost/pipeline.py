"""Pipeline schedules, one row each (:data:`SCHEDULES`): how per-stage forward/backward times compose into
one step, how many micro-batches a stage holds, and what runs it.

For stage times ``t_i = f_i + b_i`` (one micro-batch, all of the stage's chunks), ``m``
micro-batches, ``p`` stages and ``v`` virtual stages per rank, the step is ``m·max t_i + bubble``:

- GPipe and 1F1B: bubble ``Σ t_i - max t_i`` — for equal stages ``(p - 1)·t``, ``(p - 1)/m`` of the work
  (Narayanan et al. 2021, §2.2).
- Interleaved 1F1B: bubble ``(Σ t_i - max t_i)/v`` — for equal stages ``(p-1)·t/v``.
- Zero-bubble ZB-H1 (Qi et al. 2024): the weight-gradient half of backward ``W`` fills the cool-down,
  bubble ``(p - 1)(F + B - W)``; with ``B = W = b/2`` that is ``Σ_{i≠max} f_i``.
- Zero-bubble V (ZB-V, Qi et al. 2024 §6) and DualPipeV (DeepSeek-AI 2024, the "cut-in-half" DualPipe of
  github.com/deepseek-ai/DualPipe) hold two chunks per rank in a V: rank ``r`` runs chunks ``r`` and
  ``2p-1-r``, so rank 0 holds both the embedding and the head. Per chunk ``F = f/2``, full backward
  ``b/2`` split evenly into input and weight steps ``B = W = b/4``. ZB-V: bubble ``(p - 1)(F + B - 2W)``,
  zero when ``F = B = W`` — per rank ``max(0, f/2 - b/4) = max(0, (3f - t)/4)`` summed over the ranks
  but the slowest. DualPipeV: ``(p - 1)(F&B + B_full - 3W)`` (DualPipe's table with ``PP = 2p`` chunks
  in line); torch's schedule runs the overlapped ``F&B`` one after the other unless a model registers
  its own overlap, so ``F&B = F + B_full`` and the bubble is ``(f + t)/4`` per rank but the slowest.
  DualPipeV's advantage, hiding the expert all-to-all behind the other micro-batch's compute, is the
  plan's ``ep_comm_overlap``, priced apart; without it DualPipeV is never faster than ZB-V.

Micro-batches whose activations stage ``i`` holds at its peak, in whole-stage units: GPipe all ``m``;
1F1B and zero-bubble (ZB-H1) ``p - i``; interleaved 1F1B: Megatron's warm-up runs ``(v-1)·p + 2·(p-1-i)``
chunk forwards before the first backward, and each chunk holds ``1/v`` of the stage's activations, so with
the chunk in progress ``((v-1)p + 2(p-1-i) + 1)/v = p + (p - 1 - 2i)/v``; stage 0 holds
``p·(1 + (p-1)/(p·v))`` (Korthikanti et al. §3); ZB-V ``p`` on every rank (its peak equals 1F1B's
first stage, Qi et al. §6: 2p half-size chunks); DualPipeV ``PP + 1`` chunks with ``PP = 2p``, i.e.
``p + 1/2`` (DualPipe's table). Each capped at ``m``.

**Placement** (:func:`rank_chunks`, the one home the search, the predictor, the exports and the executor
read): looped schedules put chunk ``c`` on rank ``c % p``; the V schedules put chunks ``r`` and ``2p-1-r``
on rank ``r`` (torch's ``style="v"``). :func:`head_rank` is the rank holding the last chunk.

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

from planner.contracts import ParallelLayout, Schedule


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


def _slowest(totals: list[float], forward_s: list[float]) -> int:
    return max(range(len(totals)), key=lambda i: (totals[i], forward_s[i]))


def _bubble_zbv(totals: list[float], forward_s: list[float], virtual: int) -> float:
    i_max = _slowest(totals, forward_s)
    return sum(max(0.0, (3 * f - t) / 4) for i, (t, f) in enumerate(zip(totals, forward_s)) if i != i_max)


def _bubble_dualpipev(totals: list[float], forward_s: list[float], virtual: int) -> float:
    i_max = _slowest(totals, forward_s)
    return sum((f + t) / 4 for i, (t, f) in enumerate(zip(totals, forward_s)) if i != i_max)


def _two_sequential(t0: float, t1: float, f0: float, f1: float, m: int, v: int) -> float:
    top = max(t0, t1)
    return (m - 1) * top + t0 + t1


def _two_interleaved(t0: float, t1: float, f0: float, f1: float, m: int, v: int) -> float:
    top = max(t0, t1)
    return m * top + (t0 + t1 - top) / v


def _two_zero(t0: float, t1: float, f0: float, f1: float, m: int, v: int) -> float:
    # m·T* + Σ_{i≠i*} f_i >= m·max T + the smaller forward (the slowest rank is not known from bounds)
    return m * max(t0, t1) + min(f0, f1)


def _two_zbv(t0: float, t1: float, f0: float, f1: float, m: int, v: int) -> float:
    return m * max(t0, t1)  # the bubble term is not monotone in the bounds: 0 stands in


def _two_dualpipev(t0: float, t1: float, f0: float, f1: float, m: int, v: int) -> float:
    # the other rank's (f + t)/4 grows with its time and forward: the smaller of the two bounds it
    return m * max(t0, t1) + min(f0 + t0, f1 + t1) / 4


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


def _work_zbv(w: PipeWork) -> float:
    return w.m * w.minmax


def _work_dualpipev(w: PipeWork) -> float:
    # m·T* + Σ_{i≠i*} (f_i + t_i)/4 >= m·T* + (total - T*)/4, increasing in T*
    return (w.m - 0.25) * w.minmax + w.total / 4


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


def _star(mdl, T, t_max, terms, cap):  # noqa: ANN001, ANN202, N803
    """A variable equal to ``terms[r*]`` of one rank ``r*`` at ``t_max`` (the bubbles leave out the slowest
    rank's term); ``cap`` a redundant upper bound that keeps the LP relaxation from running it to the domain's
    end, and ``star <= Σ terms`` (redundant too) keeps the relaxed bubble from going negative: without it one
    CP-SAT worker stopped at FEASIBLE after its 1 s on Llama 3 8B's pp2 ZeRO-2 leaves it proves in 0.01 s with."""
    z = [mdl.NewBoolVar(f"z{r}") for r in range(len(T))]
    mdl.AddExactlyOne(z)
    star = mdl.NewIntVar(0, cap[1], "star")
    for r, zr in enumerate(z):
        mdl.Add(T[r] >= t_max).OnlyEnforceIf(zr)
        mdl.Add(star <= terms[r]).OnlyEnforceIf(zr)
    mdl.Add(star <= cap[0])
    mdl.Add(star <= sum(terms))
    return star


def _cpsat_zbv(mdl, T, F, t_max, tail, m: int, v: int, big: int):  # noqa: ANN001, ANN202, N803
    # 4x: Σ_r u_r - u_{r*} with u_r >= max(0, 3F_r - T_r); at the optimum u_r <= 2 T_r <= 2 t_max
    u = [mdl.NewIntVar(0, 3 * big, f"u{r}") for r in range(len(T))]
    for r, ur in enumerate(u):
        mdl.Add(ur >= 3 * F[r] - T[r])
    star = _star(mdl, T, t_max, u, (2 * t_max, 3 * big))
    return 4 * m * t_max + sum(u) - star + 4 * tail, 4


def _cpsat_dualpipev(mdl, T, F, t_max, tail, m: int, v: int, big: int):  # noqa: ANN001, ANN202, N803
    # 4x: Σ_r (F_r + T_r) - (F* + T*) with T* = t_max (the left-out rank is at t_max), so only F* is chosen
    f_star = _star(mdl, T, t_max, list(F), (t_max, big))
    mdl.Add(sum(T) >= t_max)  # redundant (t_max is one rank's time at the optimum): the relaxed Σ_{r≠r*} T_r >= 0
    return 4 * m * t_max + sum(F) + sum(T) - t_max - f_star + 4 * tail, 4


def _in_flight_all(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(m)


def _in_flight_warmup(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(min(m, pp - stage))


def _in_flight_interleaved(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(min(m, pp + (pp - 1 - 2 * stage) / virtual))


def _in_flight_v(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(min(m, pp))


def _in_flight_dualpipev(stage: int, pp: int, m: int, virtual: int) -> float:
    return float(min(m, pp + 0.5))


def _looped(rank: int, pp: int, virtual: int) -> list[int]:
    return list(range(rank, pp * virtual, pp))


def _v_shape(rank: int, pp: int, virtual: int) -> list[int]:
    return [rank, 2 * pp - 1 - rank]


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
    depth: int  # chunks per rank when not ``virtual`` (the plan's virtual_stages)
    placement: Callable[[int, int, int], list[int]]  # (rank, pp, v) -> its chunks, in pipeline order
    split_backward: bool  # weight gradients in their own step, after the input gradients (zero-bubble)
    dominated_by: Schedule | None  # a schedule with no slower step and no more in flight: searched instead
    torch_class: str  # torch.distributed.pipelining's schedule class the executor runs
    looped: bool  # that class takes every stage of the rank (several chunks), not one
    torchtitan: str | None  # torchtitan's --parallelism.pipeline_parallel_schedule (None: not exported)
    min_micro_batches: Callable[[int], int] = lambda pp: 1  # per pipeline, that torch's class accepts

    @property
    def v_shape(self) -> bool:
        """Two chunks per rank in a V (ZB-V, DualPipeV): rank 0 holds the first and the last."""
        return self.placement is _v_shape


_SEQUENTIAL = {"bubble": _bubble_sequential, "two_rank_floor": _two_sequential, "max_factor": lambda m: m - 1,
               "work_floor": _work_sequential, "cpsat": _cpsat_sequential}
_ONE_CHUNK = {"virtual": False, "depth": 1, "placement": _looped}
_V = {"virtual": False, "depth": 2, "placement": _v_shape, "split_backward": True, "looped": True}

SCHEDULES: dict[Schedule, ScheduleFacts] = {
    Schedule.gpipe: ScheduleFacts(**_SEQUENTIAL, **_ONE_CHUNK, in_flight=_in_flight_all, split_backward=False,
                                  dominated_by=Schedule.one_f_one_b, torch_class="ScheduleGPipe", looped=False,
                                  torchtitan="GPipe"),
    Schedule.one_f_one_b: ScheduleFacts(**_SEQUENTIAL, **_ONE_CHUNK, in_flight=_in_flight_warmup, split_backward=False,
                                        dominated_by=None, torch_class="Schedule1F1B", looped=False, torchtitan="1F1B",
                                        min_micro_batches=lambda pp: pp),
    Schedule.interleaved_1f1b: ScheduleFacts(
        _bubble_interleaved, _two_interleaved, lambda m: m, _work_interleaved, _cpsat_interleaved,
        _in_flight_interleaved, virtual=True, depth=1, placement=_looped, split_backward=False, dominated_by=None,
        torch_class="ScheduleInterleaved1F1B", looped=True, torchtitan="Interleaved1F1B"),
    Schedule.zero_bubble: ScheduleFacts(
        _bubble_zero, _two_zero, lambda m: m, _work_zero, _cpsat_zero, _in_flight_warmup, **_ONE_CHUNK,
        split_backward=True, dominated_by=None, torch_class="ScheduleInterleavedZeroBubble", looped=True,
        torchtitan=None),
    Schedule.zero_bubble_v: ScheduleFacts(
        _bubble_zbv, _two_zbv, lambda m: m, _work_zbv, _cpsat_zbv, _in_flight_v, **_V, dominated_by=None,
        torch_class="ScheduleZBVZeroBubble", torchtitan="ZBVZeroBubble"),
    Schedule.dualpipe_v: ScheduleFacts(
        _bubble_dualpipev, _two_dualpipev, lambda m: m, _work_dualpipev, _cpsat_dualpipev, _in_flight_dualpipev,
        **_V, dominated_by=Schedule.zero_bubble_v, torch_class="ScheduleDualPipeV", torchtitan="DualPipeV",
        min_micro_batches=lambda pp: 2 * pp),  # torch: "at least as many microbatches as stages"
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


def rank_chunks(schedule: Schedule, pp: int, virtual: int, rank: int) -> list[int]:
    """The chunk (pipeline stage) indices pipeline rank ``rank`` runs, in pipeline order (module doc)."""
    return SCHEDULES[schedule].placement(rank, pp, virtual)


def rank_layers(layout: ParallelLayout, num_layers: int) -> list[list[int]]:
    """The transformer layers each pipeline rank holds, in its chunks' order: the layout's split
    (``layers_per_stage``, else :func:`planner.cost.checks.default_layer_split`) over :func:`rank_chunks`."""
    from planner.cost.checks import default_layer_split

    p, v = layout.pp, layout.virtual_stages
    counts = layout.layers_per_stage or default_layer_split(num_layers, p * v)
    starts = [sum(counts[:i]) for i in range(p * v)]
    return [[i for chunk in rank_chunks(layout.schedule, p, v, rank) for i in range(starts[chunk],
                                                                                  starts[chunk] + counts[chunk])]
            for rank in range(p)]


def head_rank(schedule: Schedule, pp: int, virtual: int) -> int:
    """The pipeline rank holding the last chunk (the final norm, the head and the loss)."""
    last = pp * virtual - 1
    return next(r for r in range(pp) if last in rank_chunks(schedule, pp, virtual, r))


def microbatches_in_flight(schedule: Schedule, stage: int, pp: int, num_micro_batches: int, virtual: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak, in whole-stage units (module doc)."""
    return SCHEDULES[schedule].in_flight(stage, pp, num_micro_batches, virtual)
