"""Rows and facts shared by several targets' tables (the exported frameworks' common refusals, the pipeline
sends row, the sends of torch's pipelining). Never imports torch."""

from __future__ import annotations

from collections.abc import Callable

from planner.contracts import ModelSpec, Precision, Recompute, TrainingConfig
from planner.cost.pipeline import SCHEDULES
from planner.targets.core import GPUS_PER_NODE, Job, Limit, TargetFacts
from planner.targets.split import recompute_text, uniform_recompute


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


def _uses_op_sac(j: Job) -> bool:
    lay = j.layout
    if lay.recompute_per_stage is None:
        return lay.recompute is Recompute.op
    return any(s.kind is Recompute.op for s in lay.recompute_per_stage)


_OP_SAC_SPLIT_BACKWARD = Limit(
    feature="per-op selective checkpointing under a split-backward schedule",
    scope="layout",
    refuses=lambda j: _uses_op_sac(j) and _pp(j) and SCHEDULES[j.layout.schedule].split_backward,
    field="schedule",
    value=lambda j: j.layout.schedule.value,
    problem="runs each stage's backward in two passes (input gradients, then weight gradients), and torch's "
    "selective checkpointing allows one backward over a checkpointed region (torch 2.13 raises 'Trying to "
    "backward an extra time'; seen on an autopar run of ZB-H1 with recompute=op)",
    fix="plan with a schedule without the split weight pass (1f1b, interleaved_1f1b, gpipe), or recompute='full'",
)
"""torch.distributed.pipelining's zero-bubble schedules (ZB-H1, ZB-V, DualPipeV) with per-op SAC: the executor and
torchtitan run both on torch, so both tables hold this row."""


def _no_op_sac(framework: str, has: str) -> Limit:
    """The row of a framework without per-op selective checkpointing (``Recompute.op``, planner.cost.sac)."""
    return Limit(
        feature="per-op selective activation checkpointing",
        scope="layout",
        refuses=_uses_op_sac,
        field="recompute",
        value=_recompute_value,
        problem=f"(per-op selective checkpointing) cannot be expressed: {framework} {has}",
        fix="plan with recompute='selective', 'full' or 'none', or use --to torchtitan",
    )


# ============================================================================================
# what the targets' pipelines send (TargetFacts.pp_sends, read by predict and the search) and the row
# refusing any other pp_scatter_gather. Each target's own facts are in its module (benchmarks/loss_memory.py
# measures the torch losses, torch's profiler on the CPU; the framework losses are counted there)
# ============================================================================================
def _sends_as_sp(model: ModelSpec, sp: bool) -> tuple[bool, ...]:
    return (sp,)


_TORCH_PIPELINE_SENDS = (
    "torch.distributed.pipelining sends each stage's output as it is (stage.py): under sequence parallelism "
    "the TP rank's sequence shard (1/tp of the activation), without it the whole activation, replicated on "
    "every TP rank"
)


def _no_v_schedule(problem: str, fix: str) -> Limit:
    """The row of a framework whose pipeline cannot place two chunks per rank in a V (the schedules whose
    ``planner.cost.pipeline.SCHEDULES`` row is ``v_shape``)."""
    return Limit(
        feature="V-shaped schedule (ZB-V, DualPipeV)",
        scope="layout",
        refuses=lambda j: _pp(j) and SCHEDULES[j.layout.schedule].v_shape,
        field="schedule",
        value=lambda j: j.layout.schedule.value,
        problem=problem,
        fix=fix,
    )


def _least_micro_batches(j: Job) -> int:
    return SCHEDULES[j.layout.schedule].min_micro_batches(j.layout.pp)


def _torch_schedule_micro_batches(framework: str) -> Limit:
    """The row refusing fewer micro-batches per pipeline than torch's schedule class takes (1F1B: pp,
    DualPipeV: 2 pp; :data:`planner.cost.pipeline.SCHEDULES`), for a target that runs torch's pipelining."""
    return Limit(
        feature="fewer micro-batches than the pipeline schedule takes",
        scope="split",
        refuses=lambda j: _pp(j) and j.micro_batches is not None and j.micro_batches < _least_micro_batches(j),
        field="micro-batches per pipeline",
        value=lambda j: j.micro_batches,
        problem=lambda j: (
            f"are fewer than the {_least_micro_batches(j)} that torch's "
            f"{SCHEDULES[j.layout.schedule].torch_class} takes with pp={j.layout.pp} in {framework}"
        ),
        fix=lambda j: (
            f"use at least {_least_micro_batches(j)} micro-batches per pipeline (global batch / (dp x "
            "micro_batch_size)), or schedule gpipe"
        ),
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
