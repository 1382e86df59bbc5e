"""MoE terms on one GPU, measured against the planner's price (issue 23: fine-grained MoE runs up to
2.3x slower than predicted; which of the dispatch terms holds on real hardware?).

(1) host synchronisation: GPU idle time of one device->host copy of the tokens-per-expert counts that
    a dropless dispatcher waits for, as the profiler measures it (``profiler.timing.host_sync_s``; the
    first runs in benchmarks/data/moe_h100.log also timed ``.cpu()`` + a stream sync, as Megatron-Core
    waits: within 2-10 us of ``.tolist()``). Against ``Assumptions.moe_host_sync_s``.
(2) expert GEMMs at Qwen3-30B-A3B's expert shape (h 2048, f 768, SwiGLU: up 2f), forward (nt): one
    GEMM per local expert on one stream (the executor), round-robin on 4 streams (Transformer Engine's
    GroupedLinear), and torch._grouped_mm (one kernel) where it runs, against
    ``planner.cost.compute.grouped_gemm_time_s`` on the GPU's reference profile (1 and 4 streams, and one
    kernel: every expert at once).
(3) the executor on one GPU: a 2-layer model of Qwen3-30B-A3B's blocks (vocabulary cut to 32k),
    seq 4096, micro-batch 1, bf16, predicted for target autopar (its expert GEMMs as the executor runs
    them on this GPU: planner.targets.priced_profile) against the measured median step and peak memory.
(4) the executor's MoE layer alone (bf16 weights, 4096 tokens), forward + backward, its experts as
    torch._grouped_mm and as the per-expert loop: wall time against the sum of its GPU kernels' time
    (torch.profiler): how much of the layer waits on the host.

    python3 benchmarks/moe_gpu_check.py [--skip-executor]          # on the GPU machine
    .venv/bin/python benchmarks/moe_gpu_check.py --smoke            # here: every path on the CPU, tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.contracts import (  # noqa: E402
    ClusterProfile,
    GemmLayout,
    ModelSpec,
    MoESpec,
    ParallelLayout,
    Precision,
    TrainingConfig,
)

H, F, EXPERTS, TOP_K = 2048, 768, 128, 8


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the wall time of ``reps`` calls, divided by ``reps`` (after a warm-up)."""
    fn()
    _sync(dev)
    times = []
    for _ in range(rounds):
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(dev)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def expert_loop(x: list[torch.Tensor], w: torch.Tensor, streams: list) -> None:
    """One GEMM per expert (x[e] @ w[e].T), round-robin over ``streams`` (None: the current stream)."""
    if not streams:
        for e, xe in enumerate(x):
            xe @ w[e].T
        return
    main = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(main)
    for e, xe in enumerate(x):
        with torch.cuda.stream(streams[e % len(streams)]):
            xe @ w[e].T
    for s in streams:
        main.wait_stream(s)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, rows: int):
    """torch._grouped_mm over the experts (one kernel), or None where this build or GPU has none."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None or x.device.type != "cuda":
        return None
    offs = torch.arange(rows, rows * (w.shape[0] + 1), rows, device=x.device, dtype=torch.int32)
    wt = w.transpose(1, 2)
    try:
        fn(x, wt, offs=offs)
    except Exception as exc:  # noqa: BLE001 - a kernel this build lacks is reported, not fatal
        print(f"    torch._grouped_mm: not run ({type(exc).__name__}: {str(exc)[:120]})")
        return None
    return lambda: fn(x, wt, offs=offs)


def expert_gemms(dev: torch.device, profile: ClusterProfile, cases: list[tuple[int, int]], reps: int) -> None:
    """(2): measured vs priced forward expert GEMMs, per (local experts, rows per expert)."""
    from planner.cost.compute import grouped_gemm_time_s

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    prec = Precision.bf16 if dev.type == "cuda" else Precision.fp32
    print(f"\n(2) forward expert GEMMs (nt), h {H}, f {F}; profile '{profile.name}'")
    print(f"    {'experts x rows':>15} {'GEMM':>6} {'1 stream':>9} {'4 streams':>9} {'grouped_mm':>10}"
          f" {'priced 1':>9} {'priced 4':>9} {'priced all':>10}  (us per grouped GEMM)")
    streams = [torch.cuda.Stream(dev) for _ in range(4)] if dev.type == "cuda" else []
    for experts, rows in cases:
        for name, n, k in (("up", 2 * F, H), ("down", H, F)):
            x = torch.randn(experts * rows, k, device=dev, dtype=dtype)
            w = torch.randn(experts, n, k, device=dev, dtype=dtype)
            parts = list(x.split(rows))
            one = timed(lambda parts=parts, w=w: expert_loop(parts, w, []), dev, reps)
            four = (timed(lambda parts=parts, w=w: expert_loop(parts, w, streams), dev, reps)
                    if streams else float("nan"))
            g = grouped_mm(x, w, rows)
            gm = timed(g, dev, reps) if g else float("nan")
            p1, p4, pa = (grouped_gemm_time_s(profile, rows, n, k, prec, experts, s, GemmLayout.nt)
                          for s in (1, 4, experts))
            print(f"    {experts:>6} x {rows:<6} {name:>6} {one * 1e6:9.0f} {four * 1e6:9.0f} {gm * 1e6:10.0f}"
                  f" {p1 * 1e6:9.0f} {p4 * 1e6:9.0f} {pa * 1e6:10.0f}")


def moe_spec(layers: int, vocab: int, hidden: int = H, ffn: int = F, experts: int = EXPERTS) -> ModelSpec:
    """Qwen3-30B-A3B's blocks (planner/presets.py), ``layers`` of them, vocabulary ``vocab``."""
    return ModelSpec(name=f"qwen3-moe-{layers}l", num_layers=layers, hidden_size=hidden, num_attention_heads=32,
                     num_kv_heads=4, head_dim=hidden // 16, ffn_hidden_size=3 * hidden, vocab_size=vocab,
                     moe=MoESpec(num_experts=experts, top_k=TOP_K, expert_ffn_hidden_size=ffn))


