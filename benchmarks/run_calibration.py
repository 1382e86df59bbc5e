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

    .venv/bin/python benchmarks/run_calibration.py [--profile P.json] [--record DIR] [--from DIR]

``--record DIR`` keeps every plan and report (DIR/<name>/plan.json, report.json) and the profile
(DIR/profile.json): ``tests/data/cpu_runs`` was recorded so. ``--from DIR`` evaluates recorded runs
without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.contracts import ClusterProfile, ModelSpec, ParallelLayout, Plan, RunReport, TrainingConfig  # noqa: E402
from planner.run_calibration import CalibrationRun, calibrate, step_errors  # noqa: E402

SPEC = ModelSpec(name="bench", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=192, vocab_size=256)
TRAINING = TrainingConfig(seq_length=64, global_batch_size=16, precision="fp32")
LAYOUTS = {
    "dp4": {"dp_shard": 4}, "zero1": {"dp_shard": 4, "zero_stage": 1}, "zero2": {"dp_shard": 4, "zero_stage": 2},
    "zero3": {"dp_shard": 4, "zero_stage": 3}, "dp4-mb2": {"dp_shard": 4, "micro_batch_size": 2},
    "tp2dp2": {"dp_shard": 2, "tp": 2}, "tp2dp2-sp": {"dp_shard": 2, "tp": 2, "sp": True}, "tp4": {"tp": 4},
    "pp2dp2": {"pp": 2, "dp_shard": 2}, "pp4-mb2": {"pp": 4, "micro_batch_size": 2}, "pp2tp2": {"pp": 2, "tp": 2},
    "hsdp": {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3},
}


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun(*args: str) -> str | None:
    """Run under torchrun on 4 ranks; None when it succeeded, else the end of its error output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *args]
    r = subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True, check=False)
    errors = [line for line in r.stderr.splitlines() if "Error" in line and "ChildFailedError" not in line]
    return None if r.returncode == 0 else (errors[-1] if errors else r.stderr[-500:])


def cpu_profile(path: str | None, tmp: Path) -> ClusterProfile:
    if path:
        return ClusterProfile.model_validate_json(Path(path).read_text())
    out = tmp / "profile.json"
    print("profiling this machine: autopar profile --quick under torchrun (4 ranks) ...", flush=True)
    failed = torchrun(str(Path(sys.executable).parent / "autopar"), "profile", "--quick", "--out", str(out))
    if failed:
        raise SystemExit(f"autopar profile failed: {failed}")
    return ClusterProfile.model_validate_json(out.read_text())


def record_runs(profile: ClusterProfile, where: Path) -> list[CalibrationRun]:
    from executor.train import check_plan, plan_for
    from planner.errors import AutoparError

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
        failed = torchrun("-m", "executor.train", "--plan", str(where / name / "plan.json"), "--steps", "8",
                          "--warmup", "3", "--profile-steps", "2", "--out", str(where / name / "report.json"))
        if failed:
            print(f"    failed {name}: {failed}")
            continue
        runs.append(load_run(where / name))
        print(f"    ran {name:<10} measured {runs[-1].report.median_step_time_s * 1e3:8.1f} ms", flush=True)
    return runs


def load_run(folder: Path) -> CalibrationRun:
    return CalibrationRun(folder.name, Plan.model_validate_json((folder / "plan.json").read_text()),
                          RunReport.model_validate_json((folder / "report.json").read_text()))


def load_recorded(where: Path) -> tuple[ClusterProfile, list[CalibrationRun]]:
    profile = ClusterProfile.model_validate_json((where / "profile.json").read_text())
    return profile, [load_run(f) for f in sorted(where.iterdir()) if (f / "report.json").is_file()]


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def evaluate(profile: ClusterProfile, runs: list[CalibrationRun]) -> dict:
    """Calibrate on every other run, judge on the rest (module doc)."""
    from planner.run_calibration import predicted

    fit, held = runs[::2], runs[1::2]
    calibrated = calibrate(profile, fit)
    before, after = step_errors(profile, held), step_errors(calibrated, held)
    cal = calibrated.calibration
    print(f"\ncalibrated on {len(fit)} runs ({', '.join(r.name for r in fit)}):")
    for term, f in cal.factors.items():
        print(f"    {term:<12} x{f.factor:8.3f}  (runs {f.low:.3f} .. {f.high:.3f}, {f.runs} runs)")
    print(f"    fit: median |error| {cal.uncalibrated_median_error:.1%} before, {cal.fitted_median_error:.1%} after "
          f"(in sample), {cal.held_out_median_error:.1%} leave-one-run-out")
    print(f"\nheld out ({len(held)} plans):   {'predicted':>10} {'calibrated':>11} {'measured':>10}")
    preds = [predicted(r, calibrated)[0] for r in held]
    for r, b, p in zip(held, step_errors(profile, held), preds):
        m = r.report.median_step_time_s
        print(f"    {r.name:<20} {predicted(r, profile)[0] * 1e3:8.1f}ms {p * 1e3:9.1f}ms {m * 1e3:8.1f}ms   "
              f"(error {b:.0%} -> {abs(p / m - 1):.0%})")
    measured = [r.report.median_step_time_s for r in held]
    best = min(range(len(held)), key=lambda i: preds[i])
    return {"plans": len(runs), "calibrated_on": len(fit), "held_out": len(held),
            "before": statistics.median(before), "after": statistics.median(after),
            "spearman": spearman(preds, measured), "regret": measured[best] / min(measured) - 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile")
    ap.add_argument("--record", type=Path)
    ap.add_argument("--from", dest="source", type=Path)
    a = ap.parse_args()
    if a.source:
        profile, runs = load_recorded(a.source)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            profile = cpu_profile(a.profile, Path(tmp))
            print(f"running {len(LAYOUTS)} plans of {SPEC.name} on 4 CPU ranks ...", flush=True)
            runs = record_runs(profile, a.record or Path(tmp) / "runs")
    r = evaluate(profile, runs)
    print(f"targets: held-out median error <= 15% ({'PASS' if r['after'] <= 0.15 else 'MISS'}), Spearman >= 0.9 "
          f"({'PASS' if r['spearman'] >= 0.9 else 'MISS'}), regret <= 5% ({'PASS' if r['regret'] <= 0.05 else 'MISS'})")
    print(f"calibrate: plans={r['plans']} calibrated_on={r['calibrated_on']} held_out={r['held_out']} "
          f"median_abs_err_before={r['before']:.1%} median_abs_err_after={r['after']:.1%} "
          f"spearman={r['spearman']:.2f} regret={r['regret']:.1%}")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
