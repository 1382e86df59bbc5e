"""Where one executor step's time goes, beside what the planner predicted for it.

Runs a plan's step in this process (under torchrun, one rank) with ``torch.profiler``: after
``--warmup`` steps, one step is profiled, and its GPU kernel time is sorted into GEMMs, attention,
the optimizer, copies and the other (elementwise / reduction) kernels, against the step's wall time:
what is left is time the GPU waited for the host (Python, autograd, FSDP hooks, kernel launches),
which the cost model does not charge. On CPU only the wall time and the top operators are printed.

    torchrun --standalone --nproc-per-node 1 benchmarks/step_breakdown.py --profile P.json [--zero 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # gpu_timing_check, after the repo (executor/ != executor.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from executor.train import RunOptions, Runtime  # noqa: E402
from planner.contracts import ClusterProfile, ModelSpec, ParallelLayout, TrainingConfig  # noqa: E402
from planner.tune import plan_for  # noqa: E402

KINDS = (  # (kind, words of a kernel's name), first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "sm90_", "sm80_")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, words in KINDS if any(w in low for w in words)), "other")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="ClusterProfile the plan is priced on")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--loop-rounds", type=int, default=0,
                    help="after the profile, this many rounds of one bare step and one timed as executor.train "
                         "times it (device sync and barrier on both sides), interleaved: does its loop add time?")
    a = ap.parse_args(argv)
    if a.warmup < 2:
        ap.error(f"--warmup {a.warmup}: give at least 2 (the first step compiles and allocates; the rest are timed)")
    cluster = ClusterProfile.model_validate_json(Path(a.profile).read_text())
    cluster = cluster.model_copy(update={"gpus_per_node": 1, "num_nodes": 1})
    heads = max(a.hidden // 128, 1)
    spec = ModelSpec(name="breakdown", num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=heads,
                     num_kv_heads=max(heads // 2, 1), ffn_hidden_size=a.hidden * 11 // 4 // 64 * 64, vocab_size=32000)
    training = TrainingConfig(seq_length=a.seq, global_batch_size=a.batch, precision=a.precision)
    plan = plan_for(spec, training, ParallelLayout(micro_batch_size=a.micro, zero_stage=a.zero), cluster)
    rt = Runtime(plan, RunOptions(steps=a.warmup + 1, warmup=a.warmup))
    cuda = rt.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed_step(step: int, fenced: bool = False) -> float:
        """Seconds of one step, its batch prepared before the timer as in executor.train; ``fenced``:
        with executor.train's barrier on both sides too."""
        rt.prefetch(step)
        sync()
        if fenced:
            dist.barrier()
        t0 = time.perf_counter()
        rt.step(step)
        rt.optimizer.step()
        sync()
        if fenced:
            dist.barrier()
        return time.perf_counter() - t0

    walls = [timed_step(step) for step in range(a.warmup)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rt.prefetch(a.warmup)
    with profile(activities=activities) as prof:
        sync()
        t0 = time.perf_counter()
        rt.step(a.warmup)
        rt.optimizer.step()
        sync()
        wall = time.perf_counter() - t0
    pred = plan.prediction
    print(f"model {a.layers} layers x {a.hidden}, seq {a.seq}, batch {a.batch} (micro {a.micro}), ZeRO-{a.zero}, "
          f"{a.precision}, on {torch.cuda.get_device_name(rt.device) if cuda else 'cpu'}")
    print(f"step wall: warm-up steps {', '.join(f'{w * 1e3:.1f}' for w in walls)} ms; profiled {wall * 1e3:.1f} ms "
          "(the profiler adds some host time)")
    print(f"predicted: step {pred.step_time_s * 1e3:.1f} ms = compute {pred.compute_time_s * 1e3:.1f} + optimizer "
          f"{pred.optimizer_time_s * 1e3:.1f} + exposed comm {pred.exposed_comm_time_s * 1e3:.1f} ms; "
          f"MFU {pred.mfu:.1%}; measured MFU at the median of the warm-up steps after the first "
          f"{pred.mfu * pred.step_time_s / statistics.median(walls[1:]):.1%}")
    events = prof.key_averages()
    if cuda:
        from gpu_timing_check import gpu_rows_s

        kernels = gpu_rows_s(events)
        if not kernels:
            print("no GPU rows in the profile (this torch's profiler labels them otherwise)")
            kernels = {"(none)": 1e-9}
        busy = sum(kernels.values())
        by_kind: dict[str, float] = {}
        for name, t in kernels.items():
            by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + t
        print(f"GPU kernels: {busy * 1e3:.1f} ms summed over kernels, of {wall * 1e3:.1f} ms wall ({busy / wall:.0%}); "
              f"the rest, {(wall - busy) * 1e3:.1f} ms, the GPU waited for the host")
        for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"  {k:<10} {t * 1e3:8.2f} ms  {t / busy:5.1%}")
        print(f"top {a.top} kernels by GPU time:")
        for name, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:a.top]:
            print(f"  {t * 1e3:8.2f} ms  {kind_of(name):<9} {name[:110]}")
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                             "cuLaunchKernelEx"))
        print(f"kernel launches in the step: {launches}")
    print(f"top {a.top} operators by host time:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:a.top]:
        print(f"  {e.self_cpu_time_total / 1e3:8.2f} ms  x{e.count:<6} {e.key[:100]}")
    if a.loop_rounds > 0:
        loops: dict[str, list[float]] = {"bare": [], "executor.train's": []}
        step = a.warmup + 1
        for r in range(a.loop_rounds):  # the order alternates: neither loop always runs first
            for kind, fenced in (("bare", False), ("executor.train's", True))[:: 1 if r % 2 == 0 else -1]:
                loops[kind].append(timed_step(step, fenced))
                step += 1
        print(f"step loops, {a.loop_rounds} interleaved rounds (torch threads {torch.get_num_threads()}): "
              + "; ".join(f"{k} median {statistics.median(v) * 1e3:.1f} ms ({min(v) * 1e3:.0f}-{max(v) * 1e3:.0f})"
                          for k, v in loops.items()))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
