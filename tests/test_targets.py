"""planner/targets/: every row of every capability table fires on a job built to hit it (first in its
table) and not on a neighbouring job; split rows fire only on split fields; exports to a target other
than the plan's name the blocking feature; the executor refuses with the ``autopar`` table's own rows."""

from __future__ import annotations

import re

import pytest
from test_export import make_plan

from planner.contracts import ModelSpec, ParallelLayout, StageRecompute, TrainingConfig
from planner.errors import UnknownNameError
from planner.export import export_plan
from planner.presets import get_preset
from planner.targets import (
    SCOPES,
    TARGETS,
    Job,
    Target,
    TargetRefusal,
    check,
    every_nth_recompute,
    job_of,
    refusal,
    uniform_recompute,
)

LLAMA = get_preset("llama3-8b")  # 32 layers, 32 heads, 8 KV heads, vocab 128256, ffn 14336
MIXTRAL = get_preset("mixtral-8x7b")  # 8 experts of the dense FFN width, every layer MoE
DEEPSEEK = get_preset("deepseek-v3")  # MLA
GPT3 = get_preset("gpt3-1.3b")  # learned positions, tied, dropout 0.1
TIED = LLAMA.model_copy(update={"tied_embeddings": True})
ALIBI = LLAMA.model_copy(update={"position_embedding": "alibi"})


def moe(**update) -> ModelSpec:
    return MIXTRAL.model_copy(update={"moe": MIXTRAL.moe.model_copy(update=update)})


def full(n: int | None = None) -> StageRecompute:
    return StageRecompute(kind="full", num_layers=n)


SEL = StageRecompute(kind="selective")


def job(
    model: ModelSpec = LLAMA,
    *,
    seq: int = 4096,
    training: dict | None = None,
    micro: int | None = None,
    hf: bool = False,
    **layout,
) -> Job:
    train = TrainingConfig(seq_length=seq, global_batch_size=64, **(training or {}))
    return Job(model, train, ParallelLayout(**layout), micro_batches=micro, hf=hf)


COMMON = {  # rows every exported framework has: feature -> (hit, miss)
    "key/value heads replicated over the TP ranks": (job(tp=16, sp=True), job(tp=8, sp=True)),
    "mixed precision without fp32 master weights": (job(training={"master_weights_fp32": False}), job()),
    "a GPU count that does not fill whole nodes": (
        job(dp_shard=12, zero_stage=3),
        job(dp_shard=4, zero_stage=3),
    ),
}
RECOMPUTE_4_2 = job(pp=2, recompute_per_stage=[full(4), full(2)])  # 16 layers per rank
RECOMPUTE_4_4 = job(pp=2, recompute_per_stage=[full(4), full(4)])
RECOMPUTE_ALL = job(pp=2, recompute_per_stage=[full(), full()])

