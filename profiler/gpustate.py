"""What a GPU's clock and power did while a table was measured (NVML, through torch.cuda).

A GPU runs GEMMs back to back at its board power limit, and the SM clock falls to hold it there: on
a lent H200 one bf16 GEMM (4096 x 5632 x 2048) ran at 646 TFLOP/s back to back (SM clock 1620 MHz,
690 W), at 700-722 between memory-bound kernels (1845-1935 MHz) and 713 with idle gaps (1980 MHz,
281 W) (benchmarks/gemm_clock.py, README "On a GPU"). The profiler's GEMM tables are timed back to
back, so they hold the sustained rates; :class:`GpuStateSampler` records the clock and power they
ran at, for the profile's notes, so a reader can tell a capped table from a cool one.

``torch.cuda.clock_rate`` and ``torch.cuda.power_draw`` read NVML (the nvidia-ml-py package); where
it cannot be read the sampler records nothing and says so.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from types import TracebackType

import torch

SAMPLE_EVERY_S = 0.25  # NVML's own sample period is 1/6 s to 1 s by product


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class GpuStateSampler:
    """Samples the SM clock (MHz) and board power (W) of ``device`` every ``every_s`` in a daemon
    thread while the ``with`` block runs; :meth:`note` words what it saw.

    ``read_clock_mhz`` and ``read_power_w`` stand in for NVML in tests (each takes no argument)."""

    def __init__(self, device: torch.device, every_s: float = SAMPLE_EVERY_S,
                 read_clock_mhz: Callable[[], float] | None = None,
                 read_power_w: Callable[[], float] | None = None) -> None:
        self.device = torch.device(device)
        self.every_s = every_s
        self.clocks: list[float] = []
        self.watts: list[float] = []
        self.error: str | None = None
        self._read_clock = read_clock_mhz or (lambda: float(torch.cuda.clock_rate(self.device)))
        self._read_power = read_power_w or (lambda: torch.cuda.power_draw(self.device) / 1000.0)  # mW
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.span_s = 0.0
        self._t0 = 0.0

    def _sample(self) -> bool:
        try:
            clock, watts = self._read_clock(), self._read_power()
        except Exception as exc:  # noqa: BLE001 - NVML missing or refusing: no samples, a note says why
            self.error = f"{type(exc).__name__}: {exc}".strip()[:160]
            return False
        self.clocks.append(clock)
        self.watts.append(watts)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if not self._sample():
                return

    def __enter__(self) -> GpuStateSampler:
        self._t0 = time.perf_counter()
        if self._sample():  # the first reading at once: an unreadable NVML starts no thread
            self._thread = threading.Thread(target=self._run, name="gpu-state", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.every_s + 1.0)
        if self.error is None:
            self._sample()  # and one at the end
        self.span_s = time.perf_counter() - self._t0

    def note(self, what: str) -> str:
        """One sentence for the profile's sources on what ``what`` ran at."""
        if not self.clocks:
            return (f"GPU clock and power while {what} ran: not read ({self.error or 'no samples'}; "
                    "torch.cuda.clock_rate needs the nvidia-ml-py package)")
        clock, watts = self.clocks, self.watts
        return (f"GPU clock and power while {what} ran ({len(clock)} NVML samples over "
                f"{self.span_s:.0f} s): SM clock median {statistics.median(clock):.0f} MHz "
                f"(10th-90th percentile {_percentile(clock, 0.1):.0f}-{_percentile(clock, 0.9):.0f}), board power "
                f"median {statistics.median(watts):.0f} W (max {max(watts):.0f}); GEMMs timed back to back can hold "
                "a board at its power limit, and a step that alternates GEMMs with memory-bound kernels then "
                "runs them at a higher clock than the tables' (README 'On a GPU')")

