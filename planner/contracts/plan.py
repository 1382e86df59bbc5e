"""Plan and Prediction: the full recipe for splitting a training step, and what it is predicted to cost."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from planner.contracts.cluster import LinkLevel
from planner.contracts.common import SCHEMA_VERSION, Contract, Precision
from planner.contracts.goodput import GoodputPrediction, TrainingGoal
from planner.contracts.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_LAYERS
from planner.contracts.model import ModelSpec
from planner.contracts.training import TrainingConfig


class Schedule(str, Enum):
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved_1f1b"
    zero_bubble = "zero_bubble"
    zero_bubble_v = "zero_bubble_v"  # ZB-V: two chunks per rank in a V (Qi et al. 2024 §6)
    dualpipe_v = "dualpipe_v"  # DualPipeV: DeepSeek's DualPipe cut in half, two chunks per rank in a V


class Recompute(str, Enum):
    none = "none"
    selective = "selective"  # attention core (Korthikanti et al.): softmax, dropout, attention over values
    full = "full"  # whole block: only its input is kept
    op = "op"  # per-op selective checkpointing as torchtitan's SelectiveAC runs it: matmul outputs kept except
    # every second, attention outputs and reduce-scatters kept, the rest run again (planner.cost.sac)


class StageRecompute(Contract):
    """Recompute choice of one pipeline stage: ``num_layers`` of its layers use ``kind``, the rest none."""

    kind: Recompute
    num_layers: int | None = Field(None, ge=0, le=MAX_LAYERS, strict=True,
                                   description="None = every layer of the stage")


class ParallelLayout(Contract):
    """Mesh degrees and the per-step choices. Mesh order, outermost first: pp, dp_replicate, dp_shard, cp, tp."""

    dp_replicate: int = Field(1, ge=1, le=MAX_GPUS, strict=True,
                              description="data-parallel replicas (DDP, or HSDP replicate groups)")
    dp_shard: int = Field(1, ge=1, le=MAX_GPUS, strict=True,
                          description="data-parallel ranks that shard states (ZeRO / FSDP group)")
    tp: int = Field(1, ge=1, le=MAX_GPUS, strict=True)
    sp: bool = Field(False, description="sequence parallel on the TP group (norms/dropout split by sequence)")
    cp: int = Field(1, ge=1, le=MAX_GPUS, strict=True, description="context parallel: sequence split across ranks")
    pp: int = Field(1, ge=1, le=MAX_LAYERS, strict=True)
    ep: int = Field(1, ge=1, le=MAX_GPUS, strict=True,
                    description="expert parallel: routed experts split over ep ranks, folded with etp over the "
                    "dp_shard x cp x tp ranks of a pipeline stage (see expert_fold_problem)")
    etp: int | None = Field(None, ge=1, le=MAX_GPUS, strict=True,
                            description="expert tensor parallel: TP degree of the routed experts (Megatron-Core "
                            "--expert-tensor-parallel-size, MoE parallel folding); None = tp. Must divide tp")
    zero_stage: int = Field(0, ge=0, le=3, strict=True,
                            description="0 = DDP; 1 optimizer, 2 + grads, 3 + params sharded over dp_shard")
    reshard_after_forward: bool = Field(True, description="ZeRO-3/FSDP: free gathered params after forward")
    micro_batch_size: int = Field(1, ge=1, le=MAX_GLOBAL_BATCH, strict=True)
    schedule: Schedule = Schedule.one_f_one_b
    virtual_stages: int = Field(1, ge=1, le=MAX_LAYERS, strict=True,
                                description="model chunks per pipeline rank (interleaved)")
    layers_per_stage: list[Annotated[int, Field(le=MAX_LAYERS, strict=True)]] | None = Field(
        None, description="transformer layers per pipeline stage; None = even")
    recompute: Recompute = Recompute.none
    recompute_per_stage: list[StageRecompute] | None = Field(None, description="overrides recompute per stage")
    offload_optimizer: bool = Field(False, description="optimizer states and step on the CPU")
    optimizer_offload_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="with offload_optimizer: the share of the optimizer states and their step "
        "on the CPU, the rest on the GPU (Megatron-Core --optimizer-offload-fraction, DeepSpeed offload_optimizer."
        "ratio); 1 = all")
    tp_comm_overlap: bool = Field(
        False, description="TP collectives overlapped with GEMMs (async TP / TP-comm-overlap)"
    )
    dp_comm_overlap: bool = Field(True, description="gradient reduce / param gather overlapped with compute")
    ep_comm_overlap: bool = Field(
        False, description="expert all-to-all overlapped with another micro-batch's compute (DualPipe, 2-batch overlap)"
    )
    compile: bool = Field(
        False, description="torch.compile of the model and its loss (torchtitan's --compile.enable with "
        "--compile.components model,loss): the loss keeps 4 B per logit (planner.targets TargetFacts.loss); "
        "only torchtitan runs it, and async TP there compiles anyway")
    pp_scatter_gather: bool = Field(
        False,
        description="each TP rank sends 1/tp of a stage's activation to the next pipeline stage (its sequence "
        "shard under sp, or a part the next stage all-gathers: DeepSpeed's pipe_partitioned); False: every TP "
        "rank sends the whole activation. Not given: sp (what torch's pipelining and Megatron-Core send); each "
        "target refuses a value its pipeline does not send (planner.targets TargetFacts.pp_sends)",
    )

    def _check_depth(self) -> None:
        """Chunks per rank: any for interleaved 1F1B, the schedule's own depth otherwise (planner.cost.pipeline),
        which is also what an unstated ``virtual_stages`` means (a V schedule's two chunks need no saying)."""
        from planner.cost.pipeline import SCHEDULES  # the schedule facts' home imports this module

        facts = SCHEDULES[self.schedule]
        if "virtual_stages" not in self.model_fields_set and not facts.virtual:
            object.__setattr__(self, "virtual_stages", facts.depth)
        if facts.depth > 1 and self.pp == 1:
            raise ValueError(f"schedule='{self.schedule.value}' runs two chunks per rank in a V, so it needs "
                             "pp > 1; use schedule='1f1b' for pp=1")
        if not facts.virtual and self.virtual_stages != facts.depth:
            raise ValueError(
                f"virtual_stages={self.virtual_stages} does not fit schedule='{self.schedule.value}', which runs "
                f"{facts.depth} chunk(s) per rank; set virtual_stages={facts.depth} (only interleaved_1f1b "
                "takes other depths)"
            )

    @model_validator(mode="after")
    def _check(self) -> ParallelLayout:
        if "pp_scatter_gather" not in self.model_fields_set:
            object.__setattr__(self, "pp_scatter_gather", self.sp)  # the sends follow sp unless stated
        if self.sp and self.tp == 1:
            raise ValueError(
                "sp=True splits the sequence over the TP group, so it needs tp > 1; set sp=False or tp > 1"
            )
        if self.schedule is Schedule.interleaved_1f1b and self.pp == 1:
            raise ValueError("schedule='interleaved_1f1b' needs pp > 1; use schedule='1f1b' for pp=1")
        self._check_depth()
        if self.layers_per_stage is not None and len(self.layers_per_stage) != self.pp * self.virtual_stages:
            raise ValueError(
                f"layers_per_stage has {len(self.layers_per_stage)} entries but pp x virtual_stages = "
                f"{self.pp * self.virtual_stages}; give one count per (virtual) stage"
            )
        if self.optimizer_offload_fraction < 1.0 and not self.offload_optimizer:
            raise ValueError(f"optimizer_offload_fraction={self.optimizer_offload_fraction} offloads nothing without "
                             "offload_optimizer=True; set it, or leave the fraction at 1")
        if self.recompute_per_stage is not None and len(self.recompute_per_stage) != self.pp:
            raise ValueError(
                f"recompute_per_stage has {len(self.recompute_per_stage)} entries but pp={self.pp}; "
                "give one entry per pipeline stage"
            )
        return self

    @property
    def offload_share(self) -> float:
        """The share of the optimizer states on the CPU: 0 without offload, else the fraction."""
        return self.optimizer_offload_fraction if self.offload_optimizer else 0.0

    @staticmethod
    def offload_fields(share: float) -> dict:
        """The fields of an offload share (0: none), for building a layout from the search's leaf choice."""
        return {"offload_optimizer": share > 0, "optimizer_offload_fraction": share if share > 0 else 1.0}

    MESH_ORDER: ClassVar[tuple[str, ...]] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    """The world mesh, outermost first: TP innermost (neighbouring ranks, a node's NVLink), then CP, the ZeRO
    shard group, the replicate group, the pipeline. The cost model places groups by it
    (:func:`planner.cost.comm.mesh_groups`) and the executor builds its device mesh by it."""
    EXPERT_MESH_ORDER: ClassVar[tuple[str, ...]] = ("pp", "dp_replicate", "edp", "ep", "etp")
    """The routed experts' mesh over the same ranks (folded: ``edp x ep x etp = dp_shard x cp x tp``)."""

    def mesh_sizes(self, expert: bool = False) -> tuple[int, ...]:
        """Sizes of :attr:`MESH_ORDER` (``expert``: of :attr:`EXPERT_MESH_ORDER`)."""
        if expert:
            return self.pp, self.dp_replicate, self.expert_dp, self.ep, self.expert_tp
        return self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp

    def mesh_strides(self) -> Mapping[str, int]:
        """Per mesh dimension (both meshes), the ranks between neighbouring members of its group: the product
        of the dimensions inside it (read-only; memoised by the sizes, as the search asks per candidate)."""
        return _mesh_strides(self.mesh_sizes(), self.mesh_sizes(True))

    def _offload_summary(self) -> str:
        share = self.offload_share
        return "" if not share else " offload" if share == 1.0 else f" offload{share:g}"

    def recompute_summary(self) -> str:
        """The recompute in a few words: the kind, or each stage's (``s0:fullx3``)."""
        if self.recompute_per_stage is None:
            return self.recompute.value
        parts = [f"s{i}:{r.kind.value}" + (f"x{r.num_layers}" if r.num_layers is not None
                                           and r.kind is not Recompute.none else "")
                 for i, r in enumerate(self.recompute_per_stage)]
        return "per stage [" + " ".join(parts) + "]"

    def summary(self) -> str:
        """The layout in one line, as the CLI's, the pages' and ``autopar tune``'s tables show it."""
        v = f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"tp{self.tp}{'+sp' if self.sp else ''} cp{self.cp} pp{self.pp}{v}"
                f" dp{self.dp_replicate}x{self.dp_shard}"
                f"{f' ep{self.ep}' if self.ep > 1 else ''}{f' etp{self.etp}' if self.etp is not None else ''}"
                f" zero{self.zero_stage}{self._offload_summary()}"
                f"{' keep-gathered' if self.zero_stage == 3 and not self.reshard_after_forward else ''}"
                f" mb{self.micro_batch_size} {self.schedule.value if self.pp > 1 else ''} rc:{self.recompute_summary()}"
                f"{f' split{self.layers_per_stage}' if self.layers_per_stage else ''}")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def num_gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def expert_tp(self) -> int:
        """The routed experts' TP degree: ``etp``, or ``tp`` when not set."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same routed-expert shard within a replicate group: the dp_shard x cp x tp
        ranks of a stage over ep x expert_tp (MoE parallel folding, Korthikanti/Liu et al. 2025:
        attention runs tp x cp x dp, experts etp x ep x edp on the same ranks). At least 1."""
        return max(self.dp_shard * self.cp * self.tp // (self.ep * self.expert_tp), 1)

    def expert_fold_culprit(self) -> tuple[str, int | None]:
        """(field, value) an error about the folding names: etp where it does not divide tp, else ep."""
        return ("etp", self.etp) if self.tp % self.expert_tp else ("ep", self.ep)

    def expert_fold_problem(self) -> str | None:
        """Why ep x etp cannot fold over this layout's ranks, or None. The one home of the folding rule:
        etp divides tp, and ep x etp divides dp_shard x cp x tp (with etp = tp: ep divides dp_shard x cp)."""
        etp, ranks = self.expert_tp, self.dp_shard * self.cp * self.tp
        if self.tp % etp:
            return f"etp={etp} must divide tp={self.tp} (the experts' TP group is part of the attention's)"
        if ranks % (self.ep * etp):
            return (f"ep={self.ep} x etp={etp} must divide the dp_shard x cp x tp = {ranks} ranks the experts "
                    "are folded over")
        return None


class MemoryBreakdown(Contract):
    """Bytes per GPU on the most loaded pipeline stage."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    buffers_bytes: int
    total_bytes: int
    capacity_bytes: int
    fits: bool
    stage: int = 0
    terms: dict[str, int] = Field(
        default_factory=dict, description="what buffers_bytes is made of, by name (planner.cost.memory.MEMORY_TERMS)")
    headroom_bytes: int = Field(0, ge=0, description="kept free beyond total_bytes (assumptions.memory_headroom): "
                                "fits means total_bytes + headroom_bytes <= capacity_bytes")

    @property
    def allocated_bytes(self) -> int:
        """The caching allocator's peak allocation (what ``torch.cuda.max_memory_allocated`` reads): the
        total less the allocator's reserve beyond it and what lies outside the allocator."""
        outside = ("fragmentation", "runtime", "communicators", "reserved")
        return self.total_bytes - sum(self.terms.get(k, 0) for k in outside)

    def as_measured(self, kind: str) -> int:
        """The predicted figure a run's measured peak of ``kind`` (``RunReport.memory_kind``) is compared with:
        the allocator's peak allocation for ``cuda_max_allocated``, the whole total for a CPU rank's RSS."""
        return self.allocated_bytes if kind == "cuda_max_allocated" else self.total_bytes


class CommTime(Contract):
    kind: Literal[
        "tp", "cp", "ep", "pp", "dp_grad", "dp_param", "offload"
    ]
    level: LinkLevel
    group_size: int
    bytes_per_step: float
    time_s: float
    exposed_s: float

    @property
    def overlapped_s(self) -> float:
        return self.time_s - self.exposed_s


class StagePrediction(Contract):
    stage: int
    layers: int
    forward_s: float = Field(description="forward of one micro-batch through the stage (all chunks)")
    backward_s: float = Field(description="backward incl. recompute of one micro-batch")
    memory_bytes: int
    microbatches_in_flight: float


class StepTimeInterval(Contract):
    """The interval of a predicted step time, from the leave-one-source-out residuals of its regime."""

    low_s: float = Field(gt=0)
    high_s: float = Field(gt=0)
    level: float = Field(gt=0, lt=1)
    regime: str = Field(description="framework|dense or moe|precision|scale the residuals came from ('*': any)")
    rows: int = Field(ge=1, description="held-out published runs in that regime")


class Prediction(Contract):
    schema_version: Literal["1"] = SCHEMA_VERSION
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    model_flops_per_step: float = Field(description="6N-style model FLOPs (no recompute), PaLM convention")
    hardware_flops_per_step: float = Field(description="FLOPs actually executed, recompute included")
    mfu: float
    hfu: float
    compute_time_s: float = Field(description="per-GPU busy time of the critical stage over the step")
    bubble_time_s: float
    bubble_fraction: float
    optimizer_time_s: float
    exposed_comm_time_s: float
    memory: MemoryBreakdown
    comm: list[CommTime]
    stages: list[StagePrediction]
    notes: list[str] = Field(default_factory=list)
    terms: dict[str, float] = Field(
        default_factory=dict, description="the critical rank's step by term (planner.contracts.report.STEP_TERMS): "
        "compute by operator class, each collective kind's exposed time (pp: sends and the bubble), the optimizer "
        "step, other: kernel launches; what a run's breakdown is compared with")
    goodput: GoodputPrediction | None = Field(
        None, description="time-to-train under the plan's goal (planner.cost.goodput): checkpoint interval and "
                          "mode, goodput, days, GPU-hours, cost; None without a goal")
    interval: StepTimeInterval | None = Field(
        None, description="where the measured step time lies for 80% of held-out published runs of this regime "
                          "(planner.uncertainty); None where no regime has enough of them")


class Alternative(Contract):
    layout: ParallelLayout
    prediction: Prediction | None = None
    reason: str
    slower_by: float | None = Field(None, description="step time / the best plan's step time - 1")


class FamilyOutcome(Contract):
    """The best a structural family (tp, cp, pp, ep, sp) reached in the search, and why it lost."""

    family: str
    best_step_s: float | None = Field(None, description="fastest member that fits (None: none evaluated or fits)")
    slower_by: float | None = None
    members: int = Field(description="candidates of this family the search considered")
    reason: str


class SearchReport(Contract):
    """How the search went: what it considered, what removed each candidate, what the solver did."""

    candidates_considered: int
    removed_by_rule: dict[str, int] = Field(default_factory=dict, description="divisibility / placement rule -> count")
    rule_examples: dict[str, str] = Field(default_factory=dict, description="rule -> one candidate it removed")
    dominated: int = Field(0, description="removed because another candidate is as fast with less memory")
    pruned_by_bound: int = Field(0, description="lower bound already slower than the k-th best plan")
    memory_infeasible: int = 0
    evaluated: int = Field(0, description="priced exactly (default split, per-stage recompute)")
    solved: int = Field(0, description="layer split and recompute solved by CP-SAT")
    solver_status_counts: dict[str, int] = Field(default_factory=dict)
    closed_without_solver: int = Field(
        0, description="default split already met the lower bound: optimal without CP-SAT"
    )
    wall_s: float
    families: list[FamilyOutcome] = Field(default_factory=list)
    smallest_shortfall_bytes: float | None = Field(
        None, description="when nothing fits: memory missing on the closest candidate"
    )


class Fallback(Contract):
    """The plan to resume with after losing ``lost_nodes`` nodes (planner.fallback), or why there is none."""

    lost_nodes: int = Field(ge=1, strict=True)
    num_gpus: int = Field(gt=0, le=MAX_GPUS, strict=True, description="the GPUs it uses of those left")
    layout: ParallelLayout | None = None
    prediction: Prediction | None = None
    slower_by: float | None = Field(None, description="step time / the plan's step time - 1")
    reason: str


class SizeTried(Contract):
    """One (GPUs, global batch) pair the search tried (planner.search.sizing), with its best step or why none."""

    num_gpus: int = Field(gt=0, le=MAX_GPUS, strict=True)
    global_batch_size: int = Field(gt=0, strict=True, description="sequences per step")
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    reason: str | None = Field(None, description="why no layout of this pair runs the job")


class Sizing(Contract):
    """Which GPUs and global batch the plan uses when the cluster's count or a batch range left a choice."""

    available_gpus: int = Field(gt=0, le=MAX_GPUS, strict=True)
    global_batch_range: list[int] | None = Field(None, description="[low, high] sequences, when a range was given")
    chosen_gpus: int = Field(gt=0, le=MAX_GPUS, strict=True)
    chosen_global_batch: int = Field(gt=0, strict=True)
    why: str
    tried: list[SizeTried] = Field(default_factory=list)

    def summary(self) -> str:
        """The CLI's one line."""
        r = self.global_batch_range
        batch = "" if r is None else f" global_batch={self.chosen_global_batch} of {r[0]}..{r[1]}"
        return f"sizing: gpus={self.chosen_gpus} of {self.available_gpus}{batch} ({self.why})"


class Plan(Contract):
    schema_version: Literal["1"] = SCHEMA_VERSION
    model: ModelSpec
    training: TrainingConfig
    cluster: str = Field(description="name of the ClusterProfile planned for")
    num_gpus: int = Field(gt=0, le=MAX_GPUS, strict=True)
    layout: ParallelLayout
    precision: Precision
    target: str = Field(
        "autopar",
        description="what the plan was made to run on: autopar (the executor), "
        "megatron, deepspeed or torchtitan (planner/targets/)",
    )
    prediction: Prediction
    alternatives: list[Alternative] = Field(default_factory=list)
    solver_status: str | None = Field(
        None,
        description="how the chosen layer split was proved: CP-SAT's status (OPTIMAL, FEASIBLE) or "
        "'OPTIMAL (bound)' when the default split met the lower bound; None for a layout given by hand",
    )
    search: SearchReport | None = None
    goal: TrainingGoal | None = Field(None, description="what to train and how the cluster fails, when given: "
                                                         "the plans are then ranked by expected time-to-train")
    fallbacks: list[Fallback] = Field(default_factory=list, description="plans for the loss of 1..K nodes, each "
                                      "resumable from the last checkpoint (autopar run --fallback K)")
    sizing: Sizing | None = Field(None, description="the GPUs and global batch chosen where the cluster's GPU count "
                                  "or a global batch range left a choice, with every pair tried")


@functools.lru_cache(maxsize=4096)
def _mesh_strides(sizes: tuple[int, ...], expert_sizes: tuple[int, ...]) -> Mapping[str, int]:
    out: dict[str, int] = {}
    orders = ((ParallelLayout.MESH_ORDER, sizes), (ParallelLayout.EXPERT_MESH_ORDER, expert_sizes))
    for order, dims in orders:
        stride = 1
        for name, size in zip(reversed(order), reversed(dims)):
            out.setdefault(name, stride)  # pp and dp_replicate: the world mesh's (the same ranks inside)
            stride *= size
    return MappingProxyType(out)
