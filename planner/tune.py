"""``autopar tune``: plan, run a handful of differing layouts, calibrate on half, judge on the rest, re-plan.

The loop (one home for the CLI, ``POST /v1/tune`` and ``benchmarks/tune.py``):

1. **Choose** :attr:`TuneSettings.plans` layouts that differ. The search's best plan comes first; then, from
   every structure the search's rules admit (:func:`planner.search.enumerate.structures`) with each ZeRO
   choice, recompute kind and schedule, uniform layouts that fit and that the target runs
   (:func:`candidates`), greedily the one that adds most feature values not yet chosen (structure, schedule,
   ZeRO, recompute, micro-batch), the faster first among equals (:func:`choose`).
2. **Run** each for a few steps with the executor (``runner``: by default ``python -m executor PLAN.json``,
   which checks the host and launches torchrun), keeping plan, report and log in the work folder. A run that
   fails is kept with why, and the loop goes on.
3. **Calibrate** on every other run in the order chosen (the search's best in the calibration half) and
   predict the held-out half before and after (:func:`judge`): median |error|, Spearman, top-1 regret, the
   held-out peak memory.
4. **Re-plan** on the profile calibrated on every run: the plan a user gets next.

Nothing here imports torch: the runs happen in other processes.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from planner.contracts import (
    ClusterProfile,
    ModelSpec,
    ParallelLayout,
    Plan,
    Prediction,
    Recompute,
    RunReport,
    TrainingConfig,
)
from planner.contracts.limits import MAX_MICRO_BATCH, MAX_TIME_BUDGET_S
from planner.contracts.tune import TunedRun, TuneReport
from planner.errors import AutoparError
from planner.run_calibration import (
    CalibrationRun,
    calibrate,
    measured_peak,
    peak_as_measured,
    predicted,
    prediction,
    spearman,
)
from planner.search.options import SearchOptions

Runner = Callable[[Path, Path, Path], None]  # (plan.json, report.json to write, log file); raises RunFailed
Progress = Callable[[str, int, int, str], None]  # (phase, done, total, what)


class RunFailed(RuntimeError):
    """A tuned layout's run did not produce a report; the message says why (the end of its log)."""


SEARCH = SearchOptions()  # the search's defaults, which tune's search and listing keep

LIMITS: dict[str, tuple[float, float]] = {  # each TuneSettings field's bounds: the CLI's and the API's too
    "plans": (2, 64), "steps": (3, 1000), "warmup": (0, 999), "profile_steps": (1, 100),
    "max_micro_batch_size": (1, MAX_MICRO_BATCH), "time_budget_s": (0.1, MAX_TIME_BUDGET_S),
    "run_timeout_s": (10, 86400),
}


@dataclass(frozen=True)
class TuneSettings:
    """What ``autopar tune`` runs: how many layouts, how long each, for which target. Bounds: :data:`LIMITS`."""

    plans: int = 10
    steps: int = 8
    warmup: int = 3
    profile_steps: int = 2
    target: str = SEARCH.target
    max_micro_batch_size: int = SEARCH.max_micro_batch_size
    time_budget_s: float = SEARCH.time_budget_s  # for the search and for listing the candidates, each
    run_timeout_s: float = 900.0  # one run, start to report: a run still going then is stopped (hung)

    def __post_init__(self) -> None:
        for name, (lo, hi) in LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise AutoparError(name, value, f"give {lo:g} to {hi:g}", problem="is out of bounds")
        from planner.targets import Target

        if self.target not in {t.value for t in Target}:
            raise AutoparError("target", self.target, "use one of " + ", ".join(t.value for t in Target),
                               problem="is not a target autopar plans for")
        if self.warmup + self.profile_steps >= self.steps:
            raise AutoparError("steps", self.steps, f"give more than warmup + profile steps "
                               f"({self.warmup} + {self.profile_steps})", problem="leaves no step to time")


TUNE = TuneSettings()  # the defaults, as the CLI and the API show them


