"""What each target can run: one capability table per target, read by the search, ``autopar export`` and
the executor's refusal.

A target is where a plan is meant to run: ``autopar`` (this project's executor) or a framework that
``autopar export`` writes launch files for (``megatron``, ``deepspeed``, ``torchtitan``). Its table
(:data:`TARGETS`) is a list of :class:`Limit` rows, each one feature the target cannot run: a test
on a :class:`Job` (model, training, layout) and the :class:`~planner.errors.AutoparError` it raises
(field, value, problem, fix). :func:`refusal` returns the first row's error, :func:`check` raises it.
Adding a schedule or a feature a target lacks is one row here; nothing else decides what a target runs.

A row's ``scope`` says which part of the job it reads, so that the search can ask before choosing a
layer split: ``model`` (model and training only), ``layout`` (the base layout's fields: degrees,
ZeRO, schedule, virtual stages, offload, resharding, overlaps, sp, micro-batch size) and ``split``
(``layers_per_stage``, ``recompute_per_stage``, micro-batch counts). ``uneven_split`` and
``per_stage_recompute`` tell the search whether it may vary the split or the recompute per stage at
all; the split rows say which particular choices are refused.

A target also prices differently (:class:`TargetFacts`, ``TargetSpec.facts``): the bytes its loss holds
per logit, what its pipeline stages send (``pp_scatter_gather`` follows from the target and ``sp``; a
``pp_sends`` row refuses any other value, so no plan prices sends the target does not do) and whether
its fp32 master copy is the parameter itself. ``predict(..., target=...)`` and the search read them
here; every fact names its source.

Each table names the framework release its rows were checked against (source paths in the row
comments); this module never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from planner.contracts import (
    ClusterProfile,
    ModelSpec,
    ParallelLayout,
    Plan,
    Precision,
    Recompute,
    Schedule,
    TrainingConfig,
)
from planner.contracts.limits import ONE_KERNEL
from planner.cost.checks import default_layer_split
from planner.cost.params import embedding_params, head_per_tp_rank
from planner.errors import AutoparError, UnknownNameError

GPUS_PER_NODE = 8  # launchers start this many processes per node (fewer when the plan has fewer GPUs)
SCOPES = ("model", "layout", "split")

__all__ = [
    "GPUS_PER_NODE",
    "ONE_KERNEL",
    "SCOPES",
    "TARGETS",
    "Job",
    "Limit",
    "RecomputeSetting",
    "Target",
    "TargetFacts",
    "TargetRefusal",
    "TargetSpec",
    "check",
    "every_nth_recompute",
    "job_of",
    "loss_bytes_per_logit",
    "planned_scatter_gather",
    "priced_profile",
    "recompute_text",
    "refusal",
    "stage_layers",
    "titan_compiled",
    "target_facts",
    "uniform_recompute",
]


class Target(str, Enum):
    autopar = "autopar"
    megatron = "megatron"
    deepspeed = "deepspeed"
    torchtitan = "torchtitan"


@dataclass(frozen=True)
class Job:
    """What a limit looks at. ``training`` None: not known (the executor's own checks without one);
    rows that read it then refuse nothing. ``micro_batches``: per data-parallel pipeline, when known."""

    model: ModelSpec
    training: TrainingConfig | None
    layout: ParallelLayout
    micro_batches: int | None = None
    hf: bool = False  # a Hugging Face model (autopar target only)


Text = str | Callable[[Job], str]


@dataclass(frozen=True)
class Limit:
    """One row: a feature the target cannot run, and the error that says so."""

    feature: str  # short name shown to users
    scope: Literal["model", "layout", "split"]
    refuses: Callable[[Job], bool]
    field: Text
    value: Callable[[Job], object]
    problem: Text
    fix: Text

    def error(self, job: Job, target: Target) -> TargetRefusal:
        return TargetRefusal(self, target, job)


@dataclass(frozen=True)
class TargetFacts:
    """What a target does that the cost model prices by target (``predict`` and the search read them here).

    ``loss(layout)``: bytes per logit the LM head's logits and the cross-entropy hold at their peak, for one
    micro-batch of 16-bit logits (``memory.logits_bytes``), or None: the profile's own measurement
    (``assumptions.loss_bytes_per_logit``, profiler/memory.py measures the executor's loss).
    ``pp_sends(model, sp)``: the ``pp_scatter_gather`` values the target's pipeline runs (True: each TP rank
    sends 1/tp of a stage's activation), the first being what it plans.
    ``master_in_param``: the fp32 master copy is the parameter itself (FSDP2's sharded fp32 parameter; fp32
    parameters under autocast), its 16-bit weights only copies held through the backward
    (``memory.model_state_bytes``); False: 16-bit parameters beside an fp32 master (Rajbhandari et al.).
    ``fsdp_root(model, tp)``: parameters (per TP rank) of the FSDP2 units besides the blocks that ZeRO-3 with
    resharding holds gathered at the backward's peak, in 16 bits (``memory.root_weights``, one pipeline stage).
    ``fp8_saved_inputs``: FP8 training keeps each linear layer's FP8-cast input for its backward (1 byte an
    element, ``memory.layer_activation_bytes``); False: the 16-bit input, cast again in the backward.
    ``expert_gemms(profile, precision)``: how many GEMMs of a grouped expert GEMM run at once on the target, the
    profile's GPU and the training precision (:data:`ONE_KERNEL`: all of them, one grouped kernel; 1: one after
    another), or None: the profile's ``assumptions.grouped_gemm_streams`` (Transformer Engine's streams).
    :func:`priced_profile` applies it.
    Each with the source it was read from."""

    loss: Callable[[ParallelLayout], float | None]
    loss_source: str
    pp_sends: Callable[[ModelSpec, bool], tuple[bool, ...]]
    pp_source: str
    master_in_param: bool
    states_source: str
    expert_gemms: Callable[[ClusterProfile, Precision], int | None] = lambda profile, precision: None
    expert_source: str = "the profile's assumptions.grouped_gemm_streams"
    fsdp_root: Callable[[ModelSpec, int], float] = lambda model, tp: 0.0
    root_source: str = "not FSDP2: no unit beside the blocks is held gathered"
    fp8_saved_inputs: bool = True
    fp8_source: str = "refuses FP8 training: never priced"


GROUPED_MM_GPUS = re.compile(r"(?<![a-z0-9])(gh200|h100|h200|h800|h20|g?b100|g?b200|g?b300)(?![a-z0-9])", re.IGNORECASE)
"""NVIDIA GPUs of compute capability 9.0 and 10.x (Hopper and datacenter Blackwell), where ``torch._grouped_mm``
runs its CUTLASS kernels, by the device's name (a datasheet's or CUDA's: "H100", "NVIDIA H100 80GB HBM3");
not Ada (8.9) or consumer Blackwell (12.x), whose FP8 peaks would otherwise mislead, nor AMD GPUs."""


def _grouped_mm_or_loop(profile: ClusterProfile, precision: Precision) -> int:
    """One grouped kernel on the GPUs of :data:`GROUPED_MM_GPUS`; elsewhere the experts run one GEMM after
    another. torchtitan casts the experts' operands to bf16 whatever the training precision."""
    return ONE_KERNEL if GROUPED_MM_GPUS.search(profile.device.name) else 1


def _executor_experts(profile: ClusterProfile, precision: Precision) -> int:
    """The executor runs ``torch._grouped_mm`` in bf16 only (``executor.moe.grouped_mm_dtype``): fp32 loops."""
    return _grouped_mm_or_loop(profile, precision) if precision is Precision.bf16 else 1


def _embedding_and_head(model: ModelSpec, tp: int) -> float:
    return embedding_params(model) / tp + head_per_tp_rank(model, tp)


def priced_profile(
    profile: ClusterProfile, target: str | Target, precision: Precision = Precision.bf16
) -> ClusterProfile:
    """``profile`` as ``target`` runs on it in ``precision``: its expert GEMMs' concurrency
    (``TargetFacts.expert_gemms``) in place of the profile's own, where they differ (else ``profile`` itself,
    so its memo is kept)."""
    streams = target_facts(target).expert_gemms(profile, precision)
    if streams is None or streams == profile.assumptions.grouped_gemm_streams:
        return profile
    a = profile.assumptions.model_copy(update={"grouped_gemm_streams": streams})
    return profile.model_copy(update={"assumptions": a})


@dataclass(frozen=True)
class TargetSpec:
    target: Target
    framework: str  # the release each row describes
    limits: tuple[Limit, ...]
    uneven_split: bool  # can the target run any layers_per_stage the search picks?
    per_stage_recompute: bool  # can it run a different recompute kind/count per pipeline stage?
    facts: TargetFacts


