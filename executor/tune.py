"""``autopar tune``: plan, run differing layouts here for a few steps, calibrate, judge, re-plan (``planner/tune.py``).

Everything lands in ``--out-dir``: each layout's ``NN/plan.json``, ``report.json`` and ``run.log``; the profile
it started from (``profile.json``) and the one calibrated on every run (``profile.calibrated.json``, for
``autopar plan --profile``); the plan searched on it (``plan.json``) and the whole report (``tune.json``). The
last line printed is the summary (:meth:`planner.contracts.tune.TuneReport.line`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from planner.cli import JobInputs, with_job
from planner.console import make_console
from planner.contracts.tune import TuneReport
from planner.errors import AutoparError
from planner.files import check_out_dir
from planner.tune import LIMITS, TUNE, TuneSettings, autopar_runner

console = make_console()
FLAGS = {"plans": "--plans", "steps": "--steps", "warmup": "--warmup", "profile_steps": "--profile-steps",
         "max_micro_batch_size": "--max-micro-batch", "time_budget_s": "--time-budget",
         "run_timeout_s": "--run-timeout", "target": "--target"}
err = make_console(stderr=True)


@with_job
def tune(
    job: JobInputs,
    plans: Annotated[int, typer.Option(min=LIMITS["plans"][0], max=LIMITS["plans"][1],
                                       help="layouts to run (half calibrate, half are held out)")] = TUNE.plans,
    steps: Annotated[int, typer.Option(min=LIMITS["steps"][0], max=LIMITS["steps"][1],
                                       help="optimizer steps per run")] = TUNE.steps,
    warmup: Annotated[int, typer.Option(min=LIMITS["warmup"][0], max=LIMITS["warmup"][1],
                                        help="first steps of each run left out of its median")] = TUNE.warmup,
    profile_steps: Annotated[int, typer.Option(
        min=LIMITS["profile_steps"][0], max=LIMITS["profile_steps"][1],
        help="last steps of each run profiled for the breakdown by term")] = TUNE.profile_steps,
    target: Annotated[str, typer.Option(help="what runs the plans afterwards (planner/targets/); the runs here "
                                             "are the executor's")] = TUNE.target,
    max_micro_batch: Annotated[int, typer.Option(
        min=LIMITS["max_micro_batch_size"][0], max=LIMITS["max_micro_batch_size"][1],
        help="largest micro-batch to try")] = TUNE.max_micro_batch_size,
    time_budget: Annotated[float, typer.Option(
        min=LIMITS["time_budget_s"][0], max=LIMITS["time_budget_s"][1],
        help="seconds for the search and for listing the layouts, each")] = TUNE.time_budget_s,
    run_timeout: Annotated[float, typer.Option(
        min=LIMITS["run_timeout_s"][0], max=LIMITS["run_timeout_s"][1],
        help="seconds one run may take before it is stopped as hung")] = TUNE.run_timeout_s,
    out_dir: Annotated[Path | None, typer.Option(help="where runs, profiles and the report go (default "
                                                      "./tune-<time>)")] = None,
) -> None:
    """Run differing layouts of a job here, calibrate the profile on half, judge it on the other half, re-plan.

      autopar tune --model tiny --profile cpu.json --global-batch 16 --seq 64 --plans 10
    """
    from planner.tune import tune as tune_loop

    model, profile, training = job.one_batch("tune")
    try:
        settings = TuneSettings(plans=plans, steps=steps, warmup=warmup, profile_steps=profile_steps, target=target,
                                max_micro_batch_size=max_micro_batch, time_budget_s=time_budget,
                                run_timeout_s=run_timeout)
    except AutoparError as exc:  # named as the user wrote it
        raise AutoparError(FLAGS.get(exc.field, exc.field), exc.value, exc.fix, problem=exc.problem) from None
    where = out_dir or Path(f"tune-{datetime.now(UTC):%Y%m%d-%H%M%S}")
    check_out_dir(where, "--out-dir")
    where.mkdir(parents=True, exist_ok=True)
    (where / "profile.json").write_text(profile.model_dump_json(indent=1))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task("tune", total=None)

        def progress(phase: str, done: int, total: int, what: str) -> None:
            bar.update(task, description=f"{phase}: {what}"[:90], completed=done, total=total)

        report, calibrated = tune_loop(model, training, profile, settings, where, autopar_runner(settings), progress)
    (where / "profile.calibrated.json").write_text(calibrated.model_dump_json(indent=1))
    (where / "tune.json").write_text(report.model_dump_json(indent=1))
    if report.replanned is not None:
        (where / "plan.json").write_text(report.replanned.model_dump_json(indent=1))
    render(report, where)
    print(report.line())


def render(report: TuneReport, where: Path) -> None:
    """Each layout's step predicted before and after calibration against measured; what failed and why."""
    table = Table(title=f"tune of {report.model} on {report.cluster} ({report.num_gpus} ranks)")
    for col in ("run", "layout", "half", "predicted", "calibrated", "measured", "error after"):
        table.add_column(col, justify="left" if col in ("run", "layout", "half") else "right")
    for r in report.runs:
        def ms(x: float | None) -> str:
            return "—" if x is None else f"{x * 1e3:.1f} ms"
        err_after = (f"{r.calibrated_step_s / r.measured_step_s - 1:+.0%}"
                     if r.calibrated_step_s and r.measured_step_s else (r.error or "—")[:60])
        table.add_row(r.name, r.layout.summary(), r.role, ms(r.predicted_step_s), ms(r.calibrated_step_s),
                      ms(r.measured_step_s), err_after)
    console.print(table)
    if report.replan_error:
        console.print(f"no plan on the calibrated profile: {report.replan_error}", highlight=False)
    if report.replanned is not None:
        same = "the same layout" if report.replanned.layout == report.first_plan else "a different layout"
        console.print(f"re-planned on the calibrated profile: {report.replanned.layout.summary()} "
                      f"({report.replanned.prediction.step_time_s * 1e3:.1f} ms predicted; {same} as before)")
    console.print(f"written to {where}/ (tune.json, profile.calibrated.json, plan.json, NN/run.log)")
    if report.plans < 2:
        raise AutoparError("runs", report.plans, f"read the runs' logs in {where}/NN/run.log",
                           problem="succeeded: too few to calibrate on")
