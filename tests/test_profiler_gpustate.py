"""profiler.gpustate: the GPU clock and power note of a profile's GEMM tables (NVML stood in: no GPU here)."""

from __future__ import annotations

import itertools
import re
import sys
import threading

import pytest
import torch

from profiler.compute import gemm_state_sampler
from profiler.gpustate import GpuStateSampler, Reading, spread


def test_spread_is_the_10th_and_90th_percentile():
    values = [float(v) for v in range(1, 12)]  # 1..11: order statistics fall on whole values
    assert spread(values) == (2.0, 10.0)
    assert spread([1.0, 2.0]) == (1.1, 1.9)  # linear between them
    assert spread([5.0]) == (5.0, 5.0)


def _fed(readings: list[tuple], limits=(700.0, 1980.0)) -> GpuStateSampler:  # noqa: ANN001
    """A sampler whose readings come from a list, one per reading, and whose thread never ticks
    (every_s is long): enter takes the first (a probe, not kept), exit the last, so tests drive the
    rest by hand."""
    feed = iter(readings)
    return GpuStateSampler(torch.device("cuda", 0), every_s=3600, read=lambda: Reading(*next(feed)), limits=limits)


def _sections(sampler: GpuStateSampler, samples: dict[str, int]) -> None:
    """Name each section in turn and take its number of readings by hand."""
    for name, count in samples.items():
        sampler.section(name)
        for _ in range(count):
            sampler._sample()


def test_each_section_is_summarised_against_the_boards_limits():
    sampler = _fed([(1600.0, 690.0)] * 9 + [(1980.0, 280.0)] * 6)
    with sampler:
        sampler._sample()  # before any section is named: "all"
        _sections(sampler, {"bf16 GEMMs": 7, "fp32 GEMMs": 5})
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
    assert "held down" not in fp32 and "below" not in fp32  # at its top clock, far below the limit


def test_without_the_boards_limits_a_low_clock_is_not_called_capped():
    sampler = _fed([(1600.0, 690.0)] * 3, limits=(None, None))
    with sampler:
        sampler._sample()
    note = sampler.note("GEMM tables")
    assert "all: SM clock median 1600 MHz (10th-90th percentile 1600-1600), power median 690 W (2 samples)" in note
    assert "held down" not in note and "below" not in note


def test_a_low_clock_far_below_the_power_limit_is_not_blamed_on_it():
    """Without NVML's reasons: 1500 of 1980 MHz at 300 of 700 W is low, but not the power limit's doing."""
    sampler = _fed([(1500.0, 300.0)] * 4)
    with sampler:
        sampler._sample()
    note = sampler.note("GEMM tables")
    assert "power limit, so these are sustained" not in note
    assert ("(2 samples): SM clock below 92% of its top (power below the limit, and NVML's clock event reasons "
            "were not read): not the power limit") in note


def test_nvmls_reasons_name_the_cause():
    power, thermal, idle = 0x4, 0x40, 0x1
    sampler = _fed([(1600.0, 600.0, power)] * 5 + [(1500.0, 450.0, thermal)] * 4 + [(1400.0, 300.0, 0x2)] * 4
                   + [(1500.0, 400.0, 0x8)] * 4 + [(1980.0, 100.0, idle)] * 2)
    with sampler:
        # "power": well below 95% of the limit, but NVML says its cap holds the clock
        _sections(sampler, {"power": 4, "thermal": 4, "clock setting": 4, "hardware": 4, "idle": 0})
    note = sampler.note("GEMM tables")
    names = ["power", "thermal", "clock setting", "hardware", "idle"]
    starts = [note.index(f"{n}: SM clock") for n in names] + [len(note)]
    parts = {n: note[a:b] for n, a, b in zip(names, starts, starts[1:])}
    assert "clock event reasons: software power cap 100%)" in parts["power"]
    assert "held down by the power limit" in parts["power"]
    assert "clock event reasons: hardware thermal slowdown 100%): held down by thermal slowdown" in parts["thermal"]
    assert "power limit" not in parts["thermal"]
    assert ("clock event reasons: application clock setting 100%): SM clock below 92% of its top (NVML named no "
            "power or thermal cause): not the power limit") in parts["clock setting"]
    assert "clock event reasons: hardware slowdown 100%): held down by hardware slowdown" in parts["hardware"]
    assert "power limit, so" not in parts["hardware"]
    assert parts["idle"].endswith("clock event reasons: GPU idle 100%)")  # at its top clock: no verdict


