"""Who is being measured: device name, count and memory, software versions, one host name per node."""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess

from planner.contracts import Precision
from planner.contracts.cluster import ComputeProfile, DeviceSpec, Environment


def host_memory_bytes() -> int:
    """Total RAM of this host (os.sysconf, else /proc/meminfo)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return _meminfo("MemTotal")


def available_memory_bytes(device) -> int:
    """Memory a measurement can still allocate: free device memory on CUDA, MemAvailable on a CPU host
    (read without importing torch)."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    avail = _meminfo("MemAvailable")
    return avail or host_memory_bytes()


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cache_size(entry: str) -> int:
    """Bytes of one sysfs cache entry (``entry``/size, e.g. ``480M``); 0 where it cannot be read."""
    try:
        with open(os.path.join(entry, "size")) as f:
            text = f.read().strip().upper()
    except OSError:
        return 0
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    return int(digits) * scale if digits.isdigit() else 0


def _index_entries(base: str) -> list[str]:
    try:
        return [os.path.join(base, e) for e in os.listdir(base) if e.startswith("index")]
    except OSError:
        return []


def last_level_cache_bytes(base: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Size of one CPU's largest cache (the last level, as the kernel reports it under
    ``base``/index*/size, e.g. ``480M``); 0 where it cannot be read (not Linux, no sysfs). What a
    rank's threads can fill together: :func:`reachable_cache_bytes`."""
    return max((_cache_size(e) for e in _index_entries(base)), default=0)


def reachable_cache_bytes(root: str = "/sys/devices/system/cpu", cpus: list[int] | None = None,
                          threads: int | None = None) -> int:
    """Last-level cache this process's threads can fill: the summed sizes of the distinct highest-level
    cache instances (by ``shared_cpu_list``) over the CPUs it may run on (``os.sched_getaffinity``),
    at most one instance per thread (``threads``; None: no bound), since a thread fills the cache of
    the core it runs on. One CPU's view undercounts where the L3 is split: on an AMD EPYC each CCX
    has its own (32 MiB), and a rank whose 12 threads span 12 of them can hold 12 x 32 MiB. A VM's
    kernel may report the whole socket's (480 MiB on a 2-vCPU Intel VM), which is what it says. 0
    where sysfs cannot be read; one CPU's :func:`last_level_cache_bytes` where the cache entries say
    no level or sharing."""
    if cpus is None:
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = list(range(os.cpu_count() or 1))
    instances: dict[tuple[int, str], int] = {}
    for cpu in cpus:
        for entry in _index_entries(os.path.join(root, f"cpu{cpu}", "cache")):
            try:
                with open(os.path.join(entry, "level")) as f:
                    level = int(f.read().strip())
                with open(os.path.join(entry, "shared_cpu_list")) as f:
                    shared = f.read().strip()
            except (OSError, ValueError):
                continue
            size = _cache_size(entry)
            if size:
                instances[(level, shared)] = size
    if not instances:
        return last_level_cache_bytes(os.path.join(root, f"cpu{cpus[0] if cpus else 0}", "cache"))
    top = max(level for level, _ in instances)
    sizes = sorted((size for (level, _), size in instances.items() if level == top), reverse=True)
    return sum(sizes[:threads] if threads else sizes)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_count(device_type: str) -> int:
    """Devices on this node: its GPUs, or on a CPU the CPUs this process may use."""
    import torch

    if device_type == "cuda":
        return torch.cuda.device_count()
    return len(usable_cpus())


