"""The ``torchtitan`` target: torchtitan 0.3.0. Its pricing facts, its capability table and its launch file:
``torchtitan_train.sh``, ``torchrun -m torchtitan.train`` with a torchtitan 0.3.0 config registry entry
(``--module``/``--config``) and ``--section.key`` overrides, checked against torchtitan 0.3.0
``torchtitan/config/manager.py``, ``config/configs.py``, ``trainer.py`` and ``models/*/config_registry.py``.
Never imports torch."""

from __future__ import annotations

import re

from planner.contracts import ModelSpec, ParallelLayout, Plan, Precision, Recompute, Schedule
from planner.cost.params import head_per_tp_rank
from planner.cost.pipeline import SCHEDULES
from planner.targets.core import Job, Limit, Target, TargetFacts, TargetSpec, _grouped_mm_or_loop
from planner.targets.launch import (
    bash_script,
    layer_counts,
    torchrun,
)
from planner.targets.rows import (
    _OP_SAC_SPLIT_BACKWARD,
    _TORCH_PIPELINE_SENDS,
    _WHOLE_NODES,
    _kv_heads,
    _master_weights,
    _pp,
    _pp_sends,
    _recompute_value,
    _sends_as_sp,
    _torch_schedule_micro_batches,
    _trained,
)
from planner.targets.split import RecomputeSetting, every_nth_recompute, uniform_recompute

TORCHTITAN_RELEASE = "torchtitan 0.3.0"  # the release its table was checked against


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
    async_checkpoint="[checkpoint] async_mode = 'async' (torch.distributed.checkpoint.async_save)",
    checkpoint_source="torchtitan 0.3.0 components/checkpoint.py",
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
    _OP_SAC_SPLIT_BACKWARD,
    _kv_heads("torchtitan"),
    _master_weights("torchtitan"),
    _torch_schedule_micro_batches("torchtitan"),
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
# the launch file (autopar export --to torchtitan)
# ============================================================================================
# torchtitan 0.3.0 config_registry entries whose model shapes and float8 match a plan exactly
# (torchtitan/models/<module>/config_registry.py; llama3_405b converts its Linear layers to float8):
# (layers, hidden, heads, kv heads, ffn, vocab,
#  MoE (experts, top-k, expert ffn, shared, dense layers) or None,
#  MLA or not, float8 or not) -> (--module, --config)
_TORCHTITAN_CONFIGS = {
    (32, 4096, 32, 8, 14336, 128256, None, False, False): ("llama3", "llama3_8b"),
    (80, 8192, 64, 8, 28672, 128256, None, False, False): ("llama3", "llama3_70b"),
    (126, 16384, 128, 8, 53248, 128256, None, False, True): ("llama3", "llama3_405b"),
    (61, 7168, 128, 128, 18432, 129280, (256, 8, 2048, 1, 3), True, False): (
        "deepseek_v3",
        "deepseek_v3_671b",
    ),
}


def render(plan: Plan) -> dict[str, str]:
    """``torchtitan_train.sh``: torchrun of ``torchtitan.train`` with a ``--module/--config`` registry entry,
    ``--section.key value`` overrides and the activation-checkpoint subcommand last."""
    module, config, notes = _titan_registry_entry(plan)
    cmd = torchrun(plan, "-m torchtitan.train")
    cmd.add("--module", module)
    cmd.add("--config", config)
    for flag, *values in _titan_overrides(plan):
        cmd.add(flag, *values)
    cmd.add(f"activation_checkpoint:{_titan_checkpointing(plan)}")
    notes += [
        f"Options checked against {TORCHTITAN_RELEASE} (torchtitan/config/manager.py ConfigManager,",
        "torchtitan/config/configs.py, torchtitan/trainer.py); earlier releases took TOML job files instead.",
        "The optimizer (AdamW in the registry entries), learning rate and float8 (model_spec converters)",
        "come from the registry entry; these overrides do not set them.",
    ]
    if plan.training.optimizer.value != "adamw":
        notes.append(
            f"NOTE: this plan's optimizer is {plan.training.optimizer.value}: set optimizer.param_groups."
        )
    if plan.layout.ep > 1 and plan.layout.tp > 1:
        notes.append(
            f"{TORCHTITAN_RELEASE} runs expert-parallel experts whole (etp=1, as planned), folded over the "
            "dp_shard x cp x tp ranks (efsdp = dp_shard*cp*tp/ep, distributed/parallel_dims.py)."
        )
    return {
        "torchtitan_train.sh": bash_script(plan, "torchtitan", notes, ["# no environment needed"], [cmd.render()])
    }