CASES: dict[Target, dict[str, tuple[Job, Job]]] = {
    Target.megatron: {
        **COMMON,
        "torch.compile of the model and loss": (job(compile=True), job()),
        "per-op selective activation checkpointing": (job(recompute="op"), job(recompute="selective")),
        "ALiBi position embeddings": (job(ALIBI), job()),
        "GPipe schedule": (job(pp=2, schedule="gpipe"), job(pp=2)),
        "zero-bubble schedule": (job(pp=2, schedule="zero_bubble"), job(pp=2)),
        "V-shaped schedule (ZB-V, DualPipeV)": (job(pp=2, schedule="zero_bubble_v", virtual_stages=2),
                                                job(pp=2, schedule="interleaved_1f1b", virtual_stages=2)),
        "MoE expert and tensor parallelism without sequence parallelism": (
            job(MIXTRAL, tp=2, dp_shard=8, ep=8),
            job(MIXTRAL, tp=2, sp=True, dp_shard=8, ep=8),
        ),
        "MoE linear biases with expert tensor parallelism": (
            job(MIXTRAL.model_copy(update={"linear_bias": True}), tp=2, sp=True, dp_shard=8, ep=8),
            job(MIXTRAL.model_copy(update={"linear_bias": True}), tp=2, sp=True, dp_shard=8, ep=8, etp=1),
        ),
        "TP communication overlap without sequence parallelism": (
            job(tp=8, tp_comm_overlap=True),
            job(tp=8, sp=True, tp_comm_overlap=True),
        ),
        "ZeRO-2/3 with pipeline parallelism": (
            job(pp=2, dp_shard=2, zero_stage=3),
            job(dp_shard=2, zero_stage=3),
        ),
        "ZeRO-3 that keeps gathered parameters after forward": (
            job(dp_shard=8, zero_stage=3, reshard_after_forward=False),
            job(dp_shard=8, zero_stage=3),
        ),
        "optimizer CPU offload outside the distributed optimizer (ZeRO-1)": (
            job(dp_shard=2, offload_optimizer=True),
            job(dp_shard=2, zero_stage=1, offload_optimizer=True),
        ),
        "recompute that differs between pipeline stages": (RECOMPUTE_4_2, RECOMPUTE_4_4),
        "activation sends between pipeline stages": (job(pp=2, tp=2, pp_scatter_gather=True), job(pp=2, tp=2)),
    },
    Target.deepspeed: {
        **COMMON,
        "torch.compile of the model and loss": (job(compile=True), job()),
        "per-op selective activation checkpointing": (job(recompute="op"), job(recompute="full")),
        "ring context parallelism": (job(cp=2), job()),
        "V-shaped schedule (ZB-V, DualPipeV)": (job(pp=2, schedule="dualpipe_v", virtual_stages=2), job(pp=2)),
        "interleaved (virtual-stage) schedule": (
            job(pp=2, schedule="interleaved_1f1b", virtual_stages=2),
            job(pp=2),
        ),
        "GPipe schedule": (job(pp=2, schedule="gpipe"), job(pp=2)),
        "zero-bubble schedule with sequence parallelism": (
            job(pp=2, tp=2, sp=True, schedule="zero_bubble"),
            job(pp=2, tp=2, schedule="zero_bubble"),
        ),
        "a layer count the pipeline stages do not split evenly": (job(pp=3), job(pp=4)),
        "uneven layers per pipeline stage": (
            job(pp=2, layers_per_stage=[15, 17]),
            job(pp=2, layers_per_stage=[16, 16]),
        ),
        "ZeRO-2/3 with pipeline parallelism": (
            job(pp=2, dp_shard=2, zero_stage=2),
            job(dp_shard=2, zero_stage=2),
        ),
        "hybrid sharding (ZeRO over part of the data-parallel ranks)": (
            job(dp_replicate=2, dp_shard=2, zero_stage=1),
            job(dp_shard=4, zero_stage=1),
        ),
        "ZeRO-3 that keeps gathered parameters after forward": (
            job(dp_shard=8, zero_stage=3, reshard_after_forward=False),
            job(dp_shard=8, zero_stage=3),
        ),
        "optimizer CPU offload without ZeRO": (
            job(offload_optimizer=True),
            job(dp_shard=2, zero_stage=1, offload_optimizer=True),
        ),
        "optimizer offload of a share below ZeRO-3": (
            job(dp_shard=2, zero_stage=1, offload_optimizer=True, optimizer_offload_fraction=0.5),
            job(dp_shard=2, zero_stage=3, offload_optimizer=True, optimizer_offload_fraction=0.5),
        ),
        "TP communication overlap": (job(tp=8, sp=True, tp_comm_overlap=True), job(tp=8, sp=True)),
        "expert all-to-all overlap": (
            job(MIXTRAL, dp_shard=8, ep=8, zero_stage=1, ep_comm_overlap=True),
            job(MIXTRAL, dp_shard=8, ep=8, zero_stage=1),
        ),
        "expert tensor parallelism other than tp": (
            job(MIXTRAL, tp=2, sp=True, dp_shard=8, ep=8, zero_stage=1, etp=1),
            job(MIXTRAL, tp=2, sp=True, dp_shard=8, ep=8, zero_stage=1),
        ),
        "gradient reduction overlapped with a pipeline's backward": (
            job(pp=2, dp_shard=2, zero_stage=1),
            job(pp=2, dp_shard=2, zero_stage=1, dp_comm_overlap=False),
        ),
        "gradient reduction overlapped with backward without ZeRO": (
            job(dp_shard=2),
            job(dp_shard=2, zero_stage=1),
        ),
        "ALiBi position embeddings": (job(ALIBI), job()),
        "multi-latent attention": (job(DEEPSEEK), job()),
        "biases on the query, key and value projections only": (
            job(LLAMA.model_copy(update={"qkv_bias": True})),
            job(LLAMA.model_copy(update={"qkv_bias": True, "linear_bias": True})),
        ),
        "fp8 training": (job(training={"precision": "fp8"}), job()),
        "MoE with pipeline parallelism": (job(MIXTRAL, pp=2), job(MIXTRAL)),
        "experts narrower or wider than the dense FFN": (job(moe(expert_ffn_hidden_size=7168)), job(MIXTRAL)),
        "shared experts": (job(moe(num_shared_experts=1)), job(MIXTRAL)),
        "MoE layers placed other than every N-th layer": (job(moe(first_dense_layers=1)), job(MIXTRAL)),
        "recompute that differs between pipeline stages": (RECOMPUTE_4_2, RECOMPUTE_ALL),
        "recompute of only some layers of a pipeline stage": (RECOMPUTE_4_4, RECOMPUTE_ALL),
        "activation sends between pipeline stages": (
            job(pp=2, tp=2, sp=True, pp_scatter_gather=False),
            job(pp=2, tp=2, pp_scatter_gather=False),
        ),
    },
    Target.torchtitan: {
        **COMMON,
        "per-op selective checkpointing under a split-backward schedule": (
            job(pp=2, schedule="zero_bubble", recompute="op"), job(pp=2, schedule="1f1b", recompute="op")),
        "tensor parallelism without sequence parallelism": (job(tp=2), job(tp=2, sp=True)),
        "ZeRO-1/2 (sharding without parameters)": (
            job(dp_shard=2, zero_stage=1),
            job(dp_shard=2, zero_stage=3),
        ),
        "DDP with context parallelism": (job(cp=2), job(cp=2, zero_stage=3)),
        "expert parallelism without FSDP": (
            job(MIXTRAL, dp_shard=8, ep=8),
            job(MIXTRAL, dp_shard=8, ep=8, zero_stage=3),
        ),
        "expert parallelism that is not a multiple of context parallelism": (
            job(MIXTRAL, dp_shard=2, cp=4, ep=2, zero_stage=3),
            job(MIXTRAL, dp_shard=2, cp=2, ep=2, zero_stage=3),
        ),
        "expert all-to-all overlap": (
            job(MIXTRAL, dp_shard=8, ep=8, zero_stage=3, ep_comm_overlap=True),
            job(MIXTRAL, dp_shard=8, ep=8, zero_stage=3),
        ),
        "tensor-parallel experts with expert parallelism": (
            job(MIXTRAL, tp=2, sp=True, dp_shard=8, ep=8, zero_stage=3),
            job(MIXTRAL, tp=2, sp=True, dp_shard=8, ep=8, zero_stage=3, etp=1),
        ),
        "experts outside the tensor-parallel group without expert parallelism": (
            job(MIXTRAL, tp=2, sp=True, dp_shard=8, zero_stage=3, etp=1),
            job(MIXTRAL, tp=2, sp=True, dp_shard=8, zero_stage=3),
        ),
        "optimizer-only CPU offload": (job(offload_optimizer=True), job()),
        "fewer micro-batches than the pipeline schedule takes": (
            job(pp=2, schedule="dualpipe_v", virtual_stages=2, micro=3),
            job(pp=2, schedule="dualpipe_v", virtual_stages=2, micro=4),
        ),
        "zero-bubble schedule with one stage per rank (ZB-H1)": (
            job(pp=2, schedule="zero_bubble"),
            job(pp=2),
        ),
        "data-parallel communication without overlap": (
            job(dp_shard=2, zero_stage=3, dp_comm_overlap=False),
            job(dp_shard=2, zero_stage=3),
        ),
        "activation sends between pipeline stages": (
            job(pp=2, tp=2, sp=True, pp_scatter_gather=False),
            job(pp=2, tp=2, sp=True),
        ),
        "fp16 training": (job(training={"precision": "fp16"}), job()),
        "16-bit gradient reduction": (job(training={"grad_reduce_in_fp32": False}), job()),
        "unfused attention": (job(training={"flash_attention": False}), job()),
        "SGD optimizer": (job(training={"optimizer": "sgd"}), job()),
        # torchtitan 0.3.0 recomputes every layer or none (v0.2.2's every-N-th layer mode is gone)
        "recompute that differs between pipeline stages": (RECOMPUTE_4_2, RECOMPUTE_ALL),
        "recompute of the first layers of each stage": (RECOMPUTE_4_4, RECOMPUTE_ALL),
        "selective (attention-core) recompute": (job(recompute="selective"), job(recompute="full")),
        "per-stage selective (attention-core) recompute": (
            job(pp=2, recompute_per_stage=[SEL, SEL]),
            RECOMPUTE_ALL,
        ),
    },
    Target.autopar: {
        "torch.compile of the model and loss": (job(compile=True), job()),
        "per-op selective checkpointing under a split-backward schedule": (
            job(pp=2, schedule="zero_bubble", recompute="op"), job(pp=2, schedule="1f1b", recompute="op")),
        "expert parallelism on a dense model": (
            job(dp_shard=2, ep=2),
            job(MIXTRAL, dp_shard=8, ep=8, zero_stage=2),
        ),
        "expert parallelism that does not fold over dp_shard x cp x tp": (
            job(MIXTRAL, dp_shard=2, ep=4),
            job(MIXTRAL, dp_shard=2, cp=2, ep=4),
        ),
        "expert parallelism that does not split the experts evenly": (
            job(MIXTRAL, dp_shard=3, ep=3),
            job(MIXTRAL, dp_shard=4, ep=4),
        ),
        "tensor parallelism over more ranks than (key/value) heads": (job(tp=16), job(tp=8)),
        "tensor parallelism that does not split the vocabulary and FFN": (
            job(LLAMA.model_copy(update={"vocab_size": 128257}), tp=2),
            job(tp=2),
        ),
        "tensor parallelism with tied embeddings": (job(TIED, tp=2), job(TIED, tp=2, hf=True)),
        "tensor parallelism on a MoE model without sequence parallelism": (
            job(MIXTRAL, tp=2),
            job(MIXTRAL, tp=2, sp=True),
        ),
        "expert tensor parallelism between 1 and tp": (
            job(MIXTRAL, tp=4, sp=True, etp=2),
            job(MIXTRAL, tp=4, sp=True, etp=1),
        ),
        "expert tensor parallelism that does not split the expert FFN": (
            job(moe(expert_ffn_hidden_size=1001), tp=2, sp=True),
            job(MIXTRAL, tp=2, sp=True),
        ),
        "tensor parallelism that does not split the shared experts": (
            job(moe(num_shared_experts=1, shared_expert_ffn_hidden_size=1001), tp=2, sp=True, etp=1),
            job(moe(num_shared_experts=1, shared_expert_ffn_hidden_size=1002), tp=2, sp=True, etp=1),
        ),
        "ZeRO-1 with tensor or expert parallelism": (
            job(dp_shard=2, tp=2, zero_stage=1),
            job(dp_shard=2, tp=2, zero_stage=2),
        ),
        "optimizer CPU offload without FSDP (ZeRO-0/1)": (
            job(dp_shard=4, offload_optimizer=True),
            job(dp_shard=4, zero_stage=2, offload_optimizer=True),
        ),
        "optimizer offload of a share": (
            job(dp_shard=4, zero_stage=3, offload_optimizer=True, optimizer_offload_fraction=0.75),
            job(dp_shard=4, zero_stage=3, offload_optimizer=True),
        ),
        "expert tensor parallelism on a Hugging Face MoE model": (
            job(MIXTRAL, tp=2, sp=True, dp_shard=4, hf=True), job(MIXTRAL, tp=2, sp=True, dp_shard=4, etp=1, hf=True)),
        "fp16 or fp8 training": (job(training={"precision": "fp16"}), job()),
        "a sequence that context/sequence parallelism cannot split": (
            job(seq=20, cp=2, tp=2, sp=True),
            job(seq=16, cp=2, tp=2, sp=True),
        ),
        "multi-head latent attention in the built-in model": (job(DEEPSEEK), job(DEEPSEEK, hf=True)),
        "position embeddings other than RoPE in the built-in model": (job(GPT3), job(GPT3, hf=True)),
        "dropout in the built-in model": (job(LLAMA.model_copy(update={"dropout": 0.1})), job()),
        "pipeline parallelism with tied embeddings": (job(TIED, pp=2), job(TIED)),
        "fewer micro-batches than the pipeline schedule takes": (job(pp=4, micro=3), job(pp=4, micro=4)),
        "multi-stage schedule with micro-batches not in rounds of pp": (
            job(pp=4, schedule="zero_bubble", micro=9),
            job(pp=4, schedule="zero_bubble", micro=8),
        ),
        "activation sends between pipeline stages": (job(pp=2, tp=2, pp_scatter_gather=True), job(pp=2, tp=2)),
    },
}
ROWS = [(t, limit) for t, spec in TARGETS.items() for limit in spec.limits]