def plan_for(model: ModelSpec, training: TrainingConfig, layout: ParallelLayout, profile: ClusterProfile,
             target: str = "autopar") -> Plan:
    """A Plan for a given layout (no search), with its prediction on ``profile``."""
    from planner.cost.predict import predict

    return Plan(model=model, training=training, cluster=profile.name, num_gpus=layout.num_gpus, layout=layout,
                precision=training.precision, target=target,
                prediction=predict(model, training, profile, layout, target=target))


def features(layout: ParallelLayout) -> tuple:
    """What :func:`choose` wants to vary: structure, schedule, ZeRO (with its sharding), recompute, micro-batch."""
    structure = (layout.tp, layout.sp, layout.cp, layout.pp, layout.ep, layout.dp_replicate, layout.dp_shard)
    sharded = layout.dp_shard > 1  # ZeRO over one rank shards nothing: the same layout as ZeRO-0
    zero = (layout.zero_stage if sharded else 0, layout.reshard_after_forward or not sharded, layout.offload_share)
    schedule = (layout.schedule, layout.virtual_stages) if layout.pp > 1 else None
    return structure, schedule, zero, layout.recompute, layout.micro_batch_size


def choose(pool: Sequence[tuple[ParallelLayout, Prediction]], k: int) -> list[tuple[ParallelLayout, Prediction]]:
    """``k`` layouts of ``pool`` (its first is kept first): each next one adds the most feature values
    (:func:`features`) not yet chosen, the fastest predicted among equals; none the same in every feature."""
    chosen = [pool[0]] if pool else []
    seen = [{f} for f in features(pool[0][0])] if pool else []
    taken = {features(pool[0][0])} if pool else set()
    rest = []
    for c in sorted(pool[1:], key=lambda c: c[1].step_time_s):
        if features(c[0]) not in taken:
            taken.add(features(c[0]))
            rest.append(c)
    while rest and len(chosen) < k:
        best = max(range(len(rest)), key=lambda i: (sum(f not in s for f, s in zip(features(rest[i][0]), seen)),
                                                    -rest[i][1].step_time_s))
        layout, pred = rest.pop(best)
        chosen.append((layout, pred))
        for f, s in zip(features(layout), seen):
            s.add(f)
    return chosen


def candidates(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, settings: TuneSettings,
               ) -> list[tuple[ParallelLayout, Prediction]]:
    """Uniform layouts (every stage the same recompute, even layer split) of every admitted structure, ZeRO
    choice and schedule, that fit with the profile's headroom and that the target runs; listed until the time
    budget is spent, one combination of every structure before the next of any (:func:`_round_robin`)."""
    from planner.cost.predict import predict
    from planner.search.enumerate import structures
    from planner.search.rules import Rules
    from planner.targets import check
    from planner.targets.core import Job

    opts = SearchOptions(target=settings.target, max_micro_batch_size=settings.max_micro_batch_size)
    rules = Rules()
    deadline = time.perf_counter() + settings.time_budget_s
    per_structure = [_choices(st, model, opts, rules) for st in structures(model, training, profile, opts, rules)]
    out = []
    for args in _round_robin(per_structure):
        if time.perf_counter() > deadline:
            break
        try:
            layout = _layout(*args)
            m = training.global_batch_seqs // (layout.dp_replicate * layout.dp_shard * layout.micro_batch_size)
            check(settings.target, Job(model, training, layout, micro_batches=m))
            pred = predict(model, training, profile, layout, target=settings.target)
        except AutoparError:
            continue
        if pred.memory.fits:
            out.append((layout, pred))
    return out


def _choices(st, model: ModelSpec, opts, rules) -> list[tuple]:  # noqa: ANN001 - a Structure, options, rules
    """A structure's (schedule, ZeRO choice, recompute) combinations, as :func:`_layout`'s arguments."""
    from planner.search.enumerate import leaf_choices, schedule_choices

    return [(st, opts, sched, v, *leaf, rc) for sched, v in schedule_choices(st, model, opts, rules)
            for leaf in leaf_choices(st, opts) for rc in Recompute]


def _round_robin(groups: list[list]):  # noqa: ANN202 - a generator
    """One item of every group in turn, then the next of each: what a time budget cuts short is spread evenly."""
    for i in range(max((len(g) for g in groups), default=0)):
        for g in groups:
            if i < len(g):
                yield g[i]