def executor_run(profile: ClusterProfile, spec: ModelSpec, training: TrainingConfig, steps: int, smoke: bool) -> None:
    """(3): the executor's step on one device against the prediction for target autopar."""
    from benchmarks.executor import run_executor
    from planner.contracts import Plan
    from planner.cost.predict import predict
    from planner.targets import ONE_KERNEL, priced_profile

    profile = profile.model_copy(update={"gpus_per_node": 1, "num_nodes": 1})
    layout = ParallelLayout(micro_batch_size=1, zero_stage=0)
    pred = predict(spec, training, profile, layout, target="autopar")
    plan = Plan(model=spec, training=training, cluster=profile.name, num_gpus=1, layout=layout,
                precision=training.precision, prediction=pred)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "moe.json"
        path.write_text(plan.model_dump_json())
        report = run_executor(path, 1, steps, 2 if smoke else 3, Path(tmp))
    streams = priced_profile(profile, "autopar", training.precision).assumptions.grouped_gemm_streams
    measured, how = report.median_step_time_s, "one kernel" if streams == ONE_KERNEL else f"{streams} at once"
    print(f"\n(3) executor, one device: {spec.name} (h {spec.hidden_size}, {spec.moe.num_experts} experts of "
          f"{spec.moe.expert_ffn_hidden_size}, top-{TOP_K}), seq {training.seq_length}, batch "
          f"{training.global_batch_size}, micro-batch 1, {training.precision.value}; profile '{profile.name}'")
    print(f"    step time   measured {measured * 1e3:8.1f} ms; predicted (autopar, expert GEMMs {how}) "
          f"{pred.step_time_s * 1e3:8.1f} ms ({pred.step_time_s / measured - 1:+.0%})")
    print(f"    peak memory measured {report.peak_memory_bytes_per_rank[0] / 2**30:8.2f} GiB ({report.memory_kind}); "
          f"predicted allocated {pred.memory.allocated_bytes / 2**30:.2f} GiB, "
          f"total {pred.memory.total_bytes / 2**30:.2f} GiB")
    print(f"    predicted: compute {pred.compute_time_s * 1e3:.1f} ms, optimizer "
          f"{pred.optimizer_time_s * 1e3:.1f} ms, exposed communication {pred.exposed_comm_time_s * 1e3:.1f} ms")


def moe_layer(dev: torch.device, tokens: int, reps: int) -> None:
    """(4): one MoE layer's forward + backward, wall against GPU kernel time."""
    from torch.profiler import ProfilerActivity, profile

    from executor.moe import MoE

    spec = moe_spec(1, 256) if dev.type == "cuda" else moe_spec(1, 256, 64, 32, 8)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    layer = MoE(spec.hidden_size, spec.moe).to(dev, dtype)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, spec.hidden_size, device=dev, dtype=dtype, requires_grad=True)

    def step():
        (layer(x).float().square().mean() + layer.aux_loss).backward()

    for grouped in (True, False):
        layer.experts.use_grouped_mm = grouped
        wall = timed(step, dev, reps, rounds=3)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            step()
            _sync(dev)
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel = sum(e.self_device_time_total for e in events) / 1e6
        how = "torch._grouped_mm where it runs" if grouped else "per-expert loop"
        print(f"\n(4) executor MoE layer ({how}), {tokens} tokens, {spec.moe.num_experts} experts of "
              f"{spec.moe.expert_ffn_hidden_size}: forward + backward {wall * 1e3:.1f} ms wall, GPU kernels "
              f"{kernel * 1e3:.1f} ms")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:5]:
            print(f"    {e.key[:60]:60} {e.self_device_time_total / 1e3:8.2f} ms  x{e.count}")


def gpu_profile(dev: torch.device) -> ClusterProfile:
    from planner.reference import datasheet_for, reference_profile

    if dev.type != "cuda":
        return reference_profile("h100")
    found = datasheet_for(torch.cuda.get_device_name(dev))
    return reference_profile(found[0] if found else "h100")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks every path runs")
    ap.add_argument("--skip-executor", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    profile = gpu_profile(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke)"
    print(f"device: {name}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    from profiler.timing import host_sync_s

    idle = host_sync_s(dev)
    measured = "no device to idle (CPU)" if idle is None else f"{idle * 1e6:.1f} us"
    print(f"\n(1) host synchronisation (profiler.timing.host_sync_s): GPU idle per .tolist() {measured}; "
          f"Assumptions.moe_host_sync_s {profile.assumptions.moe_host_sync_s * 1e6:.0f} us")
    tokens = 4096
    cases = [(8, 16)] if args.smoke else [(EXPERTS, tokens * TOP_K // EXPERTS), (EXPERTS // 8, tokens * TOP_K // 16),
                                         (EXPERTS, 2 * tokens * TOP_K // EXPERTS)]
    expert_gemms(dev, profile, cases, 3 if args.smoke else 20)
    moe_layer(dev, 64 if args.smoke else tokens, 2 if args.smoke else 5)
    if not args.skip_executor:
        spec = moe_spec(1, 256, 64, 32, 8) if args.smoke else moe_spec(2, 32000)
        training = TrainingConfig(seq_length=64 if args.smoke else 4096, global_batch_size=2,
                                  precision="fp32" if args.smoke else "bf16")
        executor_run(profile, spec, training, 3 if args.smoke else args.steps, args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
