"""The planner's search: its decomposition equals predict, CP-SAT and the whole search equal brute force,
the divisibility rules, memory-infeasible cases, and the plan / explain / export commands."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys

import pytest

from planner.contracts import LinkLevel, ParallelLayout, Plan, Recompute, Schedule, TrainingConfig
from planner.cost.checks import check_layout
from planner.cost.predict import predict
from planner.errors import AutoparError
from planner.presets import get_preset
from planner.reference import reference_profile
from planner.search import SearchOptions, search
from planner.search.bound import leaf_bound, min_max_stage
from planner.search.brute import brute_force_search, brute_force_stages, compositions
from planner.search.cpsat import solve_stages
from planner.search.enumerate import structures
from planner.search.price import price_structure
from planner.search.rules import Rule, Rules
from planner.search.stages import LeafComm, StageModel, floor_states, memory_minmax_s, recompute_bound_s


def small(name: str, layers: int):  # noqa: ANN201
    """A preset cut to ``layers`` blocks (MoE presets keep at most 2 leading dense blocks)."""
    m = get_preset(name)
    update: dict = {"num_layers": layers}
    if m.moe is not None:
        update["moe"] = m.moe.model_copy(update={"first_dense_layers": min(m.moe.first_dense_layers, 2)})
    return m.model_copy(update=update)


# ------------------------------------------------------------------ decomposition == predict
DECOMPOSITION_CASES = [
    ("llama3-8b", "dgx-h100", 2, dict(tp=2, pp=4, dp_shard=2, zero_stage=1, sp=True), 64, 4096),
    ("llama3-8b", "dgx-h100", 2, dict(tp=2, pp=4, dp_shard=2, zero_stage=3, schedule=Schedule.interleaved_1f1b,
                                      virtual_stages=2), 64, 4096),
    ("llama3-8b", "dgx-a100-80gb", 2, dict(tp=1, pp=4, dp_shard=4, zero_stage=2, schedule=Schedule.zero_bubble),
     64, 4096),
    ("mixtral-8x7b", "dgx-h100", 4, dict(tp=2, pp=4, dp_shard=4, ep=4, zero_stage=1, offload_optimizer=True), 64, 4096),
    ("deepseek-v3", "dgx-h100", 16, dict(tp=1, pp=8, dp_shard=16, ep=16, zero_stage=1,
                                         schedule=Schedule.interleaved_1f1b, virtual_stages=2), 256, 4096),
    ("gpt3-175b", "dgx-a100-80gb", 16, dict(tp=8, pp=8, dp_replicate=2, zero_stage=0, schedule=Schedule.gpipe),
     64, 2048),
    # MoE parallel folding: experts on ep x etp of the dp x cp x tp ranks (etp < tp)
    ("qwen3-30b-a3b", "dgx-h100", 2, dict(tp=4, sp=True, pp=2, dp_shard=2, ep=8, etp=1, zero_stage=1), 64, 4096),
    ("mixtral-8x7b", "dgx-h100", 4, dict(tp=4, sp=True, pp=4, dp_shard=2, ep=4, etp=2, zero_stage=1,
                                         ep_comm_overlap=True), 64, 4096),
    ("deepseek-v3", "dgx-h100", 16, dict(tp=2, sp=True, pp=8, dp_shard=8, ep=16, etp=1, zero_stage=1,
                                         schedule=Schedule.interleaved_1f1b, virtual_stages=2), 256, 4096),
    # the V schedules: rank 0 holds the first and the last chunk (the embedding and the head)
    ("llama3-8b", "dgx-h100", 2, dict(tp=2, pp=4, dp_shard=2, zero_stage=3, schedule=Schedule.zero_bubble_v,
                                      virtual_stages=2), 64, 4096),
    ("deepseek-v3", "dgx-h100", 16, dict(tp=1, pp=8, dp_shard=16, ep=16, zero_stage=1,
                                         schedule=Schedule.dualpipe_v, virtual_stages=2), 256, 4096),
]


def random_splits(sm: StageModel, rng: random.Random, count: int):  # noqa: ANN201 - yields (chunks, recompute)
    """``count`` random layer splits of ``sm``'s (virtual) stages, each with a random recompute kind and
    layer count per pipeline rank."""
    n, layers_total = sm.p * sm.v, sm.model.num_layers
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, layers_total), n - 1))
        chunks = [b - a for a, b in zip([0, *cuts], [*cuts, layers_total])]
        rec = []
        for layers in sm.rank_layers(chunks):
            kind = rng.choice(list(Recompute))
            rec.append((kind, 0 if kind is Recompute.none else rng.randint(0, len(layers))))
        yield chunks, rec


@pytest.mark.parametrize("name,system,nodes,layout,gbs,seq", DECOMPOSITION_CASES)
def test_stage_model_equals_predict_on_random_splits(name, system, nodes, layout, gbs, seq):  # noqa: ANN001
    """Every split and per-stage recompute the search prices must cost exactly what predict says."""
    model, prof = get_preset(name), reference_profile(system, nodes)
    tr = TrainingConfig(global_batch_size=gbs, seq_length=seq)
    sm = StageModel(model, tr, prof, ParallelLayout(**layout))
    for chunks, rec in random_splits(sm, random.Random(7), 12):
        step, terms = sm.evaluate(chunks, rec)
        pred = predict(model, tr, prof, sm.layout_for(chunks, rec))
        assert step == pytest.approx(pred.step_time_s, rel=1e-12)
        assert max(t.memory_bytes for t in terms) == pytest.approx(pred.memory.total_bytes, rel=1e-9)
        assert sm.fits(terms) == pred.memory.fits


# ------------------------------------------------------------------ CP-SAT == brute force per candidate
CPSAT_CASES = [
    ("llama3-8b", 8, "dgx-h100", 1, dict(tp=2, pp=4, zero_stage=1), 32, 4096),
    ("llama3-8b", 8, "dgx-h100", 1, dict(tp=1, pp=4, dp_shard=2, zero_stage=3, schedule=Schedule.zero_bubble),
     32, 4096),
    ("llama3-70b", 8, "dgx-a100-40gb", 1, dict(tp=2, pp=2, dp_shard=2, zero_stage=1,
                                                 schedule=Schedule.interleaved_1f1b, virtual_stages=2), 32, 4096),
    ("deepseek-v3", 6, "dgx-h100", 2, dict(tp=1, pp=2, dp_shard=8, ep=8, zero_stage=2), 32, 4096),
    ("llama3-70b", 12, "dgx-a100-40gb", 2, dict(tp=4, pp=4, zero_stage=0), 64, 4096),
    ("gpt3-175b", 8, "dgx-a100-40gb", 1, dict(tp=1, pp=8, zero_stage=0), 16, 2048),
    ("gpt3-175b", 8, "dgx-a100-80gb", 1, dict(tp=2, pp=4, zero_stage=1, schedule=Schedule.gpipe), 8, 2048),
    ("mixtral-8x7b", 6, "dgx-a100-40gb", 1, dict(tp=2, pp=2, dp_shard=2, ep=2, zero_stage=1, offload_optimizer=True),
     16, 4096),
    # two block kinds (dense prefix, then MoE) under zero-bubble: the F* term of the objective
    ("deepseek-v3", 7, "dgx-h100", 4, dict(tp=1, pp=4, dp_shard=8, ep=8, zero_stage=2, schedule=Schedule.zero_bubble),
     32, 4096),
    # the V schedules' objectives (the slowest rank's term left out) and placement, one and two block kinds
    ("llama3-8b", 8, "dgx-h100", 1, dict(tp=1, pp=2, dp_shard=4, zero_stage=1, schedule=Schedule.zero_bubble_v,
                                         virtual_stages=2), 32, 4096),
    ("deepseek-v3", 7, "dgx-h100", 4, dict(tp=1, pp=2, dp_shard=16, ep=8, zero_stage=2, schedule=Schedule.dualpipe_v,
                                           virtual_stages=2), 32, 4096),
    ("deepseek-v3", 7, "dgx-h100", 4, dict(tp=1, pp=2, dp_shard=16, ep=8, zero_stage=2, schedule=Schedule.zero_bubble_v,
                                           virtual_stages=2), 32, 4096),
]


@pytest.mark.parametrize("name,layers,system,nodes,layout,gbs,seq", CPSAT_CASES)
def test_cpsat_split_equals_brute_force(name, layers, system, nodes, layout, gbs, seq):  # noqa: ANN001
    model, prof = small(name, layers), reference_profile(system, nodes)
    tr = TrainingConfig(global_batch_size=gbs, seq_length=seq)
    sm = StageModel(model, tr, prof, ParallelLayout(**layout))
    brute = brute_force_stages(sm)
    sol = solve_stages(sm, time_limit_s=20)
    if brute is None:
        assert sol.status == "INFEASIBLE"
        return
    assert sol.status == "OPTIMAL"
    value = sm.evaluate(sol.chunks, sol.recompute)[0]
    assert value == pytest.approx(brute[0], rel=1e-6)
    pred = predict(model, tr, prof, sm.layout_for(sol.chunks, sol.recompute))
    assert pred.memory.fits
    assert pred.step_time_s == pytest.approx(value, rel=1e-12)


def test_cpsat_moves_layers_off_the_head_stage():
    """A 2-stage pipeline of 8 equal layers: the LM head makes the last stage slower, so the optimum
    gives it fewer layers than the first (uneven split, found by CP-SAT, not the default one)."""
    model = small("llama3-8b", 8)
    prof = reference_profile("dgx-h100", 1)
    tr = TrainingConfig(global_batch_size=32, seq_length=4096)
    sm = StageModel(model, tr, prof, ParallelLayout(tp=2, pp=4, zero_stage=1))
    sol = solve_stages(sm)
    assert sol.status == "OPTIMAL"
    assert sol.chunks != sm.default_chunks()
    assert sol.chunks[-1] < max(sol.chunks)
    assert sm.evaluate(sol.chunks, sol.recompute)[0] < sm.greedy(sm.default_chunks())[0]


def test_cpsat_reports_infeasible_when_nothing_fits():
    model = small("gpt3-175b", 8)
    prof = reference_profile("dgx-a100-40gb", 1)
    tr = TrainingConfig(global_batch_size=8, seq_length=2048)
    sm = StageModel(model, tr, prof, ParallelLayout(tp=1, pp=2, dp_shard=4, zero_stage=0))
    assert brute_force_stages(sm) is None
    assert solve_stages(sm).status == "INFEASIBLE"


def test_compositions_counts():
    assert len(list(compositions(8, 4))) == 35  # C(7, 3)
    assert all(sum(c) == 8 and min(c) >= 1 for c in compositions(8, 4))


# ------------------------------------------------------------------ whole search == brute force
BRUTE_OPTS = dict(max_micro_batch_size=2, max_virtual_stages=2, zero_stages=(0, 1), hsdp=False, offload=False)
SEARCH_CASES = [
    # GPT-3's learned positions are not the built-in decoder's: planned for Megatron-LM (one recompute choice
    # for every stage, which CP-SAT and the brute force both hold to)
    ("gpt3-175b", 8, "dgx-a100-80gb", 1, 8, 2048, dict(max_tp=1, target="megatron")),  # memory forces a pipeline
    ("gpt3-175b", 6, "dgx-a100-40gb", 1, 8, 2048, dict(target="megatron")),
    ("llama3-70b", 8, "dgx-a100-40gb", 1, 16, 4096, dict(max_tp=2, target="megatron")),
    # for autopar, which runs no ZeRO-1 with TP, zero-bubble pp4 leaves decide (CP-SAT stopped at FEASIBLE on
    # them while the search gave it a solution hint)
    ("llama3-70b", 8, "dgx-a100-40gb", 1, 16, 4096, dict(max_tp=2)),
    ("mixtral-8x7b", 6, "dgx-a100-40gb", 1, 16, 4096, {}),
    ("llama3-8b", 8, "dgx-h100", 1, 16, 4096, dict(zero_stages=(0, 1, 3), max_tp=2)),
    # MoE parallel folding wins: tp=4/8 for long sequences, experts on ep=8 x etp=1 of the tp x dp ranks
    ("mixtral-8x7b", 4, "dgx-a100-40gb", 1, 16, 32768, dict(target="megatron", max_cp=1)),
    ("mixtral-8x7b", 8, "dgx-a100-40gb", 1, 8, 16384, dict(target="megatron", max_cp=1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,layers,system,nodes,gbs,seq,extra", SEARCH_CASES)
def test_search_equals_exhaustive_brute_force(name, layers, system, nodes, gbs, seq, extra):  # noqa: ANN001
    model, prof = small(name, layers), reference_profile(system, nodes)
    tr = TrainingConfig(global_batch_size=gbs, seq_length=seq)
    opts = SearchOptions(**{**BRUTE_OPTS, **extra})
    plan = search(model, tr, prof, opts)
    brute = brute_force_search(model, tr, prof, opts)
    assert brute is not None
    assert plan.prediction.step_time_s == pytest.approx(brute[0], rel=1e-6)
    assert plan.prediction.memory.fits
    assert plan.solver_status and plan.solver_status.startswith("OPTIMAL")


def test_search_folds_experts_over_tensor_ranks_where_faster():
    """Long sequences need tp=4 on a 40 GB A100 node; the experts then run ep=8 x etp=1 over the
    dp=2 x tp=4 ranks (more experts per group than dp x cp = 2 would allow, their all-to-all inside the
    node, no TP collectives around them): faster than the same layout with the experts TP-split."""
    model, prof = small("mixtral-8x7b", 4), reference_profile("dgx-a100-40gb", 1)
    tr = TrainingConfig(global_batch_size=16, seq_length=32768)
    plan = search(model, tr, prof, SearchOptions(**{**BRUTE_OPTS, "target": "megatron", "max_cp": 1}))
    lay = plan.layout
    assert lay.tp == 4 and lay.etp == 1 and lay.ep == 8 and lay.ep * lay.etp > lay.dp_shard * lay.cp
    assert plan.search.removed_by_rule[Rule.FOLD.message()] > 0
    unfolded = predict(model, tr, prof, lay.model_copy(update={"etp": None, "ep": lay.dp_shard * lay.cp}))
    assert unfolded.step_time_s > plan.prediction.step_time_s * 1.01


def test_search_uses_pipeline_and_uneven_split_when_memory_forces_it():
    model, prof = small("gpt3-175b", 8), reference_profile("dgx-a100-80gb", 1)
    tr = TrainingConfig(global_batch_size=8, seq_length=2048)
    plan = search(model, tr, prof, SearchOptions(**{**BRUTE_OPTS, "max_tp": 1, "target": "megatron"}))
    assert plan.layout.pp > 1
    assert plan.prediction.memory.fits
    assert plan.search.solved + plan.search.closed_without_solver >= 1


# ------------------------------------------------------------------ rules
def test_divisibility_rules_remove_and_name_candidates():
    model = get_preset("llama3-70b")  # 64 heads, 8 kv heads, 80 layers
    prof = reference_profile("dgx-h100", 4)  # 32 GPUs
    tr = TrainingConfig(global_batch_size=48, seq_length=4096)
    rules = Rules()
    found = structures(model, tr, prof, SearchOptions(max_micro_batch_size=4), rules)
    assert found
    for st in found:
        layout = ParallelLayout(tp=st.tp, sp=st.sp, cp=st.cp, pp=st.pp, dp_shard=st.dp, micro_batch_size=st.mb)
        check_layout(model, tr, layout, prof.num_gpus)  # every surviving structure is a valid layout
        assert st.tp <= prof.gpus_per_node and 48 % (st.dp * st.mb) == 0
    assert rules.by_rule[Rule.TP_PER_NODE] > 0
    assert rules.by_rule[Rule.DP_BATCH] > 0  # dp=32 does not divide 48
    assert Rule.MAX_MICRO_BATCH.message(limit=4) in rules.counts
    assert "dp=" in rules.examples["dp must divide global_batch_size"]


def test_head_and_expert_rules():
    model = get_preset("mixtral-8x7b")  # 32 heads, 8 kv heads, 8 experts
    prof = reference_profile("dgx-h100", 2)
    tr = TrainingConfig(global_batch_size=16, seq_length=4096)
    rules = Rules()
    found = structures(model, tr, prof, SearchOptions(max_tp=16), rules)
    # ep x etp folds over the dp x cp x tp ranks; etp = tp (None) is ep dividing dp x cp; etp < tp needs SP
    assert all(8 % st.ep == 0 and st.tp % st.expert_tp == 0 and (st.dp * st.cp * st.tp) % (st.ep * st.expert_tp) == 0
               for st in found)
    assert all((st.dp * st.cp) % st.ep == 0 for st in found if st.etp is None)
    assert all(st.sp and st.etp < st.tp for st in found if st.etp is not None)
    assert any(st.etp is not None and st.ep > st.dp * st.cp for st in found)  # folded over tensor ranks too
    assert rules.by_rule[Rule.TP_KV_HEADS] == 0  # powers of two all divide
    assert rules.by_rule[Rule.FOLD] > 0
    odd = get_preset("gpt3-6.7b")  # 32 heads
    odd = odd.model_copy(update={"num_attention_heads": 20, "num_kv_heads": 20, "hidden_size": 2560})
    rules2 = Rules()
    structures(odd, tr, reference_profile("dgx-h100", 2), SearchOptions(), rules2)
    assert rules2.by_rule[Rule.TP_HEADS] > 0  # tp=8 vs 20 heads
    assert rules2.examples["tp must divide num_attention_heads"] == "tp=8, heads=20"


def test_sequence_rules():
    model = get_preset("llama3-8b")
    tr = TrainingConfig(global_batch_size=8, seq_length=4098)  # 2·cp never divides it for cp > 1
    rules = Rules()
    found = structures(model, tr, reference_profile("dgx-h100", 1), SearchOptions(), rules)
    assert all(st.cp == 1 for st in found)
    assert rules.by_rule[Rule.CP_SEQ] > 0
    assert all(not st.sp or 4098 % st.tp == 0 for st in found)
    assert rules.by_rule[Rule.SP_SEQ] > 0


def test_min_max_stage_is_a_lower_bound_of_every_split():
    from planner.cost.layer import without_host  # the bound is tight for additive passes (no host wait)

    model, prof = small("llama3-8b", 10), without_host(reference_profile("dgx-h100", 1))
    tr = TrainingConfig(global_batch_size=32, seq_length=4096)
    st = next(s for s in structures(model, tr, prof, SearchOptions(), Rules()) if s.pp == 4 and s.tp == 2 and s.mb == 1)
    price_structure(st, model, tr, prof, SearchOptions(), {})
    bound = min_max_stage(st)
    sm = StageModel(model, tr, prof, ParallelLayout(tp=2, pp=4, zero_stage=0, sp=st.sp, cp=st.cp))
    best = min(max(t.forward_s + t.backward_s for t in sm.evaluate(c, [(Recompute.none, 0)] * 4)[1])
               for c in compositions(10, 4))
    assert bound <= best * (1 + 1e-9)
    assert bound >= best * 0.99  # and tight


@pytest.mark.parametrize("name,layers,pp,nodes",
                         [("llama3-8b", 7, 3, 3), ("gpt3-175b", 9, 2, 4), ("llama3-70b", 12, 8, 4)])
def test_uniform_min_max_stage_equals_every_split_minimum(name, layers, pp, nodes):  # noqa: ANN001
    """Equal layers take the closed form: it equals the best contiguous split's slowest stage (to 1e-9),
    never above it."""
    model, prof = small(name, layers), reference_profile("dgx-a100-80gb", nodes)
    tr = TrainingConfig(global_batch_size=96, seq_length=2048)
    found = [s for s in structures(model, tr, prof, SearchOptions(), Rules()) if s.pp == pp][:6]
    assert found
    for st in found:
        price_structure(st, model, tr, prof, SearchOptions(), {})
        assert len(set(st.layer_times)) == 1
        best = min(max(2 * st.p2p_s + n * st.layer_times[0]
                       + (st.emb_s if r == 0 else 0.0) + (st.head_s if r == pp - 1 else 0.0)
                       for r, n in enumerate(c)) for c in compositions(layers, pp))
        bound = min_max_stage(st)
        assert best * (1 - 1e-9) <= bound <= best


def test_shared_block_costs_equal_unshared_ones_for_every_expert_degree():
    """Dense blocks, activations and the embedding/head are memoised across expert-parallel degrees:
    a search-wide cache must give exactly what a fresh cache computes for each layout."""
    from planner.search.stages import shared_costs
    model, prof = small("deepseek-v3", 4), reference_profile("dgx-h100", 4)
    tr = TrainingConfig(global_batch_size=64, seq_length=4096)
    shared: dict = {}
    for ep, mb, tp in itertools.product((1, 2, 4, 8, 16), (1, 2), (1, 2)):
        lay = ParallelLayout(tp=tp, pp=2, dp_shard=16 // tp, ep=ep, micro_batch_size=mb)
        assert shared_costs(model, tr, prof, lay, shared) == shared_costs(model, tr, prof, lay, {})


def test_shared_block_costs_equal_unshared_ones_for_every_expert_tp_degree():
    """Folded layouts (etp < tp) share the search-wide cache with unfolded ones: it gives exactly what a
    fresh cache computes for each."""
    from planner.search.stages import shared_costs
    model, prof = small("qwen3-30b-a3b", 4), reference_profile("dgx-h100", 2)
    tr = TrainingConfig(global_batch_size=64, seq_length=4096)
    shared: dict = {}
    for etp, ep in itertools.product((None, 1, 2, 4), (1, 2, 4, 8, 16)):
        lay = ParallelLayout(tp=4, sp=True, pp=2, dp_shard=2, ep=ep, etp=etp)
        if lay.expert_fold_problem() is None:
            assert shared_costs(model, tr, prof, lay, shared) == shared_costs(model, tr, prof, lay, {})


@pytest.mark.parametrize("seq", [16384, 24576, 32768])
def test_memory_bound_is_a_lower_bound_of_every_fitting_split(seq):  # noqa: ANN001
    """memory_minmax_s never exceeds the slowest stage of any split and per-stage recompute that
    fits (and is inf exactly when none fits); the frugal leaf's bound without ZeRO-3 buffers holds
    for every ZeRO stage. Memory binds here: the bound is above the unconstrained best."""
    model, prof = small("mixtral-8x7b", 6), reference_profile("dgx-a100-40gb", 1)
    tr = TrainingConfig(global_batch_size=16, seq_length=seq)
    binding = 0
    for zero, offload in ((0, False), (1, False), (1, True), (3, False)):
        for sched, v in ((Schedule.one_f_one_b, 1), (Schedule.interleaved_1f1b, 2), (Schedule.zero_bubble, 1),
                         (Schedule.zero_bubble_v, 2)):
            lay = ParallelLayout(tp=1, pp=2, dp_shard=4, ep=4, zero_stage=zero, offload_optimizer=offload,
                                 schedule=sched, virtual_stages=v)
            sm = StageModel(model, tr, prof, lay)
            # the frugal leaf lowered to the least states of every ZeRO stage tried (pipelined ZeRO-3 holds its
            # gathered weights and unsharded gradients: not always the least)
            frugal = floor_states(StageModel(model, tr, prof, lay.model_copy(update={"zero_stage": 3,
                                                                                    "offload_optimizer": True})),
                                  (0, 1, 3), True)
            bound, frugal_bound = memory_minmax_s(sm), memory_minmax_s(frugal, gather_buffers=False)
            best = unconstrained = math.inf
            for chunks in compositions(6, 2 * v):
                ranks = sm.rank_layers(list(chunks))
                for rec in itertools.product(*[sm.stage_options(len(x)) for x in ranks]):
                    terms = sm.evaluate(list(chunks), list(rec))[1]
                    slowest = max(t.forward_s + t.backward_s for t in terms)
                    unconstrained = min(unconstrained, slowest)
                    if sm.fits(terms):
                        best = min(best, slowest)
            assert math.isinf(bound) == math.isinf(best)
            assert bound <= best * (1 + 1e-9) and frugal_bound <= best * (1 + 1e-9)
            binding += bound > unconstrained * 1.01
    assert binding >= 3


@pytest.mark.parametrize("name,layers", [("llama3-8b", 4), ("mixtral-8x7b", 4)])
def test_leaf_bound_with_exposed_zero_traffic_is_a_lower_bound_of_every_split(name, layers):  # noqa: ANN001
    """leaf_bound (per-micro-batch ZeRO-2/3 collectives partly exposed, ``max(F + (1-eff)C, C + (1-eff)F)``)
    never exceeds the step of any split and per-stage recompute, on a network slow enough that the
    collectives outlast the compute; and it binds (is above the bound that ignores them)."""
    model = small(name, layers)
    prof = reference_profile("dgx-a100-40gb", 2, nic_gbit_per_gpu=25)
    tr = TrainingConfig(global_batch_size=16, seq_length=4096)
    opts = SearchOptions()
    structs = [s for s in structures(model, tr, prof, opts, Rules()) if s.tp == 1 and s.cp == 1 and s.pp in (1, 2)
               and s.mb == 1 and s.ep in (1, 2)]
    cache: dict = {}
    binding = checked = per_mb_checked = 0
    for st in structs:
        price_structure(st, model, tr, prof, opts, cache)
        scheds = [(Schedule.one_f_one_b, 1)] + ([(Schedule.interleaved_1f1b, 2), (Schedule.zero_bubble, 1),
                                                 (Schedule.zero_bubble_v, 2), (Schedule.dualpipe_v, 2)]
                                                if st.pp > 1 else [])
        for (sched, v), zero, reshard, overlap, offload in itertools.product(scheds, (1, 2, 3), (True, False),
                                                                             (True, False), (False, True)):
            if (zero < 3 and not reshard) or (offload and zero == 2):
                continue
            lay = ParallelLayout(tp=1, pp=st.pp, dp_shard=st.dp, ep=st.ep, zero_stage=zero,
                                 reshard_after_forward=reshard, schedule=sched, virtual_stages=v, micro_batch_size=1,
                                 dp_comm_overlap=overlap, offload_optimizer=offload)
            sm = StageModel(model, tr, prof, lay, block_cache=cache)
            dense = sum(sm.kind_cost[k].dense_params for k in sm.kinds) + sm.emb_params + sm.head_params
            expert = sum(sm.kind_cost[k].expert_params for k in sm.kinds)
            comm = LeafComm.of(prof, tr, lambda lay=lay: lay, (zero, st.dp, 1, 1, 1, st.ep), offload, reshard, overlap,
                               dense / st.pp, expert / st.pp, {}, pp=st.pp)
            minmax = min_max_stage(st) if v == 1 else 0.0
            bound = leaf_bound(st, sched, v, minmax, recompute_bound_s(sm), comm)
            plain = leaf_bound(st, sched, v, minmax, recompute_bound_s(sm),
                               LeafComm(0.0, comm.replica_s, comm.gather_s if zero == 3 else 0.0, 0, False,
                                        comm.optimizer_s, comm.eff))
            best = math.inf
            for chunks in compositions(layers, st.pp * v):
                ranks = sm.rank_layers(list(chunks))
                for rec in itertools.product(*[sm.stage_options(len(x)) for x in ranks]):
                    val, terms = sm.evaluate(list(chunks), list(rec))
                    if sm.fits(terms):
                        best = min(best, val)
            if math.isinf(best):
                continue
            checked += 1
            assert bound <= best * (1 + 1e-9), (st, sched, v, zero, reshard, overlap, offload, bound, best)
            if zero >= 2:
                per_mb_checked += 1
                binding += bound > plain * 1.001
    assert checked >= 20 and binding >= per_mb_checked // 3


# ------------------------------------------------------------------ infeasible
def test_nothing_fits_names_the_shortfall_and_fixes():
    model = get_preset("llama3.1-405b")
    prof = reference_profile("dgx-a100-40gb", 1)
    tr = TrainingConfig(global_batch_size=8, seq_length=8192)
    with pytest.raises(AutoparError) as info:
        search(model, tr, prof, SearchOptions(offload=False))
    msg = str(info.value)
    assert "GiB" in msg and "has no layout" in msg
    assert "more GPUs" in msg and "offload" in msg and "recompute" in msg


def test_budget_spent_before_any_layout_is_not_reported_as_nothing_fits():
    model, prof = get_preset("llama3-8b"), reference_profile("dgx-h100", 1)
    tr = TrainingConfig(global_batch_size=32, seq_length=4096)
    with pytest.raises(AutoparError) as info:
        search(model, tr, prof, SearchOptions(time_budget_s=1e-9))
    assert info.value.field == "time_budget_s"
    assert "--time-budget" in str(info.value) and "has no layout" not in str(info.value)


# ------------------------------------------------------------------ plan contents
def test_plan_has_ranked_alternatives_and_explanations():
    model = get_preset("llama3-8b")
    prof = reference_profile("dgx-h100", 2)
    tr = TrainingConfig(global_batch_size=64, seq_length=4096)
    plan = search(model, tr, prof, SearchOptions(top_k=4))
    assert len(plan.alternatives) == 3
    times = [plan.prediction.step_time_s] + [a.prediction.step_time_s for a in plan.alternatives]
    assert times == sorted(times)
    for alt in plan.alternatives:
        assert alt.slower_by >= 0 and "step time" in alt.reason
    rep = plan.search
    assert rep.candidates_considered > rep.evaluated > 0
    assert rep.families[0].reason == "the chosen plan's structure"
    assert any("largest difference" in f.reason for f in rep.families[1:])
    again = Plan.model_validate_json(plan.model_dump_json())
    assert again == plan


# ------------------------------------------------------------------ CLI
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_plan_explain_export(tmp_path):  # noqa: ANN001
    out = tmp_path / "plan.json"
    r = run_cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "64",
                "--seq", "4096", "--top", "3", "--zero-stages", "1", "--no-hsdp", "--target", "megatron",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "Top 3 plans" in r.stdout and "Why the other structures lost" in r.stdout
    plan = Plan.model_validate_json(out.read_text())
    assert plan.layout.zero_stage == 1 and plan.layout.dp_replicate == 1
    r = run_cli("explain", str(out))
    assert r.returncode == 0 and "Top 3 plans" in r.stdout
    r = run_cli("export", str(out), "--to", "megatron", "--out-dir", str(tmp_path / "mlm"))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "mlm" / "megatron_args.sh").read_text()
    assert f"--tensor-model-parallel-size {plan.layout.tp}" in text
    r = run_cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "8", "--json", "--top", "2")
    assert r.returncode == 0
    assert json.loads(r.stdout)["search"]["evaluated"] > 0


def test_cli_plan_bad_input_is_one_line(tmp_path):  # noqa: ANN001
    r = run_cli("plan", "--model", "llama3-8b", "--global-batch", "8", "--zero-stages", "1,5")
    assert r.returncode == 2 and "--zero-stages" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("plan", "--model", "llama3-8b", "--global-batch", "8", "--schedules", "1f1b,dualpipe")
    assert r.returncode == 2 and "dualpipe" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": "1"}')
    r = run_cli("explain", str(bad))
    assert r.returncode == 2 and "not a valid Plan" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("plan", "--model", "llama3.1-405b", "--cluster", "dgx-a100-40gb", "--global-batch", "8",
                "--seq", "8192", "--no-offload")
    assert r.returncode == 2 and "GiB" in r.stderr and "Traceback" not in r.stderr


def test_equally_fast_plans_rank_the_smaller_memory_footprint_first():
    model, prof = small("llama3-8b", 8), reference_profile("dgx-h100", 1)
    # NVLink without latency or a bandwidth limit: the ZeRO stages' traffic costs nothing, so ZeRO-1/2/3
    # are equally fast (on a real link ZeRO-2/3's first gather and last reduce-scatter show)
    free = [x.model_copy(update={"alpha_s": 0.0, "busbw_bytes_per_s": 1e24}) if x.level is LinkLevel.intra_node else x
            for x in prof.links]
    prof = prof.model_copy(update={"links": free})
    tr = TrainingConfig(global_batch_size=64, seq_length=2048)
    plan = search(model, tr, prof, SearchOptions(top_k=8, max_tp=1, max_pp=1, max_cp=1))
    ties = [a for a in plan.alternatives if abs(a.prediction.step_time_s - plan.prediction.step_time_s)
            <= 1e-9 * plan.prediction.step_time_s]
    assert ties, "this instance has equally fast layouts (ZeRO stages whose traffic costs nothing)"
    for alt in ties:
        assert alt.prediction.memory.total_bytes >= plan.prediction.memory.total_bytes
        assert alt.reason.startswith("as fast, but needs")


def test_gemm_memo_is_scoped_to_the_search_and_changes_nothing():
    from planner.cost.compute import gemm_time_s
    from planner.cost.memo import _MEMO as _GEMM_MEMO
    from planner.cost.memo import memoised as memoised_gemms

    prof, other = reference_profile("dgx-h100", 1), reference_profile("dgx-a100-40gb", 1)
    plain = gemm_time_s(prof, 4096, 4096, 4096,
                        tr_precision := TrainingConfig(global_batch_size=1, seq_length=8).precision, 3)
    with memoised_gemms(prof):
        assert gemm_time_s(prof, 4096, 4096, 4096, tr_precision, 3) == plain
        assert gemm_time_s(prof, 4096, 4096, 4096, tr_precision, 3) == plain  # from the memo
        assert len(_GEMM_MEMO.get()[1]) == 1
        gemm_time_s(other, 4096, 4096, 4096, tr_precision)  # another profile is not memoised here
        assert len(_GEMM_MEMO.get()[1]) == 1
    assert _GEMM_MEMO.get() is None
    model = small("llama3-8b", 4)
    tr = TrainingConfig(global_batch_size=16, seq_length=2048)
    with_memo = search(model, tr, prof, SearchOptions(top_k=3))
    import planner.search.engine as engine

    without = engine._search(model, tr, prof, SearchOptions(top_k=3), None)
    assert [a.layout for a in with_memo.alternatives] == [a.layout for a in without.alternatives]
    assert with_memo.prediction.step_time_s == without.prediction.step_time_s


def test_profile_without_host_link_plans_without_offload_and_says_why():
    """A measured profile may lack host<->device links: offload is then no choice, not a crash."""
    profile = reference_profile("dgx-a100-80gb", 1)
    profile = profile.model_copy(update={"links": [x for x in profile.links if x.level is not LinkLevel.host_device]})
    model = get_preset("llama2-7b").model_copy(update={"num_layers": 4})
    plan = search(model, TrainingConfig(seq_length=1024, global_batch_size=16), profile)
    assert not plan.layout.offload_optimizer
    assert all(not a.layout.offload_optimizer for a in plan.alternatives)
    assert plan.search.removed_by_rule[Rule.OFFLOAD_LINK.message()] == 1


# ------------------------------------------------------------------ split bounds before CP-SAT
SPLIT_CASES = [  # (preset, layers, seq, pp) on 8 GPUs: memory binds at the longer sequences; deepseek: two block kinds
    ("mixtral-8x7b", 6, 16384, 2), ("mixtral-8x7b", 6, 32768, 4), ("mixtral-8x7b", 5, 24576, 2),
    ("deepseek-v3", 5, 8192, 2), ("deepseek-v3", 6, 16384, 4),
]


def _split_cases():
    for name, layers, seq, pp in SPLIT_CASES:
        model, prof = small(name, layers), reference_profile("dgx-a100-80gb", 1)
        tr = TrainingConfig(global_batch_size=16, seq_length=seq)
        dp = 8 // pp
        ep = min(4, dp) if model.moe is not None else 1
        for zero, offload, reshard in ((0, False, True), (1, False, True), (1, True, True), (2, False, True),
                                       (3, False, True), (3, False, False)):
            for sched, v in ((Schedule.one_f_one_b, 1), (Schedule.zero_bubble, 1), (Schedule.gpipe, 1),
                             (Schedule.interleaved_1f1b, 2), (Schedule.zero_bubble_v, 2), (Schedule.dualpipe_v, 2)):
                if v * pp <= layers:
                    yield StageModel(model, tr, prof, ParallelLayout(
                        tp=1, pp=pp, dp_shard=dp, ep=ep, zero_stage=zero, offload_optimizer=offload,
                        reshard_after_forward=reshard, schedule=sched, virtual_stages=v))


def test_split_bound_is_a_lower_bound_of_every_fitting_split():
    """SplitBound.minmax_s (contiguous) and holding_minmax_s (any holding, interleaved included) never
    exceed the slowest rank (f + b, exposed collectives included) of any split and per-stage
    recompute that fits, and two_rank_step_s never exceeds the
    step of any of them (interleaved included); both bind (are above the bounds the search had before)."""
    from planner.search.stages import SplitBound
    checked = deep = binding_minmax = binding_holding = binding_step = interleaved = 0
    for sm in _split_cases():
        n, p = len(sm.kinds), sm.p
        best_slowest = best_step = math.inf
        for chunks in compositions(n, p * sm.v):
            ranks = sm.rank_layers(list(chunks))
            for rec in itertools.product(*[sm.stage_options(len(x)) for x in ranks]):
                val, terms = sm.evaluate(list(chunks), list(rec))
                if sm.fits(terms):
                    best_slowest = min(best_slowest, max(t.forward_s + t.backward_s for t in terms))
                    best_step = min(best_step, val)
        bound = SplitBound(sm)
        if math.isinf(best_step):
            assert bound.two_rank_step_s(math.inf) == math.inf or p != 2
            continue
        checked += 1
        deep += p > 2
        known = memory_minmax_s(sm)
        # (hi: any slowest rank of a split that fits; above the best, so the bisection may reach past it)
        holding = SplitBound(sm).holding_minmax_s(known, 2 * best_slowest)
        assert known <= holding <= best_slowest * (1 + 1e-9)
        binding_holding += holding > known * (1 + 1e-6)
        if sm.v == 1:
            split = bound.minmax_s(known, 2 * best_slowest)
            assert holding * (1 - 1e-6) <= split <= best_slowest * (1 + 1e-9)
            binding_minmax += split > known * (1 + 1e-6)
        if p == 2:
            interleaved += sm.v > 1
            step = bound.two_rank_step_s(math.inf)
            assert step <= best_step * (1 + 1e-9), (sm.layout, step, best_step)
            # with a cutoff above the best step it must not claim that every split reaches it
            # (a fresh bound: its memo must not help)
            above = best_step * (1 + 1e-7)
            assert SplitBound(sm).two_rank_step_s(above) < above, (sm.layout, best_step)
            binding_step += step >= best_step * 0.98
    assert checked >= 30 and deep >= 10 and binding_minmax >= 5 and binding_holding >= 5 and binding_step >= 10 \
        and interleaved >= 5, (checked, deep, binding_minmax, binding_holding, binding_step, interleaved)


def test_search_settles_leaves_by_the_split_bound_without_changing_the_plan():
    """The split bound only skips CP-SAT proofs: the search still equals brute force on a case where
    pipelines with memory pressure reach CP-SAT."""
    model, prof = small("llama3-70b", 6), reference_profile("dgx-a100-40gb", 2, nic_gbit_per_gpu=25)
    tr = TrainingConfig(global_batch_size=16, seq_length=4096)
    opts = SearchOptions(max_micro_batch_size=2, max_virtual_stages=2, zero_stages=(0, 1, 3), hsdp=False, offload=False)
    plan = search(model, tr, prof, opts)
    brute = brute_force_search(model, tr, prof, opts)
    assert brute is not None
    assert plan.prediction.step_time_s == pytest.approx(brute[0], rel=1e-6)


@pytest.mark.parametrize("name,layers,system,pp", [("gpt3-175b", 5, "dgx-a100-80gb", 2),
                                                    ("gpt3-175b", 6, "dgx-a100-80gb", 4),
                                                    ("mixtral-8x7b", 5, "dgx-a100-40gb", 2)])
def test_leaf_bound_with_pigeonhole_tails_is_a_lower_bound_of_every_split(name, layers, system, pp):
    """leaf_bound with the tails of ranks holding ceil(blocks / p) blocks of a kind (pigeonhole_comms)
    and the split bound as the slowest rank never exceeds the step of any split and per-stage
    recompute that fits; on a slow network (large tails) it is above the average-stage bound."""
    from planner.search.bound import pigeonhole_comms
    from planner.search.stages import SplitBound
    model = small(name, layers)
    prof = reference_profile(system, 1, nic_gbit_per_gpu=25)
    tr = TrainingConfig(global_batch_size=16, seq_length=2048)
    opts = SearchOptions()
    structs = [s for s in structures(model, tr, prof, opts, Rules()) if s.tp == 1 and s.cp == 1 and s.pp == pp
               and s.mb == 1 and s.ep in (1, 2)]
    cache: dict = {}
    checked = binding = 0
    for st in structs:
        price_structure(st, model, tr, prof, opts, cache)
        scheds = [(Schedule.one_f_one_b, 1), (Schedule.zero_bubble, 1)]
        if pp * 2 <= layers and st.m % pp == 0:
            scheds.append((Schedule.interleaved_1f1b, 2))
        if pp * 2 <= layers:
            scheds += [(Schedule.zero_bubble_v, 2), (Schedule.dualpipe_v, 2)]
        for (sched, v), zero, offload in itertools.product(scheds, (0, 1, 3), (False, True)):
            if offload and zero == 0:
                continue
            lay = ParallelLayout(tp=1, pp=pp, dp_shard=st.dp, ep=st.ep, zero_stage=zero, schedule=sched,
                                 virtual_stages=v, micro_batch_size=1, offload_optimizer=offload)
            sm = StageModel(model, tr, prof, lay, block_cache=cache)
            dense = sum(sm.kind_cost[k].dense_params for k in sm.kinds) + sm.emb_params + sm.head_params
            expert = sum(sm.kind_cost[k].expert_params for k in sm.kinds)
            comm = LeafComm.of(prof, tr, lambda lay=lay: lay, (zero, st.dp, 1, 1, 1, st.ep), offload, True, True,
                               dense / pp, expert / pp, {}, pp=pp)
            best = best_slowest = math.inf
            for chunks in compositions(layers, pp * v):
                ranks = sm.rank_layers(list(chunks))
                for rec in itertools.product(*[sm.stage_options(len(x)) for x in ranks]):
                    val, terms = sm.evaluate(list(chunks), list(rec))
                    if sm.fits(terms):
                        best = min(best, val)
                        best_slowest = min(best_slowest, max(t.forward_s + t.backward_s for t in terms))
            if math.isinf(best):
                continue
            checked += 1
            split = SplitBound(sm)
            stage = split.minmax_s(0.0, 2 * best_slowest) if v == 1 else split.holding_minmax_s(0.0, 2 * best_slowest)
            rec_s = recompute_bound_s(sm)
            bound = leaf_bound(st, sched, v, stage, rec_s, comm, pigeonhole_comms(sm, {}))
            assert bound <= best * (1 + 1e-9), (st, sched, v, zero, offload, bound, best)
            binding += bound > leaf_bound(st, sched, v, stage, rec_s, comm) * (1 + 1e-6)
    assert checked >= 8 and binding >= 1, (checked, binding)


def test_stage_model_equals_predict_on_a_piecewise_measured_profile():
    """Links fitted in segments (LinkProfile.min_bytes/max_bytes): the data-parallel terms the search
    prices as alpha + slope x params are taken on the large-message segment, where a stage of a real
    model sends its gradients, so the decomposition still equals predict."""
    base = reference_profile("dgx-h100", 2)
    links = []
    for link in base.links:
        if link.level.value == "host_device":
            links.append(link)
            continue
        links.append(link.model_copy(update={"max_bytes": 64 << 20, "alpha_s": link.alpha_s * 0.5,
                                             "busbw_bytes_per_s": link.busbw_bytes_per_s * 0.6}))
        links.append(link.model_copy(update={"min_bytes": 64 << 20, "alpha_s": link.alpha_s * 3}))
    prof = base.model_copy(update={"links": links, "kind": "measured"})
    model, tr = get_preset("llama3-8b"), TrainingConfig(global_batch_size=64, seq_length=4096)
    for layout in (dict(tp=2, pp=4, dp_shard=2, zero_stage=1, sp=True), dict(tp=2, pp=4, dp_shard=2, zero_stage=3)):
        sm = StageModel(model, tr, prof, ParallelLayout(**layout))
        rng = random.Random(3)
        for _ in range(6):
            cuts = sorted(rng.sample(range(1, model.num_layers), sm.p - 1))
            chunks = [b - a for a, b in zip([0, *cuts], [*cuts, model.num_layers])]
            rec = [(Recompute.none, 0)] * sm.p
            step, _ = sm.evaluate(chunks, rec)
            assert step == pytest.approx(predict(model, tr, prof, sm.layout_for(chunks, rec)).step_time_s, rel=1e-12)


FLOOR_CASES = [
    ("deepseek-v3", 4, "dgx-h100", 4, 64, 4096, {}, {}),
    ("deepseek-v3", 4, "dgx-h100", 4, 64, 4096, dict(tp_comm_overlap=True, ep_comm_overlap=True), {}),
    ("mixtral-8x7b", 4, "dgx-h100", 2, 32, 4096, {}, dict(precision="fp8")),
    ("gpt3-175b", 6, "dgx-a100-80gb", 4, 96, 2048, dict(tp_comm_overlap=True), dict(flash_attention=False)),
    ("llama3-70b", 8, "dgx-a100-40gb", 4, 64, 4096, dict(pp_scatter_gather=False), {}),
    # a profile calibrated from runs: its factors below 1 must lower the floor too
    ("llama3-70b", 8, "dgx-a100-40gb", 4, 64, 4096, {}, {}, {"gemm": 0.3, "attention": 0.3, "tp": 0.3, "pp": 0.3}),
    ("mixtral-8x7b", 4, "dgx-h100", 2, 32, 4096, {}, {}, {"gemm": 0.5, "ep": 0.2, "tp": 2.0, "elementwise": 0.1}),
]


@pytest.mark.parametrize("case", FLOOR_CASES)
def test_structure_floor_is_a_lower_bound_of_every_structure_bound(case):  # noqa: ANN001
    """The search prices a structure's blocks only once its floor (structure_floor, from
    work_floor_s) is below the k-th best: the floor must never exceed the priced bound ``bound_s``
    (nor ``work_floor_s`` the priced ``work_s``) on any structure, and must not be vacuous."""
    from planner.contracts.cluster import RunCalibration, TermFactor
    from planner.search.bound import structure_floor
    from planner.search.stages import work_floor_s
    name, layers, system, nodes, gbs, seq, opts, train, *factors = case
    model, prof = small(name, layers), reference_profile(system, nodes)
    if factors:
        prof = prof.model_copy(update={"calibration": RunCalibration(
            factors={t: TermFactor(factor=f, low=f, high=f, runs=1) for t, f in factors[0].items()}, runs=["hand"],
            fitted_median_error=0.0, uncalibrated_median_error=0.0)})
    tr = TrainingConfig(global_batch_size=gbs, seq_length=seq, **train)
    o = SearchOptions(**opts)
    structs = structures(model, tr, prof, o, Rules())
    assert len(structs) > 20
    exact_cache: dict = {}
    floor_cache: dict = {}
    ratios = []
    for st in structs:
        price_structure(st, model, tr, prof, o, exact_cache)
        floor = structure_floor(st, model, tr, prof, o, floor_cache)
        work = work_floor_s(model, tr, prof, st.tp, st.sp, st.cp, st.ep, st.mb, o.tp_comm_overlap and st.tp > 1,
                            o.ep_comm_overlap and st.ep > 1, floor_cache, st.etp)
        assert work <= st.work_s, (st.family, st.mb, work, st.work_s)
        assert floor <= st.bound_s, (st.family, st.mb, floor, st.bound_s)
        ratios.append(floor / st.bound_s)
    assert max(ratios) > (0.8 if not factors else 0.2)  # GEMMs, attention and collectives: most of a block's time
    if model.moe is not None:  # folded structures (etp < tp) are among them, and bounded too
        assert any(st.etp is not None for st in structs)


def test_lazy_structure_pricing_prices_few_shapes_and_keeps_the_plan():
    """Structures are priced in bound order, lazily: the plan equals the one found when every
    structure's blocks are priced up front (the floor only skips work), with fewer shapes priced."""
    from planner.search import bound, engine
    model, prof = small("deepseek-v3", 6), reference_profile("dgx-h100", 4)
    tr = TrainingConfig(global_batch_size=64, seq_length=4096)
    calls = []
    real = engine.price_structure

    def counting(st, *a, **k):  # noqa: ANN001, ANN002, ANN003
        calls.append(st)
        return real(st, *a, **k)

    def exact_floor(st, model, training, profile, opts, cache):  # noqa: ANN001
        real(st, model, training, profile, opts, cache)
        return st.bound_s

    engine.price_structure = bound.price_structure = counting  # each module calls the name it imported
    try:
        lazy = search(model, tr, prof, SearchOptions(target="megatron"))  # MLA: not the built-in decoder's
        n_lazy = len(calls)
        floor = bound.structure_floor
        bound.structure_floor = exact_floor  # every structure priced up front, as before lazy pricing
        try:
            eager = search(model, tr, prof, SearchOptions(target="megatron"))
        finally:
            bound.structure_floor = floor
    finally:
        engine.price_structure = bound.price_structure = real
    assert lazy.layout == eager.layout
    assert lazy.prediction.step_time_s == eager.prediction.step_time_s
    assert [a.layout for a in lazy.alternatives] == [a.layout for a in eager.alternatives]
    assert (lazy.search.evaluated == eager.search.evaluated
            and lazy.search.pruned_by_bound == eager.search.pruned_by_bound)
    assert n_lazy < len(structures(model, tr, prof, SearchOptions(), Rules()))