def test_reasons_in_a_minority_of_samples_are_listed_but_name_no_cause():
    sampler = _fed([(1980.0, 650.0, 0)] + [(1980.0, 650.0, 0x4)] + [(1980.0, 650.0, 0)] * 3)  # the first: the probe
    with sampler:
        for _ in range(3):
            sampler._sample()
    note = sampler.note("GEMM tables")
    assert "clock event reasons: software power cap 25%)" in note and "held down" not in note


class _FakeNvml:
    """pynvml's calls the reader makes, on one handle; counts the handle lookups."""

    NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    def __init__(self, reasons_supported: bool = True) -> None:
        self.lookups = 0
        self.reasons_supported = reasons_supported

    def handle(self, device):  # noqa: ANN001, ANN201 - torch.cuda._get_pynvml_handler
        self.lookups += 1
        return ("handle", device)

    def nvmlDeviceGetClockInfo(self, handle, clock):  # noqa: ANN001, ANN201, N802
        assert handle[0] == "handle" and clock == 1
        return 1620

    def nvmlDeviceGetPowerUsage(self, handle):  # noqa: ANN001, ANN201, N802
        return 690_500  # mW

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):  # noqa: ANN001, ANN201, N802
        if not self.reasons_supported:
            raise self.NVMLError("Not Supported")
        return 0x4

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):  # noqa: ANN001, ANN201, N802
        return 700_000

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):  # noqa: ANN001, ANN201, N802
        return 1980


@pytest.mark.parametrize("reasons_supported", [True, False])
def test_nvml_is_read_through_one_handle_in_watts(monkeypatch, reasons_supported):
    fake = _FakeNvml(reasons_supported)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "_get_pynvml_handler", fake.handle)
    monkeypatch.setattr(torch.version, "hip", None)
    sampler = GpuStateSampler(torch.device("cuda", 0), every_s=3600)
    with sampler:
        sampler._sample()
        sampler._sample()
    reasons = 0x4 if reasons_supported else None
    assert sampler.samples == {"all": [Reading(1620.0, 690.5, reasons)] * 3}  # the probe on enter is not kept
    note = sampler.note("GEMM tables")
    assert fake.lookups == 1  # one handle for every reading and the board's limits
    assert "SM clock median 1620 MHz (10th-90th percentile 1620-1620 of 1980), power median 690 W of 700" in note
    assert "held down by the power limit" in note  # by NVML's reason, or by 690 of 700 W without it
    assert ("clock event reasons: software power cap 100%" in note) == reasons_supported


def test_rocm_reads_torchs_amdsmi_readings_in_watts(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: 1700)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device=None: 550)  # amdsmi says W
    sampler = GpuStateSampler(torch.device("cuda", 0), every_s=3600)
    with sampler:
        pass
    assert sampler.samples == {"all": [Reading(1700.0, 550.0, None)]}
    assert sampler.board_limits() == (None, None)


def test_an_unreadable_nvml_starts_no_thread_and_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ModuleNotFoundError
    monkeypatch.setattr(torch.version, "hip", None)
    before = threading.active_count()
    sampler = GpuStateSampler(torch.device("cuda", 0), every_s=0.01)
    with sampler:
        assert threading.active_count() == before and sampler._thread is None
    assert sampler.samples == {}
    note = sampler.note("GEMM tables")
    assert note.startswith("GPU clock and power while the GEMM tables ran: not read (ModuleNotFoundError: ")
    assert note.endswith("; reading NVML needs the nvidia-ml-py package (autopar's torch extra))")


def test_a_reading_that_fails_later_keeps_the_samples_before_it_and_says_so():
    calls = itertools.count()

    def flaky() -> Reading:
        if next(calls) >= 3:
            raise RuntimeError("NVML: GPU is lost")
        return Reading(1700.0, 500.0)

    sampler = GpuStateSampler(torch.device("cuda", 0), every_s=3600, read=flaky, limits=(None, None))
    with sampler:  # the probe on enter is the first call
        assert sampler._sample() and sampler._sample() and not sampler._sample()
    assert sampler.samples == {"all": [Reading(1700.0, 500.0)] * 2}
    note = sampler.note("GEMM tables")
    assert "sampling stopped early (RuntimeError: NVML: GPU is lost)" in note and "SM clock median 1700 MHz" in note
    assert "nvidia-ml-py" not in note  # only a missing module is blamed on the package


def test_the_thread_samples_while_the_block_runs():
    clocks = itertools.count(1000)
    sampler = GpuStateSampler(torch.device("cuda", 0), every_s=0.001,
                              read=lambda: Reading(float(next(clocks)), 100.0), limits=(None, None))
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
