"""RunReport: what the executor measured when it ran a plan."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from planner.contracts.cluster import Environment
from planner.contracts.common import MAX_STEP_S, SCHEMA_VERSION, Contract, PlausibleDate
from planner.contracts.limits import MAX_GPUS
from planner.contracts.plan import ParallelLayout
from planner.contracts.terms import COMM_TERMS, COMPUTE_TERMS, STEP_TERMS, TERM_MEANING, unknown_terms

__all__ = ["COMM_TERMS", "COMPUTE_TERMS", "STEP_TERMS", "TERM_MEANING", "CheckpointRecord", "RunReport",
           "StepRecord", "TermTimes", "term_comparison"]

class StepRecord(Contract):
    step: int = Field(ge=0, strict=True)
    loss: float
    time_s: float = Field(gt=0, le=MAX_STEP_S)
    profiled: bool = Field(False, description="run under torch.profiler for the breakdown: left out of the median")


class CheckpointRecord(Contract):
    """One checkpoint the run saved (rank 0's view): how long training stopped and how long the write took."""

    step: int = Field(ge=0, strict=True)
    mode: Literal["sync", "async"]
    blocking_s: float = Field(ge=0, description="training stopped this long (async: until async_save returned)")
    write_s: float = Field(ge=0, description="from the save's start until the checkpoint was on storage")
    bytes_per_rank: int = Field(ge=0, description="the tensors rank 0 saved")
    tensors_per_rank: int | None = Field(None, ge=0, le=10**7, strict=True,
                                         description="parameter tensors rank 0 saved (each with its optimizer "
                                         "states); None in reports written before it was recorded")


class TermTimes(Contract):
    """One rank's step time split into :data:`STEP_TERMS` (seconds per step, averaged over the profiled steps)."""

    rank: int = Field(ge=0, le=MAX_GPUS, strict=True)
    step_s: float = Field(gt=0, description="the profiled steps' mean wall time (the profiler slows them)")
    terms: dict[str, float] = Field(description="term -> seconds per step; they sum to step_s")
    data_s: float = Field(0.0, ge=0, description="making the next batch, outside the timed step (prefetched)")

    @field_validator("terms")
    @classmethod
    def _known(cls, v: dict[str, float]) -> dict[str, float]:
        unknown_terms(v)
        if any(not x >= 0 for x in v.values()):
            raise ValueError("every term is seconds >= 0")
        return v

    @model_validator(mode="after")
    def _within_the_step(self) -> TermTimes:
        total = sum(self.terms.values())
        if total > self.step_s * 1.01 + 1e-9:
            raise ValueError(f"the terms sum to {total:.6g} s, more than the step's {self.step_s:.6g} s: they split it")
        return self


class RunReport(Contract):
    schema_version: Literal["1"] = SCHEMA_VERSION
    plan_id: str | None = None
    layout: ParallelLayout
    created_at: PlausibleDate = Field(default_factory=lambda: datetime.now(UTC))
    device: str = Field(description="e.g. 'cpu' or 'NVIDIA H100 80GB HBM3'")
    num_ranks: int = Field(gt=0, le=MAX_GPUS, strict=True)
    warmup_steps: int = Field(ge=0, strict=True)
    steps: list[StepRecord]
    median_step_time_s: float = Field(gt=0, le=MAX_STEP_S)
    tokens_per_s: float = Field(gt=0, le=1e12)
    mfu: float | None = Field(None, ge=0, le=100)  # above 1 where a profile understates the peak
    peak_memory_bytes_per_rank: list[Annotated[int, Field(ge=0, le=2**50)]]
    memory_kind: Literal["cuda_max_allocated", "rss"] = "rss"
    environment: Environment = Field(default_factory=Environment)
    breakdown: list[TermTimes] = Field(default_factory=list, description="per rank, the step time by term "
                                       "(torch.profiler on the profiled steps); empty when not profiled")
    checkpoints: list[CheckpointRecord] = Field(default_factory=list, description="each checkpoint saved, with "
                                                "its blocking and write times (planner.cost.goodput predicts them)")


def term_comparison(predicted: dict[str, float], report: RunReport | None) -> list[dict]:
    """Per term of the step (STEP_TERMS): predicted and measured seconds per step and their shares of the step;
    measured is the mean over the profiled ranks. Empty when neither side has terms."""
    measured = report.breakdown if report is not None else []
    if not predicted and not measured:
        return []
    p_total = sum(predicted.values()) or None
    m_total = sum(b.step_s for b in measured) / len(measured) if measured else None
    rows = []
    for term in STEP_TERMS:
        m = sum(b.terms.get(term, 0.0) for b in measured) / len(measured) if measured else None
        p = predicted.get(term) if predicted else None
        if not (p or m):
            continue
        rows.append({"term": term, "meaning": TERM_MEANING[term], "predicted": p, "measured": m,
                     "predicted_share": p / p_total if p is not None and p_total else None,
                     "measured_share": m / m_total if m is not None and m_total else None})
    return rows