def test_gc_is_relaxed_during_a_search_and_restored_after_the_last_one():
    """The search raises the collector's young-generation threshold while it runs (never switches it
    off); overlapping searches (the service's threads) keep it raised until the last one ends, and
    the caller's thresholds come back exactly."""
    import gc
    import threading

    from planner.search.engine import SEARCH_GC_GEN0, gc_relaxed

    before = gc.get_threshold()
    inside_a, release_a = threading.Event(), threading.Event()
    seen: dict[str, tuple] = {}

    def first() -> None:
        with gc_relaxed():
            seen["a"] = gc.get_threshold()
            inside_a.set()
            release_a.wait(5)

    t = threading.Thread(target=first)
    t.start()
    inside_a.wait(5)
    with gc_relaxed():
        seen["b"] = gc.get_threshold()
        release_a.set()
        t.join(5)
        seen["b_after_a_left"] = gc.get_threshold()
        assert gc.isenabled()
    raised = (max(before[0], SEARCH_GC_GEN0), *before[1:])
    assert seen == {"a": raised, "b": raised, "b_after_a_left": raised}
    assert gc.get_threshold() == before
    plan = search(small("llama3-8b", 4), TrainingConfig(global_batch_size=16, seq_length=2048),
                  reference_profile("dgx-h100", 1), SearchOptions(top_k=2))
    assert plan.layout is not None and gc.get_threshold() == before


