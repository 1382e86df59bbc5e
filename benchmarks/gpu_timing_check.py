"""Does the profiler's CUDA timing measure the GPU? (profiler.timing's holds, issue 5)

For a few operations the host launches about as slowly as a GPU runs them (small GEMMs, a small add,
short attention) and one it does not (a large GEMM), prints per call: the time
:func:`profiler.timing.time_fn` reports, the same without holds (``hold=False``: the GPU may wait
for the host between calls), and the GPU's own kernel time from ``torch.profiler`` (the reference),
each the median of three rounds taken in turn, in another order each round (a GPU's clock drifts
with its power and heat over seconds, which would otherwise favour one of them).

Kernels queued back to back on one stream still start a little apart: the GPU's own gap between
kernels, which a training step's queued kernels pay as well and kernel times leave out. It is
measured apart from the operations, from torch.profiler's timestamps of one-element adds queued
behind a spin kernel (the held add less its kernel time is printed beside it), and the reference
for an operation is its kernel time plus one such gap per kernel it launches. Target: the held
time within 15% of that for every operation (the held time against the bare kernel time is printed
too). Exit status 1 on a miss, 2 where torch.profiler records no kernels; 0 without a GPU.

    python benchmarks/gpu_timing_check.py
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from profiler.timing import HOLD_STATS, time_fn  # noqa: E402

TARGET = 0.15


def gpu_rows(events) -> list:  # noqa: ANN001 - torch.profiler's key_averages()
    """The GPU rows (kernels, memcpy, memset) of a torch.profiler run. Operator rows (aten::mm) and
    GPU annotations (Optimizer.step#AdamW.step) are left out: they repeat their kernels' time."""
    from torch.autograd import DeviceType

    return [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA
            and e.self_device_time_total > 0 and not getattr(e, "is_user_annotation", False)]


def gpu_rows_s(events) -> dict[str, float]:  # noqa: ANN001 - torch.profiler's key_averages()
    """Seconds per GPU row (:func:`gpu_rows`) by name. Also used by step_breakdown.py."""
    rows: dict[str, float] = {}
    for e in gpu_rows(events):
        rows[e.key] = rows.get(e.key, 0.0) + e.self_device_time_total / 1e6
    return rows


def kernel_seconds(fn, device: torch.device, calls: int = 50) -> tuple[float, float]:  # noqa: ANN001
    """Per-call GPU kernel time of ``fn`` from torch.profiler (:func:`gpu_rows`), and GPU rows
    (kernels, memcpy, memset) per call."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    rows = gpu_rows(prof.key_averages())
    return sum(e.self_device_time_total for e in rows) / 1e6 / calls, sum(e.count for e in rows) / calls


def timed(fn, device: torch.device, rounds: int = 3) -> tuple[float, float, float, float]:  # noqa: ANN001
    """(held, unheld, kernel seconds, kernels per call) of ``fn``, each the median of ``rounds``
    rounds. The three are taken in turn, in another order each round (a GPU's clock drifts with its
    power and heat, and would favour whichever came first), and the profiled run is about as long as
    a held trial (2 ms), not a long stretch that could reach the power limit."""
    runs: list[dict[str, float]] = []
    calls = 50
    for r in range(rounds):
        got: dict[str, float] = {}
        for what in ("held", "unheld", "kernels")[r % 3:] + ("held", "unheld", "kernels")[:r % 3]:
            if what == "kernels":
                got["kernels"], got["n"] = kernel_seconds(fn, device, calls)
            else:
                got[what] = time_fn(fn, device=device, warmup=3, trials=5, min_time_s=0.002,
                                    hold=what == "held").median_s
                if what == "held":
                    calls = max(3, min(50, math.ceil(0.002 / max(got["held"], 1e-9))))
        runs.append(got)
    return tuple(statistics.median(r[k] for r in runs) for k in ("held", "unheld", "kernels", "n"))  # type: ignore


def queued_gap_s(device: torch.device, adds: int = 200) -> float | None:
    """The GPU's own idle time between kernels queued back to back on one stream: one-element adds
    launched behind a spin kernel (so the host has queued them all before the GPU reaches them),
    the median of (next kernel's start - this one's end) over torch.profiler's kernel timestamps.
    None where the profiler records no kernels (no CUPTI)."""
    from collections import Counter

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    one, other = torch.ones(1, device=device), torch.ones(1, device=device)
    for _ in range(3):
        torch.add(one, other, out=other)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(20_000_000)  # about 10 ms at 2 GHz: longer than queuing the adds takes
        for _ in range(adds):
            torch.add(one, other, out=other)
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA]
    if not kernels:
        return None
    add_name = Counter(e.name for e in kernels).most_common(1)[0][0]  # the adds, not the spin kernel
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels if e.name == add_name)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]  # microseconds
    return statistics.median(gaps) / 1e6 if gaps else None


def cases(device: torch.device) -> list[tuple[str, object]]:
    def gemm(n: int):  # noqa: ANN202
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(a)
        return lambda: torch.matmul(a, b, out=out)

    x, y = torch.randn(1 << 18, device=device), torch.randn(1 << 18, device=device)
    z = torch.empty_like(x)
    q = torch.randn(1, 8, 512, 128, device=device, dtype=torch.bfloat16)
    return [("bf16 GEMM 512^3", gemm(512)), ("bf16 GEMM 1024^3", gemm(1024)),
            ("fp32 add 1 MiB", lambda: torch.add(x, y, out=z)),
            ("causal SDPA b1 s512 h8 d128", lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)),
            ("bf16 GEMM 8192^3 (GPU-bound)", gemm(8192))]


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_timing_check: no CUDA device here; nothing to check")
        return 0
    device = torch.device("cuda", 0)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    one, other = torch.ones(1, device=device), torch.ones(1, device=device)
    held, _, kernel, per_call = timed(lambda: torch.add(one, other, out=other), device)
    if kernel <= 0:
        print("torch.profiler recorded no GPU kernels (CUPTI unavailable?): no reference to check against")
        return 2
    inferred = max(held - kernel, 0.0) / max(per_call, 1.0)
    direct = queued_gap_s(device)
    gap = direct if direct is not None else inferred
    print(f"the stream's gap between queued kernels: {gap * 1e6:.2f} us "
          + ("(kernel timestamps of queued one-element adds; " if direct is not None else "(")
          + f"held one-element add {held * 1e6:.2f} us less its kernel {kernel * 1e6:.2f} us: "
          f"{inferred * 1e6:.2f} us)")
    print(f"{'operation':<30} {'held':>10} {'unheld':>10} {'kernels':>10} {'n':>5} {'+gaps':>10} {'held err':>9} "
          f"{'vs bare':>8}")
    worst = 0.0
    for name, fn in cases(device):
        held, unheld, kernels, n = timed(fn, device)
        if kernels <= 0:
            print(f"{name:<30} torch.profiler recorded no GPU kernels: not judged")
            continue
        reference = kernels + n * gap
        err = abs(held - reference) / reference
        worst = max(worst, err)
        print(f"{name:<30} {held * 1e6:8.1f}us {unheld * 1e6:8.1f}us {kernels * 1e6:8.1f}us {n:5.1f} "
              f"{reference * 1e6:8.1f}us {err:8.1%} {abs(held - kernels) / kernels:7.1%}")
    print(f"held timings: {HOLD_STATS['held']} (each operation once a round); trials still paced by the host: "
          f"{HOLD_STATS['host_paced']}")
    verdict = "PASS" if worst <= TARGET else "MISS"
    print(f"held time against kernel time plus the stream's gaps: worst {worst:.1%} (target <= {TARGET:.0%}): "
          f"{verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
