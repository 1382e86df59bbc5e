"""Time-to-train: what the job must train and how its cluster fails (:class:`TrainingGoal`), and what a plan
then costs in days, GPU-hours and money with its checkpoint interval and mode (:class:`GoodputPrediction`).
The terms are :mod:`planner.cost.goodput`'s."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from planner.contracts.common import SCHEMA_VERSION, Contract

# Llama 3 405B: 419 unexpected interruptions in 54 days of pre-training on 16,384 H100s (Llama 3 Herd of
# Models, Dubey et al. 2024, §3.3.4): 419 / (54 x 24 h x 16,384 GPUs)
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16_384)
# Llama 3's checkpoint storage (Tectonic): 2 TB/s sustained over the 2,048 nodes of 8 GPUs (§3.3.1): ~1 GB/s a node
LLAMA3_STORAGE_GBPS_PER_NODE = 2000 / 2048
# a restart after a failure: rescheduling, process start, communicator set-up and loading the checkpoint. No
# single published figure; FlashRecovery (Zhang et al. 2025, arXiv 2509.03047) brings a 4,800-device job back in
# 150 s with a purpose-built system, which this does not assume: 10 minutes, to be measured on your cluster
DEFAULT_RESTART_S = 600.0
MAX_FAILURE_RATE = 1.0  # per GPU-hour: a GPU failing every hour is not a cluster to plan for
MAX_PRICE = 1e4  # USD per GPU-hour
MAX_TOKENS = 1e16
MAX_GBPS_PER_NODE = 1e4  # GB/s of storage writes a node gets
MAX_RESTART_S = 7 * 86400.0  # a week between a failure and training again


class TrainingGoal(Contract):
    """What to train and the cluster's failure and storage facts (each default with its source above)."""

    schema_version: Literal["1"] = SCHEMA_VERSION
    tokens: float | None = Field(None, gt=0, le=MAX_TOKENS, description="tokens to train (or give steps)")
    steps: int | None = Field(None, gt=0, le=10**9, strict=True, description="optimizer steps to train")
    failure_rate_per_gpu_hour: float = Field(
        LLAMA3_FAILURES_PER_GPU_HOUR, gt=0, le=MAX_FAILURE_RATE,
        description="job-interrupting failures per GPU-hour (default: Llama 3 405B's 419 in 54 days on 16,384 "
                    "GPUs)")
    checkpoint_gbps_per_node: float | None = Field(
        None, gt=0, le=MAX_GBPS_PER_NODE,
        description="storage write bandwidth a node gets, GB/s; None: the profile's measured checkpoint lines "
                    "where it has them, else Llama 3's 2 TB/s over 2,048 nodes (LLAMA3_STORAGE_GBPS_PER_NODE)")
    restart_s: float = Field(DEFAULT_RESTART_S, ge=0, le=MAX_RESTART_S,
                             description="seconds from a failure until training resumes, checkpoint load included")
    price_per_gpu_hour: float | None = Field(None, gt=0, le=MAX_PRICE,
                                             description="USD per GPU-hour; None: no cost is stated")

    @model_validator(mode="after")
    def _amount(self) -> TrainingGoal:
        if (self.tokens is None) == (self.steps is None):
            raise ValueError(f"give exactly one of tokens or steps; got tokens={self.tokens}, steps={self.steps}")
        return self


class CheckpointChoice(Contract):
    """One checkpoint mode for a plan: its cost per checkpoint, its best interval and what the job then takes."""

    mode: Literal["sync", "async"]
    blocking_s: float = Field(ge=0, description="training stops this long per checkpoint (sync: the copy to host "
                                                "and the write; async: the copy to host)")
    write_s: float = Field(ge=0, description="the write to storage (async: behind training)")
    interval_s: float = Field(gt=0, description="training time between checkpoints (Daly's optimum)")
    wall_s: float = Field(gt=0, description="expected wall-clock time to train, failures included")
    goodput: float = Field(gt=0, le=1, description="training time / wall-clock time")


class GoodputPrediction(Contract):
    """A plan's time-to-train under the goal's failure rate: the better checkpoint mode the target offers, the
    other beside it; days, GPU-hours and cost from the wall-clock time (every GPU held throughout)."""

    steps: int
    train_s: float = Field(description="steps x predicted step time: the time without failures or checkpoints")
    mtbf_s: float = Field(description="the job's mean time between failures: 1 / (rate x GPUs)")
    checkpoint_bytes: float = Field(description="one checkpoint: weights and optimizer states, stored once")
    checkpoint_bytes_per_rank: float = Field(description="what the most loaded rank copies to host")
    chosen: CheckpointChoice
    other: CheckpointChoice | None = None
    days: float
    gpu_hours: float
    cost: float | None = None
    notes: list[str] = Field(default_factory=list)

    def summary(self) -> str:
        """The CLI's one line (issue 27's format)."""
        c = self.chosen
        cost = "n/a" if self.cost is None else f"{self.cost:.0f}"
        return (f"goodput: checkpoint_interval_s={c.interval_s:.0f} checkpoint_blocking_s={c.blocking_s:.3g} "
                f"mtbf_s={self.mtbf_s:.0f} goodput={100 * c.goodput:.1f}% days={self.days:.2f} "
                f"gpu_hours={self.gpu_hours:.0f} cost={cost}")