@pytest.mark.parametrize("name,layers,system,nodes,gbs,seq", [
    ("deepseek-v3", 12, "dgx-h100", 16, 128, 8192),
    ("mixtral-8x7b", 16, "dgx-a100-40gb", 1, 16, 32768),
    ("llama3-70b", 16, "dgx-a100-80gb", 2, 64, 8192),
])
def test_interleaved_memory_floor_is_a_lower_bound_of_every_depth(name, layers, system, nodes, gbs, seq):  # noqa: ANN001
    """One memory bound stands for every interleaving depth of a structure (the search prunes all of
    them with it before pricing each): it never exceeds any depth's own frugal memory min-max, and
    it binds (memory forces more than the plain min-max stage on some structures)."""
    from planner.search.bound import interleaved_memory_floor
    from planner.search.enumerate import schedule_choices
    from planner.search.price import frugal_stage_model
    model, prof = small(name, layers), reference_profile(system, nodes)
    tr = TrainingConfig(global_batch_size=gbs, seq_length=seq)
    o = SearchOptions()
    cache: dict = {}
    checked = binding = seen = 0
    for st in structures(model, tr, prof, o, Rules()):
        depths = [v for s, v in schedule_choices(st, model, o, Rules()) if s is Schedule.interleaved_1f1b]
        if st.pp == 1 or len(depths) < 2:
            continue
        seen += 1
        if seen > 300:
            break
        price_structure(st, model, tr, prof, o, cache)
        floor = interleaved_memory_floor(model, tr, prof, st, o, Schedule.interleaved_1f1b, depths, cache)
        for v in depths:
            try:
                sm = frugal_stage_model(model, tr, prof, st, o, Schedule.interleaved_1f1b, v, cache)
            except AutoparError:
                continue
            own = memory_minmax_s(sm, 0.0, gather_buffers=False)
            assert floor <= own * (1 + 1e-12), (st.family, v, depths, floor, own)
            checked += 1
        if math.isfinite(floor) and floor > min_max_stage(st) * 1.01:
            binding += 1
    assert checked > 20 and binding > 0, (checked, binding)


