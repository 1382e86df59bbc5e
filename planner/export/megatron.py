"""Megatron-LM: ``megatron_args.sh``, a bash script that runs ``pretrain_gpt.py`` under ``torchrun`` with one
argument per line. Flags checked against NVIDIA/Megatron-LM ``megatron/training/arguments.py`` and
``megatron/core/transformer/pipeline_parallel_layer_layout.py`` (the release :mod:`planner.targets` names)."""

from __future__ import annotations

from planner.contracts import Plan, Precision
from planner.export.common import (
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
        a.add("--optimizer-offload-fraction", "1.0")
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
