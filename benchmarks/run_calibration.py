#!/usr/bin/env python3
"""Calibration from runs: does a cluster's own runs' breakdown make its next predictions closer?

On this machine (4 gloo ranks on the CPU): a CPU profile (``--profile P.json``, or ``autopar profile --quick``
under torchrun), twelve layouts of one small model run by the executor (``autopar run``'s worker: 8 steps,
3 warm-up, the last 2 profiled for the breakdown by term). The runs alternate between a calibration half and
a held-out half; the profile is calibrated on the first (``planner.run_calibration``) and the held-out plans are
predicted before and after. Printed: per plan predicted vs measured, the held-out median |error| before and
after, Spearman's rho and the top-1 regret of the calibrated predictions over the held-out plans, and the
fit's own leave-one-run-out error; last, one line:

    calibrate: plans=N calibrated_on=K held_out=M median_abs_err_before=X% median_abs_err_after=Y% spearman=S regret=R%

Targets (issue: learn from every run): held-out median error <= 15% after, Spearman >= 0.9, regret <= 5%.
Which runs land in the calibration half matters on 11 runs: ``--splits N`` (default 50) repeats the judgement
on N random halves and prints each figure's p10 / median / p90.

    .venv/bin/python benchmarks/run_calibration.py [--profile P.json] [--record DIR] [--from DIR]

``--record DIR`` keeps every plan and report (DIR/<name>/plan.json, report.json) and the profile
(DIR/profile.json): ``tests/data/cpu_runs`` was recorded so. ``--from DIR`` evaluates recorded runs
without running anything.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpu_bench import LAYOUTS, SPEC, TRAINING, cpu_profile, torchrun  # noqa: E402  (benchmarks/cpu_bench.py)

from planner.contracts import ClusterProfile, ParallelLayout, Plan, RunReport  # noqa: E402
from planner.run_calibration import CalibrationRun, calibrate, predicted, spearman  # noqa: E402


def record_runs(profile: ClusterProfile, where: Path) -> list[CalibrationRun]:
    from executor.train import check_plan
    from planner.errors import AutoparError
    from planner.tune import plan_for

    where.mkdir(parents=True, exist_ok=True)
    (where / "profile.json").write_text(profile.model_dump_json(indent=1))
    runs = []
    for name, layout in LAYOUTS.items():
        try:
            plan = plan_for(SPEC, TRAINING, ParallelLayout(**layout), profile)
            check_plan(plan)
        except (AutoparError, ValueError) as exc:
            print(f"    skipped {name}: {exc}")
            continue
        (where / name).mkdir(exist_ok=True)
        (where / name / "plan.json").write_text(plan.model_dump_json(indent=1))
        try:
            torchrun(4, "-m", "executor.train", "--plan", str(where / name / "plan.json"), "--steps", "8",
                     "--warmup", "3", "--profile-steps", "2", "--out", str(where / name / "report.json"))
        except SystemExit as exc:
            print(f"    failed {name}: {exc}")
            continue
        runs.append(load_run(where / name))
        print(f"    ran {name:<10} measured {runs[-1].report.median_step_time_s * 1e3:8.1f} ms", flush=True)
    return runs


def load_run(folder: Path) -> CalibrationRun:
    return CalibrationRun(folder.name, Plan.model_validate_json((folder / "plan.json").read_text()),
                          RunReport.model_validate_json((folder / "report.json").read_text()))


def load_recorded(where: Path) -> tuple[ClusterProfile, list[CalibrationRun]]:
    """The recorded profile and runs, in LAYOUTS order (the order they ran in: the split depends on it)."""
    profile = ClusterProfile.model_validate_json((where / "profile.json").read_text())
    found = {f.name: f for f in where.iterdir() if (f / "report.json").is_file()}
    order = [n for n in LAYOUTS if n in found] + sorted(set(found) - set(LAYOUTS))
    return profile, [load_run(found[n]) for n in order]


def judge(profile: ClusterProfile, fit: list[CalibrationRun], held: list[CalibrationRun]) -> dict:
    """Calibrate on ``fit``; the held-out plans' median |error| before and after, Spearman and top-1 regret."""
    calibrated = calibrate(profile, fit)
    preds = [predicted(r, calibrated)[0] for r in held]
    base = [predicted(r, profile)[0] for r in held]
    measured = [r.report.median_step_time_s for r in held]
    best = min(range(len(held)), key=lambda i: preds[i])
    return {"calibrated": calibrated, "preds": preds, "base": base,
            "before": statistics.median(abs(b / m - 1) for b, m in zip(base, measured)),
            "after": statistics.median(abs(p / m - 1) for p, m in zip(preds, measured)),
            "spearman": spearman(preds, measured), "regret": measured[best] / min(measured) - 1}


