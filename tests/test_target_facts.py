"""planner/targets/ TargetFacts: what each target does that the cost model prices by target.

The loss term by hand (bytes per logit x tokens x vocab / tp) for every target; the pipeline sends by
hand for every target with and without sequence parallelism, and the rows that refuse any other
``pp_scatter_gather``; the model states of a target whose parameters are the fp32 master (FSDP2,
autocast) against the Rajbhandari et al. counts; predict and the search's stage model on target megatron
against autopar, differing by exactly those terms; the stage model equal to predict for every target;
the torch losses measured (benchmarks/loss_memory.py) against the facts; validate's rows mapped to the
target their framework matches.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_search import random_splits

from planner.contracts import GemmLayout, ModelSpec, ParallelLayout, Precision, Recompute, TrainingConfig
from planner.cost.predict import predict
from planner.presets import get_preset
from planner.reference import reference_profile
from planner.search.enumerate import base_layout, structures
from planner.search.options import SearchOptions
from planner.search.rules import Rules
from planner.search.stages import StageModel
from planner.targets import (
    ONE_KERNEL,
    TARGETS,
    Job,
    Target,
    loss_bytes_per_logit,
    planned_scatter_gather,
    priced_profile,
    refusal,
    target_facts,
)

ROOT = Path(__file__).resolve().parents[1]
L, H, V, SEQ = 8, 1024, 32000, 1024
TARGET_NAMES = [t.value for t in Target]
# bytes per logit, read off the frameworks' sources (planner/targets/ names them); None: the profile's own
LOSS = {"autopar": None, "megatron": 6.0, "deepspeed": 10.0, "torchtitan": 12.0}
SENDS_ROW = "activation sends between pipeline stages"


def small_model(**changes) -> ModelSpec:
    fields = dict(num_layers=L, hidden_size=H, num_attention_heads=16, ffn_hidden_size=4 * H, ffn_kind="gelu",
                  vocab_size=V, linear_bias=False)
    fields.update(changes)
    return ModelSpec(**fields)


def train(gbs: int = 32) -> TrainingConfig:
    return TrainingConfig(seq_length=SEQ, global_batch_size=gbs)


@pytest.fixture(scope="module")
def node():
    return reference_profile("dgx-a100-80gb", 1)


# ------------------------------------------------------------------ the loss term
@pytest.mark.parametrize("target", TARGET_NAMES)
def test_loss_term_by_hand(node, target):
    """One micro-batch of 1024 tokens over 32000 logits on the last (only) stage, tp = 1."""
    mem = predict(small_model(), train(), node, ParallelLayout(dp_shard=8), target=target).memory
    per_logit = LOSS[target] if LOSS[target] is not None else node.assumptions.loss_bytes_per_logit
    assert mem.terms["loss"] == int(per_logit * SEQ * V)


def test_a_compiled_torchtitan_loss_keeps_four_bytes_a_logit(node):
    """torchtitan compiles model and loss for compile=True (as with async TP): 4 B per logit, the eager loss 12."""
    lay = ParallelLayout(dp_shard=8, zero_stage=3)
    assert loss_bytes_per_logit("torchtitan", lay, 14.0) == 12.0
    assert loss_bytes_per_logit("torchtitan", lay.model_copy(update={"compile": True}), 14.0) == 4.0
    eager = predict(small_model(), train(), node, lay, target="torchtitan").memory.terms["loss"]
    compiled = predict(small_model(), train(), node, lay.model_copy(update={"compile": True}),
                       target="torchtitan").memory.terms["loss"]
    assert eager - compiled == pytest.approx((12 - 4) * SEQ * V, abs=2)


def test_loss_per_logit_by_layout(node):
    """torchtitan: eager torch cross-entropy (12), its loss-parallel Function under TP (16), +2 where the
    pipeline keeps the 16-bit logits, 4 compiled (written with async TP); the others by layout unchanged."""
    a = node.assumptions.loss_bytes_per_logit
    cases = [  # (layout, autopar, megatron, deepspeed, torchtitan)
        (ParallelLayout(), a, 6, 10, 12),
        (ParallelLayout(tp=2, sp=True), a, 6, 10, 16),
        (ParallelLayout(pp=2), a, 6, 10, 14),
        (ParallelLayout(tp=2, sp=True, pp=2), a, 6, 10, 18),
        (ParallelLayout(tp=2, sp=True, pp=2, tp_comm_overlap=True), a, 6, 10, 4),
    ]
    for lay, *want in cases:
        assert [loss_bytes_per_logit(t, lay, a) for t in TARGET_NAMES] == want, lay


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_loss_term_with_tp_and_pipeline_in_the_stage_model(node, target):
    """The search's stage model holds bytes per logit x tokens x vocab / tp on the last stage (pp = 2, tp = 2,
    micro-batches of 2 sequences)."""
    lay = ParallelLayout(tp=2, sp=True, pp=2, dp_shard=2, micro_batch_size=2)
    sm = StageModel(small_model(), train(), node, lay, target=target)
    assert sm.logits == pytest.approx(loss_bytes_per_logit(target, lay, node.assumptions.loss_bytes_per_logit)
                                      * 2 * SEQ * V / 2)


# ------------------------------------------------------------------ pipeline sends
# (target, sp, MoE) -> each TP rank sends 1/tp of the activation?
SENDS = {
    ("autopar", False, False): False, ("autopar", True, False): True,  # torch pipelining: the stage output
    ("megatron", False, False): False, ("megatron", True, False): True,  # get_tensor_shapes: / tp with SP only
    ("torchtitan", False, False): False, ("torchtitan", True, False): True,
    ("deepspeed", False, False): True, ("deepspeed", True, False): True,  # pipe_partitioned (default), SP shard
    ("deepspeed", False, True): False,  # Megatron-DeepSpeed: no partitioning for MoE with pp and tp
}


@pytest.mark.parametrize("target,sp,moe", list(SENDS))
def test_pipeline_sends_by_hand(node, target, sp, moe):
    model = get_preset("mixtral-8x7b") if moe else small_model()
    assert planned_scatter_gather(target, model, sp) is SENDS[target, sp, moe]
    if moe:
        return
    # pp 2 x tp 2 x dp 2, 2 sequences a micro-batch: 8 micro-batches, each sent forward and its gradient back
    lay = ParallelLayout(tp=2, sp=sp, pp=2, dp_shard=2, micro_batch_size=2, pp_scatter_gather=SENDS[target, sp, moe])
    pred = predict(small_model(), train(), node, lay, target=target)
    whole = 2 * SEQ * H * 2  # 2 sequences x SEQ tokens x h x 2 bytes
    sent = next(c for c in pred.comm if c.kind == "pp").bytes_per_step
    assert sent == pytest.approx(2 * 8 * whole / (2 if SENDS[target, sp, moe] else 1))


@pytest.mark.parametrize("target,sp,moe", list(SENDS))
def test_the_other_sends_are_refused(target, sp, moe):
    model = get_preset("mixtral-8x7b") if moe else small_model()
    row = next(limit for limit in TARGETS[Target(target)].limits if limit.feature == SENDS_ROW)
    runs, other = SENDS[target, sp, moe], not SENDS[target, sp, moe]
    train_ = TrainingConfig(seq_length=4096, global_batch_size=64)

    def job(**lay) -> Job:
        return Job(model, train_, ParallelLayout(tp=2, sp=sp, pp=2, dp_shard=2, **lay))

    assert not row.refuses(job(pp_scatter_gather=runs))
    both = target == "deepspeed" and not sp and not moe  # pipe_partitioned on or off: DeepSpeed runs either
    assert row.refuses(job(pp_scatter_gather=other)) is not both
    if not both:
        err = row.error(job(pp_scatter_gather=other), Target(target))
        assert err.field.endswith("pp_scatter_gather") and err.value is other
        assert f"pp_scatter_gather={runs}" in err.fix
    # no pipeline or no TP: nothing is sent apart, whatever the field says
    assert not row.refuses(Job(model, train_, ParallelLayout(tp=2, sp=sp, dp_shard=4, pp_scatter_gather=other)))
    assert not row.refuses(Job(model, train_, ParallelLayout(pp=2, dp_shard=4, pp_scatter_gather=not sp)))


def test_refusal_names_field_value_and_fix():
    job = Job(small_model(), train(), ParallelLayout(tp=2, pp=2, dp_shard=2, pp_scatter_gather=True))
    err = refusal("megatron", job)
    assert err is not None and err.feature == SENDS_ROW
    assert str(err).startswith("pp_scatter_gather=True")
    assert "whole activation" in str(err) and "plan with pp_scatter_gather=False" in str(err)


def test_a_layout_sends_as_sp_unless_stated():
    assert ParallelLayout(tp=2, pp=2, sp=True).pp_scatter_gather is True
    assert ParallelLayout(tp=2, pp=2).pp_scatter_gather is False
    assert ParallelLayout(tp=2, pp=2, pp_scatter_gather=True).pp_scatter_gather is True
    again = ParallelLayout.model_validate_json(ParallelLayout(tp=2, pp=2, sp=True, pp_scatter_gather=False)
                                               .model_dump_json())
    assert again.pp_scatter_gather is False


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_the_search_sets_the_sends_from_the_target(node, target):
    model, opts = small_model(), SearchOptions(target=target)
    structs = structures(model, train(), node, opts, Rules())
    assert any(st.sp for st in structs) and any(not st.sp and st.tp > 1 for st in structs)
    for st in structs:
        assert st.pp_scatter_gather is planned_scatter_gather(target, model, st.sp)
        assert base_layout(st, opts).pp_scatter_gather is st.pp_scatter_gather


# ------------------------------------------------------------------ model states
PHI = V * H + L * (4 * H * H + 2 * H + 8 * H * H) + H + H * V  # embedding, blocks, final norm, head


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_states_where_the_parameter_is_the_master(node, zero):
    """Megatron/DeepSpeed: 16-bit weights 2 beside fp32 grads 4 and master + Adam 12, sharded by ZeRO stage.
    The executor/torchtitan: the fp32 parameter (4) is the master, sharded only where the parameters are
    (FSDP2, ZeRO-2/3); Adam 8 sharded from ZeRO-1; 16-bit copies (2) held through the backward at ZeRO-0/1
    (autocast's casts) and ZeRO-2 (weights kept gathered), none at ZeRO-3."""
    n = 8
    lay = ParallelLayout(dp_shard=n, zero_stage=zero)
    std = predict(small_model(), train(), node, lay, target="megatron").memory
    own = predict(small_model(), train(), node, lay, target="autopar").memory
    shard = {w: (n if zero >= s else 1) for w, s in (("w", 3), ("g", 2), ("o", 1), ("p", 2))}
    assert (std.params_bytes, std.grads_bytes, std.optimizer_bytes) == pytest.approx(
        (2 * PHI / shard["w"], 4 * PHI / shard["g"], 12 * PHI / shard["o"]), abs=2)
    assert (own.params_bytes, own.grads_bytes, own.optimizer_bytes) == pytest.approx(
        (4 * PHI / shard["p"], 4 * PHI / shard["g"], 8 * PHI / shard["o"]), abs=2)
    assert own.terms.get("compute_copies", 0) == (2 * PHI if zero < 3 else 0)
    assert "compute_copies" not in std.terms


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_megatron_and_autopar_differ_by_exactly_the_target_terms(node, zero):
    """Same layout, same activations and step time; the allocated peaks differ by the loss (bytes per logit
    x tokens x vocab), the model states and 16-bit copies counted above and, at ZeRO-3, the executor's
    root unit held gathered (TargetFacts.fsdp_root), the totals by that times
    (1 + fragmentation). Micro-batches of 2 sequences: the backward, not the optimizer step, is the peak of both.
    The profile states a host that keeps ahead: the executor's own host time per kernel (TargetFacts.
    host_s_per_kernel) is a step-time term of its own, checked in test_the_executor_waits_for_its_host."""
    from planner.cost.layer import without_host

    node = without_host(node)
    lay = ParallelLayout(dp_shard=8, zero_stage=zero, micro_batch_size=2)
    mg = predict(small_model(), train(), node, lay, target="megatron")
    ap = predict(small_model(), train(), node, lay, target="autopar")
    assert ap.step_time_s == mg.step_time_s and ap.memory.activations_bytes == mg.memory.activations_bytes
    assert "optimizer_step" not in ap.memory.terms and "optimizer_step" not in mg.memory.terms
    loss = (node.assumptions.loss_bytes_per_logit - 6.0) * 2 * SEQ * V
    states = {0: (4 + 4 + 8 + 2) - (2 + 4 + 12), 1: (4 + 4 + 8 / 8 + 2) - (2 + 4 + 12 / 8),
              3: (4 + 4 + 8) / 8 - (2 + 4 + 12) / 8}[zero] * PHI
    # ZeRO-3: the executor's root unit (embedding, final norm, output) held gathered in 16 bits (fsdp_root)
    root = 2 * (V * H + H + V * H) if zero == 3 else 0
    assert ap.memory.terms.get("root_weights", 0) == root and "root_weights" not in mg.memory.terms
    assert ap.memory.allocated_bytes - mg.memory.allocated_bytes == pytest.approx(loss + states + root, abs=16)
    frag = ap.memory.terms["fragmentation"] / (ap.memory.allocated_bytes)
    assert ap.memory.total_bytes - mg.memory.total_bytes == pytest.approx((loss + states + root) * (1 + frag), abs=32)


def test_the_executor_waits_for_its_host(node):
    """On a GPU the executor's passes last at least its host's time per counted kernel times their kernels
    (planner.targets.autopar.EXECUTOR_HOST_S_PER_KERNEL, measured); Megatron-LM's host is taken to keep ahead. A
    profile's own statement (0 here) wins over the target's default; a CPU profile never waits (host and
    device are one)."""
    from planner.cost.layer import host_seconds_per_kernel, without_host
    from planner.targets import priced_profile
    from planner.targets.autopar import EXECUTOR_HOST_S_PER_KERNEL

    lay = ParallelLayout(tp=8, sp=True)  # short kernels on every rank: host-bound
    ap, mg = (predict(small_model(), train(), node, lay, target=t) for t in ("autopar", "megatron"))
    free = predict(small_model(), train(), without_host(node), lay, target="autopar")
    assert host_seconds_per_kernel(priced_profile(node, "autopar")) == EXECUTOR_HOST_S_PER_KERNEL
    assert host_seconds_per_kernel(priced_profile(node, "megatron")) == 0.0
    assert host_seconds_per_kernel(priced_profile(without_host(node), "autopar")) == 0.0
    assert ap.step_time_s > 1.5 * free.step_time_s and free.step_time_s == mg.step_time_s
    assert ap.terms["other"] > free.terms["other"]


def test_offloaded_plans_are_counted_alike(node):
    """Offload takes the optimizer part (master and moments) off the GPU and leaves the 16-bit weight and
    gradient shards for every target: FSDP2 keeps all its shards on the host, but nothing checks the host's
    memory, so the GPU stays charged as for Megatron."""
    lay = ParallelLayout(dp_shard=8, zero_stage=3, offload_optimizer=True)
    for target in TARGET_NAMES:
        mem = predict(small_model(), train(), node, lay, target=target).memory
        assert (mem.params_bytes, mem.grads_bytes, mem.optimizer_bytes) == pytest.approx(
            (2 * PHI / 8, 4 * PHI / 8, 0), abs=2), target
        assert "compute_copies" not in mem.terms


# ------------------------------------------------------------------ FSDP2 units held beside the blocks
@pytest.mark.parametrize("tp", [1, 2])
def test_fsdp_root_units_by_target(node, tp):
    """ZeRO-3 with resharding, one stage: the executor holds its root unit (embedding V·h/tp, final norm whole,
    output V·h/tp) gathered through the backward, torchtitan 0.3 its [norm, output] unit; in 16 bits. Not
    without resharding (every weight is already counted gathered), not for Megatron or DeepSpeed."""
    lay = ParallelLayout(dp_shard=8 // tp, tp=tp, sp=tp > 1, zero_stage=3)
    want = {"autopar": 2 * (V * H / tp + H + V * H / tp), "torchtitan": 2 * (H + V * H / tp),
            "megatron": 0, "deepspeed": 0}
    for target, root in want.items():
        terms = predict(small_model(), train(), node, lay, target=target).memory.terms
        assert terms.get("root_weights", 0) == pytest.approx(root, abs=2), target
        keep = lay.model_copy(update={"reshard_after_forward": False})
        assert "root_weights" not in predict(small_model(), train(), node, keep, target=target).memory.terms


# ------------------------------------------------------------------ FP8 saved inputs
def test_fp8_saves_fp8_linear_inputs_only_where_the_target_does():
    """Transformer Engine (Megatron) keeps each linear layer's FP8-cast input for the backward: its FP8
    activations are below its bf16 ones by (2 - 1) bytes per saved linear-input element; torchao's Float8Linear
    (torchtitan) saves the 16-bit input, so its FP8 activations are its bf16 ones, in predict and the search."""
    prof = reference_profile("dgx-h100", 1)
    lay = ParallelLayout(dp_shard=8, zero_stage=3, micro_batch_size=1)
    acts = {(t, p): predict(small_model(), TrainingConfig(seq_length=SEQ, global_batch_size=32, precision=p), prof,
                            lay, target=t).memory.activations_bytes
            for t in ("megatron", "torchtitan") for p in ("bf16", "fp8")}
    assert acts["torchtitan", "fp8"] == acts["torchtitan", "bf16"]
    # QKV, FC1 inputs (T·h each), output-projection input (T·a·dv = T·h), FC2 input (T·f = 4·T·h), per layer
    saved = L * SEQ * (H + H + H + 4 * H) * node_factor(prof, lay)
    assert acts["megatron", "bf16"] - acts["megatron", "fp8"] == pytest.approx(saved, rel=1e-9)
    for target in ("megatron", "torchtitan"):
        tr = TrainingConfig(seq_length=SEQ, global_batch_size=32, precision="fp8")
        sm = StageModel(small_model(), tr, prof, lay, target=target)
        chunks = sm.default_chunks()
        _, terms = sm.evaluate(chunks, [(Recompute.none, 0)])
        assert terms[0].memory_bytes == pytest.approx(predict(small_model(), tr, prof, lay, target=target)
                                                      .memory.total_bytes, rel=1e-9), target


def node_factor(prof, lay) -> float:
    from planner.cost.memory import activation_factor

    return activation_factor(prof.assumptions, train(), lay.zero_stage)


# ------------------------------------------------------------------ the expert GEMMs
@pytest.mark.parametrize("system,expected", [("dgx-h100", {"autopar": ONE_KERNEL, "torchtitan": ONE_KERNEL,
                                                           "deepspeed": 1, "megatron": 4}),
                                             ("dgx-a100-80gb", {"autopar": 1, "torchtitan": 1, "deepspeed": 1,
                                                                "megatron": 4})])
def test_each_target_runs_its_expert_gemms_as_it_does(system, expected):
    """torch._grouped_mm (the executor, torchtitan) is one kernel on Hopper, a loop before it; DeepSpeed's experts
    loop; Megatron's Transformer Engine GroupedLinear keeps the profile's 4 streams (the same profile back)."""
    prof = reference_profile(system, 1)
    for target, streams in expected.items():
        priced = priced_profile(prof, target)
        assert priced.assumptions.grouped_gemm_streams == streams, target
        assert (priced is prof) == (streams == prof.assumptions.grouped_gemm_streams), target
    # fp32 training: the executor's grouped kernel is bf16 only, torchtitan casts its experts to bf16 anyway
    assert priced_profile(prof, "autopar", Precision.fp32).assumptions.grouped_gemm_streams == 1
    assert priced_profile(prof, "torchtitan", Precision.fp32).assumptions.grouped_gemm_streams == expected["torchtitan"]


@pytest.mark.parametrize("name,grouped", [("H100", True), ("NVIDIA H100 80GB HBM3", True), ("NVIDIA H20", True),
                                          ("B200", True), ("NVIDIA GB200", True), ("A100 80GB", False),
                                          ("NVIDIA L40S", False), ("NVIDIA GeForce RTX 5090", False),
                                          ("AMD Instinct MI300X", False)])
def test_grouped_kernel_gpus_by_name(name, grouped):
    """Compute capability 9.0 and 10.x by name: not Ada or consumer Blackwell, whose FP8 peaks would mislead."""
    from planner.targets import GROUPED_MM_GPUS

    assert bool(GROUPED_MM_GPUS.search(name)) is grouped


def test_a_uniform_count_past_a_stage_recomputes_all_of_it(node):
    """The search's uniform recompute counts reach the largest stage; a smaller stage recomputes all its layers,
    and the layout says so (recompute=full), not a count larger than the stage."""
    sm = StageModel(small_model(num_layers=10), train(), node, ParallelLayout(pp=4, dp_shard=2), target="megatron")
    chunks = sm.default_chunks()
    assert sorted(len(r) for r in sm.rank_layers(chunks)) == [2, 2, 3, 3]
    assert sm.layout_for(chunks, [(Recompute.full, 3)] * 4).recompute is Recompute.full
    two = sm.layout_for(chunks, [(Recompute.full, 2)] * 4)
    assert [(r.kind, r.num_layers) for r in two.recompute_per_stage] == [
        (Recompute.full, None if len(r) == 2 else 2) for r in sm.rank_layers(chunks)]


def test_a_single_grouped_kernel_launches_once_per_linear():
    """Kernel launches of an MoE block: one per local expert GEMM on Transformer Engine's streams, one per grouped
    linear (up, down) where one kernel holds every local expert: 2·(E/ep - 1) fewer."""
    from planner.cost.layer import MicroBatch, forward_kernel_count

    model, tr = get_preset("qwen3-30b-a3b"), TrainingConfig(global_batch_size=64, seq_length=4096)
    lay = ParallelLayout(ep=8, dp_shard=8)
    mb = MicroBatch.of(lay, tr)
    assert (forward_kernel_count(model, True, mb, lay, 4) - forward_kernel_count(model, True, mb, lay, ONE_KERNEL)
            == 2 * (128 // 8 - 1))
    # four streams covering four local experts (Mixtral, ep = 2) still launch one GEMM per expert
    mixtral, lay2 = get_preset("mixtral-8x7b"), ParallelLayout(ep=2, dp_shard=8)
    mb2 = MicroBatch.of(lay2, tr)
    assert (forward_kernel_count(mixtral, True, mb2, lay2, 4) - forward_kernel_count(mixtral, True, mb2, lay2, 1)
            == 0)
    assert (forward_kernel_count(mixtral, True, mb2, lay2, 4)
            - forward_kernel_count(mixtral, True, mb2, lay2, ONE_KERNEL) == 2 * (8 // 2 - 1))


def test_expert_gemms_are_the_only_step_difference_an_moe_target_makes():
    """Qwen3-30B-A3B on one H100 node, pp = 1: autopar's step is Megatron's on the profile with one grouped kernel,
    and its routed expert GEMMs are the grouped kernel's price: every local expert's GEMMs in one round."""
    from planner.cost.compute import grouped_gemm_time_s
    from planner.cost.layer import MicroBatch, routed_expert_gemms

    model, prof = get_preset("qwen3-30b-a3b"), reference_profile("dgx-h100", 1)
    tr, lay = TrainingConfig(global_batch_size=64, seq_length=4096), ParallelLayout(dp_shard=8, zero_stage=1)
    ap = predict(model, tr, prof, lay, target="autopar")
    assert ap.step_time_s == predict(model, tr, priced_profile(prof, "autopar"), lay, target="megatron").step_time_s
    assert ap.step_time_s < predict(model, tr, prof, lay, target="megatron").step_time_s
    mb, moe = MicroBatch.of(lay, tr), model.moe
    rows = 4096 * 8 // 128  # a micro-batch's 4096 tokens, top-8, over all 128 experts on every rank (ep = 1)
    fwd = routed_expert_gemms(priced_profile(prof, "autopar"), model, moe, mb, 1)[0]
    one = sum(grouped_gemm_time_s(prof, rows, n, k, mb.precision, 128, 128, GemmLayout.nt)
              for n, k in ((2 * 768, 2048), (2048, 768)))
    assert fwd == pytest.approx(one, rel=1e-12)


# ------------------------------------------------------------------ the search's stage model == predict
STAGE_CASES = [
    ("llama3-8b", "dgx-h100", 2, dict(tp=2, sp=True, pp=4, dp_shard=2, zero_stage=1), 64),
    ("llama3-8b", "dgx-h100", 2, dict(tp=2, pp=2, dp_shard=4, zero_stage=0, pp_scatter_gather=False), 64),
    ("llama3-8b", "dgx-a100-80gb", 2, dict(tp=1, pp=4, dp_shard=4, zero_stage=3), 64),
    ("llama3-8b", "dgx-a100-80gb", 1, dict(dp_shard=8, zero_stage=2), 8),  # one micro-batch a step
    ("qwen3-30b-a3b", "dgx-h100", 2, dict(tp=2, sp=True, ep=8, dp_shard=8, zero_stage=1), 64),  # expert GEMMs
]


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("name,system,nodes,layout,gbs", STAGE_CASES)
def test_stage_model_equals_predict_for_every_target(target, name, system, nodes, layout, gbs):
    model, prof = get_preset(name), reference_profile(system, nodes)
    tr = TrainingConfig(global_batch_size=gbs, seq_length=4096)
    sm = StageModel(model, tr, prof, ParallelLayout(**layout), target=target)
    for chunks, rec in random_splits(sm, random.Random(11), 6):
        step, terms = sm.evaluate(chunks, rec)
        pred = predict(model, tr, prof, sm.layout_for(chunks, rec), target=target)
        assert step == pytest.approx(pred.step_time_s, rel=1e-12)
        assert max(t.memory_bytes for t in terms) == pytest.approx(pred.memory.total_bytes, rel=1e-9)


# ------------------------------------------------------------------ the torch losses, measured
def test_measured_torch_losses_match_the_facts(node):
    """benchmarks/loss_memory.py measures the losses with torch's profiler on the CPU (a one-rank group for
    the tensor-parallel ones): torchtitan 0.3.0's four cases are its facts, and the executor's loss with
    the logits kept (its pipeline schedule keeps them) is the profile's measured default."""
    pytest.importorskip("torchtitan")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/loss_memory.py"), "--tokens", "1024", "--vocab",
                          "8000", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    titan = target_facts("torchtitan").loss
    assert got["torchtitan"] == pytest.approx(titan(ParallelLayout()), abs=0.05)
    assert got["torchtitan/kept"] == pytest.approx(titan(ParallelLayout(pp=2)), abs=0.05)
    assert got["torchtitan_tp"] == pytest.approx(titan(ParallelLayout(tp=2, sp=True)), abs=0.05)
    assert got["torchtitan_tp/kept"] == pytest.approx(titan(ParallelLayout(tp=2, sp=True, pp=2)), abs=0.05)
    for case in ("torch/kept", "torch_loss_parallel", "torch_loss_parallel/kept"):
        assert got[case] == pytest.approx(node.assumptions.loss_bytes_per_logit, abs=0.05), case


# ------------------------------------------------------------------ validate: each row's target
@pytest.mark.parametrize("framework,target,stated", [
    ("NeMo / Megatron-Bridge + Megatron-Core", "megatron", False),
    ("Megatron-LM (PTD-P), interleaved 1F1B + scatter/gather optimization", "megatron", False),
    ("Megatron-DeepSpeed (bigscience fork) + DeepSpeed, PyTorch 1.11, CUDA 11.5", "deepspeed", False),
    ("Megatron-LM + DeepSpeed (3D parallelism)", "deepspeed", False),
    ("torchtitan (FSDP2)", "torchtitan", False),
    ("Composer + PyTorch FSDP (llm-foundry)", "torchtitan", True),
    ("Meta internal 4D parallelism [TP,CP,PP,DP(FSDP)] ordering", "torchtitan", True),
    ("HAI-LLM (DeepSeek internal)", "megatron", True),
])
def test_each_framework_runs_with_a_target(framework, target, stated):
    from planner.validate import framework_target

    defaults: list[str] = []
    mcore = "Megatron-Core" in framework or "NeMo" in framework
    assert framework_target({"framework": framework}, "PTD-P" in framework, mcore, defaults) == target
    assert bool(defaults) is stated and (not stated or f"target facts={target}" in defaults[0])


def test_published_rows_price_the_sends_their_framework_does():
    from planner.validate import PUBLISHED_RUNS, build_cases, load_rows

    cases, _ = build_cases(load_rows(PUBLISHED_RUNS))
    assert {c.target for c in cases} == {"megatron", "deepspeed", "torchtitan"}
    piped = [c for c in cases if c.layout.pp > 1 and c.layout.tp > 1]
    assert piped
    for c in piped:
        note = next(d for d in c.defaults if d.startswith("pp_scatter_gather="))
        if "2021-22" in note:  # Megatron-LM's scatter/gather optimisation of the time
            assert c.layout.pp_scatter_gather and c.target == "megatron"
            continue
        assert c.layout.pp_scatter_gather is planned_scatter_gather(c.target, c.model, c.layout.sp), c.run_id
        job = Job(c.model, c.training, c.layout)
        row = next(limit for limit in TARGETS[Target(c.target)].limits if limit.feature == SENDS_ROW)
        assert not row.refuses(job), c.run_id
    assert any(c.target == "deepspeed" and c.layout.pp_scatter_gather for c in piped)  # pipe_partitioned


def test_a_compiled_search_is_torchtitans_and_refused_elsewhere():
    """SearchOptions.compile: torchtitan's plans carry it (their loss priced compiled); a target that compiles
    nothing refuses the request at once, naming the field."""
    from planner.errors import AutoparError
    from planner.search.engine import search

    prof, tr = reference_profile("dgx-h100", 1), TrainingConfig(global_batch_size=64, seq_length=4096)
    plan = search(get_preset("llama3-8b"), tr, prof, SearchOptions(target="torchtitan", compile=True, top_k=2))
    assert plan.layout.compile and all(a.layout.compile for a in plan.alternatives)
    assert loss_bytes_per_logit("torchtitan", plan.layout, 14.0) == 4.0  # what predict and the search price
    for target in ("autopar", "megatron", "deepspeed"):
        with pytest.raises(AutoparError) as info:
            search(get_preset("llama3-8b"), tr, prof, SearchOptions(target=target, compile=True))
        assert info.value.field == "layout.compile", target