class TargetRefusal(AutoparError):
    """A target's refusal: the row (``limit``) that refused ``job`` on ``target``, with the row's error.
    ``planned``: the target the plan was made for, when another; the error then says so and names the
    blocking feature."""

    def __init__(self, limit: Limit, target: Target, job: Job, planned: Target | None = None):
        def text(t: Text) -> str:
            return t(job) if callable(t) else t

        problem, fix = text(limit.problem), text(limit.fix)
        if planned is not None and planned is not target:
            problem += (
                f"; this plan was made for target '{planned.value}', and {target.value} cannot run its "
                f"{limit.feature}"
            )
            fix = f"re-plan with --target {target.value}, or {fix}"
        super().__init__(text(limit.field), limit.value(job), fix, problem=problem)
        self.limit, self.target, self.job, self.planned = limit, target, job, planned

    @property
    def feature(self) -> str:
        return self.limit.feature

    def for_plan_made_for(self, planned: Target) -> TargetRefusal:
        """The same refusal of a plan that was made for ``planned``."""
        return TargetRefusal(self.limit, self.target, self.job, planned)


def _target(target: Target | str) -> Target:
    if isinstance(target, Target):
        return target
    known = _BY_NAME.get(target)  # the search asks per leaf: the exact names without parsing
    if known is not None:
        return known
    try:
        return Target(str(target).strip().lower())
    except ValueError:
        raise UnknownNameError("target", target, [t.value for t in Target]) from None


_BY_NAME = {t.value: t for t in Target}


def refusal(target: Target | str, job: Job, scopes: Iterable[str] = SCOPES) -> TargetRefusal | None:
    """The error of the first row of ``target``'s table, among ``scopes``, that refuses ``job``; None
    when the target runs it."""
    t, wanted = _target(target), tuple(scopes)
    for scope in wanted:
        if scope not in SCOPES:
            raise UnknownNameError("scope", scope, list(SCOPES))
    for limit in TARGETS[t].limits:
        if limit.scope in wanted and limit.refuses(job):
            return limit.error(job, t)
    return None


def check(target: Target | str, job: Job, scopes: Iterable[str] = SCOPES) -> None:
    """Raise :func:`refusal`'s error, if any."""
    err = refusal(target, job, scopes)
    if err is not None:
        raise err


def target_facts(target: Target | str) -> TargetFacts:
    """``target``'s :class:`TargetFacts`."""
    return TARGETS[_target(target)].facts


def loss_bytes_per_logit(target: Target | str, layout: ParallelLayout, assumption: float) -> float:
    """Bytes per logit of ``target``'s loss under ``layout``; ``assumption`` (the profile's
    ``loss_bytes_per_logit``) where the target's facts defer to the measured figure."""
    own = target_facts(target).loss(layout)
    return assumption if own is None else own


def planned_scatter_gather(target: Target | str, model: ModelSpec, sp: bool) -> bool:
    """The ``pp_scatter_gather`` a plan for ``target`` states: what its pipeline does with (or without) SP."""
    return target_facts(target).pp_sends(model, sp)[0]


def job_of(plan: Plan, *, hf: bool = False) -> Job:
    """The job of a saved plan; micro-batches per pipeline = global batch / (dp x micro-batch size)."""
    lay = plan.layout
    per_step = lay.dp * lay.micro_batch_size
    gbs = plan.training.global_batch_seqs
    micro = gbs // per_step if gbs % per_step == 0 else None
    return Job(plan.model, plan.training, lay, micro_batches=micro, hf=hf)


# ============================================================================================
# the layer split and the recompute per stage, as the frameworks can state them
# ============================================================================================
def stage_layers(layout: ParallelLayout, num_layers: int) -> list[int]:
    """Transformer layers per (virtual) stage, in stage order (stage ``chunk * pp + rank``)."""
    if layout.layers_per_stage is not None:
        return list(layout.layers_per_stage)
    return default_layer_split(num_layers, layout.pp * layout.virtual_stages)


def _rank_chunks(counts: list[int], pp: int, virtual: int) -> list[list[int]]:
    """Layers of each model chunk, per pipeline rank (the planner's and Megatron's stage order)."""
    return [[counts[c * pp + r] for c in range(virtual)] for r in range(pp)]


def recompute_text(layout: ParallelLayout) -> str:
    """``recompute`` or the per-stage list as ``[kind:layers, ...]``."""
    if layout.recompute_per_stage is None:
        return layout.recompute.value
    parts = (
        s.kind.value if s.num_layers is None else f"{s.kind.value}:{s.num_layers}"
        for s in layout.recompute_per_stage
    )
    return "[" + ", ".join(parts) + "]"


def _per_rank(layout: ParallelLayout, chunks: list[list[int]]) -> list[tuple[str, int]]:
    """(kind, layers recomputed) of each pipeline rank; ("none", 0) when it recomputes nothing."""
    assert layout.recompute_per_stage is not None
    out = []
    for rank, choice in zip(chunks, layout.recompute_per_stage):
        total = sum(rank)
        n = total if choice.num_layers is None else min(choice.num_layers, total)
        out.append((choice.kind.value, n) if n > 0 and choice.kind is not Recompute.none else ("none", 0))
    return out


@dataclass(frozen=True)
class RecomputeSetting:
    kind: str  # "none" | "selective" | "full"
    block: int | None = None  # full recompute of only the first ``block`` layers of every model chunk


def uniform_recompute(layout: ParallelLayout, num_layers: int) -> RecomputeSetting | None:
    """The plan's recompute as one setting shared by every stage (Megatron's --recompute-*), or None.

    A rank recomputing ``n`` of its layers fully is "block N": the first ``N`` layers of each model
    chunk, when ``sum over its chunks of min(N, chunk layers)`` equals ``n`` on every rank.
    """
    if layout.recompute_per_stage is None:
        return RecomputeSetting(layout.recompute.value)
    chunks = _rank_chunks(stage_layers(layout, num_layers), layout.pp, layout.virtual_stages)
    wanted = _per_rank(layout, chunks)
    kinds = {k for k, _ in wanted} - {"none"}
    if not kinds:
        return RecomputeSetting("none")
    if len(kinds) > 1:
        return None
    kind = kinds.pop()
    if all(n == sum(rank) for rank, (_, n) in zip(chunks, wanted) if sum(rank) > 0):
        return RecomputeSetting(kind)
    if kind == "selective":
        return None
    largest = max((c for rank in chunks for c in rank), default=0)
    for block in range(1, largest + 1):
        if all(sum(min(block, c) for c in rank) == n for rank, (_, n) in zip(chunks, wanted)):
            return RecomputeSetting("full", block)
    return None