def _layout(st, opts, sched, v, zero, rep, shard, offload, reshard, rc) -> ParallelLayout:  # noqa: ANN001
    from planner.search.enumerate import base_layout

    return base_layout(st, opts, schedule=sched, virtual_stages=v, zero_stage=zero, dp_replicate=rep,
                       dp_shard=shard, **ParallelLayout.offload_fields(offload), reshard_after_forward=reshard,
                       recompute=rc)


def autopar_runner(settings: TuneSettings, env: dict[str, str] | None = None) -> Runner:
    """Run a plan as a user would: ``python -m executor PLAN.json`` (``autopar run``: host checks, torchrun),
    its output in the log; :class:`RunFailed` with the log's end when it writes no report."""
    root = str(Path(__file__).resolve().parents[1])

    def run(plan_file: Path, report_file: Path, log_file: Path) -> None:
        cmd = [sys.executable, "-m", "executor", "run", str(plan_file), "--steps", str(settings.steps), "--warmup",
               str(settings.warmup), "--profile-steps", str(settings.profile_steps), "--out", str(report_file)]
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        with log_file.open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True,
                                    env={**os.environ, **(env or {}), "PYTHONPATH": path})
            try:
                code = proc.wait(timeout=settings.run_timeout_s)
            except subprocess.TimeoutExpired:  # a hung run (a collective that never completes) ends, workers too
                _end(proc)
                raise RunFailed(f"stopped after run_timeout_s={settings.run_timeout_s:g} s (a hung run?); its "
                                f"log: {log_file}") from None
            except BaseException:  # Ctrl-C: the run is in a session of its own, so it would outlive us
                _end(proc)
                raise
        if code != 0 or not report_file.is_file():
            tail = log_file.read_text(errors="replace").strip().splitlines()[-6:]
            raise RunFailed(f"exit status {code}: " + " / ".join(line.strip() for line in tail))

    return run