def without_split(j: Job) -> Job:
    """The job's base layout: no layer split, no per-stage recompute, no micro-batch count."""
    lay = j.layout.model_copy(update={"layers_per_stage": None, "recompute_per_stage": None})
    return Job(j.model, j.training, lay, None, j.hf)


# ---------------------------------------------------------------- the tables
def test_every_row_has_a_case_and_every_case_a_row() -> None:
    for target, spec in TARGETS.items():
        features = [limit.feature for limit in spec.limits]
        assert len(features) == len(set(features)), f"{target.value}: a feature is named twice"
        assert set(features) == set(CASES[target]), target.value


def test_each_table_names_its_framework_release() -> None:
    assert set(TARGETS) == set(Target)
    for target, spec in TARGETS.items():
        assert spec.target is target and re.search(r"\d+\.\d+", spec.framework), spec.framework
        assert all(limit.scope in SCOPES for limit in spec.limits)
    assert TARGETS[Target.autopar].uneven_split and TARGETS[Target.autopar].per_stage_recompute
    assert TARGETS[Target.megatron].uneven_split and not TARGETS[Target.megatron].per_stage_recompute
    assert not TARGETS[Target.deepspeed].uneven_split and TARGETS[Target.torchtitan].uneven_split


def test_a_fold_refusal_names_etp_where_etp_does_not_divide_tp() -> None:
    err = refusal(Target.autopar, job(MIXTRAL, tp=4, sp=True, etp=3, dp_shard=2))
    assert err.field == "layout.etp" and err.value == 3
    err = refusal(Target.autopar, job(MIXTRAL, dp_shard=2, ep=4))
    assert err.field == "layout.ep" and err.value == 4