def every_nth_recompute(layout: ParallelLayout, num_layers: int) -> int | None:
    """torchtitan's layer-selective checkpointing: the smallest ``N`` for which every rank, fully
    recomputing every N-th of its ``L`` layers (``floor(L / N)`` of them), recomputes as many layers as
    ``recompute_per_stage`` says; None without ``recompute_per_stage``, with selective recompute, or
    when no ``N`` does. (torchtitan counts the blocks of all model parts of a rank with one counter,
    torchtitan/distributed/activation_checkpoint.py ``_apply_layer_sac``, v0.2.2.)"""
    if layout.recompute_per_stage is None:
        return None
    chunks = _rank_chunks(stage_layers(layout, num_layers), layout.pp, layout.virtual_stages)
    wanted = _per_rank(layout, chunks)
    if any(k == "selective" for k, _ in wanted):
        return None
    totals = [sum(rank) for rank in chunks]
    for every in range(1, max(totals, default=0) + 2):
        if all(t // every == n for t, (_, n) in zip(totals, wanted)):
            return every
    return None


# ============================================================================================
# rows shared by the exported frameworks
# ============================================================================================
def _trained(test: Callable[[TrainingConfig], bool]) -> Callable[[Job], bool]:
    """A row test on the training config; refuses nothing when the job's training is not known."""
    return lambda j: j.training is not None and test(j.training)


def _no_compile(framework: str, why: str) -> Limit:
    """The row of a target that runs no ``torch.compile`` of the model (``ParallelLayout.compile``)."""
    return Limit(
        feature="torch.compile of the model and loss",
        scope="layout",
        refuses=lambda j: j.layout.compile,
        field="layout.compile",
        value=lambda j: True,
        problem=f"cannot be expressed: {framework} {why}",
        fix="plan with compile=False, or use --to torchtitan",
    )


def _kv_heads(framework: str) -> Limit:
    return Limit(
        feature="key/value heads replicated over the TP ranks",
        scope="layout",
        refuses=lambda j: j.model.mla is None and j.model.kv_heads % j.layout.tp != 0,
        field="tp",
        value=lambda j: j.layout.tp,
        problem=lambda j: (
            f"does not divide num_kv_heads={j.model.kv_heads}; {framework} splits the key/value "
            "heads across the TP ranks and does not replicate them"
        ),
        fix=lambda j: f"use a tp that divides num_kv_heads={j.model.kv_heads}",
    )


def _master_weights(framework: str) -> Limit:
    return Limit(
        feature="mixed precision without fp32 master weights",
        scope="model",
        refuses=_trained(lambda t: t.precision is not Precision.fp32 and not t.master_weights_fp32),
        field="master_weights_fp32",
        value=lambda j: False,
        problem=f"cannot be expressed: {framework} keeps an fp32 master copy of the weights for "
        "mixed-precision training",
        fix="plan with master_weights_fp32=True",
    )


_WHOLE_NODES = Limit(
    feature="a GPU count that does not fill whole nodes",
    scope="layout",
    refuses=lambda j: j.layout.num_gpus % min(GPUS_PER_NODE, j.layout.num_gpus) != 0,
    field="num_gpus",
    value=lambda j: j.layout.num_gpus,
    problem=f"does not fill whole nodes of {GPUS_PER_NODE} GPUs, and torchrun starts the same number of "
    "processes on every node",
    fix=f"plan for a multiple of {GPUS_PER_NODE} GPUs (whole nodes)",
)


def _pp(j: Job) -> bool:
    return j.layout.pp > 1


def _one_recompute_fails(j: Job) -> bool:
    return (
        j.layout.recompute_per_stage is not None and uniform_recompute(j.layout, j.model.num_layers) is None
    )


def _recompute_value(j: Job) -> str:
    return recompute_text(j.layout)


# ============================================================================================
# what each target does (TargetFacts), read by predict and the search; benchmarks/loss_memory.py
# measures the torch losses (torch's profiler, on the CPU), the framework losses are counted below
# ============================================================================================
def _sends_as_sp(model: ModelSpec, sp: bool) -> tuple[bool, ...]:
    return (sp,)


def _deepspeed_sends(model: ModelSpec, sp: bool) -> tuple[bool, ...]:
    if sp:
        return (True,)  # each rank's own sequence shard; partitioning it again would mix the ranks' shards
    return (False,) if model.moe is not None else (True, False)


_TORCH_PIPELINE_SENDS = (
    "torch.distributed.pipelining sends each stage's output as it is (stage.py): under sequence parallelism "
    "the TP rank's sequence shard (1/tp of the activation), without it the whole activation, replicated on "
    "every TP rank"
)

_AUTOPAR_FACTS = TargetFacts(
    loss=lambda lay: None,
    loss_source="the executor's loss, measured per profile by profiler/memory.py (14.0 on an H100): torch's "
    "cross-entropy on fp32-cast logits (loss_parallel under TP), the 16-bit logits kept to the backward as "
    "the pipeline schedule's stage output: 2 (logits) + 4 (fp32 copy) + 4 (log-softmax) + 4 (its gradient) "
    "at the backward's peak; 14.0 with loss_parallel too (benchmarks/loss_memory.py)",
    pp_sends=_sends_as_sp,
    pp_source=_TORCH_PIPELINE_SENDS + " (executor/pipeline.py)",
    master_in_param=True,
    states_source="executor/parallelize.py: ZeRO-2/3 are FSDP2 fully_shard with MixedPrecisionPolicy(param_dtype="
    "bf16, reduce_dtype=fp32), whose sharded fp32 parameter is the master (16-bit weights exist only gathered); "
    "ZeRO-0/1 keep whole fp32 parameters under torch.autocast (its cached 16-bit casts live through the "
    "backward) and torch's ZeroRedundancyOptimizer shards only the optimizer state",
    fsdp_root=_embedding_and_head,
    root_source="executor/parallelize.py apply_fsdp: fully_shard on each block, then on the model, whose unit "
    "holds the embedding, final norm and output projection; its pre-backward hook gathers them before the "
    "output's backward and frees them after the embedding's, so they are held through the whole backward "
    "(torchtitan of 2024 wrapped the same way: parallelisms/parallelize_llama.py apply_fsdp)",
    expert_gemms=_executor_experts,
    expert_source="executor/moe.py GroupedExperts: torch._grouped_mm (one kernel per linear layer) on a GPU of "
    "compute capability 9 or 10 in bf16, else (fp32, older GPUs) one GEMM per local expert on one stream; "
    "on an H100 the 128 "
    "experts' up-projection at 256 rows each took 0.41 ms as one kernel against 2.0-3.9 ms as a loop "
    "(benchmarks/moe_gpu_check.py, benchmarks/data/moe_h100.log)",
)

_MEGATRON_FACTS = TargetFacts(
    loss=lambda lay: 6.0,
    loss_source="Megatron-Core core_v0.19.0 megatron/core/tensor_parallel/cross_entropy.py (the default; "
    "--cross-entropy-loss-fusion's native path, megatron/core/fusions/fused_cross_entropy.py, holds the same, "
    "and arguments.py refuses the Transformer Engine one): the 16-bit logits (2) are cast once to fp32 (4), "
    "the max subtracted, exponentiated and normalised in place, that softmax saved and made the gradient in "
    "place, then cast to 16 bits (2): 6 in the forward and in the backward",
    pp_sends=_sends_as_sp,
    pp_source="core_v0.19.0 megatron/core/pipeline_parallel/schedules.py get_tensor_shapes divides the sent "
    "sequence by tp only with --sequence-parallel; the scatter-gather of whole activations was removed in "
    "core_v0.18.0 (NVIDIA/Megatron-LM 10e7b74597)",
    master_in_param=False,
    states_source="16-bit parameters beside fp32 main parameters and Adam states sharded by the distributed "
    "optimizer (megatron/core/optimizer/distrib_optimizer.py); Megatron-FSDP shards a 16-bit model-weight "
    "buffer and an fp32 main-weight buffer (megatron_fsdp/param_and_grad_buffer.py): the Rajbhandari et al. "
    "counts",
    fp8_source="Transformer Engine (Megatron-Core's TE layers, --fp8-format): Linear and LayerNormLinear save the "
    "FP8-cast input for the weight gradient (transformer_engine/pytorch/module/linear.py, layernorm_linear.py)"
)

_DEEPSPEED_FACTS = TargetFacts(
    loss=lambda lay: 10.0,
    loss_source="deepspeedai/Megatron-DeepSpeed (2025-07) megatron/model/gpt_model.py: GPTModelPipe casts the "
    "LM head's logits to fp32 (float16_to_fp32) and CrossEntropy runs megatron/core/tensor_parallel/"
    "cross_entropy.py, whose max subtraction makes a second fp32 tensor (softmax saved, made the gradient in "
    "place); DeepSpeed's pipeline engine keeps that stage output in pipe_buffers['outputs'] through the "
    "backward (runtime/pipe/engine.py): 4 (fp32 logits) + 4 (softmax, then gradient) + 2 (the gradient cast "
    "to 16 bits) = 10; the non-pipeline path (post_language_model_processing) holds 2 + 4 + 4 in the forward",
    pp_sends=_deepspeed_sends,
    pp_source="DeepSpeed runtime/pipe/engine.py: with pipe_partitioned (default true, runtime/config.py) a "
    "tensor-parallel stage sends 1/tp of its output (PartitionedTensor over the TP group, runtime/utils.py) "
    "and the next stage all-gathers it, whole outputs without; the parts are cut from each rank's own tensor, "
    "so with sequence parallelism (distinct shards) each rank sends its own shard (1/tp) unpartitioned, and "
    "Megatron-DeepSpeed's gpt_model.py asserts partitioning off for MoE models with pp > 1 and tp > 1",
    master_in_param=False,
    states_source="ZeRO keeps 16-bit parameters (partitioned at stage 3) beside fp32 master partitions "
    "(deepspeed/runtime/zero/stage_1_and_2.py single_partition_of_fp32_groups, stage3.py "
    "fp32_partitioned_groups_flat): the Rajbhandari et al. counts",
    expert_gemms=lambda profile, precision: 1,
    expert_source="deepspeed/moe/experts.py Experts.forward: the local experts' chunks one after another, each "
    "expert its own MLP, on one stream",
)


def titan_compiled(lay: ParallelLayout) -> bool:
    """torchtitan runs the layout compiled (model and loss): asked for (``compile``), or for async TP, which
    torchtitan only runs compiled. The loss's bytes and the export's ``--compile`` flags both follow it."""
    return lay.compile or (lay.tp_comm_overlap and lay.tp > 1)


def _titan_loss(lay: ParallelLayout) -> float:
    if titan_compiled(lay):
        return 4.0
    return (16.0 if lay.tp > 1 else 12.0) + (2.0 if lay.pp > 1 else 0.0)


_TORCHTITAN_FACTS = TargetFacts(
    loss=_titan_loss,
    loss_source="torchtitan 0.3.0 torchtitan/components/loss.py casts the logits to fp32; tp = 1: torch's "
    "cross-entropy (log-softmax saved; its backward makes the NLL and log-softmax gradients) with the logits "
    "deleted before backward (trainer.py 'del pred'): 12; tp > 1: _LossParallelCrossEntropy (shifted logits "
    "and their exp in the forward, log-probabilities saved, zeros, exp and product in the backward): 16; "
    "with pipeline parallelism torch.distributed.pipelining keeps the stage output (the 16-bit logits) to "
    "its backward: +2; compiled (the export's --compile.components model,loss, written for compile=True and with "
    "async TP): 4 "
    "(logits saved, 16-bit gradient). Measured by benchmarks/loss_memory.py",
    pp_sends=_sends_as_sp,
    pp_source=_TORCH_PIPELINE_SENDS + " (torchtitan 0.3.0 distributed/pipeline_parallel.py builds its "
    "PipelineStage schedules on it)",
    master_in_param=True,
    states_source="torchtitan 0.3.0 applies FSDP2 fully_shard with MixedPrecisionPolicy(param_dtype=bf16, "
    "reduce_dtype=fp32) (distributed/fsdp.py apply_fsdp_to_decoder): the sharded fp32 parameter is the master",
    fsdp_root=lambda model, tp: head_per_tp_rank(model, tp),
    root_source="torchtitan 0.3.0 models/llama3/infra/parallelize.py apply_fsdp: the token embedding a unit "
    "resharded after its forward, [norm, output] one unit kept gathered from its forward to its backward "
    "(reshard_after_forward only with the 'always' policy), the blocks resharded",
    expert_gemms=_grouped_mm_or_loop,
    expert_source="torchtitan 0.3.0 models/moe/moe.py GroupedExperts: use_grouped_mm (the default) runs "
    "torch._grouped_mm, one kernel per linear layer, its token groups padded to 8 rows; torch's fallback off "
    "Hopper and Blackwell runs the groups one after another",
    fp8_saved_inputs=False,
    fp8_source="torchao's Float8Linear (torchtitan's float8 converter): matmul_with_hp_or_float8_args saves the "
    "high-precision input and weight and casts them again in the backward (torchao/float8/float8_linear.py); "
    "torch.compile may save the casts instead, which the model does not see"
)


def _pp_sends(framework: str, facts: TargetFacts, field: str = "pp_scatter_gather") -> Limit:
    """The row refusing a ``pp_scatter_gather`` the target's pipeline does not do (its ``facts.pp_sends``)."""

    def what(j: Job) -> str:
        runs = facts.pp_sends(j.model, j.layout.sp)
        if runs == (False,):
            return "send the whole activation from every TP rank"
        shard = "its sequence-parallel shard" if j.layout.sp else "a part the next stage all-gathers"
        return f"send 1/tp of the activation from each TP rank ({shard})" + (
            "" if len(runs) == 1 else ", or whole activations")

    return Limit(
        feature="activation sends between pipeline stages",
        scope="layout",
        refuses=lambda j: (_pp(j) and j.layout.tp > 1
                           and j.layout.pp_scatter_gather not in facts.pp_sends(j.model, j.layout.sp)),
        field=field,
        value=lambda j: j.layout.pp_scatter_gather,
        problem=lambda j: (
            f"prices {'1/tp of the' if j.layout.pp_scatter_gather else 'the whole'} activation per TP rank between "
            f"pipeline stages, and with sp={j.layout.sp}{' on a MoE model' if j.model.moe else ''} {framework}'s "
            f"stages {what(j)}"
        ),
        fix=lambda j: f"plan with pp_scatter_gather={facts.pp_sends(j.model, j.layout.sp)[0]}",
    )


# ============================================================================================
# Megatron-LM: NVIDIA/Megatron-LM core_v0.19.0, megatron/training/arguments.py,
# megatron/core/transformer/transformer_config.py, megatron/core/distributed/fsdp/mcore_fsdp_adapter.py
# ============================================================================================
_MEGATRON = (
    _no_compile("Megatron-LM", "has no torch.compile of the model (its fusions are Transformer Engine's kernels)"),
    _kv_heads("Megatron-LM"),
    _master_weights("Megatron-LM"),
    Limit(
        feature="ALiBi position embeddings",
        scope="model",
        refuses=lambda j: j.model.position_embedding == "alibi",
        field="position_embedding",
        value=lambda j: "alibi",
        problem="is not offered by Megatron-LM (--position-embedding-type: learned_absolute, rope, mrope, "
        "relative, none)",
        fix="use --to torchtitan with a model that has ALiBi, or a rope/learned model",
    ),
    Limit(
        feature="GPipe schedule",
        scope="layout",
        refuses=lambda j: _pp(j) and j.layout.schedule is Schedule.gpipe,
        field="schedule",
        value=lambda j: "gpipe",
        problem="is not a Megatron-LM pipeline schedule (it runs 1F1B, or interleaved 1F1B with virtual "
        "stages)",
        fix="plan with schedule='1f1b' (same bubble, less memory), or use --to torchtitan",
    ),
    Limit(
        feature="zero-bubble schedule",
        scope="layout",
        refuses=lambda j: _pp(j) and j.layout.schedule is Schedule.zero_bubble,
        field="schedule",
        value=lambda j: "zero_bubble",
        problem="is not in Megatron-LM (zero-bubble schedules live in forks such as "
        "sail-sg/zero-bubble-pipeline-parallelism)",
        fix="plan with schedule='1f1b' or 'interleaved_1f1b', or use --to deepspeed (Megatron-DeepSpeed "
        "--enable-zbh1-pipeline)",
    ),
    Limit(
        feature="MoE expert and tensor parallelism without sequence parallelism",
        scope="layout",
        refuses=lambda j: j.model.moe is not None and j.layout.ep > 1 and j.layout.tp > 1 and not j.layout.sp,
        field="sp",
        value=lambda j: False,
        problem="cannot be expressed: Megatron-LM needs sequence parallelism when an MoE model uses both "
        "expert and tensor parallelism",
        fix="plan with sp=True",
    ),
    Limit(
        # megatron/core/transformer/transformer_config.py: "Bias in Moe is only supported when ETP==1"
        feature="MoE linear biases with expert tensor parallelism",
        scope="layout",
        refuses=lambda j: j.model.moe is not None and j.model.linear_bias and j.layout.expert_tp > 1,
        field="etp",
        value=lambda j: j.layout.expert_tp,
        problem="cannot be expressed with linear biases: Megatron-Core supports biases in MoE layers only with "
        "expert tensor parallelism 1 (--expert-tensor-parallel-size 1)",
        fix="plan with etp=1 (the experts folded over the tensor-parallel ranks), or use a model without "
        "linear biases",
    ),
    Limit(
        feature="TP communication overlap without sequence parallelism",
        scope="layout",
        refuses=lambda j: j.layout.tp_comm_overlap and j.layout.tp > 1 and not j.layout.sp,
        field="tp_comm_overlap",
        value=lambda j: True,
        problem="needs sequence parallelism in Megatron-LM (--tp-comm-overlap asserts --sequence-parallel)",
        fix="plan with sp=True or tp_comm_overlap=False",
    ),
    Limit(
        feature="ZeRO-2/3 with pipeline parallelism",
        scope="layout",
        refuses=lambda j: j.layout.zero_stage >= 2 and _pp(j),
        field="zero_stage",
        value=lambda j: j.layout.zero_stage,
        problem="needs gradient/parameter sharding, which Megatron-LM offers only through FSDP "
        "(Megatron-FSDP "
        "or --use-torch-fsdp2), and neither runs with pipeline parallelism; its distributed optimizer "
        "shards only optimizer states",
        fix="use --to torchtitan (FSDP with PP), or plan with zero_stage <= 1 or pp=1",
    ),
    Limit(
        feature="ZeRO-3 that keeps gathered parameters after forward",
        scope="layout",
        refuses=lambda j: j.layout.zero_stage == 3 and j.layout.dp > 1 and not j.layout.reshard_after_forward,
        field="reshard_after_forward",
        value=lambda j: False,
        problem="has no Megatron-FSDP switch (it always frees gathered parameters)",
        fix="plan with reshard_after_forward=True or use --to torchtitan "
        "(fsdp_reshard_after_forward='never')",
    ),
    Limit(
        feature="optimizer CPU offload outside the distributed optimizer (ZeRO-1)",
        scope="layout",
        refuses=lambda j: j.layout.offload_optimizer and j.layout.zero_stage != 1,
        field="offload_optimizer",
        value=lambda j: True,
        problem=lambda j: (
            f"with zero_stage={j.layout.zero_stage}: Megatron-LM's optimizer CPU offload "
            "(--optimizer-cpu-offload) works with its distributed optimizer (zero_stage=1)"
        ),
        fix="plan with zero_stage=1 or offload_optimizer=False",
    ),
    Limit(
        feature="recompute that differs between pipeline stages",
        scope="split",
        refuses=_one_recompute_fails,
        field="recompute_per_stage",
        value=_recompute_value,
        problem="differs between pipeline stages, and Megatron-LM applies one setting "
        "(--recompute-granularity/--recompute-method/--recompute-num-layers) to every stage",
        fix="plan with one recompute kind and layer count for all stages, or use --to torchtitan",
    ),
    _pp_sends("Megatron-LM", _MEGATRON_FACTS),
    _WHOLE_NODES,
)


# ============================================================================================
# DeepSpeed: deepspeedai/DeepSpeed v0.19.5 deepspeed/runtime/pipe/engine.py, zero/config.py;
# deepspeedai/Megatron-DeepSpeed main (2025-07) megatron/arguments.py, megatron/model/gpt_model.py
# ============================================================================================
def _even_split_fails(j: Job) -> bool:
    return _pp(j) and len(set(stage_layers(j.layout, j.model.num_layers))) > 1


_UNEVEN = {
    "field": "layers_per_stage",
    "value": lambda j: stage_layers(j.layout, j.model.num_layers),
    "problem": "cannot be expressed: Megatron-DeepSpeed partitions the layers itself "
    "(PipelineModule partition_method='type:transformer')",
    "fix": lambda j: (
        f"plan an even split ({j.model.num_layers} layers over pp={j.layout.pp}) "
        "or use --to megatron or --to torchtitan"
    ),
}


def _dp_overlap(j: Job) -> bool:
    return j.layout.dp_comm_overlap and j.layout.dp > 1


_DEEPSPEED = (
    _no_compile("Megatron-DeepSpeed", "is not compiled by autopar's export (it writes no compile section)"),
    _kv_heads("Megatron-DeepSpeed"),
    _master_weights("DeepSpeed"),
    Limit(
        feature="ring context parallelism",
        scope="layout",
        refuses=lambda j: j.layout.cp > 1,
        field="cp",
        value=lambda j: j.layout.cp,
        problem="cannot be expressed: DeepSpeed has no ring context parallelism (its sequence parallelism, "
        "Ulysses --ds-sequence-parallel-size, exchanges attention heads all-to-all, which the plan did "
        "not predict)",
        fix="plan with cp=1, or use --to megatron or --to torchtitan",
    ),
    Limit(
        feature="interleaved (virtual-stage) schedule",
        scope="layout",
        refuses=lambda j: j.layout.virtual_stages > 1 or j.layout.schedule is Schedule.interleaved_1f1b,
        field="schedule",
        value=lambda j: "interleaved_1f1b",
        problem="cannot be expressed: DeepSpeed's pipeline engine runs one stage per rank",
        fix="plan with schedule='1f1b' and virtual_stages=1, or use --to megatron or --to torchtitan",
    ),
    Limit(
        feature="GPipe schedule",
        scope="layout",
        refuses=lambda j: _pp(j) and j.layout.schedule is Schedule.gpipe,
        field="schedule",
        value=lambda j: "gpipe",
        problem="cannot be expressed: DeepSpeed's pipeline engine trains with 1F1B",
        fix="plan with schedule='1f1b', or use --to torchtitan",
    ),
    Limit(
        feature="zero-bubble schedule with sequence parallelism",
        scope="layout",
        refuses=lambda j: (
            _pp(j) and j.layout.schedule is Schedule.zero_bubble and j.layout.sp and j.layout.tp > 1
        ),
        field="sp",
        value=lambda j: True,
        problem="cannot be combined with Megatron-DeepSpeed's ZB-H1 schedule (--enable-zbh1-pipeline rejects "
        "sequence parallelism)",
        fix="plan with sp=False (or schedule='1f1b')",
    ),
    Limit(
        feature="a layer count the pipeline stages do not split evenly",
        scope="layout",
        refuses=lambda j: j.layout.layers_per_stage is None and _even_split_fails(j),
        **_UNEVEN,
    ),
    Limit(
        feature="uneven layers per pipeline stage",
        scope="split",
        refuses=lambda j: j.layout.layers_per_stage is not None and _even_split_fails(j),
        **_UNEVEN,
    ),
    Limit(
        feature="ZeRO-2/3 with pipeline parallelism",
        scope="layout",
        refuses=lambda j: j.layout.zero_stage >= 2 and _pp(j),
        field="zero_stage",
        value=lambda j: j.layout.zero_stage,
        problem="cannot be expressed: DeepSpeed's pipeline engine rejects ZeRO-2 and ZeRO-3 with pipeline "
        "parallelism",
        fix="plan with zero_stage <= 1 or pp=1",
    ),
    Limit(
        feature="hybrid sharding (ZeRO over part of the data-parallel ranks)",
        scope="layout",
        refuses=lambda j: j.layout.zero_stage >= 1 and j.layout.dp_replicate > 1,
        field="dp_replicate",
        value=lambda j: j.layout.dp_replicate,
        problem=lambda j: (
            f"cannot be expressed with zero_stage={j.layout.zero_stage}: ZeRO partitions over the "
            "whole data-parallel group (MiCS needs the model built under deepspeed.zero.MiCS_Init, which "
            "Megatron-DeepSpeed does not do)"
        ),
        fix="plan with dp_replicate=1 (shard over all data-parallel ranks) or use --to torchtitan (HSDP)",
    ),
    Limit(
        feature="ZeRO-3 that keeps gathered parameters after forward",
        scope="layout",
        refuses=lambda j: j.layout.zero_stage == 3 and j.layout.dp > 1 and not j.layout.reshard_after_forward,
        field="reshard_after_forward",
        value=lambda j: False,
        problem="has no ZeRO-3 setting (parameters are released by the stage3_max_live_parameters / "
        "stage3_max_reuse_distance heuristics)",
        fix="plan with reshard_after_forward=True, or use --to torchtitan",
    ),
    Limit(
        feature="optimizer CPU offload without ZeRO",
        scope="layout",
        refuses=lambda j: j.layout.offload_optimizer and j.layout.zero_stage == 0,
        field="offload_optimizer",
        value=lambda j: True,
        problem="needs ZeRO: DeepSpeed's offload_optimizer is valid for ZeRO stages 1-3",
        fix="plan with zero_stage >= 1",
    ),
    Limit(
        feature="TP communication overlap",
        scope="layout",
        refuses=lambda j: j.layout.tp_comm_overlap and j.layout.tp > 1,
        field="tp_comm_overlap",
        value=lambda j: True,
        problem="cannot be expressed: Megatron-DeepSpeed has no TP communication overlap",
        fix="plan with tp_comm_overlap=False, or use --to megatron",
    ),
    Limit(
        feature="expert all-to-all overlap",
        scope="layout",
        refuses=lambda j: j.layout.ep_comm_overlap and j.layout.ep > 1,
        field="ep_comm_overlap",
        value=lambda j: True,
        problem="cannot be expressed: DeepSpeed MoE does not overlap the expert all-to-all",
        fix="plan with ep_comm_overlap=False, or use --to megatron",
    ),
    Limit(
        # megatron/arguments.py --enable-expert-tensor-parallelism; deepspeed/moe/sharded_moe.py,
        # deepspeed/utils/groups.py _get_expert_parallel_ranks (EP over data-parallel ranks, stride tp)
        feature="expert tensor parallelism other than tp",
        scope="layout",
        refuses=lambda j: j.model.moe is not None and j.layout.expert_tp != j.layout.tp,
        field="etp",
        value=lambda j: j.layout.etp,
        problem=lambda j: (
            f"is not tp={j.layout.tp}: Megatron-DeepSpeed splits the experts over the whole tensor-parallel "
            "group (--enable-expert-tensor-parallelism) or not at all, and forms expert-parallel groups over "
            "data-parallel ranks only; it cannot fold experts over the tensor-parallel ranks"
        ),
        fix="plan with etp unset (= tp), or use --to megatron (--expert-tensor-parallel-size)",
    ),
    Limit(
        feature="gradient reduction overlapped with a pipeline's backward",
        scope="layout",
        refuses=lambda j: _dp_overlap(j) and _pp(j),
        field="dp_comm_overlap",
        value=lambda j: True,
        problem="cannot be expressed: the pipeline engine reduces gradients after the pipeline flush",
        fix="plan with dp_comm_overlap=False",
    ),
    Limit(
        feature="gradient reduction overlapped with backward without ZeRO",
        scope="layout",
        refuses=lambda j: _dp_overlap(j) and not _pp(j) and j.layout.zero_stage == 0,
        field="dp_comm_overlap",
        value=lambda j: True,
        problem="cannot be expressed: without ZeRO the engine all-reduces gradients after backward",
        fix="plan with dp_comm_overlap=False or zero_stage >= 1",
    ),
    Limit(
        feature="ALiBi position embeddings",
        scope="model",
        refuses=lambda j: j.model.position_embedding == "alibi",
        field="position_embedding",
        value=lambda j: "alibi",
        problem="is not offered by Megatron-DeepSpeed",
        fix="use --to torchtitan with an ALiBi model, or a rope/learned model",
    ),
    Limit(
        feature="multi-latent attention",
        scope="model",
        refuses=lambda j: j.model.mla is not None,
        field="mla",
        value=lambda j: "multi-latent attention",
        problem="is not implemented in Megatron-DeepSpeed",
        fix="use --to megatron or --to torchtitan",
    ),
    Limit(
        feature="fp8 training",
        scope="model",
        refuses=_trained(lambda t: t.precision is Precision.fp8),
        field="precision",
        value=lambda j: "fp8",
        problem="has no DeepSpeed config setting, and autopar does not target Megatron-DeepSpeed's "
        "Transformer-Engine block (--fp8-hybrid)",
        fix="plan with precision bf16, or use --to megatron or --to torchtitan",
    ),
    Limit(
        feature="MoE with pipeline parallelism",
        scope="layout",
        refuses=lambda j: j.model.moe is not None and _pp(j),
        field="pp",
        value=lambda j: j.layout.pp,
        problem="cannot be used with MoE in Megatron-DeepSpeed: its pipeline model (GPTModelPipe) builds no "
        "expert layers",
        fix="plan with pp=1 for this MoE model, or use --to megatron",
    ),
    Limit(
        feature="experts narrower or wider than the dense FFN",
        scope="model",
        refuses=lambda j: (
            j.model.moe is not None and j.model.moe.expert_ffn_hidden_size != j.model.ffn_hidden_size
        ),
        field="moe.expert_ffn_hidden_size",
        value=lambda j: j.model.moe.expert_ffn_hidden_size,
        problem=lambda j: (
            f"differs from ffn_hidden_size={j.model.ffn_hidden_size}; Megatron-DeepSpeed experts "
            "use --ffn-hidden-size"
        ),
        fix="use --to megatron",
    ),
    Limit(
        feature="shared experts",
        scope="model",
        refuses=lambda j: j.model.moe is not None and j.model.moe.num_shared_experts > 0,
        field="moe.num_shared_experts",
        value=lambda j: j.model.moe.num_shared_experts,
        problem="shared experts are not in Megatron-DeepSpeed's MoE",
        fix="use --to megatron",
    ),
    Limit(
        feature="MoE layers placed other than every N-th layer",
        scope="model",
        refuses=lambda j: (
            j.model.moe is not None and j.model.moe.first_dense_layers != j.model.moe.layer_frequency - 1
        ),
        field="moe.first_dense_layers",
        value=lambda j: j.model.moe.first_dense_layers,
        problem=lambda j: (
            f"with layer_frequency={j.model.moe.layer_frequency} cannot be expressed: "
            "Megatron-DeepSpeed puts experts on layers N, 2N, ... (1-based, --expert-interval N)"
        ),
        fix="use --to megatron",
    ),
    Limit(
        feature="recompute that differs between pipeline stages",
        scope="split",
        refuses=_one_recompute_fails,
        field="recompute_per_stage",
        value=_recompute_value,
        problem="differs between pipeline stages, and Megatron-DeepSpeed applies one recompute setting to "
        "every stage",
        fix="plan with one recompute kind and layer count for all stages, or use --to megatron",
    ),
    Limit(
        feature="recompute of only some layers of a pipeline stage",
        scope="split",
        refuses=lambda j: (
            _pp(j)
            and not _one_recompute_fails(j)
            and j.layout.recompute_per_stage is not None
            and uniform_recompute(j.layout, j.model.num_layers).block is not None
        ),
        field="recompute_per_stage",
        value=_recompute_value,
        problem="recomputes only some layers per stage, which DeepSpeed's pipeline "
        "(activation_checkpoint_interval) cannot do; it recomputes every layer",
        fix="plan with full recompute of every layer, or use --to megatron",
    ),
    _pp_sends("DeepSpeed", _DEEPSPEED_FACTS),
    _WHOLE_NODES,
)


# ============================================================================================
# torchtitan: torchtitan 0.3.0 torchtitan/config/configs.py, torchtitan/trainer.py,
# torchtitan/distributed/activation_checkpoint.py (FullAC, per-op SelectiveAC, MemoryBudgetAC or none; the
# layer-selective every-N-th mode of v0.2.2 is gone), torchtitan/distributed/pipeline_parallel.py
# ============================================================================================
def _titan_recompute(j: Job) -> tuple[RecomputeSetting | None, int | None]:
    """(one setting for every layer, 1 when every layer of every rank is fully recomputed) of the job's
    per-stage recompute; torchtitan 0.3.0 has no every-N-th layer mode."""
    every = every_nth_recompute(j.layout, j.model.num_layers)
    return uniform_recompute(j.layout, j.model.num_layers), (every if every == 1 else None)


def _titan_mixed(j: Job) -> bool:
    if j.layout.recompute_per_stage is None:
        return False
    setting, every = _titan_recompute(j)
    return setting is None and every is None


def _titan_partial(j: Job) -> bool:
    if j.layout.recompute_per_stage is None:
        return False
    setting, every = _titan_recompute(j)
    return setting is not None and setting.block is not None and every is None


def _titan_stage_selective(j: Job) -> bool:
    if j.layout.recompute_per_stage is None:
        return False
    setting = uniform_recompute(j.layout, j.model.num_layers)
    return setting is not None and setting.kind == "selective"


_SELECTIVE = {
    "field": "recompute",
    "value": lambda j: "selective",
    "problem": "(attention-core recompute) cannot be expressed: torchtitan's selective checkpointing is per "
    "layer (every N-th block) or per op (saves matmul outputs)",
    "fix": "plan with recompute='full' or 'none', or use --to megatron",
}

_TORCHTITAN = (
    _kv_heads("torchtitan"),
    _master_weights("torchtitan"),
    Limit(
        feature="tensor parallelism without sequence parallelism",
        scope="layout",
        refuses=lambda j: j.layout.tp > 1 and not j.layout.sp,
        field="sp",
        value=lambda j: False,
        problem=lambda j: (
            f"cannot be expressed with tp={j.layout.tp}: torchtitan's tensor parallelism always "
            "shards norms and dropout by sequence"
        ),
        fix="plan with sp=True",
    ),
    Limit(
        feature="ZeRO-1/2 (sharding without parameters)",
        scope="layout",
        refuses=lambda j: j.layout.zero_stage in (1, 2),
        field="zero_stage",
        value=lambda j: j.layout.zero_stage,
        problem="cannot be expressed: torchtitan uses FSDP2, which shards parameters, gradients and "
        "optimizer "
        "states together (ZeRO-3)",
        fix="plan with zero_stage=3 (FSDP) or 0 (DDP), or use --to megatron or --to deepspeed",
    ),
    Limit(
        feature="DDP with context parallelism",
        scope="layout",
        refuses=lambda j: j.layout.zero_stage == 0 and j.layout.cp > 1,
        field="zero_stage",
        value=lambda j: 0,
        problem=lambda j: (
            f"cannot be expressed with cp={j.layout.cp}: torchtitan applies FSDP over the "
            "context-parallel ranks"
        ),
        fix="plan with zero_stage=3",
    ),
    Limit(
        feature="expert parallelism without FSDP",
        scope="layout",
        refuses=lambda j: j.layout.zero_stage == 0 and j.layout.ep > 1,
        field="ep",
        value=lambda j: j.layout.ep,
        problem="needs FSDP in torchtitan: expert parallelism borrows the data_parallel_shard ranks, and "
        "zero_stage=0 has none",
        fix="plan with zero_stage=3",
    ),
    Limit(
        feature="expert parallelism that is not a multiple of context parallelism",
        scope="layout",
        refuses=lambda j: j.layout.ep > 1 and (j.layout.ep % j.layout.cp != 0 or j.layout.ep < j.layout.cp),
        field="ep",
        value=lambda j: j.layout.ep,
        problem="cannot be expressed: torchtitan needs cp <= ep and ep % cp == 0 (experts borrow "
        "dp_shard x cp ranks)",
        fix=lambda j: f"use an ep that is a multiple of cp={j.layout.cp}",
    ),
    Limit(
        feature="expert all-to-all overlap",
        scope="layout",
        refuses=lambda j: j.layout.ep_comm_overlap and j.layout.ep > 1,
        field="ep_comm_overlap",
        value=lambda j: True,
        problem="is not a torchtitan job-config option",
        fix="plan with ep_comm_overlap=False, or use --to megatron",
    ),
    Limit(
        # torchtitan/distributed/parallel_dims.py: sparse mesh (pp, dp_replicate, efsdp, ep), efsdp =
        # dp_shard x cp x tp / ep; models/common/moe_sharding.py: expert weights sharded on EP only
        feature="tensor-parallel experts with expert parallelism",
        scope="layout",
        refuses=lambda j: j.model.moe is not None and j.layout.ep > 1 and j.layout.expert_tp != 1,
        field="etp",
        value=lambda j: j.layout.expert_tp,
        problem="cannot be expressed: with expert parallelism torchtitan runs every routed expert whole "
        "(expert tensor parallelism 1), its expert-parallel ranks folded over dp_shard x cp x tp "
        "(parallelism.expert_parallel_degree; no expert_tensor_parallel_degree option)",
        fix="plan with etp=1, or ep=1, or use --to megatron",
    ),
    Limit(
        # models/common/moe_sharding.py expert_param_placement_dense: EP disabled -> experts on the TP axis
        feature="experts outside the tensor-parallel group without expert parallelism",
        scope="layout",
        refuses=lambda j: j.model.moe is not None and j.layout.ep == 1 and j.layout.expert_tp != j.layout.tp,
        field="etp",
        value=lambda j: j.layout.etp,
        problem=lambda j: (
            f"is not tp={j.layout.tp}: without expert parallelism torchtitan shards the routed experts "
            "over the whole tensor-parallel group"
        ),
        fix="plan with etp unset (= tp), or ep > 1 with etp=1, or use --to megatron",
    ),
    Limit(
        feature="optimizer-only CPU offload",
        scope="layout",
        refuses=lambda j: j.layout.offload_optimizer,
        field="offload_optimizer",
        value=lambda j: True,
        problem="cannot be expressed: torchtitan has no optimizer-only CPU offload "
        "(training.enable_cpu_offload moves parameters and gradients too)",
        fix="plan with offload_optimizer=False, or use --to megatron or --to deepspeed",
    ),
    Limit(
        feature="zero-bubble schedule with one stage per rank (ZB-H1)",
        scope="layout",
        refuses=lambda j: _pp(j) and j.layout.schedule is Schedule.zero_bubble,
        field="schedule",
        value=lambda j: "zero_bubble",
        problem="is ZB-H1 with one stage per rank; torchtitan's zero-bubble schedules "
        "(InterleavedZeroBubble, "
        "ZBVZeroBubble) need >= 2 stages per rank",
        fix="plan with schedule='interleaved_1f1b' or '1f1b', or use --to deepspeed (ZB-H1)",
    ),
    Limit(
        feature="data-parallel communication without overlap",
        scope="layout",
        refuses=lambda j: j.layout.dp_comm_overlap is False and j.layout.dp > 1,
        field="dp_comm_overlap",
        value=lambda j: False,
        problem="cannot be expressed: torchtitan's FSDP2/DDP always overlap gradient reduction and parameter "
        "all-gather with compute",
        fix="plan with dp_comm_overlap=True",
    ),
    _pp_sends("torchtitan", _TORCHTITAN_FACTS),
    Limit(
        feature="fp16 training",
        scope="model",
        refuses=_trained(lambda t: t.precision is Precision.fp16),
        field="precision",
        value=lambda j: "fp16",
        problem="cannot be expressed: torchtitan's mixed_precision_param is bfloat16 or float32",
        fix="plan with precision bf16, or use --to megatron or --to deepspeed",
    ),
    Limit(
        feature="16-bit gradient reduction",
        scope="model",
        refuses=_trained(lambda t: t.precision is not Precision.fp32 and not t.grad_reduce_in_fp32),
        field="grad_reduce_in_fp32",
        value=lambda j: False,
        problem="cannot be expressed: torchtitan's mixed_precision_reduce is float32 only",
        fix="plan with grad_reduce_in_fp32=True",
    ),
    Limit(
        feature="unfused attention",
        scope="model",
        refuses=_trained(lambda t: not t.flash_attention),
        field="flash_attention",
        value=lambda j: False,
        problem="cannot be expressed: torchtitan always runs fused attention (SDPA/flex)",
        fix="plan with flash_attention=True",
    ),
    Limit(
        feature="SGD optimizer",
        scope="model",
        refuses=_trained(lambda t: t.optimizer.value == "sgd"),
        field="optimizer",
        value=lambda j: "sgd",
        problem="is not a torchtitan optimizer (optimizer.name: Adam, AdamW)",
        fix="plan with adamw or adam, or use --to megatron",
    ),
    Limit(
        feature="recompute that differs between pipeline stages",
        scope="split",
        refuses=_titan_mixed,
        field="recompute_per_stage",
        value=_recompute_value,
        problem="differs between pipeline stages or covers only some layers; torchtitan applies one "
        "activation-checkpoint mode to every layer",
        fix="plan with one recompute kind for every layer of every stage, or use --to megatron",
    ),
    Limit(
        feature="recompute of the first layers of each stage",
        scope="split",
        refuses=_titan_partial,
        field="recompute_per_stage",
        value=_recompute_value,
        problem="recomputes only some layers of a stage, which torchtitan's activation_checkpoint "
        "cannot express (0.3.0 has full, per-op selective, memory-budget or none for every layer)",
        fix="plan with full recompute of every layer, or use --to megatron",
    ),
    Limit(
        feature="selective (attention-core) recompute",
        scope="layout",
        refuses=lambda j: j.layout.recompute_per_stage is None and j.layout.recompute is Recompute.selective,
        **_SELECTIVE,
    ),
    Limit(
        feature="per-stage selective (attention-core) recompute",
        scope="split",
        refuses=_titan_stage_selective,
        **_SELECTIVE,
    ),
    _WHOLE_NODES,
)


# ============================================================================================
# autopar: this project's executor (executor/parallelize.py, executor/pipeline.py, executor/model.py)
# on torch >= 2.6 (torch.distributed.pipelining, FSDP2 fully_shard, DTensor tensor parallel)
# ============================================================================================


def _stage_selective(layout: ParallelLayout) -> bool:
    return any(s.kind is Recompute.selective for s in layout.recompute_per_stage or [])


def _seq_split(j: Job) -> int:
    """Sequence chunks context/sequence parallelism need: 2 x cp (cp > 1), times tp with sp."""
    return (2 * j.layout.cp if j.layout.cp > 1 else 1) * (j.layout.tp if j.layout.sp else 1)


def _rounds(j: Job) -> int:
    return max(1, (j.micro_batches or 0) // j.layout.pp)


_HF_SELECTIVE = {
    "field": "layout.recompute",
    "value": lambda j: "selective",
    "problem": "needs the built-in attention's recompute hook",
    "fix": "use full or none for Hugging Face models",
}

_AUTOPAR = (
    _no_compile("the executor", "runs its model eagerly"),
    Limit(
        feature="expert parallelism on a dense model",
        scope="layout",
        refuses=lambda j: j.layout.ep > 1 and j.model.moe is None,
        field="layout.ep",
        value=lambda j: j.layout.ep,
        problem="needs a Mixture-of-Experts model",
        fix="use ep=1 for a dense model",
    ),
    Limit(
        feature="expert parallelism that does not fold over dp_shard x cp x tp",
        scope="layout",
        refuses=lambda j: (
            (j.layout.ep > 1 or j.model.moe is not None) and j.layout.expert_fold_problem() is not None
        ),
        field=lambda j: "layout." + j.layout.expert_fold_culprit()[0],
        value=lambda j: j.layout.expert_fold_culprit()[1],
        problem=lambda j: j.layout.expert_fold_problem(),
        fix="use ep and etp whose product divides dp_shard x cp x tp (the experts fold over those ranks)",
    ),
    Limit(
        feature="expert parallelism that does not split the experts evenly",
        scope="layout",
        refuses=lambda j: (
            j.layout.ep > 1 and j.model.moe is not None and j.model.moe.num_experts % j.layout.ep != 0
        ),
        field="layout.ep",
        value=lambda j: j.layout.ep,
        problem="does not split the experts evenly",
        fix=lambda j: f"use an ep dividing num_experts={j.model.moe.num_experts}",
    ),
    Limit(
        feature="tensor parallelism over more ranks than (key/value) heads",
        scope="layout",
        refuses=lambda j: (
            j.layout.tp > 1
            and (j.model.num_attention_heads % j.layout.tp != 0 or j.model.kv_heads % j.layout.tp != 0)
        ),
        field="layout.tp",
        value=lambda j: j.layout.tp,
        problem=lambda j: (
            f"does not divide num_attention_heads={j.model.num_attention_heads} and "
            f"num_kv_heads={j.model.kv_heads}"
        ),
        fix="use a tp dividing both head counts",
    ),
    Limit(
        feature="tensor parallelism that does not split the vocabulary and FFN",
        scope="layout",
        refuses=lambda j: (
            j.layout.tp > 1
            and (j.model.vocab_size % j.layout.tp != 0 or j.model.ffn_hidden_size % j.layout.tp != 0)
        ),
        field="layout.tp",
        value=lambda j: j.layout.tp,
        problem=lambda j: (
            f"does not divide vocab_size={j.model.vocab_size} and "
            f"ffn_hidden_size={j.model.ffn_hidden_size} evenly"
        ),
        fix="use a tp dividing vocab_size and ffn_hidden_size",
    ),
    Limit(
        feature="tensor parallelism with tied embeddings",
        scope="layout",
        refuses=lambda j: j.layout.tp > 1 and j.model.tied_embeddings,
        field="layout.tp",
        value=lambda j: j.layout.tp,
        problem="with tied embeddings is not implemented (the head and the embedding shard differently)",
        fix="use tp=1 or untied embeddings",
    ),
    Limit(
        feature="tensor parallelism on a Hugging Face MoE model",
        scope="layout",
        refuses=lambda j: j.hf and j.layout.tp > 1 and j.model.moe is not None,
        field="layout.tp",
        value=lambda j: j.layout.tp,
        problem="is implemented for the built-in model's MoE layers only",
        fix="use tp=1 for Hugging Face MoE models, or the built-in model",
    ),
    Limit(
        feature="tensor parallelism on a MoE model without sequence parallelism",
        scope="layout",
        refuses=lambda j: j.layout.tp > 1 and j.model.moe is not None and not j.layout.sp,
        field="layout.sp",
        value=lambda j: False,
        problem=lambda j: f"with tp={j.layout.tp} on a MoE model: the MoE layers need sequence parallelism "
        "(each TP rank routes its sequence-parallel share of the tokens; Megatron-Core requires it too)",
        fix="set sp=true",
    ),
    Limit(
        feature="expert tensor parallelism between 1 and tp",
        scope="layout",
        refuses=lambda j: j.model.moe is not None and 1 < j.layout.expert_tp < j.layout.tp,
        field="layout.etp",
        value=lambda j: j.layout.etp,
        problem=lambda j: f"is neither 1 nor tp={j.layout.tp}: the executor splits the routed experts over "
        "no TP ranks or over the whole TP group",
        fix=lambda j: f"use etp=1 or etp={j.layout.tp} (or leave it unset)",
    ),
    Limit(
        feature="expert tensor parallelism that does not split the expert FFN",
        scope="layout",
        refuses=lambda j: (
            j.model.moe is not None and j.layout.expert_tp > 1
            and j.model.moe.expert_ffn_hidden_size % j.layout.expert_tp != 0
        ),
        field="layout.etp",
        value=lambda j: j.layout.expert_tp,
        problem=lambda j: f"does not divide moe.expert_ffn_hidden_size={j.model.moe.expert_ffn_hidden_size}",
        fix="use an etp (or a tp, when etp is unset) dividing the expert FFN width",
    ),
    Limit(
        feature="tensor parallelism that does not split the shared experts",
        scope="layout",
        refuses=lambda j: (
            j.model.moe is not None and j.model.moe.num_shared_experts > 0 and j.layout.tp > 1
            and j.model.moe.shared_ffn % j.layout.tp != 0
        ),
        field="layout.tp",
        value=lambda j: j.layout.tp,
        problem=lambda j: f"does not divide the shared experts' FFN width {j.model.moe.shared_ffn}, which the "
        "executor splits over the TP ranks like a dense MLP",
        fix="use a tp dividing the shared experts' FFN width",
    ),
    Limit(
        feature="ZeRO-1 with tensor or expert parallelism",
        scope="layout",
        refuses=lambda j: j.layout.zero_stage == 1 and (j.layout.tp > 1 or j.layout.ep > 1),
        field="layout.zero_stage",
        value=lambda j: 1,
        problem="uses torch's ZeroRedundancyOptimizer, which shards plain (non-DTensor) parameters only",
        fix="use zero_stage 2 or 3 (FSDP2) with tp/ep > 1",
    ),
    Limit(
        feature="optimizer CPU offload without FSDP (ZeRO-0/1)",
        scope="layout",
        refuses=lambda j: j.layout.offload_optimizer and j.layout.zero_stage < 2,
        field="layout.offload_optimizer",
        value=lambda j: True,
        problem=lambda j: f"is implemented with FSDP2 offload, not with zero_stage {j.layout.zero_stage}",
        fix="use zero_stage 2 or 3 (FSDP2 CPUOffloadPolicy)",
    ),
    Limit(
        feature="context or expert parallelism on a Hugging Face model",
        scope="layout",
        refuses=lambda j: j.hf and (j.layout.cp > 1 or j.layout.ep > 1),
        field="layout",
        value=lambda j: f"cp={j.layout.cp}, ep={j.layout.ep}",
        problem="context/expert parallelism is implemented for the built-in model only",
        fix="use cp=1 and ep=1 for Hugging Face models, or the built-in model",
    ),
    Limit(
        feature="selective recompute on a Hugging Face model",
        scope="layout",
        refuses=lambda j: j.hf and j.layout.recompute is Recompute.selective,
        **_HF_SELECTIVE,
    ),
    Limit(
        feature="per-stage selective recompute on a Hugging Face model",
        scope="split",
        refuses=lambda j: j.hf and _stage_selective(j.layout),
        **_HF_SELECTIVE,
    ),
    Limit(
        feature="fp16 or fp8 training",
        scope="model",
        refuses=_trained(lambda t: t.precision in (Precision.fp16, Precision.fp8)),
        field="training.precision",
        value=lambda j: j.training.precision.value,
        problem="is not implemented by the executor: fp16 needs dynamic loss scaling and fp8 needs "
        "Transformer "
        "Engine / torchao float8 GEMMs; the planner still predicts it",
        fix="use bf16 (or fp32)",
    ),
    Limit(
        feature="a sequence that context/sequence parallelism cannot split",
        scope="layout",
        refuses=lambda j: j.training is not None and j.training.seq_length % _seq_split(j) != 0,
        field="training.seq_length",
        value=lambda j: j.training.seq_length,
        problem="does not split into the chunks context/sequence parallelism need (2 x cp if cp > 1, times "
        "tp "
        "with sp)",
        fix=lambda j: f"use a multiple of {_seq_split(j)}",
    ),
    Limit(
        feature="multi-head latent attention in the built-in model",
        scope="model",
        refuses=lambda j: not j.hf and j.model.mla is not None,
        field="model.mla",
        value=lambda j: "set",
        problem="is not supported by the built-in model",
        fix="use a GQA model (mla: null) or a Hugging Face model the executor supports; multi-head latent "
        "attention is not in the built-in decoder",
    ),
    Limit(
        feature="position embeddings other than RoPE in the built-in model",
        scope="model",
        refuses=lambda j: not j.hf and j.model.position_embedding != "rope",
        field="model.position_embedding",
        value=lambda j: j.model.position_embedding,
        problem="is not supported by the built-in model",
        fix="use 'rope'",
    ),
    Limit(
        feature="dropout in the built-in model",
        scope="model",
        refuses=lambda j: not j.hf and bool(j.model.dropout),
        field="model.dropout",
        value=lambda j: j.model.dropout,
        problem="is not supported by the built-in model",
        fix="use 0.0 (modern LLM pre-training runs without dropout)",
    ),
    Limit(
        feature="pipeline parallelism on a Hugging Face model",
        scope="layout",
        refuses=lambda j: j.hf and _pp(j),
        field="layout.pp",
        value=lambda j: j.layout.pp,
        problem="pipeline splitting is implemented for the built-in decoder only",
        fix="use pp=1 for Hugging Face models, or the built-in model",
    ),
    Limit(
        feature="pipeline parallelism with tied embeddings",
        scope="layout",
        refuses=lambda j: _pp(j) and j.model.tied_embeddings,
        field="model.tied_embeddings",
        value=lambda j: True,
        problem=lambda j: f"with pp={j.layout.pp} would share one weight between the first and last stage",
        fix="use untied embeddings or pp=1",
    ),
    Limit(
        feature="zero-bubble schedule with ZeRO-2/3",
        scope="layout",
        refuses=lambda j: _pp(j) and j.layout.schedule is Schedule.zero_bubble and j.layout.zero_stage >= 2,
        field="layout.schedule",
        value=lambda j: "zero_bubble",
        problem=lambda j: (
            f"with FSDP2 (zero_stage {j.layout.zero_stage}) loses the weight gradients of every "
            "stage but the first: torch's split backward computes them in a separate weight pass that FSDP "
            "never reduce-scatters (measured: the blocks of stage 1 got no gradient and the loss left the "
            "reference after one step)"
        ),
        fix="use zero_stage 0 or 1 with zero_bubble, or 1f1b / interleaved_1f1b with ZeRO-2/3",
    ),
    Limit(
        feature="1F1B with fewer micro-batches than stages",
        scope="split",
        refuses=lambda j: (
            _pp(j)
            and j.micro_batches is not None
            and j.layout.schedule is Schedule.one_f_one_b
            and j.micro_batches < j.layout.pp
        ),
        field="micro-batches per pipeline",
        value=lambda j: j.micro_batches,
        problem="are fewer than the pipeline stages, which torch's 1F1B refuses",
        fix=lambda j: (
            f"use at least pp={j.layout.pp} micro-batches (global batch / (dp x micro_batch_size)), "
            "or schedule gpipe"
        ),
    ),
    Limit(
        feature="multi-stage schedule with micro-batches not in rounds of pp",
        scope="split",
        refuses=lambda j: (
            _pp(j)
            and j.micro_batches is not None
            and j.layout.schedule in (Schedule.interleaved_1f1b, Schedule.zero_bubble)
            and j.micro_batches % _rounds(j) != 0
        ),
        field="micro-batches per pipeline",
        value=lambda j: j.micro_batches,
        problem=lambda j: (
            f"do not split into rounds of pp micro-batches ({j.micro_batches} // {j.layout.pp} = "
            f"{_rounds(j)} rounds), which torch's {j.layout.schedule.value} schedule needs"
        ),
        fix=lambda j: (
            f"use a multiple of pp={j.layout.pp} (or fewer than {j.layout.pp}) micro-batches per pipeline"
        ),
    ),
    _pp_sends("the executor", _AUTOPAR_FACTS, "layout.pp_scatter_gather"),
)


TARGETS: dict[Target, TargetSpec] = {
    Target.autopar: TargetSpec(
        Target.autopar,
        "autopar executor (executor/) on torch >= 2.6: torch.distributed.pipelining, FSDP2, DTensor TP",
        _AUTOPAR,
        uneven_split=True,
        per_stage_recompute=True,
        facts=_AUTOPAR_FACTS,
    ),
    Target.megatron: TargetSpec(
        Target.megatron,
        "Megatron-LM (Megatron-Core core_v0.19.0)",
        _MEGATRON,
        uneven_split=True,  # --decoder-first/last-pipeline-num-layers, --pipeline-model-parallel-layout
        per_stage_recompute=False,  # --recompute-num-layers is one int for every stage
        facts=_MEGATRON_FACTS,
    ),
    Target.deepspeed: TargetSpec(
        Target.deepspeed,
        "DeepSpeed v0.19.5 with deepspeedai/Megatron-DeepSpeed (main, 2025-07)",
        _DEEPSPEED,
        uneven_split=False,  # GPTModelPipe hard-codes partition_method='type:transformer'
        per_stage_recompute=False,
        facts=_DEEPSPEED_FACTS,
    ),
    Target.torchtitan: TargetSpec(
        Target.torchtitan,
        "torchtitan 0.3.0",
        _TORCHTITAN,
        uneven_split=True,  # parallelism.module_fqns_per_model_part
        per_stage_recompute=False,  # one [activation_checkpoint] for every model part
        facts=_TORCHTITAN_FACTS,
    ),
}
