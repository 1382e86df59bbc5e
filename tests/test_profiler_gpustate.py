"""profiler.gpustate: the GPU clock and power note of a profile's GEMM tables (NVML stood in: no GPU here)."""

from __future__ import annotations

import itertools
import re
import threading

import pytest
import torch

from profiler.compute import gemm_state_sampler
from profiler.gpustate import GpuStateSampler, percentile


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 0.1) == 2.0 and percentile(values, 0.9) == 9.0
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 10.0
    assert percentile([5.0], 0.9) == 5.0


def _fed(readings: list[tuple[float, float]], limits=(700.0, 1980.0)) -> GpuStateSampler:  # noqa: ANN001
    """A sampler whose readings come from a list, one per reading, and whose thread never ticks
    (every_s is long): enter takes the first (a probe, not kept), exit the last, so tests drive the
    rest by hand."""
    feed = iter(readings)
    current: list[tuple[float, float]] = []

    def clock() -> float:
        current[:] = [next(feed)]
        return current[0][0]

    return GpuStateSampler(torch.device("cuda", 0), every_s=3600, read_clock_mhz=clock,
                           read_power_w=lambda: current[0][1], limits=limits)


def test_each_section_is_summarised_against_the_boards_limits():
    sampler = _fed([(1600.0, 690.0)] * 9 + [(1980.0, 280.0)] * 6)
    with sampler:
        sampler._sample()  # before any section is named: "all"
        sampler.section("bf16 GEMMs")
        for _ in range(7):
            sampler._sample()
        sampler.section("fp32 GEMMs")
        for _ in range(5):
            sampler._sample()
    note = sampler.note("GEMM tables")
    assert note.startswith("GPU clock and power while the GEMM tables ran (NVML every 3600 s): ")
    # the probe on enter is not kept; a reading before the first section belongs to "all"
    assert "all: SM clock median 1600 MHz (10th-90th percentile 1600-1600 of 1980), power median 690 W of 700 " \
           "(1 samples): held down by the power limit" in note
    bf16 = re.search(r"bf16 GEMMs: SM clock median (\d+) MHz .*?power median (\d+) W of 700 \((\d+) samples\)"
                     r"(: held down)?", note)
    assert bf16 is not None and bf16.groups() == ("1600", "690", "7", ": held down")
    fp32 = note[note.index("fp32 GEMMs:"):]
    assert fp32.startswith("fp32 GEMMs: SM clock median 1980 MHz (10th-90th percentile 1980-1980 of 1980), "
                           "power median 280 W of 700 (6 samples)")
    assert "held down" not in fp32  # at its top clock, far below the limit


def test_without_the_boards_limits_a_low_clock_is_not_called_capped():
    sampler = _fed([(1600.0, 690.0)] * 3, limits=(None, None))
    with sampler:
        sampler._sample()
    note = sampler.note("GEMM tables")
    assert "all: SM clock median 1600 MHz (10th-90th percentile 1600-1600), power median 690 W (2 samples)" in note
    assert "held down" not in note


def test_nvml_readings_are_converted_from_milliwatts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: 1620)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device=None: 690_500)
    monkeypatch.setattr(torch.version, "hip", None)
    sampler = GpuStateSampler(torch.device("cuda", 0), every_s=3600, limits=(700.0, 1980.0))
    with sampler:
        pass
    assert sampler.samples == {"all": [(1620.0, 690.5)]}  # the exit's reading; the probe on enter is not kept
    assert "power median 690 W of 700 (1 samples): held down" in sampler.note("GEMM tables")


def test_an_unreadable_nvml_starts_no_thread_and_says_why():
    def missing() -> float:
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")

    before = threading.active_count()
    sampler = GpuStateSampler(torch.device("cuda", 0), every_s=0.01, read_clock_mhz=missing, read_power_w=lambda: 1.0)
    with sampler:
        assert threading.active_count() == before and sampler._thread is None
    assert sampler.samples == {}
    assert sampler.note("GEMM tables") == (
        "GPU clock and power while the GEMM tables ran: not read (ModuleNotFoundError: nvidia-ml-py does not seem "
        "to be installed; torch.cuda.clock_rate needs the nvidia-ml-py package (autopar's torch extra))")


def test_a_reading_that_fails_later_keeps_the_samples_before_it_and_says_so():
    calls = itertools.count()

    def flaky() -> float:
        if next(calls) >= 3:
            raise RuntimeError("NVML: GPU is lost")
        return 1700.0

    sampler = GpuStateSampler(torch.device("cuda", 0), every_s=3600, read_clock_mhz=flaky, read_power_w=lambda: 500.0,
                              limits=(None, None))
    with sampler:  # the probe on enter is the first call
        assert sampler._sample() and sampler._sample() and not sampler._sample()
    assert sampler.samples == {"all": [(1700.0, 500.0)] * 2}
    note = sampler.note("GEMM tables")
    assert "sampling stopped early (RuntimeError: NVML: GPU is lost)" in note and "SM clock median 1700 MHz" in note
    assert "nvidia-ml-py" not in note  # only a missing module is blamed on the package


def test_the_thread_samples_while_the_block_runs():
    clocks = itertools.count(1000)
    sampler = GpuStateSampler(torch.device("cuda", 0), every_s=0.001, read_clock_mhz=lambda: float(next(clocks)),
                              read_power_w=lambda: 100.0, limits=(None, None))
    with sampler:
        deadline = threading.Event()
        for _ in range(2000):  # until the thread has taken a few samples (not a timing assertion)
            if len(sampler.samples.get("all", [])) >= 4:
                break
            deadline.wait(0.005)
    assert len(sampler.samples["all"]) >= 5  # >= 4 from the thread, and the exit's
    assert sampler._thread is not None and not sampler._thread.is_alive()


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_only_a_cuda_profile_watches_its_gemm_tables(kind):
    watcher = gemm_state_sampler(torch.device(kind, 0) if kind == "cuda" else torch.device(kind))
    assert isinstance(watcher, GpuStateSampler) if kind == "cuda" else watcher is None


def test_a_cpu_profile_has_no_gpu_state_note():
    from planner.contracts import GemmLayout, Precision
    from profiler.compute import ComputeGrid, measure_compute

    grid = ComputeGrid(gemm=[(64, 64, 64, GemmLayout.nt)], attention=[], elementwise_bytes=[],
                       precisions=[Precision.fp32], warmup=1, trials=1)
    compute = measure_compute(torch.device("cpu"), grid)
    assert len(compute.gemm) == 1
    assert not any(n.startswith("GPU clock") for n in grid.notes)


def test_sections_named_after_entering_leave_no_stray_part():
    """As measure_compute uses it: enter, then one section per precision's GEMM table; the probe on
    enter is not kept, so the note has no one-sample "all" part."""
    sampler = _fed([(1700.0, 600.0)] * 4, limits=(None, None))
    with sampler:
        sampler.section("bf16 GEMMs")
        sampler._sample()
        sampler._sample()
    note = sampler.note("GEMM tables")
    assert "all:" not in note and "bf16 GEMMs: SM clock median 1700 MHz" in note and "(3 samples)" in note