@pytest.mark.parametrize(("target", "limit"), ROWS, ids=[f"{t.value}:{lim.feature}" for t, lim in ROWS])
def test_row_fires_on_its_job_first_and_not_on_the_neighbour(target, limit) -> None:
    hit, miss = CASES[target][limit.feature]
    assert limit.refuses(hit) and not limit.refuses(miss)
    err = refusal(target, hit)
    assert isinstance(err, TargetRefusal) and err.limit is limit and err.target is target
    field = limit.field(hit) if callable(limit.field) else limit.field
    assert err.field == field and str(err).startswith(f"{field}={err.value!r} ")
    with pytest.raises(TargetRefusal) as info:
        check(target.value, hit)
    assert info.value.limit is limit


@pytest.mark.parametrize(("target", "limit"), ROWS, ids=[f"{t.value}:{lim.feature}" for t, lim in ROWS])
def test_row_reads_only_its_scope(target, limit) -> None:
    """Split rows fire only through the split fields; model rows whatever the layout."""
    hit, _ = CASES[target][limit.feature]
    base = without_split(hit)
    if limit.scope == "split":
        assert not limit.refuses(base)
        assert refusal(target, hit, scopes=("model", "layout")) is None
    else:
        assert limit.refuses(base)
    if limit.scope == "model":
        assert limit.refuses(Job(hit.model, hit.training, ParallelLayout(), None, hit.hf))


