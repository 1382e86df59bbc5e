"""profiler.gpustate: the GPU clock and power note of a profile's GEMM tables (NVML stood in: no GPU here)."""

from __future__ import annotations

import itertools
import re
import time

import torch

from profiler.gpustate import GpuStateSampler


def test_samples_while_the_block_runs_and_words_what_it_saw():
    clocks = itertools.cycle([1600.0, 1620.0, 1640.0, 1980.0])
    sampler = GpuStateSampler(torch.device("cpu"), every_s=0.01, read_clock_mhz=lambda: next(clocks),
                              read_power_w=lambda: 690.0)
    with sampler:
        time.sleep(0.2)
    assert len(sampler.clocks) >= 5 and len(sampler.clocks) == len(sampler.watts)
    assert sampler.span_s >= 0.2
    note = sampler.note("the GEMM tables")
    assert note.startswith(f"GPU clock and power while the GEMM tables ran ({len(sampler.clocks)} NVML samples")
    median = re.search(r"SM clock median (\d+) MHz \(10th-90th percentile (\d+)-(\d+)\)", note)
    assert median is not None
    low, high = int(median.group(2)), int(median.group(3))
    assert 1600 <= low <= int(median.group(1)) <= high <= 1980
    assert "board power median 690 W (max 690)" in note


def test_an_unreadable_nvml_starts_no_thread_and_says_why():
    def missing() -> float:
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")

    sampler = GpuStateSampler(torch.device("cpu"), every_s=0.01, read_clock_mhz=missing, read_power_w=lambda: 1.0)
    with sampler:
        time.sleep(0.03)
    assert sampler.clocks == [] and sampler._thread is None
    note = sampler.note("the GEMM tables")
    assert "not read (ModuleNotFoundError: nvidia-ml-py does not seem to be installed" in note


def test_a_reading_that_fails_later_keeps_the_samples_before_it():
    calls = itertools.count()

    def flaky() -> float:
        if next(calls) >= 3:
            raise RuntimeError("NVML: GPU is lost")
        return 1700.0

    sampler = GpuStateSampler(torch.device("cpu"), every_s=0.01, read_clock_mhz=flaky, read_power_w=lambda: 500.0)
    with sampler:
        time.sleep(0.1)
    assert sampler.clocks == [1700.0] * 3 and sampler.error == "RuntimeError: NVML: GPU is lost"
    assert "SM clock median 1700 MHz" in sampler.note("the GEMM tables")


def test_a_cpu_profile_has_no_gpu_state_note():
    from planner.contracts import GemmLayout, Precision
    from profiler.compute import ComputeGrid, measure_compute

    grid = ComputeGrid(gemm=[(64, 64, 64, GemmLayout.nt)], attention=[], elementwise_bytes=[],
                       precisions=[Precision.fp32], warmup=1, trials=1)
    compute = measure_compute(torch.device("cpu"), grid)
    assert len(compute.gemm) == 1
    assert not any(n.startswith("GPU clock") for n in grid.notes)