# ------------------------------------------------------------------ targets
@pytest.mark.parametrize("target", ["autopar", "megatron", "deepspeed", "torchtitan"])
def test_search_returns_only_what_its_target_runs(target):  # noqa: ANN001
    """Every plan and alternative of a search for a target passes that target's whole capability table,
    and the plan records its target; the layouts a target refuses are counted under its rows."""
    from planner import targets

    model, prof = small("llama3-70b", 8), reference_profile("dgx-h100", 2)
    tr = TrainingConfig(global_batch_size=64, seq_length=8192)
    plan = search(model, tr, prof, SearchOptions(target=target, top_k=5, time_budget_s=30))
    assert plan.target == target
    for layout in [plan.layout, *(a.layout for a in plan.alternatives)]:
        m = tr.global_batch_seqs // (layout.dp * layout.micro_batch_size)
        assert targets.refusal(target, targets.Job(model, tr, layout, micro_batches=m)) is None, layout
    if target != "autopar":
        assert any(k.startswith(Rule.TARGET.message(target=target, feature="")) for k in plan.search.removed_by_rule)


def test_cpsat_holds_to_one_split_and_one_recompute_choice_when_asked():
    """A target that runs only the default split and one recompute choice on every stage (DeepSpeed):
    where the free solution splits unevenly and recomputes on the first rank alone, CP-SAT's restricted
    solution keeps the default split and the same kind and count on every rank, and is no faster."""
    model = small("llama3-8b", 16)
    prof = reference_profile("dgx-a100-40gb", 1)
    tr = TrainingConfig(global_batch_size=32, seq_length=16384)
    sm = StageModel(model, tr, prof, ParallelLayout(tp=2, pp=4, zero_stage=0))
    free = solve_stages(sm, time_limit_s=10)
    held = solve_stages(sm, even_split=True, uniform_recompute=True, time_limit_s=10)
    assert free.chunks != sm.default_chunks() and len(set(free.recompute)) > 1  # what the restriction removes
    assert held.status == "OPTIMAL" and held.chunks == sm.default_chunks()
    assert len(set(held.recompute)) == 1 and held.recompute[0][1] > 0
    assert held.objective_s >= free.objective_s * (1 - 1e-9)