def test_refusal_answers_none_and_names_bad_input() -> None:
    assert all(refusal(t, job(tp=8, sp=True, dp_shard=2, zero_stage=3)) is None for t in Target)
    with pytest.raises(UnknownNameError, match="target='jax'"):
        refusal("jax", job())
    with pytest.raises(UnknownNameError, match="scope='stage'"):
        refusal("autopar", job(), scopes=("stage",))


def test_rows_that_read_training_refuse_nothing_without_it() -> None:
    fp16 = Job(LLAMA, None, ParallelLayout(tp=2, sp=True))
    assert all(refusal(t, fp16, scopes=("model",)) is None for t in (Target.autopar, Target.torchtitan))


def test_job_of_a_plan_counts_micro_batches_per_pipeline() -> None:
    plan = make_plan(tp=4, sp=True, pp=2, dp_shard=2, zero_stage=1, micro_batch_size=2)
    j = job_of(plan, hf=True)
    assert j.micro_batches == 64 // (2 * 2) and j.hf and j.layout is plan.layout


# ---------------------------------------------------------------- recompute as the frameworks state it
def test_uniform_recompute_is_one_setting_or_block_n() -> None:
    lay = ParallelLayout(pp=2, recompute_per_stage=[full(4), full(4)])
    assert uniform_recompute(lay, 32).block == 4
    # interleaved: 2 chunks of 8 layers per rank; 4 per rank = the first 2 of each chunk
    lay = ParallelLayout(
        pp=2, schedule="interleaved_1f1b", virtual_stages=2, recompute_per_stage=[full(4)] * 2
    )
    assert uniform_recompute(lay, 32).block == 2
    assert uniform_recompute(ParallelLayout(pp=2, recompute_per_stage=[full(4), full(2)]), 32) is None
    assert uniform_recompute(ParallelLayout(pp=2, recompute_per_stage=[full(), SEL]), 32) is None


