"""TuneReport: what ``autopar tune`` (and ``POST /v1/tune``) ran, how calibration moved its predictions, and
the plan it chose afterwards (``planner/tune.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from planner.contracts.cluster import RunCalibration
from planner.contracts.common import Contract
from planner.contracts.plan import ParallelLayout, Plan


class TunedRun(Contract):
    """One layout tune ran: the half it served in, its step predicted before and after calibration, what it
    measured, and why it failed where it did."""

    name: str
    layout: ParallelLayout
    role: Literal["calibration", "held_out", "failed"]
    predicted_step_s: float = Field(gt=0, description="on the profile tune started from (as it was: "
                                    "uncalibrated, or calibrated by earlier runs)")
    calibrated_step_s: float | None = Field(None, gt=0, description="held out: on the profile calibrated on the "
                                            "calibration half only; calibration half: in sample")
    measured_step_s: float | None = Field(None, gt=0, description="the run's median step time")
    predicted_peak_bytes: int = Field(ge=0)
    measured_peak_bytes: int | None = Field(None, ge=0, description="the largest rank's peak (RunReport)")
    memory_kind: str | None = Field(None, description="what the measured peak is: rss (CPU) or cuda_max_allocated")
    error: str | None = Field(None, description="why the run failed (role 'failed')")


class TuneReport(Contract):
    """The tune loop's outcome. Errors are over the held-out plans: |predicted / measured - 1| of the step, before
    (uncalibrated profile) and after (calibrated on the other half)."""

    cluster: str
    model: str
    num_gpus: int = Field(gt=0)
    runs: list[TunedRun]
    median_abs_err_before: float | None = Field(None, ge=0)
    median_abs_err_after: float | None = Field(None, ge=0)
    spearman: float | None = Field(None, description="rank correlation of calibrated predictions with measured "
                                   "step times over the held-out plans")
    regret: float | None = Field(None, ge=0, description="measured step of the held-out plan the calibrated "
                                 "model ranks first / the fastest measured held-out step - 1")
    memory_median_abs_err: float | None = Field(None, ge=0, description="held-out peak memory per rank, median "
                                                "|predicted / measured - 1| after calibration")
    calibration: RunCalibration | None = Field(None, description="the fit on every run (the profile plans use next)")
    first_plan: ParallelLayout | None = Field(None, description="the search's choice before tuning")
    replanned: Plan | None = Field(None, description="the search's choice on the calibrated profile")
    replan_error: str | None = Field(None, description="why the search found no plan on the calibrated profile")

    @property
    def plans(self) -> int:
        return sum(r.role != "failed" for r in self.runs)

    def count(self, role: str) -> int:
        return sum(r.role == role for r in self.runs)

    def line(self) -> str:
        """The one-line summary ``autopar tune`` and ``benchmarks/tune.py`` end with."""
        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.1%}"

        rho = "n/a" if self.spearman is None else f"{self.spearman:.2f}"
        return (f"tune: plans={self.plans} calibrated_on={self.count('calibration')} held_out={self.count('held_out')}"
                f" median_abs_err_before={pct(self.median_abs_err_before)}"
                f" median_abs_err_after={pct(self.median_abs_err_after)} spearman={rho} regret={pct(self.regret)}")
