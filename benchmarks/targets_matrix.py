"""Every plan is accepted by its target: a matrix of jobs x targets.

For each job (dense 8B-405B, Mixtral, Qwen3-30B-A3B, DeepSeek-V3; 1 GPU to 1,024 nodes; A100, H100,
B200; sequences of 2k to 128k) and each target (autopar, megatron, deepspeed, torchtitan) the search runs
with ``target=`` and every returned plan and alternative is checked three ways:

- the target's capability table accepts it (``planner.targets.refusal`` is None);
- ``autopar export --to`` writes it (megatron, deepspeed, torchtitan; into a temporary folder);
- the executor's own refusal passes it (autopar: ``executor.train.check_plan``, which imports torch);
- CPU-sized jobs (a small model on 1, 2 and 4 ranks): ``autopar run PLAN --dry-run`` exits 0 on this machine.

A target that refuses the job itself (the built-in decoder has no learned positions or MLA; DeepSpeed has
no FP8 setting) returns no plan and says why: that is counted apart, not as a failure. Target: 100% of the
returned plans and alternatives accepted.

    .venv/bin/python benchmarks/targets_matrix.py [--budget 10] [--only N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner import targets  # noqa: E402
from planner.contracts import Plan, TrainingConfig  # noqa: E402
from planner.errors import AutoparError  # noqa: E402
from planner.export import export_plan  # noqa: E402
from planner.presets import get_preset  # noqa: E402
from planner.reference import reference_profile  # noqa: E402
from planner.search import SearchOptions, search  # noqa: E402


@dataclass(frozen=True)
class Job:
    model: str
    system: str
    gpus: int
    seq: int
    gbs: int
    precision: str = "bf16"


JOBS = [
    Job("llama3.1-8b", "dgx-h100", 1, 2048, 8),
    Job("llama3.1-8b", "dgx-h100", 4, 8192, 32),
    Job("llama3.1-8b", "dgx-h100", 8, 8192, 64),
    Job("llama3.1-8b", "dgx-a100-80gb", 64, 4096, 512),
    Job("llama3.1-8b", "dgx-b200", 8, 131072, 8),
    Job("llama3.1-8b", "hgx-h200", 16, 16384, 128, "fp8"),
    Job("llama2-7b", "dgx-a100-40gb", 8, 4096, 128),
    Job("llama2-13b", "dgx-a100-80gb", 16, 4096, 256),
    Job("llama3.1-70b", "dgx-h100", 64, 8192, 256),
    Job("llama3.1-70b", "dgx-a100-80gb", 256, 4096, 1024),
    Job("llama3.1-70b", "dgx-b200", 32, 32768, 64),
    Job("llama3-70b", "dgx-h100", 512, 65536, 256),
    Job("llama3.1-405b", "dgx-h100", 1024, 8192, 2048),
    Job("llama3.1-405b", "dgx-h100", 8192, 8192, 16384),
    Job("llama3.1-405b", "dgx-b200", 128, 131072, 128),
    Job("gpt3-175b", "dgx-a100-80gb", 384, 2048, 1536),
    Job("gpt3-175b", "dgx-h100", 1024, 2048, 2048),
    Job("megatron-22b", "dgx-a100-80gb", 8, 2048, 4),
    Job("mixtral-8x7b", "dgx-h100", 64, 4096, 512),
    Job("mixtral-8x7b", "dgx-a100-80gb", 16, 4096, 128),
    Job("qwen3-30b-a3b", "dgx-h100", 16, 4096, 256),
    Job("qwen3-30b-a3b", "dgx-b200", 64, 32768, 128),
    Job("deepseek-v3", "dgx-h100", 256, 4096, 1024),
    Job("deepseek-v3", "hgx-h800", 1024, 4096, 4096, "fp8"),
]
TARGETS = [t.value for t in targets.Target]


def accepted(plan: Plan, target: str, out: Path) -> list[str]:
    """Why the target would refuse the plan or an alternative ([] when it accepts all of them)."""
    problems = []
    for i, layout in enumerate([plan.layout, *(a.layout for a in plan.alternatives)]):
        one = plan.model_copy(update={"layout": layout})
        job = targets.job_of(one)
        found = targets.refusal(target, job)
        if found is not None:
            problems.append(f"#{i} table: {found}")
            continue
        try:
            if target == "autopar":
                from executor.train import check_plan

                check_plan(one)
            else:
                export_plan(one, target)
        except AutoparError as exc:
            problems.append(f"#{i} {'executor' if target == 'autopar' else 'export'}: {exc}")
    return problems


def run_one(job: Job, target: str, budget: float, out: Path) -> tuple[str, int, list[str]]:
    """(outcome, plans checked, problems) of one job for one target."""
    training = TrainingConfig(seq_length=job.seq, global_batch_size=job.gbs, precision=job.precision)
    profile = reference_profile(job.system, gpus=job.gpus)
    try:
        plan = search(get_preset(job.model), training, profile, SearchOptions(target=target, top_k=5,
                                                                              time_budget_s=budget))
    except targets.TargetRefusal as exc:
        return f"refused: {exc.feature}", 0, []
    except AutoparError as exc:
        return f"no plan: {exc.problem or exc}", 0, []
    problems = accepted(plan, target, out)
    lay = plan.layout
    text = (f"tp{lay.tp} pp{lay.pp} cp{lay.cp} ep{lay.ep} dp{lay.dp} z{lay.zero_stage} {lay.schedule.value} "
            f"MFU {plan.prediction.mfu:.1%}")
    return text, 1 + len(plan.alternatives), problems


TINY = dict(name="tiny-llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_kv_heads=4,
            ffn_hidden_size=768, vocab_size=1024)


def cpu_sized(budget: float, out: Path) -> tuple[int, list[str]]:
    """Plans of a small model for 1, 2 and 4 ranks (autopar target), each plan and alternative checked by
    ``autopar run PLAN --dry-run`` on this machine's CPU (AUTOPAR_FORCE_CPU=1): (checked, failures)."""
    import os
    import subprocess

    from planner.contracts import ModelSpec

    checked, failures = 0, []
    for gpus in (1, 2, 4):
        training = TrainingConfig(seq_length=256, global_batch_size=8, precision="fp32")
        plan = search(ModelSpec(**TINY), training, reference_profile("dgx-h100", gpus=gpus),
                      SearchOptions(top_k=3, time_budget_s=budget))
        for i, layout in enumerate([plan.layout, *(a.layout for a in plan.alternatives)]):
            path = out / f"cpu-{gpus}-{i}.json"
            path.write_text(plan.model_copy(update={"layout": layout}).model_dump_json())
            run = subprocess.run([sys.executable, "-m", "planner.cli", "run", str(path), "--dry-run"],
                                 capture_output=True, text=True, env={**os.environ, "AUTOPAR_FORCE_CPU": "1"})
            checked += 1
            line = (run.stdout or run.stderr).strip().splitlines()[-1] if (run.stdout or run.stderr) else ""
            print(f"  {gpus} rank(s) #{i}: exit {run.returncode}: {line[:150]}")
            if run.returncode:
                failures.append(f"{gpus} rank(s) #{i}: {line}")
    return checked, failures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=10.0, help="search time budget per job and target (s)")
    ap.add_argument("--only", type=int, default=None, help="the first N jobs")
    args = ap.parse_args()
    jobs = JOBS[: args.only] if args.only else JOBS
    checked = bad = refused = unfit = 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for job in jobs:
            print(f"{job.model} on {job.gpus} x {job.system}, seq {job.seq}, batch {job.gbs}, {job.precision}")
            for target in TARGETS:
                t0 = time.perf_counter()
                outcome, n, problems = run_one(job, target, args.budget, Path(tmp))
                checked += n
                bad += bool(problems)
                refused += outcome.startswith("refused")
                unfit += outcome.startswith("no plan")
                mark = "ok" if not problems else "REFUSED BY ITS TARGET"
                print(f"  {target:10} {outcome:70} {n} plans {mark} ({time.perf_counter() - t0:.1f} s)")
                for p in problems:
                    print(f"      {p}")
        print("CPU-sized jobs: `autopar run --dry-run` on this machine")
        cpu_checked, cpu_failures = cpu_sized(args.budget, Path(tmp))
    pairs = len(jobs) * len(TARGETS)
    planned = pairs - refused - unfit
    share = 1 - bad / max(planned, 1)
    print(f"\nsummary: {len(jobs)} jobs x {len(TARGETS)} targets = {pairs}; {planned} planned "
          f"({checked} plans and alternatives checked), {refused} refused by their target with the reason above, "
          f"{unfit} with no layout that fits; "
          f"accepted {share:.0%} of the planned pairs (target 100%); {time.perf_counter() - start:.0f} s")
    print(f"CPU-sized: {cpu_checked - len(cpu_failures)}/{cpu_checked} plans and alternatives pass "
          f"`autopar run --dry-run` here (target 100%)")
    return 0 if bad == 0 and not cpu_failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
