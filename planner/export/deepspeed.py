"""DeepSpeed (Megatron-DeepSpeed): ``ds_config.json`` (the DeepSpeed runtime config) and
``megatron_deepspeed_args.sh`` (``pretrain_gpt.py`` arguments for TP/PP and the model). Keys checked against
deepspeedai/DeepSpeed ``deepspeed/runtime/constants.py``, ``runtime/zero/config.py``, ``runtime/config.py`` and
``runtime/pipe/engine.py``; flags against deepspeedai/Megatron-DeepSpeed ``megatron/arguments.py`` and
``pretrain_gpt.py``."""

from __future__ import annotations

import json

from planner.contracts import Plan, Precision, Schedule
from planner.export.common import (
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
