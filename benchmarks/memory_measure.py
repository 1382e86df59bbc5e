"""Measure the executor's GPU memory per plan term (one rank, under torchrun), for ``memory_check.py``.

For each case (a built-in model, a training config and a one-GPU layout) the executor's own
``Runtime`` builds and parallelises the model as ``autopar run`` would, and three steps run. Recorded
per case, from the third step (the optimizer state exists from the first):

- ``states_bytes``: allocated after the optimizer step (weights, gradients, optimizer state);
- ``fb_peak_allocated``: peak allocated over forward and backward (states + activations + buffers);
- ``opt_peak_allocated``: peak allocated over the optimizer step (its temporaries beside the states);
- ``peak_reserved``: the caching allocator's peak reserve over the step;
- ``outside_allocator_bytes``: device memory in use (``cudaMemGetInfo``) that the allocator does not hold
  (CUDA context, kernel images, cuBLAS handles, NCCL).

Once per process: ``runtime_bytes``, the device memory in use after CUDA, cuBLAS, SDPA and a one-rank
NCCL group are initialised, before any model (what a rank holds before its first tensor).

    torchrun --standalone --nproc-per-node 1 benchmarks/memory_measure.py --out measured.json [--tiny]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_cases import CASES, TINY  # noqa: E402
from executor.train import RunOptions, Runtime  # noqa: E402
from planner.contracts import Plan  # noqa: E402
from profiler.memory import device_used, gpu_runtime_bytes  # noqa: E402


def runtime_bytes(dev: torch.device) -> dict:
    """Device memory in use once CUDA, cuBLAS, SDPA and NCCL are up (``profiler.memory``), and how much of
    it the allocator holds."""
    outside = gpu_runtime_bytes(dev)
    used = device_used(dev)
    return {"device_used": used, "allocator_reserved": used - outside, "runtime_bytes": outside}


def measure(plan: Plan, dev: torch.device) -> dict:
    rt = Runtime(plan, RunOptions(steps=3, warmup=0))
    out: dict = {}
    for step in range(3):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        rt.step(step)
        torch.cuda.synchronize()
        fb_alloc = torch.cuda.max_memory_allocated(dev)
        before_opt = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        rt.optimizer.step()
        torch.cuda.synchronize()
        out = {"fb_peak_allocated": int(fb_alloc), "opt_peak_allocated": int(torch.cuda.max_memory_allocated(dev)),
               "before_opt_allocated": int(before_opt), "states_bytes": int(torch.cuda.memory_allocated(dev)),
               "peak_reserved": int(torch.cuda.max_memory_reserved(dev)),
               "outside_allocator_bytes": device_used(dev) - int(torch.cuda.memory_reserved(dev))}
        # the step's reserve: the larger of the two phases' reserves
        out["peak_reserved"] = max(out["peak_reserved"], int(torch.cuda.memory_reserved(dev)))
    rt.optimizer.zero_grad(set_to_none=True)
    del rt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="small cases (a check of the script itself)")
    ap.add_argument("--only", default="", help="comma-separated case names")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    doc = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "capacity_bytes": torch.cuda.mem_get_info(dev)[1],
           "runtime": runtime_bytes(dev), "cases": []}
    print(json.dumps({k: v for k, v in doc.items() if k != "cases"}), flush=True)
    only = set(filter(None, args.only.split(",")))
    for name, plan in (TINY if args.tiny else CASES)():
        if only and name not in only:
            continue
        try:
            row = {"name": name, **measure(plan, dev)}
        except torch.OutOfMemoryError as exc:
            row = {"name": name, "error": f"out of memory: {str(exc)[:200]}"}
            gc.collect()
            torch.cuda.empty_cache()
        doc["cases"].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
