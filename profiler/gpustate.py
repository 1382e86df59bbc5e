"""What a GPU's clock and power did while a table was measured (NVML, or amdsmi through torch.cuda).

A GPU running GEMMs back to back can reach its board power limit, and the SM clock then falls to
hold it there: on a lent H200 one bf16 GEMM (4096 x 5632 x 2048) ran at 646 TFLOP/s back to back
(SM clock 1620 MHz, 690 W of 700), at 700-722 between memory-bound kernels (1845-1935 MHz) and 713
with idle gaps (1980 MHz, 281 W) (README "On a GPU"). The profiler's GEMM tables are timed in rounds
of back-to-back trials, so they likely hold such sustained rates; :class:`GpuStateSampler` records
the clock, the power and NVML's clock event reasons (why the clock is below its top: the power cap,
thermal slowdown, an application clock setting ...) each table ran at, against the board's power
limit and top SM clock, for the profile's notes, so a reader can tell a capped table from a cool
one, and a power cap from a thermal one.

On NVIDIA, one NVML handle per device (torch's lookup, which maps CUDA_VISIBLE_DEVICES to NVML's
index) is taken once and read directly (the nvidia-ml-py package, in autopar's ``torch`` extra); on
ROCm ``torch.cuda.clock_rate`` and ``torch.cuda.power_draw`` read amdsmi, with no reasons. Where
nothing can be read the sampler records nothing and its note says why.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from types import TracebackType
from typing import NamedTuple

import torch

SAMPLE_EVERY_S = 0.25  # NVML's own sample period is 1/6 s to 1 s by product
NEAR_POWER_LIMIT = 0.95  # median power at or above this share of the limit: capped
BELOW_TOP_CLOCK = 0.92  # median SM clock at or below this share of the top clock: held down
MOSTLY = 0.5  # a clock event reason active in at least this share of a section's samples names its cause

# NVML's clock event reasons (nvmlClocksEventReason*, the bits of nvmlDeviceGetCurrentClocksEventReasons)
CLOCK_REASONS = {
    0x1: "GPU idle",
    0x2: "application clock setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
POWER_REASONS = 0x4 | 0x80
THERMAL_REASONS = 0x20 | 0x40
HW_SLOWDOWN = 0x8  # power or heat: NVML does not say which


class Reading(NamedTuple):
    """One sample: SM clock (MHz), board power (W) and NVML's active clock event reasons (a bit
    mask of :data:`CLOCK_REASONS`; None where they cannot be read)."""

    clock_mhz: float
    power_w: float
    reasons: int | None = None


def spread(values: list[float]) -> tuple[float, float]:
    """(10th, 90th) percentile of ``values`` (linear between order statistics, as numpy's default)."""
    if len(values) < 2:
        return values[0], values[0]
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], deciles[-1]


