"""Request and response bodies of the ``/v1`` API (the documents themselves are the planner's contracts)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.contracts import ClusterProfile, ModelSpec, Plan, RunReport, Schedule, TrainingConfig, TrainingGoal
from planner.contracts.limits import (
    MAX_FALLBACKS,
    MAX_GLOBAL_BATCH,
    MAX_GPUS,
    MAX_MICRO_BATCH,
    MAX_TIME_BUDGET_S,
    MAX_TOP_K,
    MAX_VIRTUAL_STAGES,
)
from planner.contracts.tune import TuneReport
from planner.search import SearchOptions
from planner.targets import Target
from planner.tune import LIMITS, TUNE

SEARCH = SearchOptions()  # the search's defaults: one home (planner.search.options.SearchOptions)

T = TypeVar("T")
MAX_ID = 2**31 - 1  # ids are 32-bit integers (PostgreSQL INTEGER)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int = Field(description="rows matching the filters")
    limit: int
    offset: int


class ProfileSummary(BaseModel):
    id: int
    cluster: str
    version: int
    kind: Literal["measured", "reference"]
    gpu_name: str
    gpus_per_node: int
    num_nodes: int
    measured_at: datetime
    uploaded_at: datetime
    content_hash: str


class ProfileOut(ProfileSummary):
    profile: ClusterProfile


class ProfileUploaded(ProfileOut):
    created: bool = Field(description="False: the same content was stored before; this is that profile")


class ClusterSummary(BaseModel):
    name: str
    latest_profile_id: int
    versions: int
    kind: str
    gpu_name: str
    gpus_per_node: int
    num_nodes: int


class ModelRef(Strict):
    """Exactly one of a preset name, a full ModelSpec, or a Hugging Face ``config.json`` (as JSON)."""

    preset: str | None = Field(None, description="e.g. 'llama3.1-70b' (GET /v1/presets lists them)")
    spec: ModelSpec | None = None
    hf_config: dict[str, Any] | None = Field(None, description="the contents of a transformers config.json")
    name: str | None = Field(None, max_length=200, description="name for an hf_config model")

    @model_validator(mode="after")
    def _one(self) -> ModelRef:
        given = [k for k in ("preset", "spec", "hf_config") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of preset, spec or hf_config (got {given or 'none'})")
        return self


Degree = Annotated[int, Field(ge=1, le=MAX_GPUS, strict=True)]


class PlanOptions(Strict):
    """What the search may choose; bounds from ``planner/contracts/limits.py``. Integers are JSON
    integers (``true`` is no count), numbers are JSON numbers."""

    top_k: int = Field(SEARCH.top_k, ge=1, le=MAX_TOP_K, strict=True, description="alternatives to keep")
    max_tp: Degree | None = Field(None, description="largest TP degree (default: GPUs per node)")
    max_pp: Degree | None = Field(None, description="largest pipeline depth (1 = no pipeline parallelism)")
    max_cp: Degree | None = Field(None, description="largest context-parallel degree (1 = none)")
    max_ep: Degree | None = Field(None, description="largest expert-parallel degree (1 = none)")
    sequence_parallel: bool = SEARCH.sequence_parallel
    zero_stages: list[Annotated[int, Field(strict=True)]] = Field(
        list(SEARCH.zero_stages), min_length=1, description="ZeRO stages to consider")
    schedules: list[Schedule] = Field(list(SEARCH.schedules), min_length=1)
    hsdp: bool = SEARCH.hsdp
    offload: bool = SEARCH.offload
    max_micro_batch_size: int = Field(SEARCH.max_micro_batch_size, ge=1, le=MAX_MICRO_BATCH, strict=True)
    max_virtual_stages: int = Field(SEARCH.max_virtual_stages, ge=1, le=MAX_VIRTUAL_STAGES, strict=True)
    memory_headroom: float | None = Field(
        None, ge=0.0, lt=0.9, strict=True,
        description="fraction of each GPU's memory a plan keeps free beyond every predicted term; default: the "
                    "profile's assumptions.memory_headroom (5% in reference profiles)")
    tp_comm_overlap: bool = SEARCH.tp_comm_overlap
    dp_comm_overlap: bool = SEARCH.dp_comm_overlap
    ep_comm_overlap: bool = SEARCH.ep_comm_overlap
    compile: bool = Field(SEARCH.compile, description="torch.compile of model and loss (torchtitan only; its loss "
                          "then keeps 4 B per logit)")
    target: Target = Field(Target(SEARCH.target), description="what will run the plan: autopar (the executor), "
                           "megatron, deepspeed or torchtitan; the search returns only what it runs "
                           "(planner/targets/)")
    robust: bool = Field(SEARCH.robust, description="rank plans by the slow end of their 80% step-time interval")
    idle_gpus: bool = Field(SEARCH.idle_gpus, description="search an uneven GPU count beside the largest 2^a x 3^b "
                            "counts below it, leaving GPUs idle where that trains faster (planner.search.sizing)")
    global_batch_max: int | None = Field(
        None, ge=1, le=MAX_GLOBAL_BATCH, strict=True,
        description="the global batch may be any count from training.global_batch_size up to this; the plan's "
                    "sizing says which it chose and why")
    time_budget_s: float | None = Field(
        None, gt=0, le=MAX_TIME_BUDGET_S, strict=True,
        description=f"seconds after which the search returns its best (default: {SEARCH.time_budget_s:g}, or the "
                    "server's limit if lower)")

    @model_validator(mode="after")
    def _zero(self) -> PlanOptions:
        bad = [z for z in self.zero_stages if z not in (0, 1, 2, 3)]
        if bad:
            raise ValueError(f"zero_stages={bad} are not ZeRO stages; use values from 0, 1, 2, 3")
        return self


class PlanRequest(Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 64},
         "cluster": "dgx-h100", "num_nodes": 2, "options": {"top_k": 3}},
        {"model": {"preset": "mixtral-8x7b"}, "training": {"seq_length": 4096, "global_batch_tokens": 1048576},
         "cluster": "dgx-a100-80gb", "num_nodes": 4, "options": {"max_pp": 4, "memory_headroom": 0.1}},
    ]})

    model: ModelRef
    training: TrainingConfig
    profile_id: int | None = Field(None, ge=1, le=MAX_ID, strict=True,
                                   description="a stored profile (GET /v1/profiles)")
    cluster: str | None = Field(None, max_length=200, description="a cluster name: its newest profile")
    num_nodes: int | None = Field(
        None, ge=1, le=MAX_GPUS, strict=True, description="reference profiles only: nodes to plan for"
    )
    options: PlanOptions = Field(default_factory=PlanOptions)
    goal: TrainingGoal | None = Field(None, description="tokens or steps to train and the cluster's failure and "
                                      "storage facts: the plans are then ranked by expected time-to-train")
    fallbacks: int = Field(0, ge=0, le=MAX_FALLBACKS, strict=True,
                           description="also plan for the loss of 1..K nodes (the K searches share the request's "
                                       "time budget)")

    @model_validator(mode="after")
    def _where(self) -> PlanRequest:
        if (self.profile_id is None) == (self.cluster is None):
            raise ValueError("give exactly one of profile_id or cluster")
        high = self.options.global_batch_max
        if high is not None and self.training.global_batch_size is None:
            raise ValueError(f"options.global_batch_max={high} needs training.global_batch_size (the range's low end "
                             "in sequences), not global_batch_tokens")
        if high is not None and high < self.training.global_batch_size:
            raise ValueError(f"options.global_batch_max={high} is below training.global_batch_size="
                             f"{self.training.global_batch_size}; give at least that")
        return self


class Explanation(BaseModel):
    """Why no plan was produced: the field at fault, its value, and what would fix it."""

    field: str
    value: str
    problem: str
    fix: str
    message: str


class PlanSummary(BaseModel):
    id: int
    created_at: datetime
    status: Literal["ok", "infeasible"]
    model_name: str
    num_gpus: int
    profile_id: int
    cluster: str
    step_time_s: float | None


class PlanOut(PlanSummary):
    request: dict[str, Any]
    plan: Plan | None = None
    explanation: Explanation | None = None
    reused: bool = Field(False, description="the search result was reused from an identical earlier request")


class RunSubmit(Strict):
    plan_id: int = Field(ge=1, le=MAX_ID, strict=True)
    report: RunReport


class RunSummary(BaseModel):
    id: int
    plan_id: int
    created_at: datetime
    predicted_step_s: float | None
    measured_step_s: float
    error: float | None = Field(description="predicted / measured - 1")


class RunOut(RunSummary):
    report: RunReport
    predicted_tokens_per_s: float | None
    measured_tokens_per_s: float
    predicted_peak_memory_bytes: int | None
    measured_peak_memory_bytes: int


class RunSubmitted(RunOut):
    created: bool = Field(description="False: this report was stored for the plan before; this is that run")


class RunErrorSummary(BaseModel):
    runs: int
    runs_with_prediction: int
    median_abs_error: float | None
    p90_abs_error: float | None
    max_abs_error: float | None
    mean_signed_error: float | None = Field(description="> 0: the model predicts slower than measured")


class PresetOut(BaseModel):
    name: str
    spec: ModelSpec


# -- tune jobs ---------------------------------------------------------------------------------------

def _tune_field(name: str, description: str | None = None) -> Any:  # noqa: ANN401 - a pydantic FieldInfo
    """A TuneSettingsIn field with tune's own default (:data:`planner.tune.TUNE`) and bounds
    (:data:`planner.tune.LIMITS`): one home for both, the CLI's and the API's."""
    low, high = LIMITS[name]
    return Field(getattr(TUNE, name), ge=low, le=high, strict=True, description=description)


class TuneSettingsIn(Strict):
    """What a tune job runs (:class:`planner.tune.TuneSettings`): how many layouts, how long each. Integers are
    JSON integers, numbers JSON numbers; warmup + profile_steps must leave a step to time."""

    plans: int = _tune_field("plans", "layouts to run (half calibrate, half are held out)")
    steps: int = _tune_field("steps", "optimizer steps per run")
    warmup: int = _tune_field("warmup", "first steps of each run left out of its median")
    profile_steps: int = _tune_field("profile_steps", "last steps of each run profiled for the breakdown by term "
                                     "(calibration fits on it)")
    target: Target = Field(Target(TUNE.target), description="what runs the plans afterwards (the runs here are "
                           "the executor's)")
    max_micro_batch_size: int = _tune_field("max_micro_batch_size")
    time_budget_s: float = _tune_field("time_budget_s", "seconds for the search and for listing the layouts, each "
                                       "(at most the server's AUTOPAR_PLAN_BUDGET_S)")
    run_timeout_s: float = _tune_field("run_timeout_s", "seconds one run may take, start to report: a run still "
                                       "going then is stopped and counted failed")


class TuneRequest(Strict):
    """A tune job: the job to tune for (as a plan request) and how to run its layouts. The layouts run on the
    server's own host, so the profile should describe it (a measured profile of it, usually)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": {"spec": {"name": "tiny", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                            "num_kv_heads": 2, "ffn_hidden_size": 192, "vocab_size": 256}},
         "training": {"seq_length": 64, "global_batch_size": 16, "precision": "fp32"},
         "cluster": "cpu-lab", "settings": {"plans": 4, "steps": 6, "warmup": 2, "profile_steps": 2}},
    ]})

    model: ModelRef
    training: TrainingConfig
    profile_id: int | None = Field(None, ge=1, le=MAX_ID, strict=True,
                                   description="a stored profile (GET /v1/profiles)")
    cluster: str | None = Field(None, max_length=200, description="a cluster name: its newest profile")
    num_nodes: int | None = Field(None, ge=1, le=MAX_GPUS, strict=True,
                                  description="reference profiles only: nodes to tune for")
    gpus: int | None = Field(None, ge=1, le=MAX_GPUS, strict=True,
                             description="reference profiles only: GPUs to tune for (part of a node, or whole nodes)")
    settings: TuneSettingsIn = Field(default_factory=TuneSettingsIn)

    @model_validator(mode="after")
    def _where(self) -> TuneRequest:
        if (self.profile_id is None) == (self.cluster is None):
            raise ValueError("give exactly one of profile_id or cluster")
        if self.num_nodes is not None and self.gpus is not None:
            raise ValueError("give at most one of num_nodes or gpus")
        return self