def evaluate(profile: ClusterProfile, runs: list[CalibrationRun]) -> dict:
    """Calibrate on every other run (in the order they ran), judge on the rest (module doc)."""
    fit, held = runs[::2], runs[1::2]
    r = judge(profile, fit, held)
    cal = r["calibrated"].calibration
    print(f"\ncalibrated on {len(fit)} runs ({', '.join(x.name for x in fit)}):")
    for term, f in cal.factors.items():
        print(f"    {term:<12} x{f.factor:8.3f}  (runs {f.low:.3f} .. {f.high:.3f}, {f.runs} runs)")
    print(f"    fit: median |error| {cal.uncalibrated_median_error:.1%} before, {cal.fitted_median_error:.1%} after "
          f"(in sample), {cal.held_out_median_error:.1%} leave-one-run-out")
    print(f"\nheld out ({len(held)} plans):   {'predicted':>10} {'calibrated':>11} {'measured':>10}")
    for x, b, p in zip(held, r["base"], r["preds"]):
        m = x.report.median_step_time_s
        print(f"    {x.name:<20} {b * 1e3:8.1f}ms {p * 1e3:9.1f}ms {m * 1e3:8.1f}ms   "
              f"(error {abs(b / m - 1):.0%} -> {abs(p / m - 1):.0%})")
    return {"plans": len(runs), "calibrated_on": len(fit), "held_out": len(held),
            **{k: r[k] for k in ("before", "after", "spearman", "regret")}}


def spread(profile: ClusterProfile, runs: list[CalibrationRun], splits: int) -> None:
    """The same on ``splits`` random halves (seed 0): how much the figures depend on which runs were fitted."""
    rng = random.Random(0)
    got = []
    for _ in range(splits):
        order = rng.sample(runs, len(runs))
        half = (len(runs) + 1) // 2
        got.append(judge(profile, order[:half], order[half:]))

    def q(key: str) -> str:
        v = sorted(g[key] for g in got)
        return f"{v[len(v) // 10]:.2f} / {statistics.median(v):.2f} / {v[(9 * len(v)) // 10]:.2f}"

    print(f"\nover {splits} random splits (p10 / median / p90): held-out error before {q('before')}, after "
          f"{q('after')}; Spearman {q('spearman')}; regret {q('regret')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile")
    ap.add_argument("--record", type=Path)
    ap.add_argument("--from", dest="source", type=Path)
    ap.add_argument("--splits", type=int, default=50, help="random halves to report the spread over (0: none)")
    a = ap.parse_args()
    if a.source:
        profile, runs = load_recorded(a.source)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            profile = cpu_profile(a.profile, Path(tmp))
            print(f"running {len(LAYOUTS)} plans of {SPEC.name} on 4 CPU ranks ...", flush=True)
            runs = record_runs(profile, a.record or Path(tmp) / "runs")
    r = evaluate(profile, runs)
    if a.splits:
        spread(profile, runs, a.splits)
    print(f"targets: held-out median error <= 15% ({'PASS' if r['after'] <= 0.15 else 'MISS'}), Spearman >= 0.9 "
          f"({'PASS' if r['spearman'] >= 0.9 else 'MISS'}), regret <= 5% ({'PASS' if r['regret'] <= 0.05 else 'MISS'})")
    print(f"calibrate: plans={r['plans']} calibrated_on={r['calibrated_on']} held_out={r['held_out']} "
          f"median_abs_err_before={r['before']:.1%} median_abs_err_after={r['after']:.1%} "
          f"spearman={r['spearman']:.2f} regret={r['regret']:.1%}")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
