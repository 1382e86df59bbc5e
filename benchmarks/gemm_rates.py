#!/usr/bin/env python3
"""GEMM rate by cube size on this CPU, measured in rounds: can a profile interpolate between its sizes?

Times ``n x n x n`` matmuls (torch, one thread by default) with the profiler's own timing
(:func:`profiler.timing.time_fn`, each CPU point its fastest trial), for every size in every round,
and prints GFLOP/s per size and round. A rate that rises and falls between neighbouring sizes, or
moves between rounds, is one no interpolation of a profile's grid can follow (the held-out bf16
misses of ``benchmarks/profile_accuracy.py`` on AMX CPUs).

    .venv/bin/python benchmarks/gemm_rates.py [--threads 1] [--rounds 3] [--sizes 256,384,512,768,1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from profiler.timing import time_fn  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="128,192,256,384,512,768,1024")
    ap.add_argument("--precisions", default="fp32,bf16")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sizes = [int(s) for s in a.sizes.split(",")]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    cpu = torch.device("cpu")
    print(f"GFLOP/s of n x n x n matmuls, {a.threads} thread(s), torch {torch.__version__}, fastest of 5 trials "
          f"of >= 20 ms, {a.rounds} rounds over the sizes")
    print(f"{'precision':<9} {'round':>5} " + " ".join(f"{n:>7}" for n in sizes))
    for name in a.precisions.split(","):
        dtype = dtypes[name]
        operands = {n: (torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)) for n in sizes}
        for r in range(a.rounds):
            rates = []
            for n in sizes:
                x, y = operands[n]
                t = time_fn(lambda x=x, y=y: x @ y, device=cpu, warmup=2, trials=5, min_time_s=0.02).estimate_s
                rates.append(2 * n**3 / t / 1e9)
            print(f"{name:<9} {r + 1:>5} " + " ".join(f"{g:>7.0f}" for g in rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
