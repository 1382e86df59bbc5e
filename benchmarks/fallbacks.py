"""Fallback plans for 1 and 2 lost nodes for every job of the targets matrix that has 3 nodes or more.

For each job of ``benchmarks/targets_matrix.py``'s ``JOBS`` on at least 3 nodes the search plans it for the
first target that runs it (the executor, else Megatron-LM, torchtitan, DeepSpeed), then
``planner.fallback.fallback_plans`` plans the loss of 1 and 2 nodes: the same model and global batch on the
nodes left (on an uneven count the search may leave some idle, ``planner.search.sizing``). Printed per job:
the plan, each fallback's layout, GPUs used and step time against the plan's, or why there is none. Target:
a fallback for 1 and 2 lost nodes for every job.

    .venv/bin/python benchmarks/fallbacks.py [--budget 20]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.contracts import TrainingConfig  # noqa: E402
from planner.errors import AutoparError  # noqa: E402
from planner.fallback import fallback_plans  # noqa: E402
from planner.presets import get_preset  # noqa: E402
from planner.reference import reference_profile  # noqa: E402
from planner.search import SearchOptions, search  # noqa: E402

LOST = 2
TARGETS = ("autopar", "megatron", "torchtitan", "deepspeed")  # the first that plans a job is used


def matrix_jobs() -> list:
    """targets_matrix.JOBS, the module loaded by path (benchmarks/ on sys.path would shadow ``executor``)."""
    spec = importlib.util.spec_from_file_location("targets_matrix", Path(__file__).parent / "targets_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["targets_matrix"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.JOBS


def first_plan(job, training: TrainingConfig, profile, budget: float):  # noqa: ANN001, ANN201
    """(plan, options) of the first target of TARGETS that plans the job (the executor's built-in model does not
    build GPT-3's learned positions or MLA, and no target here runs FP8 but Megatron), or (None, None)."""
    for target in TARGETS:
        opts = SearchOptions(top_k=1, time_budget_s=budget, target=target)
        try:
            return search(get_preset(job.model), training, profile, opts), opts
        except AutoparError:
            continue
    return None, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=20.0, help="search seconds per plan (its fallbacks share as much)")
    args = ap.parse_args()
    jobs = [j for j in matrix_jobs() if j.gpus // reference_profile(j.system).gpus_per_node >= 3]
    found, wanted, start = 0, 0, time.perf_counter()
    for job in jobs:
        profile = reference_profile(job.system, gpus=job.gpus)
        training = TrainingConfig(seq_length=job.seq, global_batch_size=job.gbs, precision=job.precision)
        name = f"{job.model} {job.system} x{job.gpus} seq {job.seq} batch {job.gbs}"
        wanted += LOST
        plan, opts = first_plan(job, training, profile, args.budget)
        if plan is None:
            print(f"{name}: no target plans it; its fallbacks count as missing")
            continue
        print(f"{name} [{opts.target}]: {plan.layout.summary()} {plan.prediction.step_time_s:.3g} s")
        for f in fallback_plans(plan, profile, LOST, opts):
            ok = f.layout is not None
            found += ok
            what = (f"{f.num_gpus} GPUs, {f.layout.summary()}, {f.prediction.step_time_s:.3g} s ({f.slower_by:+.1%})"
                    if ok else f"none: {f.reason}")
            print(f"  lose {f.lost_nodes} node(s): {what}")
    print(f"\nfallbacks found: {found} of {wanted} ({len(jobs)} jobs with >= 3 nodes x {LOST}); target all: "
          f"{'PASS' if found == wanted else 'MISS'} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
