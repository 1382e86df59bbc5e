#!/usr/bin/env python3
"""Issue 25's targets for ``autopar tune`` (planner/tune.py): does a cluster's own runs make its next predictions right?

1. ``autopar tune`` (as ``python -m executor tune``) on model A: ``--plans`` layouts chosen to differ, each run for
   a few steps by the executor, every other one calibrates the profile, the rest are held out.
2. A second model B, never used for calibration: layouts chosen the same way are run, and predicted on the
   profile before and after A's calibration.

Printed: the tune's own table, B's per-plan predictions, the held-out peak-memory error, the targets, and last
the ``tune:`` line of model A. On this machine (default): CPU, 4 gloo ranks, the recorded CPU profile
``tests/data/cpu_runs/profile.json`` (``--profile`` for another). On one GPU: ``--gpu`` (models of about 0.5B and
0.3B, a reference profile of ``--cluster``, default hgx-h200, cut to one GPU).

Targets: held-out median |step error| <= 15% after calibration (<= 10% on a GPU), Spearman >= 0.9, top-1 regret
<= 5%; model B's median <= 25%; held-out peak memory within 15%.

    .venv/bin/python benchmarks/tune.py [--plans 10] [--out DIR] [--gpu [--cluster hgx-h200]] [--from DIR/a]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_bench import SPEC, TRAINING  # noqa: E402
from planner.contracts import ClusterProfile, ModelSpec, TrainingConfig  # noqa: E402
from planner.contracts.tune import TuneReport  # noqa: E402
from planner.run_calibration import CalibrationRun, predicted, spearman  # noqa: E402
from planner.tune import TuneSettings, autopar_runner, candidates, choose, plan_for, run_layouts  # noqa: E402

CPU = {  # model A is the CPU benchmarks' own (benchmarks/cpu_bench.py)
    "a": SPEC,
    "b": ModelSpec(name="bench-b", num_layers=6, hidden_size=96, num_attention_heads=6, num_kv_heads=2,
                   ffn_hidden_size=256, vocab_size=512),
    "training": TRAINING,
}
GPU = {
    "a": ModelSpec(name="gpu-a-0.5b", num_layers=12, hidden_size=1536, num_attention_heads=12, num_kv_heads=4,
                   ffn_hidden_size=4096, vocab_size=32000),
    "b": ModelSpec(name="gpu-b-0.3b", num_layers=8, hidden_size=1280, num_attention_heads=10, num_kv_heads=2,
                   ffn_hidden_size=3584, vocab_size=50304),
    "training": TrainingConfig(seq_length=2048, global_batch_size=8, precision="bf16"),
}


def run_tune(job: dict, where: Path, plans: int, profile_args: list[str]) -> TuneReport:
    """``python -m executor tune`` on model A, its output shown as it goes."""
    spec = where / "model-a.json"
    spec.write_text(job["a"].model_dump_json())
    t = job["training"]
    cmd = [sys.executable, "-m", "executor", "tune", "--model-file", str(spec), *profile_args,
           "--global-batch", str(t.global_batch_size), "--seq", str(t.seq_length), "--precision", t.precision.value,
           "--plans", str(plans), "--out-dir", str(where / "a")]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return TuneReport.model_validate_json((where / "a" / "tune.json").read_text())


def load_runs(folder: Path) -> list[CalibrationRun]:
    """The runs recorded in ``folder`` (NN/plan.json + report.json; a folder without a report is left out)."""
    from planner.contracts import Plan, RunReport

    return [CalibrationRun(f.name, Plan.model_validate_json((f / "plan.json").read_text()),
                           RunReport.model_validate_json((f / "report.json").read_text()))
            for f in sorted(folder.iterdir()) if (f / "report.json").is_file()]


def rejudge(folder: Path) -> tuple[TuneReport, ClusterProfile, ClusterProfile]:
    """A finished tune's runs (``folder``: profile.json, NN/plan.json + report.json) judged again with this
    checkout's code: (report, the profile it started from, the profile calibrated on every run)."""
    from planner.tune import summarise

    base = ClusterProfile.model_validate_json((folder / "profile.json").read_text())
    report, calibrated = summarise(base, load_runs(folder))
    for r in report.runs:
        after = "" if r.calibrated_step_s is None else f"{r.calibrated_step_s * 1e3:8.1f}ms"
        print(f"    {r.name} {r.role:<12} {r.predicted_step_s * 1e3:8.1f}ms {after} {r.measured_step_s * 1e3:8.1f}ms")
    return report, base, calibrated