def test_every_nth_recompute_counts_floor_of_layers_over_n() -> None:
    # ranks of 15 and 17 layers recomputing 7 and 8: every 2nd layer (15 // 2 = 7, 17 // 2 = 8)
    lay = ParallelLayout(pp=2, layers_per_stage=[15, 17], recompute_per_stage=[full(7), full(8)])
    assert every_nth_recompute(lay, 32) == 2
    assert every_nth_recompute(ParallelLayout(pp=2, recompute_per_stage=[full(5), full(5)]), 32) == 3
    assert every_nth_recompute(ParallelLayout(pp=2, recompute_per_stage=[full(6), full(6)]), 32) is None
    assert every_nth_recompute(ParallelLayout(pp=2, recompute_per_stage=[SEL, SEL]), 32) is None
    assert every_nth_recompute(ParallelLayout(pp=2), 32) is None


# ---------------------------------------------------------------- export reads the table
def test_export_to_another_target_names_the_plan_target_and_the_feature() -> None:
    plan = make_plan(tp=4, sp=True, pp=2, dp_shard=2, zero_stage=3).model_copy(
        update={"target": "torchtitan"}
    )
    assert "torchtitan_train.sh" in export_plan(plan, "torchtitan")
    with pytest.raises(TargetRefusal) as info:
        export_plan(plan, "megatron")
    msg = str(info.value)
    assert (
        info.value.feature == "ZeRO-2/3 with pipeline parallelism" and info.value.planned is Target.torchtitan
    )
    assert msg.startswith("zero_stage=3 ") and "made for target 'torchtitan'" in msg
    assert "megatron cannot run its ZeRO-2/3 with pipeline parallelism" in msg
    assert "re-plan with --target megatron" in msg


