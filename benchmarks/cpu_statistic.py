"""Which statistic of a CPU shape's trials should a profile record: the median or the fastest?

Behind :func:`profiler.timing.estimate` (CPU points: the fastest trial; GPU points: the median).
Two figures, side by side on the same trials, so the machine's moment is the same for both:

1. **How much the machine moves.** One 512³ fp32 GEMM, one thread, timed as the profiler times a
   shape (5 trials of >= 30 ms) over and over for ``--seconds``: the spread (10th and 90th
   percentile, and the largest, of its typical value) of the median of each 5 trials and of the
   fastest of each 5.
2. **Held-out accuracy under each statistic.** The quick CPU grid's GEMMs in one precision, every
   shape in its three layouts, timed in rounds (:func:`profiler.timing.time_rounds`), then the
   held-out shapes of ``benchmarks/profile_accuracy.py`` (a dimension between grid values) timed
   the same way right after. Each statistic builds its own profile from the grid's trials and is
   judged against the same statistic of the held-out trials: how many of them the planner's
   interpolation (:func:`planner.cost.compute.gemm_time_s`) prices within 15%.

    .venv/bin/python benchmarks/cpu_statistic.py [--precisions fp32,bf16] [--seconds 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from profile_accuracy import TARGET, held_out_gemms, measured_cluster  # noqa: E402

from planner.contracts import ComputeProfile, GemmPoint, Precision  # noqa: E402
from planner.cost.compute import gemm_time_s  # noqa: E402
from profiler.compute import _gemm_fn, default_grid  # noqa: E402
from profiler.timing import time_fn, time_rounds  # noqa: E402

CPU = torch.device("cpu")
TRIALS, MIN_TRIAL_S = 5, 0.03
STATISTICS = {"median": lambda ts: statistics.median(ts), "fastest": min}


def spread(values: list[float]) -> str:
    mid = statistics.median(values)
    ranked = sorted(values)
    return (f"p10 {ranked[len(ranked) // 10] / mid:.2f}, p90 {ranked[9 * len(ranked) // 10] / mid:.2f}, "
            f"max {ranked[-1] / mid:.2f} of typical")


def machine_movement(seconds: float) -> None:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    trials: list[list[float]] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        trials.append(time_fn(lambda: a @ b, device=CPU, warmup=1, trials=TRIALS, min_time_s=MIN_TRIAL_S).trials)
        time.sleep(0.3)
    print(f"512^3 fp32 GEMM, {len(trials)} measurements of {TRIALS} trials over {seconds:.0f} s:")
    for name, stat in STATISTICS.items():
        print(f"  {name:<8} of {TRIALS}: {spread([stat(t) for t in trials])}")


def held_out(precision: Precision) -> None:
    grid = default_grid(quick=True, device_type="cpu")
    layouts = list(dict.fromkeys(s[3] for s in grid.gemm))
    held = [(*s, lay) for s in held_out_gemms(grid, 10) for lay in layouts]

    def fns(shapes: list) -> list:
        return [_gemm_fn(m, n, k, precision, CPU, lay) for (m, n, k, lay) in shapes]

    t0 = time.perf_counter()
    profiled = time_rounds(fns(grid.gemm), device=CPU, warmup=2, trials=TRIALS, min_time_s=MIN_TRIAL_S)
    fresh = time_rounds(fns(held), device=CPU, warmup=2, trials=TRIALS, min_time_s=MIN_TRIAL_S)
    print(f"{precision.value}: {len(grid.gemm)} grid GEMMs, then {len(held)} held-out "
          f"({time.perf_counter() - t0:.0f} s)")
    for name, stat in STATISTICS.items():
        points = [GemmPoint(precision=precision, m=m, n=n, k=k, layout=lay, time_s=stat(r.trials))
                  for (m, n, k, lay), r in zip(grid.gemm, profiled)]
        cluster = measured_cluster(ComputeProfile(gemm=points, achieved_matmul_tflops={precision: 0.1}), CPU)
        errors = [abs(gemm_time_s(cluster, m, n, k, precision, layout=lay) - stat(r.trials)) / stat(r.trials)
                  for (m, n, k, lay), r in zip(held, fresh)]
        print(f"  {name:<8}: {sum(e <= TARGET for e in errors)} of {len(errors)} within {TARGET:.0%}, "
              f"median {statistics.median(errors) * 100:.1f}%, worst {max(errors) * 100:.1f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long to watch the machine move (part 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    machine_movement(args.seconds)
    for name in args.precisions.split(","):
        held_out(Precision(name.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
