"""The ``autopar`` target: this project's executor (``executor/``), which runs a plan itself (no launch files).
Its pricing facts and its capability table. Never imports torch."""

from __future__ import annotations

from planner.contracts import ClusterProfile, ModelSpec, Precision, Schedule
from planner.cost.params import embedding_params, head_per_tp_rank
from planner.targets.core import Job, Limit, Target, TargetFacts, TargetSpec, _grouped_mm_or_loop
from planner.targets.rows import (
    _OP_SAC_SPLIT_BACKWARD,
    _TORCH_PIPELINE_SENDS,
    _no_compile,
    _pp,
    _pp_sends,
    _sends_as_sp,
    _torch_schedule_micro_batches,
    _trained,
)


# ============================================================================================
# autopar: this project's executor (executor/parallelize.py, executor/pipeline.py, executor/model.py)
# on torch >= 2.6 (torch.distributed.pipelining, FSDP2 fully_shard, DTensor tensor parallel)
# ============================================================================================
def _executor_experts(profile: ClusterProfile, precision: Precision) -> int:
    """The executor runs ``torch._grouped_mm`` in bf16 only (``executor.moe.grouped_mm_dtype``): fp32 loops."""
    return _grouped_mm_or_loop(profile, precision) if precision is Precision.bf16 else 1


def _embedding_and_head(model: ModelSpec, tp: int) -> float:
    return embedding_params(model) / tp + head_per_tp_rank(model, tp)


EXECUTOR_HOST_S_PER_KERNEL = 1.3e-4
"""The executor's host seconds per kernel the planner counts, measured (:data:`_AUTOPAR_FACTS`'s host_source)."""

_AUTOPAR_FACTS = TargetFacts(
    loss=lambda lay: None,
    loss_source="the executor's loss, measured per profile by profiler/memory.py (14.0 on an H100): torch's "
    "cross-entropy on fp32-cast logits (loss_parallel under TP), the 16-bit logits kept to the backward as "
    "the pipeline schedule's stage output: 2 (logits) + 4 (fp32 copy) + 4 (log-softmax) + 4 (its gradient) "
    "at the backward's peak; 14.0 with loss_parallel too (benchmarks/loss_memory.py)",
    pp_sends=_sends_as_sp,
    pp_source=_TORCH_PIPELINE_SENDS + " (executor/pipeline.py)",
    master_in_param=True,
    host_s_per_kernel=EXECUTOR_HOST_S_PER_KERNEL,
    host_source="fitted by planner.run_calibration on the executor's own GPU runs (tests/data/gpu_runs: nine plans "
    "of a 0.5B model on one H200, 136 us; four of a 0.3B model on another, 123 us; the median of their host-bound "
    "runs' step over the kernels the planner counts): eager PyTorch launches each op from Python, FSDP2's hooks "
    "included, so a pass of short kernels waits for its host",
    async_checkpoint="autopar run --async-checkpoint (torch.distributed.checkpoint.async_save)",
    checkpoint_source="executor/checkpoint.py: torch.distributed.checkpoint.save",
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


def _seq_split(j: Job) -> int:
    """Sequence chunks context/sequence parallelism need: 2 x cp (cp > 1), times tp with sp."""
    return (2 * j.layout.cp if j.layout.cp > 1 else 1) * (j.layout.tp if j.layout.sp else 1)


def _rounds(j: Job) -> int:
    return max(1, (j.micro_batches or 0) // j.layout.pp)


_AUTOPAR = (
    _OP_SAC_SPLIT_BACKWARD,
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
        refuses=lambda j: j.layout.tp > 1 and j.model.tied_embeddings and not j.hf,
        field="layout.tp",
        value=lambda j: j.layout.tp,
        problem="with tied embeddings is not implemented for the built-in decoder (its head reads the "
        "embedding's table through a functional call that no TP style wraps)",
        fix="use tp=1 or untied embeddings (a Hugging Face model's tied head and embedding share one "
        "vocabulary-sharded table)",
    ),
    Limit(
        feature="expert tensor parallelism on a Hugging Face MoE model",
        scope="layout",
        refuses=lambda j: j.hf and j.model.moe is not None and j.layout.expert_tp > 1,
        field="layout.etp",
        value=lambda j: j.layout.expert_tp,
        problem="splits the routed experts' FFN over the TP ranks, which the executor does for the built-in "
        "MoE only (a Hugging Face model's experts stay whole, folded over the TP ranks)",
        fix="set etp=1",
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
            and j.model.moe.shared_ffn % j.layout.tp != 0 and not j.hf
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
        feature="optimizer offload of a share",
        scope="layout",
        refuses=lambda j: j.layout.offload_share not in (0.0, 1.0),
        field="layout.optimizer_offload_fraction",
        value=lambda j: j.layout.optimizer_offload_fraction,
        problem="is below 1: the executor offloads with FSDP2's CPUOffloadPolicy, which moves whole shards",
        fix="offload all of the optimizer (fraction 1) or none, or plan for megatron (ZeRO-1) or deepspeed (ZeRO-3)",
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
        feature="pipeline parallelism with tied embeddings",
        scope="layout",
        refuses=lambda j: _pp(j) and j.model.tied_embeddings,
        field="model.tied_embeddings",
        value=lambda j: True,
        problem=lambda j: f"with pp={j.layout.pp} would share one weight between the first and last stage",
        fix="use untied embeddings or pp=1",
    ),
    _torch_schedule_micro_batches("the executor"),
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


SPEC = TargetSpec(
    Target.autopar,
    "autopar executor (executor/) on torch >= 2.6: torch.distributed.pipelining, FSDP2, DTensor TP",
    _AUTOPAR,
    uneven_split=True,
    per_stage_recompute=True,
    facts=_AUTOPAR_FACTS,
)
