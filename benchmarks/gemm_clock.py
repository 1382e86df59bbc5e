"""Does a GEMM run at the same speed back to back as inside a step's mix? (GPU clocks under the power cap)

The profiler times each GEMM in short trials; a training step runs its GEMMs between memory-bound
kernels and host gaps; a long stretch of GEMMs alone draws the board to its power limit and the SM
clock down. This times one GEMM shape (by default the largest of benchmarks/executor.py (c)'s step,
tokens 4096 x 5632 x 2048, bf16) with CUDA events in four surroundings, each for a few seconds:
back to back, each followed by a large fp32 add (memory-bound), each followed by a short and a long
spin kernel (an idle-ish GPU), with the SM clock and board power read through NVML meanwhile; then
as the profiler times it (:func:`profiler.timing.time_fn`, held, 5 ms trials). Prints per-GEMM
time and TFLOP/s beside clock and power; there is no target (a diagnostic of README "On a GPU").

    python benchmarks/gemm_clock.py [--m 4096 --n 5632 --k 2048] [--seconds 2.5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from profiler.timing import time_fn  # noqa: E402


class Sampler:
    """SM clock (MHz) and board power (W) every 20 ms through NVML, where it can be read."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:  # noqa: BLE001 - no NVML: times only
            print(f"NVML not readable ({exc}): no clocks or power")
            self._nvml = None
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while self._nvml is not None and not self._stop.is_set():
            try:
                clock = self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM)
                watts = self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000
                self.samples.append((time.perf_counter(), clock, watts))
            except Exception:  # noqa: BLE001 - a missed sample
                pass
            time.sleep(0.02)

    def median(self, t0: float, t1: float) -> tuple[float, float]:
        window = [s for s in self.samples if t0 <= s[0] <= t1]
        if not window:
            return float("nan"), float("nan")
        return statistics.median(s[1] for s in window), statistics.median(s[2] for s in window)

    def stop(self) -> None:
        self._stop.set()


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
    sampler = Sampler()

    def surrounding(name: str, after) -> None:  # noqa: ANN001
        events = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < a.seconds:
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                gemm()
                end.record()
                events.append((start, end))
                after()
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        times = [s.elapsed_time(e) / 1e3 for s, e in events[len(events) // 4:]]  # the first quarter warms up
        med = statistics.median(times)
        clock, watts = sampler.median(t0 + (t1 - t0) / 4, t1)
        print(f"{name:<44} {med * 1e6:8.1f} us {flop / med / 1e12:6.0f} TFLOP/s   SM {clock:5.0f} MHz "
              f"{watts:5.0f} W   ({len(times)} GEMMs)")

    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; GEMM {a.m} x {a.n} x {a.k} bf16")
    print(f"{'surrounding':<44} {'per GEMM':>11} {'':>14}   {'median clock and power':>22}")
    for _ in range(a.repeats):
        surrounding("back to back", lambda: None)
        surrounding("each followed by a 512 MiB fp32 add", lambda: torch.add(big, big, out=big_out))
        surrounding("each followed by a 100k-cycle spin (~50 us)", lambda: torch.cuda._sleep(100_000))
        surrounding("each followed by a 1M-cycle spin (~0.5 ms)", lambda: torch.cuda._sleep(1_000_000))
    held = time_fn(gemm, device=dev, warmup=3, trials=7, min_time_s=0.005).median_s
    print(f"{'profiler.timing.time_fn (held, 5 ms trials)':<44} {held * 1e6:8.1f} us {flop / held / 1e12:6.0f} TFLOP/s")
    sampler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
