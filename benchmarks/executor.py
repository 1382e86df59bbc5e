"""Executor benchmark: its overhead, and how well the planner's predictions rank real runs.

(a) overhead — the executor's plain data-parallel path (DDP over 4 CPU ranks) against a hand-written
    torch DDP script (below, same model, weights, data, micro-batches, optimizer and timing) run back
    to back, twice each, interleaved; ratio of the median step times (target: within 5%).
(b) prediction vs reality — a CPU ClusterProfile (``--profile P.json``, or ``autopar profile --quick``
    under torchrun), >= 8 layouts of one model on 4 CPU ranks: predicted step time
    (``planner.cost.predict.predict`` on that profile) vs measured median step time, the Spearman rank
    correlation (target >= 0.8) and the top-1 regret: measured time of the predicted-fastest layout /
    the measured fastest - 1 (target <= 10%).
(c) on a GPU (when torch.cuda.is_available()): a single-GPU plan's predicted vs measured step time and
    peak memory (the reference profile of the GPU, or ``--profile``).

    .venv/bin/python benchmarks/executor.py [--profile P.json] [--steps 12] [--skip-overhead]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpu_bench import LAYOUTS, SPEC, TRAINING, cpu_profile, torchrun  # noqa: E402  (benchmarks/cpu_bench.py)

from planner.contracts import ClusterProfile, ModelSpec, ParallelLayout, RunReport, TrainingConfig  # noqa: E402
from planner.run_calibration import spearman  # noqa: E402

HAND_DDP = r'''
"""Hand-written DDP: what a person would write without autopar (same model, data and timing)."""
import json, statistics, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from executor.data import SyntheticTokens
from executor.model import build_model, init_weights
from executor.reference import lm_loss, make_optimizer
from planner.contracts import Plan

plan = Plan.model_validate_json(open(sys.argv[1]).read())
steps, warmup, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = build_model(plan.model, device="cpu")
init_weights(model, 0)
ddp = DDP(model)
opt = make_optimizer(model.parameters(), 1e-3)
seq, gbs, mbs = plan.training.seq_length, plan.training.global_batch_seqs, plan.layout.micro_batch_size
data = SyntheticTokens(plan.model.vocab_size, seq, 0)
per = gbs // world
times = []
for step in range(steps):
    rows = data.batch(step, gbs)[rank * per:(rank + 1) * per]
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    for i in range(0, per, mbs):
        mb = rows[i:i + mbs]
        last = i + mbs >= per
        ctx = ddp.no_sync() if not last else torch.enable_grad()
        with ctx:
            loss = lm_loss(ddp(mb[:, :-1]), mb[:, 1:], gbs * seq) * world
            loss.backward()
    opt.step()
    dist.barrier()
    times.append(time.perf_counter() - t0)
if rank == 0:
    json.dump({"median_step_time_s": statistics.median(times[warmup:])}, open(out, "w"))
dist.destroy_process_group()
'''

def make_plan(layout: dict, profile: ClusterProfile, path: Path):
    from planner.tune import plan_for

    plan = plan_for(SPEC, TRAINING, ParallelLayout(**layout), profile)
    path.write_text(plan.model_dump_json())
    return plan


def run_executor(plan_path: Path, nproc: int, steps: int, warmup: int, tmp: Path) -> RunReport:
    out = tmp / "report.json"
    out.unlink(missing_ok=True)
    torchrun(nproc, "-m", "executor.train", "--plan", str(plan_path), "--steps", str(steps), "--warmup",
             str(warmup), "--out", str(out))
    return RunReport.model_validate_json(out.read_text())


def overhead(profile: ClusterProfile, steps: int, tmp: Path) -> float:
    """(a): median step time of the executor's DDP4 / the hand-written DDP4 (best of two runs each)."""
    plan_path = tmp / "ddp4.json"
    make_plan({"dp_shard": 4}, profile, plan_path)
    script = tmp / "hand_ddp.py"
    script.write_text(HAND_DDP)
    mine, hand = [], []
    for _ in range(2):
        mine.append(run_executor(plan_path, 4, steps, 3, tmp).median_step_time_s)
        torchrun(4, str(script), str(plan_path), str(steps), "3", str(tmp / "hand.json"))
        hand.append(json.loads((tmp / "hand.json").read_text())["median_step_time_s"])
    ratio = min(mine) / min(hand)
    print("\n(a) overhead: executor DDP4 vs hand-written torch DDP4 (4 CPU ranks, gloo, same model/data)")
    print(f"    executor   median step {min(mine) * 1e3:8.2f} ms   (runs: {', '.join(f'{t * 1e3:.2f}' for t in mine)})")
    print(f"    hand DDP   median step {min(hand) * 1e3:8.2f} ms   (runs: {', '.join(f'{t * 1e3:.2f}' for t in hand)})")
    print(f"    ratio {ratio:.3f}  target <= 1.05: {'PASS' if ratio <= 1.05 else 'MISS'}")
    return ratio