class NvmlReader:
    """Reads one NVIDIA device through one NVML handle, looked up once: the SM clock, the board power
    and the clock event reasons, and on request the board's power limit and top SM clock."""

    def __init__(self, device: torch.device) -> None:
        import pynvml  # ModuleNotFoundError where nvidia-ml-py is missing: the note says so

        self._nvml = pynvml
        self._handle = torch.cuda._get_pynvml_handler(device)
        # the older name of the same call (nvidia-ml-py before 12.535)
        self._reasons = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))

    def __call__(self) -> Reading:
        nvml, handle = self._nvml, self._handle
        clock = float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
        power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # mW
        reasons = None
        if self._reasons is not None:
            try:
                reasons = int(self._reasons(handle))
            except nvml.NVMLError:  # not supported on this board: clock and power still tell
                self._reasons = None
        return Reading(clock, power, reasons)

    def limits(self) -> tuple[float | None, float | None]:
        """(power limit W, top SM clock MHz), or None each where NVML does not say."""
        nvml, handle = self._nvml, self._handle
        try:
            limit = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0  # mW
        except nvml.NVMLError:
            limit = None
        try:
            top = float(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
        except nvml.NVMLError:
            top = None
        return limit, top


def _amdsmi_reading(device: torch.device) -> Reading:
    """ROCm: torch's amdsmi readings (power in W), no clock event reasons."""
    return Reading(float(torch.cuda.clock_rate(device)), float(torch.cuda.power_draw(device)))


def default_reader(device: torch.device) -> Callable[[], Reading]:
    """What reads ``device``: :class:`NvmlReader` on NVIDIA, torch's amdsmi readings on ROCm."""
    if torch.version.hip:
        return lambda: _amdsmi_reading(device)
    return NvmlReader(device)


def reasons_text(readings: list[Reading]) -> str:
    """Each clock event reason NVML gave in any of ``readings``, with the share of them it was in."""
    masks = [r.reasons for r in readings if r.reasons is not None]
    shares = [(name, sum(bool(m & bit) for m in masks) / len(masks)) for bit, name in CLOCK_REASONS.items()] \
        if masks else []
    return ", ".join(f"{name} {share:.0%}" for name, share in shares if share > 0) or "none"


def held_down(readings: list[Reading], limit: float | None, top: float | None) -> str | None:
    """Why a section's clock was held down, in words, or None where it was not.

    NVML's reasons name the cause where they were read: a power reason (software power cap, power
    brake) or a thermal one in at least half the samples. Without them the power alone can: a median
    at 95% of the limit or above. A clock at 92% of its top or below with neither is said to be low
    without blaming the power limit."""
    clock = statistics.median(r.clock_mhz for r in readings)
    power = statistics.median(r.power_w for r in readings)
    masks = [r.reasons for r in readings if r.reasons is not None]

    def mostly(bits: int) -> bool:
        return bool(masks) and sum(bool(m & bits) for m in masks) >= MOSTLY * len(masks)

    by_power = mostly(POWER_REASONS) if masks else bool(limit and power >= NEAR_POWER_LIMIT * limit)
    if by_power:
        return ("held down by the power limit, so these are sustained rates; a step that alternates GEMMs with "
                "memory-bound kernels runs them at a higher clock (README 'On a GPU')")
    if mostly(THERMAL_REASONS):
        return "held down by thermal slowdown (the GPU was hot: these rates are below what a cooler board does)"
    if mostly(HW_SLOWDOWN):
        return ("held down by hardware slowdown (NVML: the power brake or overheating, it does not say which: "
                "these rates are below what the board does unhindered)")
    if top and clock <= BELOW_TOP_CLOCK * top:
        cause = ("NVML named no power or thermal cause" if masks
                 else "power below the limit, and NVML's clock event reasons were not read")
        return f"SM clock below {BELOW_TOP_CLOCK:.0%} of its top ({cause}): not the power limit"
    return None


class GpuStateSampler:
    """Samples the SM clock (MHz), board power (W) and clock event reasons of ``device`` every
    ``every_s`` in a daemon thread while the ``with`` block runs; :meth:`section` starts a named part
    (one table), and :meth:`note` words what each part ran at.

    ``read`` (returning a :class:`Reading`) and ``limits`` (power limit W, top clock MHz) stand in for
    NVML in tests."""

    def __init__(self, device: torch.device, every_s: float = SAMPLE_EVERY_S,
                 read: Callable[[], Reading] | None = None,
                 limits: tuple[float | None, float | None] | None = None) -> None:
        self.device = torch.device(device)
        self.every_s = every_s
        self.samples: dict[str, list[Reading]] = {}
        self.error: str | None = None
        self._read = read
        self._limits = limits
        self._section = "all"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def section(self, name: str) -> None:
        """Samples from now on belong to ``name`` (one table)."""
        with self._lock:
            self._section = name

    def _sample(self, keep: bool = True) -> bool:
        """Take a reading, and keep it in the current section (``keep``); False, the error noted,
        where it cannot be read (the first call sets up the reader)."""
        try:
            if self._read is None:
                self._read = default_reader(self.device)
            reading = Reading(*self._read())
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

    def board_limits(self) -> tuple[float | None, float | None]:
        """(power limit W, top SM clock MHz): the ones given, else the reader's, else None each."""
        if self._limits is not None:
            return self._limits
        limits = getattr(self._read, "limits", None)
        if limits is None:
            return None, None
        try:
            return limits()
        except Exception:  # noqa: BLE001 - optional context for the note
            return None, None

    def note(self, what: str) -> str:
        """One sentence for the profile's sources on each section of ``what`` (e.g. "GEMM tables")."""
        if not self.samples:
            why = self.error or "no samples"
            if self.error and self.error.startswith("ModuleNotFoundError"):
                why += "; reading NVML needs the nvidia-ml-py package (autopar's torch extra)"
            return f"GPU clock and power while the {what} ran: not read ({why})"
        limit, top = self.board_limits()
        parts = []
        for name, readings in self.samples.items():
            clocks, watts = [r.clock_mhz for r in readings], [r.power_w for r in readings]
            lo, hi = spread(clocks)
            text = (f"{name}: SM clock median {statistics.median(clocks):.0f} MHz (10th-90th percentile {lo:.0f}-"
                    f"{hi:.0f}{f' of {top:.0f}' if top else ''}), power median {statistics.median(watts):.0f} W"
                    f"{f' of {limit:.0f}' if limit else ''} ({len(readings)} samples")
            if any(r.reasons is not None for r in readings):
                text += f"; clock event reasons: {reasons_text(readings)}"
            text += ")"
            why = held_down(readings, limit, top)
            if why:
                text += ": " + why
            parts.append(text)
        stopped = f"; sampling stopped early ({self.error})" if self.error else ""
        return (f"GPU clock and power while the {what} ran (NVML every {self.every_s:g} s){stopped}: "
                + "; ".join(parts))