def _titan_registry_entry(plan: Plan) -> tuple[str, str, list[str]]:
    """(--module, --config, notes): the registry entry with the plan's model shapes, else one to add."""
    m = plan.model
    moe = m.moe
    moe_key = (
        None
        if moe is None
        else (
            moe.num_experts,
            moe.top_k,
            moe.expert_ffn_hidden_size,
            moe.num_shared_experts,
            moe.first_dense_layers,
        )
    )
    key = (m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads, m.ffn_hidden_size, m.vocab_size)
    fp8 = plan.precision is Precision.fp8
    entry = _TORCHTITAN_CONFIGS.get((*key, moe_key, m.mla is not None, fp8))
    if entry is not None and not _unlike_llama3(m):
        return entry[0], entry[1], []
    module = "deepseek_v3" if m.mla is not None or moe is not None else "llama3"
    config = (
        "autopar_" + re.sub(r"[^0-9a-zA-Z]+", "_", m.name).strip("_").lower() + ("_float8" if fp8 else "")
    )
    shapes = (
        f"layers={m.num_layers}, dim={m.hidden_size}, heads={m.num_attention_heads}, kv_heads={m.kv_heads}, "
        f"ffn_hidden={m.ffn_hidden_size}, vocab={m.vocab_size}"
    )
    if moe is not None:
        shapes += f", experts={moe.num_experts} top-{moe.top_k} of {moe.expert_ffn_hidden_size}"
    shapes += "".join(f", {fact}" for fact in _unlike_llama3(m))
    if fp8:
        shapes += ", model_spec converters=[Float8LinearConverter.Config()]"
    notes = [
        f"NOTE: no {TORCHTITAN_RELEASE} config_registry entry has this model's shapes; add a function",
        f"{config}() to torchtitan/models/{module}/config_registry.py with: {shapes}.",
    ]
    return module, config, notes


def _unlike_llama3(m: ModelSpec) -> list[str]:
    """What the model's blocks do that torchtitan's llama3 blocks (RMSNorm, RoPE, SwiGLU, no biases, no dropout)
    do not: the registry entry the user adds must build them so, or the run trains another model."""
    facts = [f"{name}={value}" for name, value, plain in (
        ("norm", m.norm, "rmsnorm"), ("position_embedding", m.position_embedding, "rope"),
        ("ffn", m.ffn_kind, "swiglu"), ("dropout", m.dropout, 0.0), ("qk_norm", m.qk_norm, False),
        ("sliding_window", m.sliding_window, None)) if value != plain]
    if m.biased_qkv:
        facts.append("bias on every linear" if m.linear_bias else "bias on wq, wk, wv")
    return facts


