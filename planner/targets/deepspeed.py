"""The ``deepspeed`` target: DeepSpeed with Megatron-DeepSpeed. Its pricing facts, its capability table and its
launch files: ``ds_config.json`` (the DeepSpeed runtime config) and ``megatron_deepspeed_args.sh``
(``pretrain_gpt.py`` arguments for TP/PP and the model). Keys checked against deepspeedai/DeepSpeed
``deepspeed/runtime/constants.py``, ``runtime/zero/config.py``, ``runtime/config.py`` and
``runtime/pipe/engine.py``; flags against deepspeedai/Megatron-DeepSpeed ``megatron/arguments.py`` and
``pretrain_gpt.py``. Never imports torch."""

from __future__ import annotations

import json

from planner.contracts import ModelSpec, Plan, Precision, Schedule
from planner.targets.core import Job, Limit, Target, TargetFacts, TargetSpec
from planner.targets.launch import (
    Command,
    bash_script,
    block_flags,
    header,
    launch_shape,
    max_positions,
    recompute_flags,
    run_lines,
    torchrun,
)
from planner.targets.rows import (
    _WHOLE_NODES,
    _kv_heads,
    _master_weights,
    _no_compile,
    _no_op_sac,
    _no_v_schedule,
    _one_recompute_fails,
    _pp,
    _pp_sends,
    _recompute_value,
    _trained,
)
from planner.targets.split import stage_layers, uniform_recompute


