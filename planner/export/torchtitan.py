"""torchtitan: ``torchtitan_train.sh``, ``torchrun -m torchtitan.train`` with a torchtitan 0.3.0 config
registry entry (``--module``/``--config``) and ``--section.key`` overrides, checked against torchtitan 0.3.0
``torchtitan/config/manager.py``, ``config/configs.py``, ``trainer.py`` and ``models/*/config_registry.py``."""

from __future__ import annotations

import re

from planner.contracts import ParallelLayout, Plan, Precision
from planner.cost.pipeline import SCHEDULES
from planner.export.common import (
    bash_script,
    layer_counts,
    torchrun,
)
from planner.targets import (
    TARGETS,
    Target,
    every_nth_recompute,
    titan_compiled,
    uniform_recompute,
)

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
TORCHTITAN_RELEASE = TARGETS[Target.torchtitan].framework  # the release its table was checked against


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
    if entry is not None:
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
    if fp8:
        shapes += ", model_spec converters=[Float8LinearConverter.Config()]"
    notes = [
        f"NOTE: no {TORCHTITAN_RELEASE} config_registry entry has this model's shapes; add a function",
        f"{config}() to torchtitan/models/{module}/config_registry.py with: {shapes}.",
    ]
    return module, config, notes


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
    """The activation_checkpoint subcommand: ``full`` or ``none`` for every layer (the target's table has
    refused the rest)."""
    setting = uniform_recompute(plan.layout, plan.model.num_layers)
    if setting is not None and setting.block is None and setting.kind in ("full", "none"):
        return setting.kind
    assert every_nth_recompute(plan.layout, plan.model.num_layers) == 1, "planner/targets.py refuses the rest"
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