def prediction_vs_reality(profile: ClusterProfile, steps: int, tmp: Path) -> tuple[float, float]:
    """(b): predicted vs measured step time of every layout; Spearman rho and top-1 regret."""
    from executor.train import check_plan
    from planner.errors import AutoparError

    rows = []
    print(f"\n(b) prediction vs reality on 4 CPU ranks, profile '{profile.name}' ({profile.kind})")
    print(f"    {'layout':<44} {'predicted':>11} {'measured':>11}")
    for layout in LAYOUTS.values():
        path = tmp / "plan.json"
        try:
            plan = make_plan(layout, profile, path)
            check_plan(plan)
        except (AutoparError, ValueError) as exc:
            print(f"    {json.dumps(layout):<44} skipped: {exc}")
            continue
        measured = run_executor(path, 4, steps, 3, tmp).median_step_time_s
        rows.append((layout, plan.prediction.step_time_s, measured))
        print(f"    {json.dumps(layout):<44} {plan.prediction.step_time_s * 1e3:9.2f}ms {measured * 1e3:9.2f}ms")
    pred, meas = [r[1] for r in rows], [r[2] for r in rows]
    rho = spearman(pred, meas)
    best_pred = min(range(len(rows)), key=lambda i: pred[i])
    regret = meas[best_pred] / min(meas) - 1
    print(f"    {len(rows)} layouts; Spearman rho {rho:.2f} (target >= 0.8: {'PASS' if rho >= 0.8 else 'MISS'}); "
          f"top-1 regret {regret:.1%} (predicted best {json.dumps(rows[best_pred][0])}; "
          f"target <= 10%: {'PASS' if regret <= 0.10 else 'MISS'})")
    return rho, regret


def single_gpu(profile_path: str | None, steps: int, tmp: Path) -> None:
    """(c): a single-GPU plan's predicted vs measured step time and peak memory."""
    import torch

    from planner.reference import datasheet_for, reference_profile

    name = torch.cuda.get_device_name(0)
    if profile_path:
        profile = ClusterProfile.model_validate_json(Path(profile_path).read_text())
    else:
        found = datasheet_for(name)
        profile = reference_profile(found[0] if found else "h100")
    profile = profile.model_copy(update={"gpus_per_node": 1, "num_nodes": 1})
    spec = ModelSpec(name="gpu-bench", num_layers=8, hidden_size=2048, num_attention_heads=16, num_kv_heads=8,
                     ffn_hidden_size=5632, vocab_size=32000)
    training = TrainingConfig(seq_length=2048, global_batch_size=8, precision="bf16")
    from planner.tune import plan_for

    plan = plan_for(spec, training, ParallelLayout(micro_batch_size=2, zero_stage=2), profile)
    path = tmp / "gpu.json"
    path.write_text(plan.model_dump_json())
    report = run_executor(path, 1, steps, 3, tmp)
    print(f"\n(c) single GPU ({name}), profile '{profile.name}': {spec.num_layers} layers x {spec.hidden_size}, "
          f"seq {training.seq_length}, batch {training.global_batch_size}, bf16")
    print(f"    step time   predicted {plan.prediction.step_time_s * 1e3:8.1f} ms   measured "
          f"{report.median_step_time_s * 1e3:8.1f} ms   "
          f"({plan.prediction.step_time_s / report.median_step_time_s - 1:+.0%})")
    print(
        f"    peak memory predicted {plan.prediction.memory.total_bytes / 2**30:8.2f} GiB  measured "
        f"{report.peak_memory_bytes_per_rank[0] / 2**30:8.2f} GiB ({report.memory_kind})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="CPU ClusterProfile JSON (default: measure one, ~1 min)")
    ap.add_argument("--gpu-profile", default=None, help="ClusterProfile of the GPU for (c)")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (3 warm-up)")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-cpu", action="store_true", help="only (c)")
    args = ap.parse_args(argv)
    import torch

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if not args.skip_cpu:
            profile = cpu_profile(args.profile, tmp)
            if not args.skip_overhead:
                overhead(profile, args.steps, tmp)
            prediction_vs_reality(profile, args.steps, tmp)
        if torch.cuda.is_available():
            single_gpu(args.gpu_profile, args.steps, tmp)
        else:
            print("\n(c) skipped: no CUDA device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