def _deepspeed_sends(model: ModelSpec, sp: bool) -> tuple[bool, ...]:
    if sp:
        return (True,)  # each rank's own sequence shard; partitioning it again would mix the ranks' shards
    return (False,) if model.moe is not None else (True, False)


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
    checkpoint_source="DeepSpeed engine.save_checkpoint writes synchronously (its asynchronous Nebula engine "
    "runs on Azure only)",
    states_source="ZeRO keeps 16-bit parameters (partitioned at stage 3) beside fp32 master partitions "
    "(deepspeed/runtime/zero/stage_1_and_2.py single_partition_of_fp32_groups, stage3.py "
    "fp32_partitioned_groups_flat): the Rajbhandari et al. counts",
    expert_gemms=lambda profile, precision: 1,
    expert_source="deepspeed/moe/experts.py Experts.forward: the local experts' chunks one after another, each "
    "expert its own MLP, on one stream",
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
    _no_op_sac("Megatron-DeepSpeed", "recomputes the attention core (selective) or whole layers, not by op"),
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
        refuses=lambda j: j.layout.schedule is Schedule.interleaved_1f1b,
        field="schedule",
        value=lambda j: "interleaved_1f1b",
        problem="cannot be expressed: DeepSpeed's pipeline engine runs one stage per rank",
        fix="plan with schedule='1f1b' and virtual_stages=1, or use --to megatron or --to torchtitan",
    ),
    _no_v_schedule(
        "cannot be expressed: DeepSpeed's pipeline engine runs one stage per rank, not two in a V",
        "plan with schedule='zero_bubble' (Megatron-DeepSpeed's ZB-H1) or '1f1b', or use --to torchtitan",
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
        feature="optimizer offload of a share below ZeRO-3",
        scope="layout",
        refuses=lambda j: j.layout.offload_share not in (0.0, 1.0) and j.layout.zero_stage != 3,
        field="optimizer_offload_fraction",
        value=lambda j: j.layout.optimizer_offload_fraction,
        problem=lambda j: f"is below 1 with zero_stage {j.layout.zero_stage}: DeepSpeed offloads a share of the "
        "optimizer (offload_optimizer.ratio, ZeRO-Offload++ Twin-Flow) with ZeRO stage 3 only "
        "(DeepSpeedZeroConfig.offload_ratio_check, 0.19)",
        fix="plan with zero_stage=3, or offload the whole optimizer (fraction 1)",
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
        feature="biases on the query, key and value projections only",
        scope="model",
        refuses=lambda j: j.model.biased_qkv and not j.model.linear_bias,
        field="qkv_bias",
        value=lambda j: True,
        problem="cannot be expressed: Megatron-DeepSpeed biases every linear layer (--add-bias-linear) or none, "
        "and has no --add-qkv-bias",
        fix="use --to megatron (--add-qkv-bias) or the executor (--to autopar)",
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
# the launch files (autopar export --to deepspeed)
# ============================================================================================
def render(plan: Plan) -> dict[str, str]:
    """``ds_config.json`` (the DeepSpeed runtime settings) and ``megatron_deepspeed_args.sh``: torchrun
    running Megatron-DeepSpeed's ``pretrain_gpt.py``. Each section adds its flags to the command and
    returns the version notes of the flags it added, in flag order."""
    a = Command("pretrain_gpt.py")
    vnotes: list[str] = []  # flags that older Megatron-DeepSpeed releases do not have
    for section in (_ds_model, _ds_moe, _ds_batch_precision, _ds_parallel, recompute_flags):
        vnotes += section(plan, a)
    a.add("--deepspeed")
    a.raw('--deepspeed_config "${DS_CONFIG:-ds_config.json}"')
    run_lines(a, log_throughput=False)
    cmd = torchrun(plan, '"${MEGATRON_DEEPSPEED_DIR:-.}/pretrain_gpt.py"')
    cmd.lines += a.lines[1:]
    notes = _ds_notes(plan, vnotes)
    return {
        "ds_config.json": json.dumps(_ds_config(plan), indent=2) + "\n",
        "megatron_deepspeed_args.sh": bash_script(plan, "deepspeed", notes, _ds_env(plan), [cmd.render()]),
    }


def _ds_accumulation(plan: Plan) -> int:
    """Gradient accumulation steps = global batch / (micro batch x dp)."""
    return plan.training.global_batch_seqs // (plan.layout.micro_batch_size * plan.layout.dp)


def _ds_config(plan: Plan) -> dict[str, object]:
    """``ds_config.json``: batch, clipping and logging, precision, ZeRO and pipeline partitioning."""
    t, lay = plan.training, plan.layout
    config: dict[str, object] = {
        "_autopar": header(plan, "deepspeed")
        + [
            (
                "DeepSpeed ignores this key. Keys checked against deepspeedai/DeepSpeed "
                "deepspeed/runtime/constants.py, zero/config.py and pipe/engine.py."
            ),
        ],
        "train_batch_size": t.global_batch_seqs,
        "train_micro_batch_size_per_gpu": lay.micro_batch_size,
        "gradient_accumulation_steps": _ds_accumulation(plan),
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    config.update(_ds_precision_config(plan))
    config["zero_optimization"] = _ds_zero_config(plan)
    if lay.pp > 1:
        # pipe_partitioned: each TP rank sends 1/tp of the activation and the next stage all-gathers it; the
        # parts are cut from each rank's own output (runtime/utils.py PartitionedTensor), so with sequence
        # parallelism (a different shard on each rank, 1/tp already) it is off (planner.targets TargetFacts)
        partitioned = lay.pp_scatter_gather and not (lay.sp and lay.tp > 1)
        config["pipeline"] = {"pipe_partitioned": partitioned, "grad_partitioned": partitioned}
    return config


def _ds_precision_config(plan: Plan) -> dict[str, object]:
    """The ``bf16`` / ``fp16`` (dynamic loss scaling) section and, when gradients are not reduced in fp32,
    ``communication_data_type``."""
    config: dict[str, object] = {}
    if plan.precision is Precision.bf16:
        config["bf16"] = {"enabled": True}
    elif plan.precision is Precision.fp16:
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    if not plan.training.grad_reduce_in_fp32 and plan.precision is not Precision.fp32:
        config["communication_data_type"] = "fp16" if plan.precision is Precision.fp16 else "bf16"
    return config


def _ds_zero_config(plan: Plan) -> dict[str, object]:
    """``zero_optimization``: the stage, and with ZeRO the comm overlap and optimizer offload."""
    lay = plan.layout
    zero: dict[str, object] = {"stage": lay.zero_stage}
    if lay.zero_stage >= 1:
        zero.update(
            {
                "overlap_comm": bool(lay.dp_comm_overlap and lay.dp > 1),
                "contiguous_gradients": True,
                "reduce_scatter": True,
            }
        )
        if lay.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            if lay.optimizer_offload_fraction < 1.0:  # Twin-Flow: this share on the CPU, the rest on the GPU
                zero["offload_optimizer"]["ratio"] = lay.optimizer_offload_fraction
    return zero


def _ds_model(plan: Plan, a: Command) -> list[str]:
    """The transformer's shape, attention, positions, norm, FFN, biases, dropout and flash attention."""
    m, t = plan.model, plan.training
    a.add("--num-layers", m.num_layers)
    a.add("--hidden-size", m.hidden_size)
    a.add("--ffn-hidden-size", m.ffn_hidden_size)
    a.add("--num-attention-heads", m.num_attention_heads)
    if m.kv_heads != m.num_attention_heads:
        a.add("--num-key-value-heads", m.kv_heads)
    if m.head_dim is not None:
        a.add("--kv-channels", m.head_dim)
    a.add("--seq-length", t.seq_length)
    a.add("--max-position-embeddings", max_positions(plan))
    if m.position_embedding == "rope":
        a.add("--use-rotary-position-embeddings")
    a.add("--normalization", m.norm)
    block_flags(plan, a)
    if t.flash_attention:
        a.add("--use-flash-attn-v2")
    return []


def _ds_moe(plan: Plan, a: Command) -> list[str]:
    """DeepSpeed MoE: experts, top-k, expert interval, expert parallelism, capacity and the ZeRO param group."""
    moe, lay = plan.model.moe, plan.layout
    if moe is None:
        return []
    a.add("--num-experts", moe.num_experts)
    a.add("--topk", moe.top_k)
    a.add("--expert-interval", moe.layer_frequency)
    a.add("--moe-expert-parallel-size", lay.ep)
    if lay.tp > 1:  # experts split over the TP group as planned (etp = tp; the table refuses other etp)
        a.add("--enable-expert-tensor-parallelism")
    if moe.capacity_factor is None:
        a.add("--disable-moe-token-dropping")
    else:
        a.add("--moe-train-capacity-factor", moe.capacity_factor)
    if lay.zero_stage >= 1:
        a.add("--create-moe-param-group")
    return []


def _ds_batch_precision(plan: Plan, a: Command) -> list[str]:
    """Micro and global batch, the precision, the optimizer and its CPU offload."""
    t, lay = plan.training, plan.layout
    a.add("--micro-batch-size", lay.micro_batch_size)
    a.add("--global-batch-size", t.global_batch_seqs)
    if plan.precision is Precision.bf16:
        a.add("--bf16")
    elif plan.precision is Precision.fp16:
        a.add("--fp16")
    a.add("--optimizer", "sgd" if t.optimizer.value == "sgd" else "adam")
    if lay.offload_optimizer:
        a.add("--cpu-optimizer")
    return []


def _ds_parallel(plan: Plan, a: Command) -> list[str]:
    """Tensor (with sequence parallelism) and pipeline parallelism with its schedule, and the ZeRO stage."""
    lay = plan.layout
    vnotes = []
    a.add("--tensor-model-parallel-size", lay.tp)
    if lay.sp and lay.tp > 1:
        a.add("--sequence-parallel")
    a.add("--pipeline-model-parallel-size", lay.pp)
    if lay.pp == 1:
        a.add("--no-pipeline-parallel")
    elif lay.schedule is Schedule.zero_bubble:
        a.add("--enable-zbh1-pipeline")
        vnotes.append(
            "--enable-zbh1-pipeline: Megatron-DeepSpeed 2024+ (ZB-H1 on DeepSpeed's pipeline scheduler)."
        )
    a.add("--zero-stage", lay.zero_stage)
    return vnotes


def _ds_env(plan: Plan) -> list[str]:
    """Script lines before the command: the data arguments and CUDA_DEVICE_MAX_CONNECTIONS."""
    m, lay = plan.model, plan.layout
    env = [
        "# Data and tokenizer: set DATA_PATH (a Megatron indexed dataset prefix), or DATA_ARGS to your own",
        "# --data-path / --tokenizer-type arguments.",
        f"# The model's vocabulary is {m.vocab_size} (NullTokenizer adds",
        "# one end-of-document token to --vocab-size).",
        (
            'DATA_ARGS="${DATA_ARGS:---data-path ${DATA_PATH:?set DATA_PATH or DATA_ARGS} '
            f'--tokenizer-type NullTokenizer --vocab-size {m.vocab_size - 1}}}"'
        ),
    ]
    if lay.tp > 1 and lay.sp:
        env.append(
            "export CUDA_DEVICE_MAX_CONNECTIONS=1  # required by Megatron-DeepSpeed's sequence parallelism"
        )
    return env


def _ds_notes(plan: Plan, vnotes: list[str]) -> list[str]:
    """The header's notes: where the flags were checked, the version-dependent flags, how to launch."""
    lay = plan.layout
    nodes, per_node = launch_shape(plan)
    notes = [
        "Flags checked against deepspeedai/Megatron-DeepSpeed megatron/arguments.py; the DeepSpeed runtime",
        "settings (batch, precision, ZeRO, pipeline partitioning) are in ds_config.json next to this script.",
        "Megatron-DeepSpeed recomputes with --recompute-* (its pipeline model turns full/uniform into",
        "DeepSpeed's activation_checkpoint_interval).",
    ]
    gas = _ds_accumulation(plan)
    launch = [
        "",
        f"Launch: the same script on each of the {nodes} node(s),",
        "with NODE_RANK, MASTER_ADDR and MASTER_PORT set;",
        f"torchrun starts {per_node} processes per node ({plan.num_gpus} in all);",
        f"data parallel size = {plan.num_gpus} / ({lay.tp} x {lay.pp}) = {lay.dp}, gradient accumulation = {gas}.",
    ]
    return notes + vnotes + launch


SPEC = TargetSpec(
    Target.deepspeed,
    "DeepSpeed v0.19.5 with deepspeedai/Megatron-DeepSpeed (main, 2025-07)",
    _DEEPSPEED,
    uneven_split=False,  # GPTModelPipe hard-codes partition_method='type:transformer'
    per_stage_recompute=False,
    facts=_DEEPSPEED_FACTS,
    render=render,
)