def test_leaves_of_other_zero_stages_do_not_share_memory_bounds():
    """ZeRO-0 and ZeRO-2 over one shard rank hold the same states per parameter but not the same activations,
    fragmentation or buffers: a bound priced for one must not prune the other (the ZeRO-2 leaf, bounded
    first, used to answer 'nothing fits' for a ZeRO-0 plan that does)."""
    model = get_preset("llama3-8b").model_copy(update={"num_layers": 6})
    prof = reference_profile("dgx-a100-40gb", gpus=2)
    tr = TrainingConfig(global_batch_size=8, seq_length=8192)
    steps = []
    for zeros in ((0, 2), (2, 0)):
        opts = SearchOptions(zero_stages=zeros, offload=False, max_tp=1, max_micro_batch_size=1,
                             schedules=(Schedule.one_f_one_b,), max_virtual_stages=1)
        steps.append(search(model, tr, prof, opts).prediction.step_time_s)
        assert steps[-1] == pytest.approx(brute_force_search(model, tr, prof, opts)[0], rel=1e-6)
    assert steps[0] == steps[1]


@pytest.mark.parametrize(("target", "kind"), [("torchtitan", Recompute.op), ("autopar", Recompute.op),
                                              ("megatron", Recompute.full)])
def test_the_search_recomputes_per_op_where_the_target_runs_it(target, kind):  # noqa: ANN001
    """FSDP only (no TP, CP, PP), llama3-8b at 64 x 8192 on 8 H100: the activations do not fit without recompute;
    per-op SAC keeps wq, wv, w1, w2 and the attention output for ~37% more forward GEMMs, cheaper than full
    recompute of the layers it needs. Megatron-LM has no per-op SAC: full recompute of some layers there."""
    model, prof = get_preset("llama3-8b"), reference_profile("dgx-h100", 1)
    tr = TrainingConfig(global_batch_size=64, seq_length=8192)
    opts = SearchOptions(target=target, max_tp=1, max_cp=1, max_pp=1, offload=False, top_k=5, time_budget_s=30)
    plan = search(model, tr, prof, opts)
    lay = plan.layout
    used = {lay.recompute} if lay.recompute_per_stage is None else {s.kind for s in lay.recompute_per_stage}
    assert used == {kind}, lay.recompute_summary()
    layouts = [lay, *(a.layout for a in plan.alternatives)]
    kinds = {s.kind for x in layouts for s in (x.recompute_per_stage or [])} | {x.recompute for x in layouts}
    assert (Recompute.op in kinds) == (target != "megatron")
    again = predict(model, tr, prof, lay, target=target)
    assert again.step_time_s == pytest.approx(plan.prediction.step_time_s, rel=1e-9) and again.memory.fits