def second_model(job: dict, base: ClusterProfile, calibrated: ClusterProfile, where: Path, plans: int,
                 recorded: Path | None = None) -> dict:
    """Model B's layouts run (or ``recorded``: an earlier run's ``b/`` folder) and predicted before and after
    model A's calibration."""
    if recorded is not None:
        runs = load_runs(recorded)
    else:
        settings = TuneSettings(plans=plans)
        chosen = choose(candidates(job["b"], job["training"], base, settings), plans)
        runs = run_layouts([plan_for(job["b"], job["training"], lay, base) for lay, _ in chosen], where / "b",
                           autopar_runner(settings), lambda phase, i, n, what: print(f"    {phase} {i}/{n} {what}",
                                                                                     flush=True))
    ran = [r for r in runs if isinstance(r, CalibrationRun)]
    for r in runs:
        if not isinstance(r, CalibrationRun):
            print(f"    failed {r[0]}: {r[2][:200]}")
    if len(ran) < 2:
        return {}
    before = [predicted(r, base)[0] for r in ran]
    after = [predicted(r, calibrated)[0] for r in ran]
    measured = [r.report.median_step_time_s for r in ran]
    print(f"\nmodel B ({job['b'].name}), never calibrated on: {'before':>10} {'after':>10} {'measured':>10}")
    for r, b, a, m in zip(ran, before, after, measured):
        print(f"    {r.name:<6} {b * 1e3:9.1f}ms {a * 1e3:9.1f}ms {m * 1e3:9.1f}ms   (error {b / m - 1:+.0%} -> "
              f"{a / m - 1:+.0%})")
    return {"plans": len(ran), "before": statistics.median(abs(b / m - 1) for b, m in zip(before, measured)),
            "after": statistics.median(abs(a / m - 1) for a, m in zip(after, measured)),
            "spearman": spearman(after, measured)}


def noise(job: dict, profile: ClusterProfile, where: Path, times: int) -> float:
    """The same plan (the search's best for model A) run ``times`` times: the step time's spread between
    identical runs, the floor under any prediction error on this machine (median |run / median - 1|)."""
    from planner.search import search

    plan = search(job["a"], job["training"], profile)
    plan.alternatives = []
    runs = run_layouts([plan] * times, where / "noise", autopar_runner(TuneSettings()), lambda *x: None)
    steps = sorted(r.report.median_step_time_s for r in runs if isinstance(r, CalibrationRun))
    if not steps:
        print(f"\nnoise: none of {times} runs of one plan finished (their logs: {where / 'noise'})")
        return float("nan")
    mid = statistics.median(steps)
    spread = statistics.median(abs(s / mid - 1) for s in steps)
    print(f"\nnoise: one plan run {len(steps)} times: {', '.join(f'{s * 1e3:.1f}' for s in steps)} ms; median |run / "
          f"median - 1| {spread:.1%}, range {steps[0] / mid - 1:+.0%} .. {steps[-1] / mid - 1:+.0%}")
    return spread


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", type=int, default=10)
    ap.add_argument("--second", type=int, default=6, help="layouts of model B to run (2 or more; 0: none)")
    ap.add_argument("--profile", default=str(ROOT / "tests/data/cpu_runs/profile.json"))
    ap.add_argument("--gpu", action="store_true", help="one GPU: larger models, a reference profile of --cluster")
    ap.add_argument("--cluster", default="hgx-h200")
    ap.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--repeat", type=int, default=0, help="also run model A's best plan this many times: the "
                    "spread between identical runs (the noise floor of any error figure here)")
    ap.add_argument("--from", dest="source", type=Path, help="judge a finished tune folder's runs again (its "
                    "profile.json and NN/ runs) instead of running model A (model B only with --second-from)")
    ap.add_argument("--second-from", type=Path, help="model B's recorded runs (an earlier run's b/ folder)")
    a = ap.parse_args()
    job = GPU if a.gpu else CPU
    profile_args = ["--cluster", a.cluster, "--gpus", "1"] if a.gpu else ["--profile", a.profile]
    with tempfile.TemporaryDirectory() as tmp:
        where = a.out or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        if a.source:
            report, base, calibrated = rejudge(a.source)
        else:
            report = run_tune(job, where, a.plans, profile_args)
            base = ClusterProfile.model_validate_json((where / "a" / "profile.json").read_text())
            calibrated = ClusterProfile.model_validate_json((where / "a" / "profile.calibrated.json").read_text())
        wanted = a.second >= 2 and report.calibration is not None and (a.source is None or a.second_from)
        b = second_model(job, base, calibrated, where, a.second, a.second_from) if wanted else {}
        if a.repeat > 1:
            noise(job, base, where, a.repeat)
    limit = 0.10 if a.gpu else 0.15
    after, rho, regret, mem = (report.median_abs_err_after, report.spearman, report.regret,
                               report.memory_median_abs_err)
    print(f"\ntargets: held-out median error <= {limit:.0%} ({verdict(after is not None and after <= limit)}), "
          f"Spearman >= 0.9 ({verdict(rho is not None and rho >= 0.9)}), regret <= 5% "
          f"({verdict(regret is not None and regret <= 0.05)}); model B median <= 25% "
          + (f"({b['before']:.1%} -> {b['after']:.1%}: {verdict(b['after'] <= 0.25)}, Spearman {b['spearman']:.2f})"
             if b else "(not run)")
          + "; held-out peak memory within 15% "
          + (f"({mem:.1%}: {verdict(mem <= 0.15)})" if mem is not None else "(not measured)"))
    print(report.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
