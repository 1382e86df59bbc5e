"""The ``megatron`` target: Megatron-LM (Megatron-Core core_v0.19.0). Its pricing facts, its capability table
and its launch file: ``megatron_args.sh``, a bash script that runs ``pretrain_gpt.py`` under ``torchrun`` with one
argument per line. Flags checked against NVIDIA/Megatron-LM ``megatron/training/arguments.py`` and
``megatron/core/transformer/pipeline_parallel_layer_layout.py`` (the release :data:`SPEC` names). Never imports
torch."""

from __future__ import annotations

from planner.contracts import Plan, Precision, Schedule
from planner.targets.core import Limit, Target, TargetFacts, TargetSpec
from planner.targets.launch import (
    Command,
    bash_script,
    block_flags,
    launch_shape,
    layer_counts,
    max_positions,
    moe_layer_pattern,
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
    _sends_as_sp,
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
    async_checkpoint="--async-save (Megatron-Core dist_checkpointing, torch_dist format)",
    checkpoint_source="Megatron-LM --save with --ckpt-format torch_dist",
    states_source="16-bit parameters beside fp32 main parameters and Adam states sharded by the distributed "
    "optimizer (megatron/core/optimizer/distrib_optimizer.py); Megatron-FSDP shards a 16-bit model-weight "
    "buffer and an fp32 main-weight buffer (megatron_fsdp/param_and_grad_buffer.py): the Rajbhandari et al. "
    "counts",
    fp8_source="Transformer Engine (Megatron-Core's TE layers, --fp8-format): Linear and LayerNormLinear save the "
    "FP8-cast input for the weight gradient (transformer_engine/pytorch/module/linear.py, layernorm_linear.py)"
)


