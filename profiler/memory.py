"""Measure the memory a rank holds beside its tensors, for the profile's ``Assumptions`` (planner.cost.memory).

On a GPU, each figure is device memory read around a small workload:

- ``runtime_bytes``: device memory in use (``cudaMemGetInfo``) that the caching allocator does not hold,
  once CUDA, cuBLAS, SDPA and the default process group have run: the CUDA context, kernel images and
  library handles;
- ``optimizer_temp_bytes_per_param``: the optimizer step's peak allocation above what it starts with,
  per parameter, for the AdamW every run uses (``executor.reference.make_optimizer``), its state made;
- ``loss_bytes_per_logit``: the peak allocation of 16-bit logits and the LM loss on them
  (``executor.reference.lm_loss``: fp32 cross-entropy) forward and backward, per logit;
- ``communicator_bytes``: device memory a new NCCL communicator of every rank takes at its first
  collective (only with two or more ranks: a one-rank communicator connects nothing).

On a CPU rank only ``runtime_bytes`` is measured (the process's resident memory before any model: the
interpreter and libraries); the others keep their reference defaults, and the profile's notes say which.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

from planner.contracts import Assumptions
from profiler.timing import host_sync_s


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_used(device: torch.device) -> int:
    """Device memory in use (``cudaMemGetInfo``): the allocator's reserve and everything outside it."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def _settle(device: torch.device) -> None:
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()


def gpu_runtime_bytes(device: torch.device) -> int:
    """Device memory outside the allocator once cuBLAS, SDPA and a collective have run."""
    a = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    q = torch.randn(1, 8, 256, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    if dist.is_initialized():
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
    del a, q
    _settle(device)
    return device_used(device) - int(torch.cuda.memory_reserved(device))


def optimizer_temp_bytes_per_param(device: torch.device, params: int = 1 << 24) -> float:
    """Peak allocation of an AdamW step above its start, per parameter (its second step: state made)."""
    from executor.reference import make_optimizer

    ws = [torch.nn.Parameter(torch.randn(params // 8, device=device)) for _ in range(8)]
    opt = make_optimizer(ws)
    for _ in range(2):
        for w in ws:
            w.grad = torch.randn_like(w)
        _settle(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        opt.step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    del ws, opt
    _settle(device)
    return peak / params


def loss_bytes_per_logit(device: torch.device, tokens: int = 4096, vocab: int = 32000) -> float:
    """Peak allocation of the LM loss forward and backward on 16-bit logits, per logit."""
    from executor.reference import lm_loss

    targets = torch.randint(0, vocab, (1, tokens), device=device)
    _settle(device)
    before = torch.cuda.memory_allocated(device)  # the logits themselves count: the LM head makes them
    torch.cuda.reset_peak_memory_stats(device)
    logits = torch.randn(1, tokens, vocab, device=device, dtype=torch.bfloat16, requires_grad=True)
    lm_loss(logits, targets, tokens).backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del logits, targets
    _settle(device)
    return peak / (tokens * vocab)


def communicator_bytes(device: torch.device) -> int | None:
    """Device memory a new communicator of every rank takes at its first collective (None on one rank)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    _settle(device)
    before = device_used(device)
    group = dist.new_group(list(range(dist.get_world_size())))
    t = torch.ones(1 << 20, device=device)
    dist.all_reduce(t, group=group)
    del t
    _settle(device)
    return max(device_used(device) - before, 0)


def measured_assumptions(device: torch.device, cpu_resident_bytes: int | None = None) -> Assumptions:
    """The profile's Assumptions with every memory term this device can measure, the GPU idle time of a
    device->host synchronisation (:func:`profiler.timing.host_sync_s`) on a GPU, and notes saying which."""
    if device.type != "cuda":
        rss = cpu_resident_bytes if cpu_resident_bytes is not None else resident_bytes()
        return Assumptions(runtime_bytes=rss, communicator_bytes=0, all_to_all_communicator_bytes=0, notes=[
            f"runtime_bytes={rss / 2**20:.0f} MiB measured: this rank's resident memory before any model (interpreter, "
            "torch); a CPU rank has no CUDA context, and gloo keeps its buffers on the host (communicators 0)",
            "optimizer_temp_bytes_per_param, loss_bytes_per_logit, fragmentation: reference defaults "
            "(measured on GPUs)",
        ])
    values: dict = {"runtime_bytes": gpu_runtime_bytes(device),
                    "optimizer_temp_bytes_per_param": round(optimizer_temp_bytes_per_param(device), 3),
                    "loss_bytes_per_logit": round(loss_bytes_per_logit(device), 3),
                    "moe_host_sync_s": round(host_sync_s(device), 7)}
    comm = communicator_bytes(device)
    if comm is not None:
        values["communicator_bytes"] = comm
    notes = [f"measured on rank 0's {torch.cuda.get_device_name(device)}: " + ", ".join(
        f"{k}={v:,}" if isinstance(v, int) else f"{k}={v:g}" for k, v in values.items()),
        "fragmentation shares" + ("" if comm is not None else " and communicator sizes (one rank)")
        + ": reference defaults (planner.contracts.Assumptions)"]
    return Assumptions(**values, notes=notes)