def gloo_version() -> str | None:
    """The torch build that vendors gloo (gloo has no version of its own; the build commit pins it)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return None
    sha = re.search(r"COMMIT_SHA=([0-9a-f]{7,40})", torch.__config__.show())
    return f"bundled with torch {torch.__version__}" + (f" (build {sha.group(1)[:12]})" if sha else "")


def environment(hostnames: list[str], backend: str, emulated_nodes: bool, device_type: str = "cpu") -> Environment:
    import torch

    nccl = None
    if backend == "nccl":
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a version string is best effort
            nccl = None
    if emulated_nodes:
        hostnames = [f"{h} [emulated node {i}]" for i, h in enumerate(hostnames)]
    return Environment(hostnames=hostnames, driver_version=driver_version() if device_type == "cuda" else None,
                       cuda_version=torch.version.cuda if device_type == "cuda" else None,
                       torch_version=torch.__version__,
                       nccl_version=nccl, gloo_version=gloo_version(), backend=backend,  # type: ignore[arg-type]
                       devices_per_node=max(1, device_count(device_type)))


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (all of the host's when it is not pinned)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def hostname() -> str:
    return socket.gethostname()


def device_spec(device, compute: ComputeProfile, ranks_per_node: int) -> tuple[DeviceSpec, list[str]]:
    """DeviceSpec of this rank's device. On CPU the peaks are the *measured* matmul rates (no
    datasheet), and memory is the host RAM shared by the node's ranks."""
    import torch

    notes: list[str] = []
    achieved = dict(compute.achieved_matmul_tflops)
    bw = compute.achieved_memory_bandwidth_bytes_per_s
    if getattr(device, "type", str(device)) == "cuda":
        from planner.reference import datasheet_for

        props = torch.cuda.get_device_properties(device)
        measured = {p: v for p, v in achieved.items() if v > 0}
        found = datasheet_for(props.name)
        if found is not None:
            # peak_tflops means the datasheet's (MFU's denominator, as published runs quote it); the
            # compute tables hold what this GPU ran at
            key, sheet = found
            # the 16-bit peaks always (the contract wants one); FP8 only where this torch and GPU ran it
            # (the planner's FP8 gate); fp32 as measured: the profiler runs it without TF32, and the
            # datasheet's fp32 entry is the TF32 rate
            keep = {Precision.bf16, Precision.fp16} | ({Precision.fp8} & measured.keys())
            peaks = {p: v for p, v in sheet.peak_tflops.items() if p in keep}
            if Precision.fp32 in measured:
                peaks[Precision.fp32] = measured[Precision.fp32]
            vs = [f"{p.value} GEMM {measured[p]:.4g} TFLOP/s = {measured[p] / peaks[p]:.0%} of {peaks[p]:.4g}"
                  for p in Precision if p in measured and p in peaks and p is not Precision.fp32]
            if bw:
                vs.append(f"memory (residual add) {bw / 1e12:.3g} TB/s = {bw / sheet.hbm_bandwidth_bytes_per_s:.0%} "
                          f"of {sheet.hbm_bandwidth_bytes_per_s / 1e12:.3g}")
            fp32 = (f"; fp32 (without TF32) reached {measured[Precision.fp32]:.4g} TFLOP/s, its peak_tflops entry"
                    if Precision.fp32 in measured else "")
            notes.append(f"{props.name}: peak_tflops are the {sheet.name} datasheet's (planner/data/hardware.csv, "
                         f"system {key}); measured best against it: " + "; ".join(vs) + fp32)
        else:
            peaks = dict(measured)
            notes.append(f"{props.name}: no datasheet in planner/data/hardware.csv for this GPU (PCIe and NVL cards "
                         "are not matched to SXM figures): peak_tflops are the best measured GEMM rates, so MFU "
                         "is against what this GPU reached, not a datasheet")
            if Precision.bf16 not in peaks and Precision.fp16 not in peaks:
                peaks[Precision.bf16] = max(peaks.values(), default=1.0)
                notes.append("no bf16/fp16 GEMM measured: peak_tflops['bf16'] is the best measured rate "
                             "(measure bf16 too for a true 16-bit peak)")
        if not bw:
            notes.append("no residual add measured (no 16/32-bit precision): hbm_bandwidth_bytes_per_s is "
                         + ("the datasheet's" if found else "a 1 TB/s placeholder") + ", not a measurement")
        fallback_bw = found[1].hbm_bandwidth_bytes_per_s if found else 1e12
        spec = DeviceSpec(name=props.name, memory_bytes=int(props.total_memory), peak_tflops=peaks,
                          hbm_bandwidth_bytes_per_s=bw or fallback_bw, sm_count=props.multi_processor_count,
                          tdp_w=found[1].tdp_w if found else None)
        return spec, notes
    total = host_memory_bytes()
    per_rank = max(1, total // max(1, ranks_per_node))
    peaks = {p: v for p, v in achieved.items() if v > 0}
    if Precision.bf16 not in peaks and Precision.fp16 not in peaks:
        # no 16-bit GEMM measured (e.g. --precisions fp32): the best rate stands in for the 16-bit peak
        peaks[Precision.bf16] = max(peaks.values(), default=0.01)
        notes.append("no bf16/fp16 GEMM measured: peak_tflops['bf16'] is the best measured rate")
    notes.append("CPU device: peak_tflops are the measured achieved matmul TFLOP/s (no datasheet peak for a CPU); "
                 f"memory_bytes is host RAM / {ranks_per_node} ranks per node; bandwidth is the measured "
                 "residual-add rate")
    spec = DeviceSpec(
        name=f"CPU: {cpu_name()} ({torch.get_num_threads()} threads/rank)",
        memory_bytes=per_rank,
        peak_tflops=peaks,
        hbm_bandwidth_bytes_per_s=bw or 1e10,
    )
    return spec, notes