def test_cpsat_chooses_per_op_recompute_per_rank_and_predict_agrees():
    """A 1F1B pipeline whose first ranks hold more micro-batches: CP-SAT picks a kind and count per rank among
    the kinds the target admits (op included for autopar, not for Megatron-LM), and predict prices the
    chosen split and recompute at the objective."""
    model = small("llama3-8b", 16)
    prof = reference_profile("dgx-a100-40gb", 1)
    tr = TrainingConfig(global_batch_size=32, seq_length=16384)
    layout = ParallelLayout(tp=2, pp=4, zero_stage=0)
    mega = StageModel(model, tr, prof, layout, target="megatron")
    assert Recompute.op not in mega.recompute_kinds
    sm = StageModel(model, tr, prof, layout, target="autopar")
    assert sm.recompute_kinds == (Recompute.selective, Recompute.full, Recompute.op)
    sol = solve_stages(sm, time_limit_s=10)
    assert sol.status == "OPTIMAL" and any(k is Recompute.op for k, n in sol.recompute if n), sol.recompute
    mine = sm.layout_for(sol.chunks, sol.recompute)
    step = predict(model, tr, prof, mine).step_time_s
    assert step == pytest.approx(sol.objective_s, rel=1e-5)
    assert all(k is not Recompute.op for k, _ in solve_stages(mega, time_limit_s=10).recompute)
