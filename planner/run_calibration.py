"""Calibrate a cluster's profile from its own runs: the more a cluster trains, the closer its predictions.

Each run (a plan and the :class:`~planner.contracts.RunReport` the executor wrote for it) measured its step by
term (``RunReport.breakdown``, :data:`~planner.contracts.report.STEP_TERMS`); the plan's layout predicted on
the uncalibrated profile gives the same terms (``Prediction.terms``). Per term, the factor is the least-squares
fit of measured on predicted seconds over the runs (:func:`fit_factors`), shrunk toward the runs' whole-step
ratio by :data:`PRIOR_RUNS` runs' worth (a term seen in one run does not decide alone: over-fitting guard) and
clipped to :data:`~planner.contracts.cluster.FACTOR_BOUNDS` (a term off by more is a model error to fix, not to
tune away); its spread is the runs' least and largest ratio. The measured terms are the profiled steps' shares
of the step times the run's median (unprofiled) step time. On a GPU the device's idle time is fitted as the
host's time per kernel instead (:func:`fit_host`); every run's peak memory beyond the prediction as one offset
(:func:`fit_memory`).

The calibrated profile is a new profile carrying the factors (``ClusterProfile.calibration``); the cost model
multiplies each operator class, collective kind, pipeline send, optimizer step and kernel launch by its
term's factor (``ClusterProfile.term_factor``), so the search and ``predict`` both use them. The fit says how
far to trust it: the median step-time error over the runs before and after, and leave-one-run-out (each run
predicted by the factors of the others), the figure that holds for a plan not yet run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from planner.contracts import CheckpointCost, CheckpointPoint, ClusterProfile, Plan, Prediction, RunReport
from planner.contracts.cluster import FACTOR_BOUNDS, RunCalibration, TermFactor
from planner.contracts.report import COMM_TERMS, STEP_TERMS
from planner.cost.goodput import checkpoint_sizes, fit_checkpoint_cost, written_bytes
from planner.errors import AutoparError


@dataclass(frozen=True)
class CalibrationRun:
    """One run to fit on: its name (the service's id or a file), the plan it ran and what it measured."""

    name: str
    plan: Plan
    report: RunReport


def measured_terms(report: RunReport, name: str = "") -> dict[str, float]:
    """Seconds per step by term. On a CPU the profiler slows every term alike: the ranks' mean profiled shares
    times the median (unprofiled) step time. On a GPU it slows the host only (the kernels take as long, the
    device idles longer): the device terms are the ranks' mean seconds as measured, and ``other`` (the device's
    idle time) is what the median step leaves beside them."""
    if not report.breakdown:
        where = f"runs[{name}].report.breakdown" if name else "report.breakdown"
        raise AutoparError(where, [], "run the plan again with --profile-steps 1 or more, or leave this run out",
                           problem="is empty: the run measured no step by term to calibrate on")
    mean = {t: statistics.fmean(b.terms.get(t, 0.0) for b in report.breakdown) for t in STEP_TERMS}
    if report.device != "cpu":
        busy = sum(v for t, v in mean.items() if t != "other")
        return {**mean, "other": max(0.0, report.median_step_time_s - busy)}
    step = statistics.fmean(b.step_s for b in report.breakdown)
    return {t: v / step * report.median_step_time_s for t, v in mean.items()}


def sized_for(run: CalibrationRun, profile: ClusterProfile) -> ClusterProfile:
    """``profile`` with as many nodes as ``run``'s plan used (a reference cluster describes any count); an error
    naming the run where its plan was made for another cluster, or a GPU count the profile cannot have."""
    plan = run.plan
    if plan.cluster != profile.name:
        raise AutoparError(f"runs[{run.name}].plan.cluster", plan.cluster, f"calibrate '{plan.cluster}' with its "
                           f"own runs, or leave this run out", problem=f"is not the profile's cluster '{profile.name}'")
    if plan.num_gpus == profile.num_gpus:
        return profile
    if profile.kind == "measured" or plan.num_gpus % profile.gpus_per_node:
        raise AutoparError(f"runs[{run.name}].plan.num_gpus", plan.num_gpus, "leave this run out, or calibrate the "
                           "profile it ran on", problem=f"cannot be priced on a profile of {profile.num_gpus} GPUs "
                           f"({profile.gpus_per_node} per node, {profile.kind})")
    return profile.with_nodes(plan.num_gpus // profile.gpus_per_node)


def usable(runs: Sequence[CalibrationRun], profile: ClusterProfile) -> tuple[list[CalibrationRun], list[str]]:
    """(the runs that can be fitted on ``profile``, the others each with why): a run needs a breakdown by term
    and a plan that :func:`sized_for` can price."""
    keep, out = [], []
    for run in runs:
        try:
            measured_terms(run.report, run.name)
            sized_for(run, profile)
        except AutoparError as exc:
            out.append(f"{run.name}: {exc.problem}")
            continue
        keep.append(run)
    return keep, out


def prediction(run: CalibrationRun, profile: ClusterProfile) -> Prediction:
    """``run``'s layout predicted on ``profile`` (:func:`sized_for` it)."""
    from planner.cost.predict import predict

    return predict(run.plan.model, run.plan.training, sized_for(run, profile), run.plan.layout, target=run.plan.target)


def predicted(run: CalibrationRun, profile: ClusterProfile) -> tuple[float, dict[str, float]]:
    """(step seconds, seconds by term) of ``run``'s layout predicted on ``profile``."""
    p = prediction(run, profile)
    return p.step_time_s, p.terms


PRIOR_RUNS = 3  # shrinkage: a term's own runs count against this many runs' worth of the step's overall ratio


def fit_factors(pairs: Sequence[tuple[dict[str, float], dict[str, float]]],
                skip: Sequence[str] = ()) -> dict[str, TermFactor]:
    """Per term (but ``skip``), the least-squares factor of the runs that predict it, ``sum(m p) / sum(p^2)`` over
    their (predicted, measured) seconds: the runs where the term weighs most in the step decide most, as they do
    in the step's error. Shrunk in log space toward the pairs' median whole-step ratio by :data:`PRIOR_RUNS`
    runs' worth (a term seen in one run moves a quarter of the way from the step's ratio to its own), clipped
    to :data:`FACTOR_BOUNDS`; its spread (``low``, ``high``) is the runs' own measured / predicted, clipped.
    Terms no run predicts are left out (factor 1)."""
    lo, hi = FACTOR_BOUNDS
    kept = [t for t in STEP_TERMS if t not in skip]
    sums = [(sum(p.get(t, 0.0) for t in kept), sum(m.get(t, 0.0) for t in kept)) for p, m in pairs]
    steps = [b / a for a, b in sums if a > 0 and b > 0]
    prior = math.log(statistics.median(steps)) if steps else 0.0
    out = {}
    for term in kept:
        seen = [(p[term], m.get(term, 0.0)) for p, m in pairs if p.get(term, 0) > 0]
        if not seen:
            continue
        ratios = [min(max(b / a, lo), hi) for a, b in seen]
        own = math.log(min(max(sum(a * b for a, b in seen) / sum(a * a for a, _ in seen), lo), hi))
        factor = math.exp((len(seen) * own + PRIOR_RUNS * prior) / (len(seen) + PRIOR_RUNS))
        out[term] = TermFactor(factor=min(max(factor, lo), hi), low=min(ratios), high=max(ratios), runs=len(seen))
    return out


HOST_BOUND_SHARE = 0.2  # a GPU run whose device sat idle this share of its step or more was waiting for its host


def fit_host(pairs: Sequence[tuple[dict[str, float], dict[str, float]]], kernel_overhead_s: float) -> float | None:
    """GPU runs: the host's seconds per kernel it launches, the median over the host-bound runs (the device idle,
    ``other``, :data:`HOST_BOUND_SHARE` of the step or more) of their measured step over their kernels (the
    uncalibrated prediction's ``other`` over ``kernel_overhead_s``): a host-bound step lasts as long as its host
    takes to launch it. None without a host-bound run (nothing says how slow the host is)."""
    if kernel_overhead_s <= 0:
        return None
    per_kernel = [_passes_s(m) / (p["other"] / kernel_overhead_s) for p, m in pairs
                  if p.get("other", 0) > 0 and _passes_s(m) > 0 and m["other"] >= HOST_BOUND_SHARE * sum(m.values())]
    return min(statistics.median(per_kernel), 1e-2) if per_kernel else None


def _passes_s(measured: dict[str, float]) -> float:
    """The measured step less what no pass launches (the optimizer step, communication, the pipeline's sends
    and bubble): the time a host-bound step's passes took to launch."""
    return sum(v for t, v in measured.items() if t not in (*COMM_TERMS, "optimizer"))


def fit(pairs: Sequence[tuple[dict[str, float], dict[str, float]]], profile: ClusterProfile
        ) -> tuple[dict[str, TermFactor], float | None]:
    """(term factors, host seconds per kernel) for ``profile``: on a CPU host and device are one, so its idle
    time is a factor like any term's; on a GPU the device's idle time is the host's lag (:func:`fit_host`)."""
    if profile.is_cpu:
        return fit_factors(pairs), None
    return fit_factors(pairs, skip=("other",)), fit_host(pairs, profile.assumptions.kernel_overhead_s)


def measured_peak(run: CalibrationRun) -> int:
    """The run's largest rank's peak memory (``RunReport.memory_kind`` says what it is)."""
    return max(run.report.peak_memory_bytes_per_rank or [0])


def peak_as_measured(run: CalibrationRun, p: Prediction) -> int:
    """The predicted peak ``p`` of ``run``'s layout as the run measured it (``MemoryBreakdown.as_measured``)."""
    return p.memory.as_measured(run.report.memory_kind)


def fit_memory(runs: Sequence[CalibrationRun], predicted_bytes: Sequence[int]) -> int | None:
    """The median over the runs of measured less predicted peak memory (what every rank holds that the model
    does not count: on a CPU rank the host runtime of torch and the executor); None without a measured peak."""
    gaps = [measured_peak(r) - p for r, p in zip(runs, predicted_bytes) if measured_peak(r) > 0]
    return int(statistics.median(gaps)) if gaps else None


def _error(step_s: float, run: CalibrationRun) -> float:
    return abs(step_s / run.report.median_step_time_s - 1)


MAX_RUN_CHECKPOINT_POINTS = 500  # the newest runs' saves kept beside the profiler's (CheckpointCost.points <= 1000)


def checkpoint_points(run: CalibrationRun) -> list[CheckpointPoint]:
    """A run's saves as points of the checkpoint lines: each mode's saves after its first (the first sets up),
    at what the busiest rank writes as the goodput prices it (:func:`planner.cost.goodput.written_bytes`), the
    bytes rank 0 held and the tensors it saved.
    Reports written before the tensors were recorded give none."""
    from planner import targets

    plan, report = run.plan, run.report
    total, _ = checkpoint_sizes(plan.model, plan.training, plan.layout, plan.prediction,
                                targets.target_facts(plan.target).master_in_param)
    written = int(written_bytes(plan.model, plan.layout, total, report.num_ranks))
    points = []
    for mode in ("sync", "async"):
        later = [r for r in report.checkpoints if r.mode == mode][1:]
        points += [CheckpointPoint(mode=mode, bytes=written, held_bytes=r.bytes_per_rank,
                                   tensors=r.tensors_per_rank, blocking_s=max(r.blocking_s, 1e-6),
                                   write_s=max(r.write_s, r.blocking_s, 1e-6), run=run.name[:200])
                   for r in later if r.tensors_per_rank]
    return points


def fit_checkpoint(profile: ClusterProfile, runs: Sequence[CalibrationRun]) -> CheckpointCost | None:
    """The profile's checkpoint lines refitted on its profiler's points and the runs' saves
    (:func:`checkpoint_points`; those of an earlier calibration replaced): a run's checkpoints teach the next
    plan's. Unchanged where the runs saved nothing; None where neither measured both modes."""
    mine = [] if profile.checkpoint is None else [p for p in profile.checkpoint.points if p.run is None]
    theirs = [p for r in runs for p in checkpoint_points(r)][-MAX_RUN_CHECKPOINT_POINTS:]
    if not theirs:
        return profile.checkpoint
    points = mine + theirs
    if {p.mode for p in points} != {"sync", "async"}:
        return profile.checkpoint
    where = profile.checkpoint.storage if profile.checkpoint else "the runs' checkpoint folders"
    ranks = profile.checkpoint.ranks if profile.checkpoint else max(r.report.num_ranks for r in runs)
    return fit_checkpoint_cost(points, ranks, where)


def _with(base: ClusterProfile, calibration: RunCalibration | None) -> ClusterProfile:
    return base.model_copy(update={"calibration": calibration})


def calibrate(profile: ClusterProfile, runs: Sequence[CalibrationRun], left_out: Sequence[str] = ()) -> ClusterProfile:
    """``profile`` (its own calibration set aside) calibrated on ``runs``: a new profile whose
    ``calibration`` holds the factors, the runs and the errors before, after and held out, and ``left_out``
    (the runs a caller did not fit on, each with why)."""
    if not runs:
        raise AutoparError("runs", [], "give runs of plans on this cluster (with their reports)",
                           problem="are none: nothing to calibrate on")
    from planner.cost.layer import without_host

    before = statistics.median(_error(prediction(r, _with(profile, None)).step_time_s, r) for r in runs)
    # fitted against a host that keeps ahead: the runs' idle device gives the host's own time (fit_host); the
    # calibrated profile then states that time, or none where no run waited for its host
    base = without_host(_with(profile, None))
    preds = [prediction(r, base) for r in runs]
    pairs = [(p.terms, measured_terms(r.report, r.name)) for p, r in zip(preds, runs)]
    factors, host = fit(pairs, base)
    memory = fit_memory(runs, [peak_as_measured(r, p) for r, p in zip(runs, preds)])
    draft = RunCalibration(factors=factors, host_s_per_kernel=host, memory_offset_bytes=memory,
                           runs=[r.name for r in runs], fitted_median_error=0.0, uncalibrated_median_error=before,
                           left_out=list(left_out))
    fitted = statistics.median(_error(predicted(r, _with(base, draft))[0], r) for r in runs)
    held_out, residuals = None, []
    if len(runs) > 1:
        for i, r in enumerate(runs):
            others, others_host = fit([x for j, x in enumerate(pairs) if j != i], base)
            cal = draft.model_copy(update={"factors": others, "host_s_per_kernel": others_host})
            residuals.append(math.log(predicted(r, _with(base, cal))[0] / r.report.median_step_time_s))
        held_out = statistics.median(abs(math.exp(x) - 1) for x in residuals)
    done = draft.model_copy(update={"fitted_median_error": fitted, "held_out_median_error": held_out,
                                    "held_out_residuals": [round(x, 5) for x in residuals]})
    return _with(base, done).model_copy(update={"checkpoint": fit_checkpoint(profile, runs)})


def step_errors(profile: ClusterProfile, runs: Sequence[CalibrationRun]) -> list[float]:
    """Each run's |predicted / measured - 1| step time on ``profile`` (as it is: calibrated or not)."""
    return [_error(predicted(r, profile)[0], r) for r in runs]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho of two equally long lists: Pearson correlation of their ranks (ties get their mean rank);
    how well predictions order measured runs."""
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0