def _titan_overrides(plan: Plan) -> list[tuple[object, ...]]:
    """``(--section.key, value...)`` for every layout and batch fact; bool flags carry no value."""
    t, lay = plan.training, plan.layout
    dp, pp = lay.dp, lay.pp
    replicate, shard = (lay.dp_replicate, lay.dp_shard) if lay.zero_stage == 3 else (dp, 1)  # 0: DDP
    out: list[tuple[object, ...]] = []
    if pp > 1:  # multi-token list: first, so the subcommand at the end is not read as a part
        out.append(
            ("--parallelism.module_fqns_per_model_part", *map(",".join, _torchtitan_parts(layer_counts(plan))))
        )
        out.append(("--parallelism.pipeline_parallel_schedule", SCHEDULES[lay.schedule].torchtitan))
        out.append(("--parallelism.pipeline_parallel_microbatch_size", lay.micro_batch_size))
    out += [
        ("--training.local_batch_size", t.global_batch_seqs // dp if pp > 1 else lay.micro_batch_size),
        ("--training.global_batch_size", t.global_batch_seqs),
        ("--training.seq_len", t.seq_length),
        ("--training.mixed_precision_param", "float32" if plan.precision is Precision.fp32 else "bfloat16"),
        ("--training.mixed_precision_reduce", "float32"),
        ("--parallelism.data_parallel_replicate_degree", replicate),
        ("--parallelism.data_parallel_shard_degree", shard),
        ("--parallelism.tensor_parallel_degree", lay.tp),
        ("--parallelism.context_parallel_degree", lay.cp),
        ("--parallelism.pipeline_parallel_degree", pp),
        ("--parallelism.expert_parallel_degree", lay.ep),
    ]
    if shard * lay.cp > 1:
        out.append(
            ("--parallelism.fsdp_reshard_after_forward", "always" if lay.reshard_after_forward else "never")
        )
    if pp > 1 or lay.ep > 1:  # trainer.py _validate_cuda_graphs refuses both under CUDA graphs
        out.append(("--training.disable_cuda_graphs",))
    return [*out, *_titan_compile(lay), ("--dump_folder", "./outputs")]


def _titan_compile(lay: ParallelLayout) -> list[tuple[str, ...]]:
    """torch.compile of model and loss as the plan was priced (``ParallelLayout.compile``; async TP only runs
    compiled), and off otherwise: registry entries may turn it on (llama3_405b), which the plan did not price."""
    async_tp = lay.tp_comm_overlap and lay.tp > 1
    if not titan_compiled(lay):
        return [("--compile.no-enable",), ("--compile.no-enable_async_tensor_parallel",)]
    return [("--compile.enable",), ("--compile.components", "model,loss"),
            ("--compile.enable_async_tensor_parallel",) if async_tp else ("--compile.no-enable_async_tensor_parallel",)]


def _titan_checkpointing(plan: Plan) -> str:
    """The activation_checkpoint subcommand: ``full``, ``selective`` (its per-op SelectiveAC: the plan's ``op``,
    with its default force-recomputed router gate) or ``none`` for every layer (the table has refused the rest)."""
    setting = uniform_recompute(plan.layout, plan.model.num_layers)
    if setting is not None and setting.block is None and setting.kind in ("full", "none", "op"):
        return "selective" if setting.kind == "op" else setting.kind
    assert every_nth_recompute(plan.layout, plan.model.num_layers) == 1, "its table (_TORCHTITAN) refuses the rest"
    return "full"


def _torchtitan_parts(counts: list[int]) -> list[list[str]]:
    """Module FQNs of each pipeline stage (model part), in stage order."""
    parts, layer = [], 0
    for i, n in enumerate(counts):
        part = ["tok_embeddings"] if i == 0 else []
        part += [f"layers.{j}" for j in range(layer, layer + n)]
        layer += n
        if i == len(counts) - 1:
            part += ["norm", "lm_head"]  # 0.3.0 models/common/decoder.py; v0.2.2 named it "output"
        parts.append(part)
    return parts


SPEC = TargetSpec(
    Target.torchtitan,
    TORCHTITAN_RELEASE,
    _TORCHTITAN,
    uneven_split=True,  # parallelism.module_fqns_per_model_part
    per_stage_recompute=False,  # one [activation_checkpoint] for every model part
    facts=_TORCHTITAN_FACTS,
    render=render,
)
