"""Is a layout valid for a model, a training setup and a GPU count, apart from what it costs: the degrees
divide what they split, the micro-batches split the global batch, the sequence fits the model, a saved plan
is one the planner could have made. Each check raises :class:`~planner.errors.AutoparError` naming the
field, the value and the fix. Also the default layer split a layout's stages get when it names none.
"""

from __future__ import annotations

from planner.contracts import ModelSpec, ParallelLayout, Plan, TrainingConfig
from planner.errors import AutoparError


def default_layer_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per (virtual) stage: as even as possible, extra layers to the interior stages first
    (the first and last stages also carry the embedding and the LM head)."""
    if num_stages > num_layers:
        raise AutoparError(
            "pp x virtual_stages", num_stages, f"use pp x virtual_stages <= num_layers={num_layers}",
            problem=f"is more stages than there are layers ({num_layers})",
        )
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    order = list(range(1, num_stages - 1)) + [num_stages - 1, 0] if num_stages > 2 else list(range(num_stages))
    for i in order[:extra]:
        counts[i] += 1
    return counts


def check_sequence(model: ModelSpec, training: TrainingConfig) -> None:
    """Raise :class:`AutoparError` where no layout can run the training's sequences: longer than a
    learned position table (the search calls this before trying layouts, so it says why)."""
    if model.position_embedding == "learned" and training.seq_length > (model.max_position_embeddings or 0):
        raise AutoparError("seq_length", training.seq_length,
                           f"use seq_length <= max_position_embeddings={model.max_position_embeddings} (--seq "
                           f"{model.max_position_embeddings}), or a model spec (--model-file) whose "
                           f"max_position_embeddings is at least {training.seq_length}",
                           problem="is longer than the model's learned position table")


def check_layout(model: ModelSpec, training: TrainingConfig, layout: ParallelLayout, num_gpus: int) -> int:
    """Raise :class:`AutoparError` for a layout that cannot run; return the number of micro-batches."""
    check_sequence(model, training)
    if layout.num_gpus != num_gpus:
        raise AutoparError(
            "layout", f"dp{layout.dp} x cp{layout.cp} x tp{layout.tp} x pp{layout.pp}",
            f"make dp_replicate x dp_shard x cp x tp x pp equal the cluster's {num_gpus} GPUs",
            problem=f"uses {layout.num_gpus} GPUs",
        )
    a, k = model.num_attention_heads, model.kv_heads
    if a % layout.tp:
        raise AutoparError("tp", layout.tp, f"use a tp that divides num_attention_heads={a}",
                           problem=f"does not divide num_attention_heads={a}")
    if k % layout.tp and layout.tp % k:
        raise AutoparError("tp", layout.tp, f"use a tp that divides or is a multiple of num_kv_heads={k}",
                           problem=f"neither divides nor is a multiple of num_kv_heads={k}")
    s = training.seq_length
    if s % layout.cp or (layout.cp > 1 and s % (2 * layout.cp)):
        raise AutoparError("cp", layout.cp, f"use a cp with 2 x cp dividing seq_length={s} (causal load balancing)",
                           problem=f"does not split seq_length={s} into 2 x cp equal chunks")
    if layout.sp and (s // layout.cp) % layout.tp:
        raise AutoparError("sp", True, f"turn sp off or use a tp dividing seq_length / cp = {s // layout.cp}",
                           problem=f"needs tp={layout.tp} to divide the local sequence {s // layout.cp}")
    if model.moe is None and layout.ep > 1:
        raise AutoparError("ep", layout.ep, "use ep=1 for a dense model", problem="needs a Mixture-of-Experts model")
    if model.moe is None and layout.expert_tp != layout.tp:
        raise AutoparError("etp", layout.etp, "leave etp unset (or equal to tp) for a dense model",
                           problem="sets the experts' tensor-parallel degree, and the model has no experts")
    if model.moe is not None:
        if model.moe.num_experts % layout.ep:
            raise AutoparError("ep", layout.ep, f"use an ep dividing num_experts={model.moe.num_experts}",
                               problem=f"does not divide num_experts={model.moe.num_experts}")
        fold = layout.expert_fold_problem()
        if fold is not None:
            field, value = layout.expert_fold_culprit()
            raise AutoparError(field, value, "use an ep (and etp) whose product divides dp_shard x cp x tp, or "
                               "shard more data-parallel ranks (ZeRO 1-3 shard over all of dp unless --dp-replicate "
                               "splits it; DDP, ZeRO-0, replicates them all)", problem=f"cannot fold: {fold}")
        if layout.expert_tp != layout.tp and not layout.sp:
            raise AutoparError("sp", False, f"set sp=True (--sp), or leave etp unset (etp = tp = {layout.tp})",
                               problem=f"with etp={layout.etp} < tp={layout.tp}: folded experts take each rank's "
                               "sequence-parallel share of the tokens (Megatron-Core needs sequence parallelism "
                               "for MoE with tensor and expert parallelism)")
    gbs, per_step = training.global_batch_seqs, layout.dp * layout.micro_batch_size
    if gbs % per_step:
        raise AutoparError(
            "micro_batch_size", layout.micro_batch_size,
            f"choose micro_batch_size and dp so that dp x micro_batch_size divides global_batch_size={gbs}",
            problem=f"x dp={layout.dp} = {per_step} does not divide global_batch_size={gbs}",
        )
    stages = layout.pp * layout.virtual_stages
    if layout.layers_per_stage is not None:
        if sum(layout.layers_per_stage) != model.num_layers or min(layout.layers_per_stage) < 0:
            raise AutoparError("layers_per_stage", layout.layers_per_stage,
                               f"give non-negative counts summing to num_layers={model.num_layers}",
                               problem=f"sums to {sum(layout.layers_per_stage)}")
    elif stages > model.num_layers:
        default_layer_split(model.num_layers, stages)
    m = gbs // per_step
    if layout.schedule.value == "interleaved_1f1b" and m % layout.pp:
        raise AutoparError("schedule", "interleaved_1f1b",
                           f"use a number of micro-batches divisible by pp={layout.pp} or schedule='1f1b'",
                           problem=f"needs micro-batches ({m}) divisible by pp={layout.pp}")
    return m


def check_plan(plan: Plan) -> None:
    """A saved plan (``explain``, ``export``) is one the planner could have made: its layout runs its
    model and training on its GPUs (:func:`check_layout`: a hand-edited file can say tp=3 on 8 GPUs, a
    global batch the micro-batches do not split, ep on a dense model) and its precision is its
    training's. Raises :class:`AutoparError` naming the field."""
    check_layout(plan.model, plan.training, plan.layout, plan.num_gpus)
    if plan.precision != plan.training.precision:
        raise AutoparError("precision", plan.precision.value,
                           f"use training.precision={plan.training.precision.value} (the planner writes both alike), "
                           "or re-plan", problem=f"differs from training.precision={plan.training.precision.value}")
