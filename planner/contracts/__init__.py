"""Versioned contracts exchanged between profiler, planner, executor and the service."""

from planner.contracts.cluster import (
    LINEAR_LAYOUTS,
    Assumptions,
    AttentionBlocking,
    AttentionPoint,
    CheckpointCost,
    CheckpointLine,
    CheckpointPoint,
    ClusterProfile,
    Collective,
    ComputeProfile,
    DeviceCheck,
    DeviceSpec,
    ElementwisePoint,
    Environment,
    GemmLayout,
    GemmPoint,
    LinkLevel,
    LinkProfile,
    TimedPoint,
)
from planner.contracts.common import SCHEMA_VERSION, Optimizer, Precision
from planner.contracts.goodput import CheckpointChoice, GoodputPrediction, TrainingGoal
from planner.contracts.model import MLASpec, ModelSpec, MoESpec
from planner.contracts.plan import (
    Alternative,
    CommTime,
    FamilyOutcome,
    MemoryBreakdown,
    ParallelLayout,
    Plan,
    Prediction,
    Recompute,
    Schedule,
    SearchReport,
    StagePrediction,
    StageRecompute,
)
from planner.contracts.report import STEP_TERMS, TERM_MEANING, RunReport, StepRecord, TermTimes
from planner.contracts.training import TrainingConfig

CONTRACTS = {
    "ModelSpec": ModelSpec,
    "TrainingConfig": TrainingConfig,
    "ClusterProfile": ClusterProfile,
    "Plan": Plan,
    "Prediction": Prediction,
    "TrainingGoal": TrainingGoal,
    "RunReport": RunReport,
}


def json_schemas() -> dict[str, dict]:
    """JSON Schema of every contract, keyed by name."""
    return {name: cls.model_json_schema() for name, cls in CONTRACTS.items()}


__all__ = [
    "SCHEMA_VERSION", "CONTRACTS", "json_schemas", "Precision", "Optimizer", "ModelSpec", "MoESpec",
    "MLASpec", "TrainingConfig", "ClusterProfile", "CheckpointCost", "CheckpointLine", "CheckpointPoint",
    "DeviceSpec", "DeviceCheck", "Environment", "LinkLevel",
    "Collective", "LinkProfile", "TimedPoint", "ComputeProfile", "GemmLayout", "GemmPoint", "LINEAR_LAYOUTS",
    "AttentionPoint", "AttentionBlocking", "ElementwisePoint",
    "Assumptions", "ParallelLayout", "Schedule", "Recompute", "StageRecompute", "Plan",
    "Prediction", "MemoryBreakdown", "CommTime", "StagePrediction", "Alternative", "RunReport", "StepRecord",
    "TermTimes", "STEP_TERMS", "TERM_MEANING",
    "SearchReport", "FamilyOutcome", "TrainingGoal", "GoodputPrediction", "CheckpointChoice",
]
