"""Does a GEMM run at the same speed back to back as inside a step's mix? (GPU clocks under the power cap)

The profiler times each GEMM in short trials; a training step runs its GEMMs between memory-bound
kernels and host gaps; a long stretch of GEMMs alone draws the board to its power limit and the SM
clock down. This times one GEMM shape (by default the largest of benchmarks/executor.py (c)'s step,
tokens 4096 x 5632 x 2048, bf16) with CUDA events in four surroundings, each for a few seconds:
back to back (CUDA events around each GEMM, and around blocks of ten as the profiler's trials time
many calls: per-GEMM events may read a few per cent slower), each followed by a large fp32 add
(memory-bound), each followed by a short and a long spin kernel (an idle-ish GPU), with the SM clock
and board power read through NVML meanwhile (:class:`profiler.gpustate.GpuStateSampler`); then as
the profiler times it (:func:`profiler.timing.time_fn`, held, 5 ms trials). README "On a GPU"'s
figures came from a first draft of this script (per-GEMM events only, NVML device 0). Prints per-GEMM
time and TFLOP/s beside clock and power; there is no target (a diagnostic of README "On a GPU").

    python benchmarks/gemm_clock.py [--m 4096 --n 5632 --k 2048] [--seconds 2.5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from profiler.gpustate import GpuStateSampler  # noqa: E402
from profiler.timing import time_fn  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--n", type=int, default=5632)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=2.5, help="per surrounding and repeat")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_clock: no CUDA device here; nothing to measure")
        return 0
    dev = torch.device("cuda", 0)
    x = torch.randn(a.m, a.k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(a.k, a.n, device=dev, dtype=torch.bfloat16)
    out = torch.empty(a.m, a.n, device=dev, dtype=torch.bfloat16)
    big = torch.randn(1 << 27, device=dev)  # 512 MiB of fp32
    big_out = torch.empty_like(big)

    def gemm() -> None:
        torch.matmul(x, w, out=out)

    flop = 2 * a.m * a.n * a.k

    def surrounding(name: str, after, per_block: bool = False, rep: int = 0) -> None:  # noqa: ANN001
        """GEMMs, each followed by ``after()``, for a.seconds: the first quarter warms up (its
        samples and times are left out); CUDA events around each GEMM, or around each block of ten
        (``per_block``: one pair per ten GEMMs, as the profiler's trials time many calls)."""
        events, key, warm = [], f"{name} #{rep}", True
        torch.cuda.synchronize()
        sampler.section(f"{key} (warm-up)")
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < a.seconds:
            if warm and time.perf_counter() - t0 >= a.seconds / 4:
                sampler.section(key)
                events.clear()
                warm = False
            if per_block:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    gemm()
                end.record()
                events.append((start, end, 10))
            else:
                for _ in range(10):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    gemm()
                    end.record()
                    events.append((start, end, 1))
                    after()
            torch.cuda.synchronize()
        med = statistics.median(s.elapsed_time(e) / 1e3 / n for s, e, n in events)
        readings = sampler.samples.get(key, [])
        clock = statistics.median(r.clock_mhz for r in readings) if readings else float("nan")
        watts = statistics.median(r.power_w for r in readings) if readings else float("nan")
        print(f"{name:<48} {med * 1e6:8.1f} us {flop / med / 1e12:6.0f} TFLOP/s   SM {clock:5.0f} MHz "
              f"{watts:5.0f} W   ({len(events)} timings)")

    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; GEMM {a.m} x {a.n} x {a.k} bf16")
    print(f"{'surrounding':<48} {'per GEMM':>11} {'':>14}   {'median clock and power':>22}")
    sampler = GpuStateSampler(dev, every_s=0.05)
    with sampler:
        for rep in range(a.repeats):
            surrounding("back to back", lambda: None, rep=rep)
            surrounding("back to back, one event pair per 10 GEMMs", lambda: None, per_block=True, rep=rep)
            surrounding("each followed by a 512 MiB fp32 add", lambda: torch.add(big, big, out=big_out), rep=rep)
            surrounding("each followed by a 100k-cycle spin (~50 us)", lambda: torch.cuda._sleep(100_000), rep=rep)
            surrounding("each followed by a 1M-cycle spin (~0.5 ms)", lambda: torch.cuda._sleep(1_000_000), rep=rep)
        held = time_fn(gemm, device=dev, warmup=3, trials=7, min_time_s=0.005).median_s
    print(f"{'profiler.timing.time_fn (held, 5 ms trials)':<48} {held * 1e6:8.1f} us {flop / held / 1e12:6.0f} TFLOP/s")
    if sampler.error:
        print(f"NVML: {sampler.error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
