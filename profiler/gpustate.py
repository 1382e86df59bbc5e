"""What a GPU's clock and power did while a table was measured (NVML, through torch.cuda).

A GPU running GEMMs back to back can reach its board power limit, and the SM clock then falls to
hold it there: on a lent H200 one bf16 GEMM (4096 x 5632 x 2048) ran at 646 TFLOP/s back to back
(SM clock 1620 MHz, 690 W of 700), at 700-722 between memory-bound kernels (1845-1935 MHz) and 713
with idle gaps (1980 MHz, 281 W) (README "On a GPU"). The profiler's GEMM tables are timed in rounds
of back-to-back trials, so they likely hold such sustained rates; :class:`GpuStateSampler` records
the clock and power each table ran at, against the board's power limit and top SM clock, for the
profile's notes, so a reader can tell a capped table from a cool one.

``torch.cuda.clock_rate`` and ``torch.cuda.power_draw`` read NVML (the nvidia-ml-py package, in
autopar's ``torch`` extra) or, on ROCm, amdsmi; where they cannot be read the sampler records
nothing and its note says why.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from types import TracebackType

import torch

SAMPLE_EVERY_S = 0.25  # NVML's own sample period is 1/6 s to 1 s by product
NEAR_POWER_LIMIT = 0.95  # median power at or above this share of the limit: capped
BELOW_TOP_CLOCK = 0.92  # median SM clock at or below this share of the top clock: held down


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` as the nearest rank (no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _board_limits(device: torch.device) -> tuple[float | None, float | None]:
    """(power limit W, top SM clock MHz) from NVML, or None each where it cannot be read (ROCm, no
    nvidia-ml-py). Uses torch's own NVML handle, which maps CUDA_VISIBLE_DEVICES to NVML's index."""
    if torch.version.hip:
        return None, None
    try:
        import pynvml

        handle = torch.cuda._get_pynvml_handler(device)
        limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0  # mW
        top = float(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
        return limit, top
    except Exception:  # noqa: BLE001 - optional context for the note
        return None, None


class GpuStateSampler:
    """Samples the SM clock (MHz) and board power (W) of ``device`` every ``every_s`` in a daemon
    thread while the ``with`` block runs; :meth:`section` starts a named part (one table), and
    :meth:`note` words what each part ran at.

    ``read_clock_mhz``, ``read_power_w`` and ``limits`` (power limit W, top clock MHz) stand in for
    NVML in tests."""

    def __init__(self, device: torch.device, every_s: float = SAMPLE_EVERY_S,
                 read_clock_mhz: Callable[[], float] | None = None,
                 read_power_w: Callable[[], float] | None = None,
                 limits: tuple[float | None, float | None] | None = None) -> None:
        self.device = torch.device(device)
        self.every_s = every_s
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.error: str | None = None
        self._read_clock = read_clock_mhz or (lambda: float(torch.cuda.clock_rate(self.device)))
        self._read_power = read_power_w or self._nvml_power_w
        self._limits = limits
        self._section = "all"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _nvml_power_w(self) -> float:
        milli = torch.cuda.power_draw(self.device)
        return float(milli) if torch.version.hip else milli / 1000.0  # NVML says mW, amdsmi W

    def section(self, name: str) -> None:
        """Samples from now on belong to ``name`` (one table)."""
        with self._lock:
            self._section = name

    def _sample(self, keep: bool = True) -> bool:
        """Read the clock and power, and keep them in the current section (``keep``); False, the
        error noted, where they cannot be read."""
        try:
            reading = (self._read_clock(), self._read_power())
        except Exception as exc:  # noqa: BLE001 - NVML missing or refusing: a note says why
            self.error = f"{type(exc).__name__}: {exc}".strip()[:160]
            return False
        if keep:
            with self._lock:
                self.samples.setdefault(self._section, []).append(reading)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if not self._sample():
                return

    def __enter__(self) -> GpuStateSampler:
        # a first reading at once, not kept (the caller names its first section after entering): an
        # unreadable NVML starts no thread
        if self._sample(keep=False):
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

    def note(self, what: str) -> str:
        """One sentence for the profile's sources on each section of ``what`` (e.g. "GEMM tables")."""
        if not self.samples:
            why = self.error or "no samples"
            if self.error and self.error.startswith("ModuleNotFoundError"):
                why += "; torch.cuda.clock_rate needs the nvidia-ml-py package (autopar's torch extra)"
            return f"GPU clock and power while the {what} ran: not read ({why})"
        limit, top = self._limits if self._limits is not None else _board_limits(self.device)
        parts = []
        for name, readings in self.samples.items():
            clocks, watts = [c for c, _ in readings], [w for _, w in readings]
            clock, power = statistics.median(clocks), statistics.median(watts)
            text = (f"{name}: SM clock median {clock:.0f} MHz (10th-90th percentile {percentile(clocks, 0.1):.0f}-"
                    f"{percentile(clocks, 0.9):.0f}{f' of {top:.0f}' if top else ''}), power median {power:.0f} W"
                    f"{f' of {limit:.0f}' if limit else ''} ({len(readings)} samples)")
            capped = (limit and power >= NEAR_POWER_LIMIT * limit) or (top and clock <= BELOW_TOP_CLOCK * top)
            if capped:
                text += (": held down by the power limit, so these are sustained rates; a step that alternates "
                         "GEMMs with memory-bound kernels runs them at a higher clock (README 'On a GPU')")
            parts.append(text)
        stopped = f"; sampling stopped early ({self.error})" if self.error else ""
        return (f"GPU clock and power while the {what} ran (NVML every {self.every_s:g} s){stopped}: "
                + "; ".join(parts))