class TuneJobRun(BaseModel):
    """A layout the job ran that wrote a report, as stored: its plan row and its run row."""

    name: str
    role: str
    plan_id: int
    run_id: int


class TuneJobSummary(BaseModel):
    id: int
    state: Literal["queued", "running", "done", "failed"]
    created_at: datetime
    updated_at: datetime
    cluster: str
    profile_id: int = Field(description="the profile tune started from")
    model_name: str
    phase: str | None = Field(description="plan, run, replan, done")
    done: int
    total: int
    message: str | None = Field(description="the latest progress message")
    error: str | None = Field(description="why the job failed")
    calibrated_profile_id: int | None = Field(description="the cluster's profile calibrated on every run")
    replanned_plan_id: int | None = Field(description="the plan searched on the calibrated profile")
    links: dict[str, str] = Field(description="self, page, and the calibrated profile and re-planned plan once "
                                  "stored")


class TuneJobOut(TuneJobSummary):
    request: dict[str, Any]
    workdir: str | None = Field(description="where the runs' plans, reports and logs are (NN/run.log)")
    log: list[str] = Field(description="the latest progress messages, oldest first")
    runs: list[TuneJobRun] = Field(description="the runs stored (GET /v1/runs/{id}), with their plans")
    result: TuneReport | None = Field(description="the TuneReport, once the runs are done")
