"""The machinery of the capability tables: :class:`Target`, the :class:`Job` a row tests, the :class:`Limit`
row, a target's pricing facts (:class:`TargetFacts`), its :class:`TargetSpec`, the :class:`TargetRefusal` error
and the lookups the search, ``autopar export`` and the executor call (:func:`refusal`, :func:`check`,
:func:`target_facts`, ...). The tables themselves are one module per target beside this one; the package
(``planner/targets/__init__.py``) fills :data:`TARGETS` from their ``SPEC``. Never imports torch."""

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
    TrainingConfig,
)
from planner.contracts.limits import ONE_KERNEL
from planner.errors import AutoparError, UnknownNameError

GPUS_PER_NODE = 8  # launchers start this many processes per node (fewer when the plan has fewer GPUs)
SCOPES = ("model", "layout", "split")


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
    ``async_checkpoint``: the target's option that copies a checkpoint to host memory and writes it behind
    training (:mod:`planner.cost.goodput` prices both modes), or None: it saves synchronously.
    Each with the source it was read from."""

    loss: Callable[[ParallelLayout], float | None]
    loss_source: str
    pp_sends: Callable[[ModelSpec, bool], tuple[bool, ...]]
    pp_source: str
    master_in_param: bool
    states_source: str
    expert_gemms: Callable[[ClusterProfile, Precision], int | None] = lambda profile, precision: None
    host_s_per_kernel: float | None = None  # GPU: the host's seconds per counted kernel (None: it keeps ahead)
    host_source: str = "not measured: the target's host is assumed to keep ahead of its GPU"
    expert_source: str = "the profile's assumptions.grouped_gemm_streams"
    fsdp_root: Callable[[ModelSpec, int], float] = lambda model, tp: 0.0
    root_source: str = "not FSDP2: no unit beside the blocks is held gathered"
    async_checkpoint: str | None = None  # the option that saves checkpoints behind training; None: synchronous
    checkpoint_source: str = "not stated"
    fp8_saved_inputs: bool = True
    fp8_source: str = "refuses FP8 training: never priced"

    def fp8_inputs(self, training: TrainingConfig) -> bool:
        """Whether a layer's saved inputs are FP8 (1 byte) under ``training``: FP8 training on a target that
        keeps them (``fp8_saved_inputs``); what predict and the search's activation bytes read."""
        return training.precision is Precision.fp8 and self.fp8_saved_inputs


GROUPED_MM_GPUS = re.compile(r"(?<![a-z0-9])(gh200|h100|h200|h800|h20|g?b100|g?b200|g?b300)(?![a-z0-9])", re.IGNORECASE)
"""NVIDIA GPUs of compute capability 9.0 and 10.x (Hopper and datacenter Blackwell), where ``torch._grouped_mm``
runs its CUTLASS kernels, by the device's name (a datasheet's or CUDA's: "H100", "NVIDIA H100 80GB HBM3");
not Ada (8.9) or consumer Blackwell (12.x), whose FP8 peaks would otherwise mislead, nor AMD GPUs."""


def _grouped_mm_or_loop(profile: ClusterProfile, precision: Precision) -> int:
    """One grouped kernel on the GPUs of :data:`GROUPED_MM_GPUS`; elsewhere the experts run one GEMM after
    another. torchtitan casts the experts' operands to bf16 whatever the training precision."""
    return ONE_KERNEL if GROUPED_MM_GPUS.search(profile.device.name) else 1


def priced_profile(
    profile: ClusterProfile, target: str | Target, precision: Precision = Precision.bf16
) -> ClusterProfile:
    """``profile`` as ``target`` runs on it in ``precision``: its expert GEMMs' concurrency
    (``TargetFacts.expert_gemms``) in place of the profile's own, and on a GPU the target's host time per kernel
    where the profile states none (``TargetFacts.host_s_per_kernel``), where they differ (else ``profile``
    itself, so its memo is kept)."""
    facts, a = target_facts(target), profile.assumptions
    update = {}
    streams = facts.expert_gemms(profile, precision)
    if streams is not None and streams != a.grouped_gemm_streams:
        update["grouped_gemm_streams"] = streams
    if facts.host_s_per_kernel is not None and a.host_s_per_kernel is None and not profile.is_cpu:
        update["host_s_per_kernel"] = facts.host_s_per_kernel
    if not update:
        return profile
    return profile.model_copy(update={"assumptions": a.model_copy(update=update)})


@dataclass(frozen=True)
class TargetSpec:
    target: Target
    framework: str  # the release each row describes
    limits: tuple[Limit, ...]
    uneven_split: bool  # can the target run any layers_per_stage the search picks?
    per_stage_recompute: bool  # can it run a different recompute kind/count per pipeline stage?
    facts: TargetFacts
    render: Callable[[Plan], dict[str, str]] | None = None  # its launch files (``autopar export``); None: our executor


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


def refusal(target: Target | str, job: Job, scopes: Iterable[str] = SCOPES,
            field: str | None = None) -> TargetRefusal | None:
    """The error of the first row of ``target``'s table, among ``scopes`` (and, given ``field``, among the
    rows about that field only), that refuses ``job``; None when the target runs it."""
    t, wanted = _target(target), tuple(scopes)
    for scope in wanted:
        if scope not in SCOPES:
            raise UnknownNameError("scope", scope, list(SCOPES))
    for limit in TARGETS[t].limits:
        if limit.scope in wanted and (field is None or limit.field == field) and limit.refuses(job):
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


TARGETS: dict[Target, TargetSpec] = {}
"""Every target's :class:`TargetSpec`, in :class:`Target` order: filled by ``planner/targets/__init__.py`` from
the target modules' ``SPEC`` (read here at call time, so that those modules can import this one)."""