# ============================================================================================
# Megatron-LM: NVIDIA/Megatron-LM core_v0.19.0, megatron/training/arguments.py,
# megatron/core/transformer/transformer_config.py, megatron/core/distributed/fsdp/mcore_fsdp_adapter.py
# ============================================================================================
_MEGATRON = (
    _no_op_sac("Megatron-LM (core_v0.19.0)", "recomputes by module (--recompute-granularity selective with "
               "--recompute-modules core_attn, mlp, ...) or whole layers, not by op"),
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
    _no_v_schedule(
        "is not in Megatron-LM (its pipeline runs 1F1B or interleaved 1F1B; DualPipeV lives in forks such as "
        "Ascend's MindSpeed)",
        "plan with schedule='interleaved_1f1b' or '1f1b', or use --to torchtitan (ZBVZeroBubble, DualPipeV)",
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
# the launch file (autopar export --to megatron)
# ============================================================================================
def render(plan: Plan) -> dict[str, str]:
    """``megatron_args.sh``: torchrun running ``pretrain_gpt.py`` with the plan's flags. Each section adds
    its flags to the command and returns the version notes of the flags it added, in flag order."""
    a = Command("pretrain_gpt.py")
    vnotes: list[str] = []  # flags that older Megatron-LM releases do not have
    for section in (_megatron_model, _megatron_moe, _megatron_batch_precision, _megatron_tp_cp_ep,
                    _megatron_pipeline, _megatron_data_parallel, recompute_flags):
        vnotes += section(plan, a)
    run_lines(a, log_throughput=True)
    cmd = torchrun(plan, '"${MEGATRON_LM_DIR:-.}/pretrain_gpt.py"')
    cmd.lines += a.lines[1:]
    notes = _megatron_notes(plan, vnotes)
    return {"megatron_args.sh": bash_script(plan, "megatron", notes, _megatron_env(plan), [cmd.render()])}


def _megatron_model(plan: Plan, a: Command) -> list[str]:
    """The transformer's shape, attention (GQA or MLA), positions, norm, FFN, biases and dropout."""
    m, t = plan.model, plan.training
    vnotes = []
    a.add("--num-layers", m.num_layers)
    a.add("--hidden-size", m.hidden_size)
    a.add("--ffn-hidden-size", m.ffn_hidden_size)
    a.add("--num-attention-heads", m.num_attention_heads)
    if m.mla is None and m.kv_heads != m.num_attention_heads:
        a.add("--group-query-attention")
        a.add("--num-query-groups", m.kv_heads)
    if m.mla is None and m.head_dim is not None:
        a.add("--kv-channels", m.head_dim)
    if m.mla is not None:
        vnotes.append(
            "  --multi-latent-attention and its --q-lora-rank/--kv-lora-rank/--qk-*-dim flags: "
            "Megatron Core >= 0.10."
        )
        a.add("--multi-latent-attention")
        if m.mla.q_lora_rank:
            a.add("--q-lora-rank", m.mla.q_lora_rank)
        a.add("--kv-lora-rank", m.mla.kv_lora_rank)
        a.add("--qk-head-dim", m.mla.qk_nope_head_dim)
        a.add("--qk-pos-emb-head-dim", m.mla.qk_rope_head_dim)
        a.add("--v-head-dim", m.mla.v_head_dim)
    a.add("--seq-length", t.seq_length)
    a.add("--max-position-embeddings", max_positions(plan))
    a.add("--position-embedding-type", "rope" if m.position_embedding == "rope" else "learned_absolute")
    a.add("--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm")
    block_flags(plan, a)
    if m.biased_qkv and not m.linear_bias:
        a.add("--add-qkv-bias")  # with --disable-bias-linear: biases on Q, K, V only (Qwen2)
    if not t.flash_attention:
        a.add("--attention-backend", "unfused")
        vnotes.append(
            "  --attention-backend: recent Megatron-Core only; older releases pick the attention "
            "kernel through Transformer Engine's NVTE_FLASH_ATTN/NVTE_FUSED_ATTN variables."
        )
    return vnotes


def _megatron_moe(plan: Plan, a: Command) -> list[str]:
    """Experts, routing, the MoE layer pattern and, with expert parallelism, the all-to-all dispatcher."""
    moe = plan.model.moe
    if moe is None:
        return []
    vnotes = []
    a.add("--num-experts", moe.num_experts)
    a.add("--moe-router-topk", moe.top_k)
    a.add("--moe-ffn-hidden-size", moe.expert_ffn_hidden_size)
    if moe.num_shared_experts:
        a.add("--moe-shared-expert-intermediate-size", moe.num_shared_experts * moe.shared_ffn)
    pattern = moe_layer_pattern(plan)
    if pattern != 1:
        a.add("--moe-layer-freq", pattern)
        vnotes.append("  --moe-layer-freq patterns and --moe-ffn-hidden-size: Megatron Core >= 0.10.")
    if moe.capacity_factor is not None:
        a.add("--moe-expert-capacity-factor", moe.capacity_factor)
    if plan.layout.ep > 1 or plan.layout.tp > 1:  # the dispatcher the plan priced (Megatron's default: allgather)
        a.add("--moe-token-dispatcher-type", "alltoall")
    return vnotes


def _megatron_batch_precision(plan: Plan, a: Command) -> list[str]:
    """Micro and global batch, the precision and its gradient-reduction dtype, the optimizer."""
    t = plan.training
    vnotes = []
    a.add("--micro-batch-size", plan.layout.micro_batch_size)
    a.add("--global-batch-size", t.global_batch_seqs)
    if plan.precision is Precision.fp16:
        a.add("--fp16")
        if t.grad_reduce_in_fp32:
            a.add("--accumulate-allreduce-grads-in-fp32")
    elif plan.precision in (Precision.bf16, Precision.fp8):
        a.add("--bf16")
        if not t.grad_reduce_in_fp32:
            a.add("--grad-reduce-in-bf16")
        if plan.precision is Precision.fp8:
            a.add("--fp8-format", "hybrid")
            vnotes.append(
                "  --fp8-format hybrid needs Transformer Engine (--transformer-impl transformer_engine, "
                "the default); the scaling recipe is --fp8-recipe (Megatron Core >= 0.12)."
            )
    a.add("--optimizer", "sgd" if t.optimizer.value == "sgd" else "adam")
    return vnotes


def _megatron_tp_cp_ep(plan: Plan, a: Command) -> list[str]:
    """Tensor (with sequence parallelism and comm overlap), context and expert parallelism."""
    lay = plan.layout
    vnotes = []
    a.add("--tensor-model-parallel-size", lay.tp)
    if lay.sp and lay.tp > 1:
        a.add("--sequence-parallel")
    if lay.tp_comm_overlap and lay.tp > 1:
        a.add("--tp-comm-overlap")
        vnotes.append(
            "  --tp-comm-overlap needs Transformer Engine userbuffers (bootstrap backend: "
            "--tp-comm-bootstrap-backend)."
        )
    if lay.cp > 1:
        a.add("--context-parallel-size", lay.cp)
        a.add("--cp-comm-type", "p2p")  # ring attention, as the planner models it
    if lay.ep > 1:
        a.add("--expert-model-parallel-size", lay.ep)
    if plan.model.moe is not None and (lay.ep > 1 or lay.expert_tp != lay.tp):
        # the routed experts' TP degree (MoE parallel folding); Megatron's default is tp
        a.add("--expert-tensor-parallel-size", lay.expert_tp)
    if lay.ep_comm_overlap and plan.model.moe is not None and lay.ep > 1:
        a.add("--overlap-moe-expert-parallel-comm")
        vnotes.append(
            "  --overlap-moe-expert-parallel-comm: Megatron-LM main (2025); not in Megatron Core "
            "0.14 or earlier."
        )
    return vnotes


def _megatron_pipeline(plan: Plan, a: Command) -> list[str]:
    """Pipeline size and the split: equal virtual stages by count, uneven first/last stages by their counts,
    any other split as an explicit layout."""
    lay = plan.layout
    pp, v = lay.pp, lay.virtual_stages
    counts = layer_counts(plan)
    vnotes = []
    a.add("--pipeline-model-parallel-size", pp)
    if pp == 1:
        return vnotes
    uniform = len(set(counts)) == 1
    if uniform and v > 1:
        a.add("--num-layers-per-virtual-pipeline-stage", counts[0])
    elif not uniform:
        middle = counts[1:-1]
        first_last = (
            v == 1
            and counts[0] > 0
            and counts[-1] > 0
            and len(set(middle)) <= 1
            and (not middle or middle[0] > 0)
        )
        if first_last:
            a.add("--decoder-first-pipeline-num-layers", counts[0])
            a.add("--decoder-last-pipeline-num-layers", counts[-1])
            vnotes.append(
                "  --decoder-first/last-pipeline-num-layers: Megatron Core >= 0.9 (uneven "
                "pipeline parallelism)."
            )
        else:
            a.add("--pipeline-model-parallel-layout", _megatron_layout(counts))
            vnotes.append(
                "  --pipeline-model-parallel-layout: Megatron Core >= 0.13 (experimental); "
                "E = embedding, t = transformer layer, L = loss, stages split by '|'."
            )
    # pp_scatter_gather=False writes no flag: --no-scatter-gather-tensors-in-pipeline set a value no
    # Megatron-Core code read, and core_v0.18.0 removed it (NVIDIA/Megatron-LM 10e7b74597)
    return vnotes


def _megatron_data_parallel(plan: Plan, a: Command) -> list[str]:
    """ZeRO-1 as the distributed optimizer, ZeRO-2/3 as Megatron-FSDP (hybrid-sharded across
    ``dp_replicate`` instances), the data-parallel comm overlap and optimizer CPU offload."""
    lay = plan.layout
    vnotes = []
    if lay.zero_stage == 1:
        a.add("--use-distributed-optimizer")
        if lay.dp_replicate > 1:
            a.add("--num-distributed-optimizer-instances", lay.dp_replicate)
            vnotes.append(
                "  --num-distributed-optimizer-instances (hybrid-sharded distributed optimizer): "
                "Megatron Core >= 0.13."
            )
    elif lay.zero_stage >= 2:
        a.add("--use-megatron-fsdp")
        a.add(
            "--data-parallel-sharding-strategy",
            "optim_grads" if lay.zero_stage == 2 else "optim_grads_params",
        )
        a.add("--use-distributed-optimizer")
        a.add("--no-gradient-accumulation-fusion")
        a.add("--ckpt-format", "fsdp_dtensor")
        vnotes.append(
            "  --use-megatron-fsdp and --ckpt-format fsdp_dtensor: Megatron Core >= 0.14 (earlier "
            "releases call it --use-custom-fsdp)."
        )
        if lay.dp_replicate > 1:  # HSDP: shard within dp_shard x cp, replicate across the instances
            a.add("--num-distributed-optimizer-instances", lay.dp_replicate)
            vnotes.append(
                "  --num-distributed-optimizer-instances with --use-megatron-fsdp (hybrid sharding, the "
                "outer group replicated: --outer-dp-sharding-strategy no_shard, the default): "
                "Megatron Core >= 0.14."
            )
    if lay.dp_comm_overlap and lay.dp * lay.cp > 1:
        a.add("--overlap-grad-reduce")
        if lay.zero_stage >= 1:
            a.add("--overlap-param-gather")
    if lay.offload_optimizer:
        a.add("--optimizer-cpu-offload")
        a.add("--optimizer-offload-fraction", f"{lay.optimizer_offload_fraction:g}")
        a.add("--use-precision-aware-optimizer")
        a.add("--overlap-cpu-optimizer-d2h-h2d")
        vnotes.append(
            "  --optimizer-cpu-offload: Megatron Core >= 0.11; needs Transformer Engine's "
            "precision-aware optimizer."
        )
    return vnotes


def _megatron_env(plan: Plan) -> list[str]:
    """Script lines before the command: the mock-data arguments and CUDA_DEVICE_MAX_CONNECTIONS."""
    m, lay = plan.model, plan.layout
    env = [
        "# Data and tokenizer: Megatron's mock data with a NullTokenizer sized to the model's vocabulary",
        f"# ({m.vocab_size}; NullTokenizer adds one end-of-document token to --vocab-size). Set DATA_ARGS to",
        "# your --data-path / --tokenizer-type arguments for a real run.",
        (
            'DATA_ARGS="${DATA_ARGS:---mock-data --tokenizer-type NullTokenizer '
            f'--vocab-size {m.vocab_size - 1}}}"'
        ),
    ]
    if lay.zero_stage < 2 and (lay.tp > 1 or lay.cp > 1):
        env.append(
            "export CUDA_DEVICE_MAX_CONNECTIONS=1  # required by Megatron-LM with TP/CP before Blackwell"
        )
    elif lay.zero_stage >= 2:
        env.append("unset CUDA_DEVICE_MAX_CONNECTIONS  # Megatron-FSDP wants several CUDA connections")
    return env


def _megatron_notes(plan: Plan, vnotes: list[str]) -> list[str]:
    """The header's notes: where the flags were checked, the version-dependent flags, how to launch."""
    lay = plan.layout
    nodes, per_node = launch_shape(plan)
    notes = ["Flags checked against NVIDIA/Megatron-LM megatron/training/arguments.py (main branch)."]
    if vnotes:
        notes += ["Version-dependent flags:"] + vnotes
    notes += [
        "",
        f"Launch: the same script on each of the {nodes} node(s),",
        "with NODE_RANK, MASTER_ADDR and MASTER_PORT set;",
        f"torchrun starts {per_node} processes per node ({plan.num_gpus} in all).",
        "Data parallel size = world size /",
        f"(tp x pp x cp) = {plan.num_gpus} / ({lay.tp} x {lay.pp} x {lay.cp}) = {lay.dp}.",
    ]
    return notes


def _megatron_layout(counts: list[int]) -> str:
    """--pipeline-model-parallel-layout for layers per (virtual) stage in stage order."""
    stages = []
    for i, n in enumerate(counts):
        text = (
            ("E" if i == 0 else "") + (f"t*{n}" if n > 1 else "t" * n) + ("L" if i == len(counts) - 1 else "")
        )
        stages.append(text)
    return "|".join(stages)


SPEC = TargetSpec(
    Target.megatron,
    "Megatron-LM (Megatron-Core core_v0.19.0)",
    _MEGATRON,
    uneven_split=True,  # --decoder-first/last-pipeline-num-layers, --pipeline-model-parallel-layout
    per_stage_recompute=False,  # --recompute-num-layers is one int for every stage
    facts=_MEGATRON_FACTS,
    render=render,
)
