"""RunReport: what the executor measured when it ran a plan."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import Field

from planner.contracts.cluster import Environment
from planner.contracts.common import SCHEMA_VERSION, Contract
from planner.contracts.limits import MAX_GPUS
from planner.contracts.plan import ParallelLayout


class StepRecord(Contract):
    step: int = Field(ge=0, strict=True)
    loss: float
    time_s: float = Field(gt=0)


class RunReport(Contract):
    schema_version: Literal["1"] = SCHEMA_VERSION
    plan_id: str | None = None
    layout: ParallelLayout
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    device: str = Field(description="e.g. 'cpu' or 'NVIDIA H100 80GB HBM3'")
    num_ranks: int = Field(gt=0, le=MAX_GPUS, strict=True)
    warmup_steps: int = Field(ge=0, strict=True)
    steps: list[StepRecord]
    median_step_time_s: float = Field(gt=0)
    tokens_per_s: float = Field(gt=0)
    mfu: float | None = None
    peak_memory_bytes_per_rank: list[int]
    memory_kind: Literal["cuda_max_allocated", "rss"] = "rss"
    environment: Environment = Field(default_factory=Environment)
