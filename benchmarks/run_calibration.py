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
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.contracts import ClusterProfile, ModelSpec, ParallelLayout, Plan, RunReport, TrainingConfig  # noqa: E402
from planner.run_calibration import CalibrationRun, calibrate, predicted, spearman, step_errors  # noqa: E402

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
    """The recorded profile and runs, in LAYOUTS order (the order they ran in: the split depends on it)."""
    profile = ClusterProfile.model_validate_json((where / "profile.json").read_text())
    found = {f.name: f for f in where.iterdir() if (f / "report.json").is_file()}
    order = [n for n in LAYOUTS if n in found] + sorted(set(found) - set(LAYOUTS))
    return profile, [load_run(found[n]) for n in order]


def judge(profile: ClusterProfile, fit: list[CalibrationRun], held: list[CalibrationRun]) -> dict:
    """Calibrate on ``fit``; the held-out plans' median |error| before and after, Spearman and top-1 regret."""
    calibrated = calibrate(profile, fit)
    preds = [predicted(r, calibrated)[0] for r in held]
    measured = [r.report.median_step_time_s for r in held]
    best = min(range(len(held)), key=lambda i: preds[i])
    return {"calibrated": calibrated, "preds": preds, "before": statistics.median(step_errors(profile, held)),
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
    for x, b, p in zip(held, step_errors(profile, held), r["preds"]):
        m = x.report.median_step_time_s
        print(f"    {x.name:<20} {predicted(x, profile)[0] * 1e3:8.1f}ms {p * 1e3:9.1f}ms {m * 1e3:8.1f}ms   "
              f"(error {b:.0%} -> {abs(p / m - 1):.0%})")
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