def _end(proc: subprocess.Popen) -> None:
    """Kill a run's whole process group (torchrun and its workers) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_layouts(plans: Sequence[Plan], workdir: Path, runner: Runner, progress: Progress
                ) -> list[CalibrationRun | tuple[str, Plan, str]]:
    """Run each plan in ``workdir/<NN>/`` (plan.json, report.json, run.log): a :class:`CalibrationRun`, or
    (name, plan, why) for a run that failed."""
    out: list[CalibrationRun | tuple[str, Plan, str]] = []
    for i, plan in enumerate(plans):
        name = f"{i:02d}"
        where = workdir / name
        where.mkdir(parents=True, exist_ok=True)
        (where / "plan.json").write_text(plan.model_dump_json(indent=1))
        progress("run", i, len(plans), f"layout {name}: {plan.layout.summary()}")
        try:
            runner(where / "plan.json", where / "report.json", where / "run.log")
            out.append(CalibrationRun(name, plan, RunReport.model_validate_json((where / "report.json").read_text())))
        except (RunFailed, ValueError, OSError) as exc:
            out.append((name, plan, str(exc)[:600]))
    progress("run", len(plans), len(plans), "runs done")
    return out


def judge(profile: ClusterProfile, fit: Sequence[CalibrationRun], held: Sequence[CalibrationRun]) -> dict:
    """Calibrate ``profile`` on ``fit``; over ``held``: the median |step error| before and after, Spearman and
    top-1 regret of the calibrated predictions, and the peak memory error; with the predictions per run."""
    calibrated = calibrate(profile, fit)
    preds = [prediction(r, calibrated) for r in held]
    after = [p.step_time_s for p in preds]
    before = [predicted(r, profile)[0] for r in held]
    measured = [r.report.median_step_time_s for r in held]
    best = min(range(len(held)), key=lambda i: after[i])
    memory = [abs(peak_as_measured(r, p) / measured_peak(r) - 1) for r, p in zip(held, preds) if measured_peak(r)]
    return {"calibrated": calibrated, "before_s": before, "after_s": after,
            "before": statistics.median(abs(b / m - 1) for b, m in zip(before, measured)),
            "after": statistics.median(abs(p / m - 1) for p, m in zip(after, measured)),
            "spearman": spearman(after, measured) if len(held) >= 3 else None,
            "regret": measured[best] / min(measured) - 1,
            "memory": statistics.median(memory) if memory else None}


def tune(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, settings: TuneSettings, workdir: Path,
         runner: Runner, progress: Progress = lambda *a: None) -> tuple[TuneReport, ClusterProfile]:
    """The loop of the module doc: (the report, the profile calibrated on every run that measured)."""
    from planner.search import search

    opts = SearchOptions(target=settings.target, max_micro_batch_size=settings.max_micro_batch_size,
                         time_budget_s=settings.time_budget_s)
    progress("plan", 0, 1, "searching the best layout")
    first = search(model, training, profile, opts)
    pool = [(first.layout, first.prediction)]
    pool += [c for c in candidates(model, training, profile, settings) if c[0] != first.layout]
    chosen = choose(pool, settings.plans)
    if len(chosen) < 2:
        raise AutoparError("plans", len(chosen), "give a job with more than one layout that fits (more GPUs, a "
                           "smaller model, or a larger --max-micro-batch)",
                           problem="layouts fit and run: tune needs two to calibrate on one and judge the other")
    plans = [plan_for(model, training, lay, profile, settings.target) for lay, _ in chosen]
    results = run_layouts(plans, workdir, runner, progress)
    report, final = summarise(profile, results)
    progress("replan", 0, 1, "searching again on the calibrated profile")
    report.first_plan = first.layout
    if report.calibration is not None:
        try:
            report.replanned = search(model, training, final, opts)
        except AutoparError as exc:  # the runs and the calibration stand: say why there is no new plan
            report.replan_error = str(exc)
    progress("done", 1, 1, report.line())
    return report, final


def summarise(profile: ClusterProfile, results: Sequence[CalibrationRun | tuple[str, Plan, str]]
              ) -> tuple[TuneReport, ClusterProfile]:
    """The report of the runs (every other one calibrates, the rest are held out) and the profile calibrated
    on all of them (``profile`` itself when fewer than two ran)."""
    ran = [r for r in results if isinstance(r, CalibrationRun) and r.report.breakdown]
    fit, held = ran[::2], ran[1::2]
    j = judge(profile, fit, held) if fit and held else None
    rows = []
    for r in results:
        if not isinstance(r, CalibrationRun) or r not in ran:
            name, plan, why = r if not isinstance(r, CalibrationRun) else (r.name, r.plan, "no breakdown by term")
            rows.append(TunedRun(name=name, layout=plan.layout, role="failed", error=why,
                                 predicted_step_s=plan.prediction.step_time_s,
                                 predicted_peak_bytes=plan.prediction.memory.total_bytes))
            continue
        role = "held_out" if r in held else "calibration"
        after = (j["after_s"][held.index(r)] if role == "held_out" else predicted(r, j["calibrated"])[0]) if j else None
        rows.append(TunedRun(name=r.name, layout=r.plan.layout, role=role, predicted_step_s=predicted(r, profile)[0],
                             calibrated_step_s=after, measured_step_s=r.report.median_step_time_s,
                             predicted_peak_bytes=r.plan.prediction.memory.as_measured(r.report.memory_kind),
                             measured_peak_bytes=measured_peak(r), memory_kind=r.report.memory_kind))
    final = calibrate(profile, ran) if len(ran) >= 2 else profile
    model = (r.plan if isinstance(r, CalibrationRun) else r[1] for r in results)
    report = TuneReport(cluster=profile.name, model=next(model).model.name if results else "?",
                        num_gpus=profile.num_gpus, runs=rows, calibration=final.calibration if len(ran) >= 2 else None)
    if j:
        report.median_abs_err_before, report.median_abs_err_after = j["before"], j["after"]
        report.spearman, report.regret = j["spearman"], max(0.0, j["regret"])
        report.memory_median_abs_err = j["memory"]
    return report, final


__all__ = ["RunFailed", "TuneSettings", "autopar_runner", "candidates", "choose", "features", "judge",
           "plan_for", "run_layouts", "summarise", "tune"]