def test_export_to_the_plans_own_target_keeps_the_rows_wording() -> None:
    plan = make_plan(tp=4, sp=True, pp=2, dp_shard=2, zero_stage=3).model_copy(update={"target": "megatron"})
    with pytest.raises(TargetRefusal) as info:
        export_plan(plan, "megatron")
    assert info.value.feature == "ZeRO-2/3 with pipeline parallelism" and "made for" not in str(info.value)


def test_export_refuses_a_plan_target_it_does_not_know() -> None:
    plan = make_plan(tp=8, sp=True, dp_shard=2, zero_stage=1).model_copy(update={"target": "jax"})
    with pytest.raises(UnknownNameError) as info:
        export_plan(plan, "megatron")
    assert info.value.field == "plan.target"


def test_plans_default_to_the_autopar_target() -> None:
    assert make_plan(tp=8, sp=True, dp_shard=2).target == "autopar"


# ---------------------------------------------------------------- the executor reads the autopar table
@pytest.mark.parametrize("limit", TARGETS[Target.autopar].limits, ids=lambda lim: lim.feature)
def test_executor_refuses_with_the_autopar_rows(limit) -> None:
    from executor.model import check_builtin
    from executor.parallelize import check_supported
    from executor.pipeline import check_pipeline

    hit, _ = CASES[Target.autopar][limit.feature]
    with pytest.raises(TargetRefusal) as info:
        if hit.micro_batches is None:
            check_supported(hit.layout, hit.model, hit.training, hf=hit.hf)
        else:
            check_pipeline(hit.layout, hit.model, hit.micro_batches, hf=hit.hf)
    assert info.value.limit is limit
    if limit.scope == "model" and not hit.hf and limit.feature.endswith("built-in model"):
        with pytest.raises(TargetRefusal) as info:
            check_builtin(hit.model)
        assert info.value.limit is limit


def test_a_schedule_torchtitan_has_no_name_for_is_refused_by_its_table():
    """planner/cost/pipeline.py's SCHEDULES gives each schedule its torchtitan name; one without a name is a
    schedule torchtitan's table refuses, so the export never meets it."""
    from planner.contracts import ParallelLayout, TrainingConfig
    from planner.cost.pipeline import SCHEDULES
    from planner.presets import get_preset
    from planner.targets import Job, refusal

    model, training = get_preset("llama3-8b"), TrainingConfig(global_batch_size=64, seq_length=4096)
    for schedule, facts in SCHEDULES.items():
        v = 2 if facts.virtual else facts.depth
        layout = ParallelLayout(dp_shard=2, pp=4, zero_stage=3, schedule=schedule, virtual_stages=v)
        refused = refusal("torchtitan", Job(model, training, layout, micro_batches=8))
        named = facts.torchtitan is not None
        assert (refused is None or refused.limit.field != "schedule") == named, (schedule, refused)
