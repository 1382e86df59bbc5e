"""MoE parallel folding (Liu et al. 2025, arXiv:2504.14960; Megatron-Core --expert-tensor-parallel-size):
attention on tp x cp x dp ranks, routed experts on the same ranks as etp x ep x edp (etp innermost).

Every expected value is arithmetic on the easy profile of tests/test_cost_terms_by_hand.py (100 TFLOP/s
bf16, 1e12 B/s HBM, efficiencies 1, 100 GB/s inside a node, 10 GB/s per GPU across nodes, alpha 0) and
its small MoE: h=1024, SwiGLU, 4 experts of FFN 512, top-2; a micro-batch of 2 x 1024 tokens (T = 2048).
"""

from __future__ import annotations

import pytest
from test_cost_terms_by_hand import easy_profile, llama, small_moe, train

from planner.contracts import LinkLevel, ParallelLayout, Precision, Recompute, TrainingConfig
from planner.cost.checks import check_layout
from planner.cost.comm import GroupPlacement, mesh_groups
from planner.cost.layer import MicroBatch, block_cost, expert_rows, forward_kernel_count, routed_expert_gemms
from planner.cost.memory import ActivationShape, layer_activation_bytes
from planner.cost.params import routed_expert_params
from planner.cost.predict import dp_traffic, expert_split, predict, stage_memory
from planner.errors import AutoparError


def mb(tp: int = 2, etp: int | None = None, sp: bool = True, batch: int = 2) -> MicroBatch:
    return MicroBatch(batch, 1024, 1, tp, sp, Precision.bf16, True, 1.0, etp)


def block(model, lay: ParallelLayout, profile=None):
    micro = MicroBatch.of(lay, TrainingConfig(seq_length=1024, global_batch_size=64), batch=2)
    return block_cost(profile or easy_profile(), model, 0, micro, lay, mesh_groups(lay, 8))


# ------------------------------------------------------------------ the layout's expert groups
class TestGroups:
    def test_expert_dp_group_size_and_stride(self):
        # tp=2, dp_shard=4 -> 8 ranks; ep=2 x etp=1 -> expert_dp = 8 / 2 = 4, ranks ep x etp = 2 apart
        lay = ParallelLayout(tp=2, sp=True, dp_shard=4, ep=2, etp=1)
        assert lay.expert_dp == 4
        groups = mesh_groups(lay, 8)
        assert groups["expert_dp"] == GroupPlacement(4, 4)  # stride 2 on an 8-GPU node: all 4 on it
        assert groups["ep"] == GroupPlacement(2, 2)  # stride etp = 1
        assert groups["etp"] == GroupPlacement(1, 1)

    def test_unfolded_groups_are_the_old_ones(self):
        # etp = tp = 2: EP over dp_shard x cp at stride tp, experts' dp = dp_shard x cp / ep
        lay = ParallelLayout(tp=2, sp=True, dp_shard=4, ep=2)
        assert lay.expert_dp == 2
        groups = mesh_groups(lay, 8)
        assert groups["ep"] == GroupPlacement(2, 2) and groups["expert_dp"] == GroupPlacement(2, 2)

    def test_folding_keeps_the_expert_all_to_all_on_the_node(self):
        # two nodes, tp=8, dp_shard=2. etp=1, ep=8: EP is 8 consecutive ranks (stride 1): one node.
        # Unfolded (etp=tp=8) ep can be at most dp_shard=2, its 2 ranks 8 apart: one per node.
        folded = mesh_groups(ParallelLayout(tp=8, sp=True, dp_shard=2, ep=8, etp=1), 8)
        assert folded["ep"] == GroupPlacement(8, 8) and folded["ep"].level is LinkLevel.intra_node
        assert folded["expert_dp"] == GroupPlacement(2, 1)  # stride 8: one per node
        plain = mesh_groups(ParallelLayout(tp=8, sp=True, dp_shard=2, ep=2), 8)
        assert plain["ep"] == GroupPlacement(2, 1) and plain["ep"].level is LinkLevel.inter_node

    def test_etp_group_is_consecutive_ranks(self):
        groups = mesh_groups(ParallelLayout(tp=4, sp=True, dp_shard=2, ep=4, etp=2), 8)
        assert groups["etp"] == GroupPlacement(2, 2)
        assert groups["ep"] == GroupPlacement(4, 4)  # stride 2: 4 of them on the node
        assert groups["expert_dp"] == GroupPlacement(1, 1)  # 8 ranks / (4 x 2)


# ------------------------------------------------------------------ parameters and rows per rank
def test_expert_parameters_per_rank():
    # 4 experts x SwiGLU 3 x 1024 x 512 = 6,291,456 routed parameters per layer
    model = small_moe()
    assert routed_expert_params(model) == 4 * 3 * 1024 * 512 == 6_291_456
    # split over ep x etp: tp=2, ep=4, etp=1 -> 4 ranks (1,572,864 each); unfolded tp=2 x ep=2 -> 4 too
    assert expert_split(ParallelLayout(tp=2, sp=True, dp_shard=2, ep=4, etp=1)) == 4
    assert expert_split(ParallelLayout(tp=2, sp=True, dp_shard=2, ep=2)) == 4
    assert expert_split(ParallelLayout(tp=4, sp=True, dp_shard=2, ep=2, etp=2)) == 4
    assert expert_split(ParallelLayout(tp=4, sp=True, dp_shard=2, ep=8, etp=1)) == 8


def test_routed_rows_per_rank():
    moe = small_moe().moe
    # T = 2048 tokens, top-2. SP splits them over tp=2: 1024 per rank, x2 copies = 2048 after the
    # all-to-all; etp=1 gathers nothing: 2048 rows = T*k*etp/(cp*tp) = 2048*2*1/2
    assert expert_rows(moe, mb(tp=2, etp=1)) == 2048
    # tp=4, etp=2: 512 tokens x2 = 1024 copies, all-gathered over 2 ranks: 2048 = 2048*2*2/4
    assert expert_rows(moe, mb(tp=4, etp=2)) == 2048
    # unfolded (etp = tp): T*k/cp = 4096, as before folding
    assert expert_rows(moe, mb(tp=2)) == 4096


def test_expert_gemms_per_rank():
    # folded tp=2, etp=1, ep=4: 1 local expert on 2048 rows at full width 512.
    #   up (gate+up): 2 * 2048 * 1024 * 1024 / 1e14 = 4.294967296e-5 s (its bytes 1.05e-5 s: compute-bound)
    #   down: 2 * 2048 * 1024 * 512 / 1e14 = 2.147483648e-5 s
    fwd = 4.294967296e-5 + 2.147483648e-5
    model = small_moe()
    assert routed_expert_gemms(easy_profile(), model, model.moe, mb(tp=2, etp=1), ep=4)[0] == pytest.approx(fwd)
    # unfolded tp=2, ep=2: 2 local experts, 4096 rows / 2 = 2048 each at width 256:
    #   up 2*2048*512*1024/1e14 = 2.147483648e-5, down 2*2048*1024*256/1e14 = 1.073741824e-5, x2 experts
    same = 2 * (2.147483648e-5 + 1.073741824e-5)
    assert routed_expert_gemms(easy_profile(), model, model.moe, mb(tp=2), ep=2)[0] == pytest.approx(same)
    assert fwd == pytest.approx(same)  # the same FLOPs, split otherwise


# ------------------------------------------------------------------ communication of one block
class TestBlockFolded:
    def test_all_to_all_bytes_and_group(self):
        # tp=2 +SP, dp_shard=2, ep=4, etp=1: a rank dispatches its 1024 tokens x2 copies x 1024 x 2 B =
        # 4,194,304 B over 4 consecutive ranks (stride etp=1, one node): 3/4 * 4,194,304 / 100e9 =
        # 3.145728e-5 s per all-to-all, dispatch + combine = 6.291456e-5 s per pass, all exposed; the
        # probabilities' 2048 x 4 B = 8,192 B: 3/4 * 8,192 / 100e9 = 6.144e-8 s; forward, the counts'
        # all-gather over ep x etp = 4 ranks: 4 experts x 8 B x 4 = 128 B, 3/4 * 128 / 100e9 = 9.6e-10 s
        bc = block(small_moe(), ParallelLayout(tp=2, sp=True, dp_shard=2, ep=4, etp=1))
        for pc, gather, meta in ((bc.forward, 9.6e-10, 128), (bc.backward, 0.0, 0)):
            assert pc.comm_bytes["ep"] == pytest.approx(2 * 4_194_304 + 8_192 + meta)
            assert pc.comm_s["ep"] == pytest.approx(6.291456e-5 + 6.144e-8 + gather)
            assert pc.exposed_comm_s["ep"] == pytest.approx(6.291456e-5 + 6.144e-8 + gather)

    def test_etp1_leaves_only_the_attention_tp_pair(self):
        # attention's all-gather + reduce-scatter of T x h x 2 B = 4,194,304 B over tp=2:
        # 1/2 * 4,194,304 / 100e9 = 2.097152e-5 s each: 4.194304e-5 s forward. Unfolded (etp = tp = 2) the
        # experts' own pair replaces the FFN's: the T*k/cp = 4096 routed rows x 1024 x 2 B = 8,388,608 B
        # all-gathered and reduce-scattered over tp=2, 4.194304e-5 s each
        folded = block(small_moe(), ParallelLayout(tp=2, sp=True, dp_shard=2, ep=4, etp=1))
        plain = block(small_moe(), ParallelLayout(tp=2, sp=True, dp_shard=2, ep=2))
        assert folded.forward.comm_s["tp"] == pytest.approx(4.194304e-5)
        assert folded.forward.comm_bytes["tp"] == pytest.approx(2 * 4_194_304)
        assert plain.forward.comm_s["tp"] == pytest.approx(4.194304e-5 + 2 * 4.194304e-5)
        assert plain.forward.comm_bytes["tp"] == pytest.approx(2 * 4_194_304 + 2 * 8_388_608)
        # backward: RS + AG + re-gather per pair = 3 * 2.097152e-5
        assert folded.backward.comm_s["tp"] == pytest.approx(3 * 2.097152e-5)
        assert folded.backward.comm_bytes["tp"] == pytest.approx(3 * 4_194_304)

    def test_etp_all_gather_bytes(self):
        # tp=4 +SP, dp_shard=1, ep=2, etp=2 (4 ranks = ep x etp): 2048 routed rows x 1024 x 2 B = 4,194,304 B
        # all-gathered (and reduce-scattered) over 2 consecutive ranks: 1/2 * 4,194,304 / 100e9 =
        # 2.097152e-5 s each -> 4.194304e-5 s per pass, exposed (no ep_comm_overlap).
        # attention pair over tp=4: 3/4 * 4,194,304 / 100e9 = 3.145728e-5 s each -> 6.291456e-5 s
        bc = block(small_moe(), ParallelLayout(tp=4, sp=True, dp_shard=1, ep=2, etp=2))
        assert bc.forward.comm_s["tp"] == pytest.approx(6.291456e-5 + 4.194304e-5)
        assert bc.forward.comm_bytes["tp"] == pytest.approx(2 * 4_194_304 + 2 * 4_194_304)
        assert bc.backward.comm_s["tp"] == pytest.approx(3 * 3.145728e-5 + 4.194304e-5)
        # the ETP pair is on the critical path: forward exposes all of it (the attention pair hides behind
        # nothing either: no tp_comm_overlap)
        assert bc.forward.exposed_comm_s["tp"] == pytest.approx(6.291456e-5 + 4.194304e-5)

    def test_shared_experts_keep_their_tp_pair(self):
        # a shared expert is a TP-split MLP on the attention's TP group: 2 pairs forward, as unfolded
        bc = block(small_moe(num_shared_experts=1), ParallelLayout(tp=2, sp=True, dp_shard=2, ep=4, etp=1))
        assert bc.forward.comm_s["tp"] == pytest.approx(2 * 4.194304e-5)

    def test_kernel_counts(self):
        # small MoE, ep=2, no TP: 25 kernels (tests/test_cost_terms_by_hand.py). Unfolded tp=2 +SP adds the
        # attention's 2 TP collectives and the experts' all-gather and reduce-scatter (29). With one local
        # expert (ep=4) its grouped GEMMs launch 2, not 4, and nothing is sorted by expert: 25 - 2 - 2 = 21;
        # folded etp=1 adds the attention's 2 (23); etp=2 of tp=4 also the experts' pair (25)
        model = small_moe()

        def count(**lay):
            layout = ParallelLayout(**lay)
            return forward_kernel_count(model, True, MicroBatch.of(layout, train()), layout)

        assert count(tp=2, sp=True, dp_shard=2, ep=2) == 29
        assert count(tp=2, sp=True, dp_shard=2, ep=4, etp=1) == 23
        assert count(tp=4, sp=True, dp_shard=2, ep=4, etp=2) == 25


# ------------------------------------------------------------------ data parallel and memory
class TestExpertDataParallel:
    def test_gradients_reduced_over_expert_dp(self):
        # tp=2, dp_shard=4, ep=2, etp=1, ZeRO-1; 1e9 dense, 0.5e9 expert params. Dense: 4 ranks stride 2:
        # RS 3/4 * 4e9 / 100e9 = 0.03, AG 3/4 * 2e9 / 100e9 = 0.015. Experts: expert_dp = 8/2 = 4 ranks,
        # stride ep x etp = 2 (on the node): RS 3/4 * 2e9 / 100e9 = 0.015, AG 3/4 * 1e9 / 100e9 = 0.0075
        lay = ParallelLayout(tp=2, sp=True, dp_shard=4, ep=2, etp=1, zero_stage=1)
        tr = dp_traffic(easy_profile(), lay, train(), 1e9, 0.5e9)
        assert tr.grad_s == pytest.approx(0.03 + 0.015)
        assert tr.gather_s == pytest.approx(0.015 + 0.0075)

    def test_expert_dp_one_rank_per_node(self):
        # two nodes, tp=8, dp_shard=2, ep=8, etp=1: expert_dp = 16/8 = 2 ranks 8 apart, one per node,
        # 10 GB/s: RS 1/2 * 4e9 / 10e9 = 0.2 s of 1e9 expert params' fp32 gradients
        lay = ParallelLayout(tp=8, sp=True, dp_shard=2, ep=8, etp=1, zero_stage=1)
        assert dp_traffic(easy_profile(nodes=2), lay, train(), 0.0, 1e9).grad_s == pytest.approx(0.2)

    def test_zero1_shards_expert_optimizer_states_over_expert_dp(self):
        # ZeRO-1, 1e9 expert params on a rank: weights 2 B, fp32 grads 4 B, master + Adam 12 B sharded
        # over expert_dp: folded (tp=2, dp_shard=4, ep=2, etp=1) 4 ranks -> 3e9 B; unfolded (etp = tp = 2)
        # dp_shard x cp / ep = 2 ranks -> 6e9 B
        prof, tr = easy_profile(), train()
        for lay, optimizer in ((ParallelLayout(tp=2, sp=True, dp_shard=4, ep=2, etp=1, zero_stage=1), 3e9),
                               (ParallelLayout(tp=2, sp=True, dp_shard=4, ep=2, zero_stage=1), 6e9)):
            mem = stage_memory(prof, tr, lay, 0, dense=0.0, experts=1e9, activations=0.0, biggest_block=0.0, loss=0.0)
            assert mem.params_bytes == 2e9 and mem.grads_bytes == 4e9
            assert mem.optimizer_bytes == pytest.approx(optimizer)


def test_activations_of_folded_experts():
    # bf16, b=2, s=1024, tp=2 +SP. The routed part keeps per row the FC1 input (h x 2 B) and, per
    # expert-FFN column, the gate, up and product (3 x 2 B). Unfolded: 4096 rows at width 512/2:
    # 4096 * (2048 + 6 * 256) = 14,680,064 B; folded etp=1: 2048 rows at width 512:
    # 2048 * (2048 + 6 * 512) = 10,485,760 B. Nothing else differs.
    model = small_moe()

    def acts(etp: int | None) -> float:
        return layer_activation_bytes(model, 0, ActivationShape(2, 1024, 1024, 2, True, etp), Recompute.none,
                                      flash=True)

    assert acts(None) - acts(1) == pytest.approx(14_680_064 - 10_485_760)
    assert acts(2) == acts(None)


# ------------------------------------------------------------------ what predict refuses
class TestRefusals:
    def _check(self, model, **lay):
        check_layout(model, TrainingConfig(seq_length=1024, global_batch_size=64), ParallelLayout(**lay), 8)

    def test_folding_needs_sequence_parallelism(self):
        with pytest.raises(AutoparError) as err:
            self._check(small_moe(), tp=2, dp_shard=4, ep=4, etp=1)
        assert err.value.field == "sp" and "sp=True" in str(err.value) and "etp=1 < tp=2" in str(err.value)

    def test_etp_must_divide_tp(self):
        with pytest.raises(AutoparError) as err:
            self._check(small_moe(), tp=4, sp=True, dp_shard=2, ep=1, etp=3)
        assert err.value.field == "etp" and "must divide tp=4" in str(err.value)

    def test_ep_times_etp_must_fold(self):
        # ep=4 x etp=2 = 8 does not divide dp_shard x cp x tp = 1 x 1 x 4
        with pytest.raises(AutoparError) as err:
            self._check(small_moe(), tp=4, sp=True, dp_shard=1, pp=2, ep=4, etp=2)
        assert err.value.field == "ep" and "ep=4 x etp=2 must divide" in str(err.value)

    def test_dense_model_has_no_experts_to_fold(self):
        with pytest.raises(AutoparError) as err:
            self._check(llama(), tp=2, sp=True, dp_shard=4, etp=1)
        assert err.value.field == "etp" and "no experts" in str(err.value)

    def test_folded_layouts_need_no_ep_dividing_dp(self):
        # ep=8 > dp_shard x cp = 4: refused unfolded, folded over the tp=2 ranks with etp=1
        self._check(small_moe(num_experts=8), tp=2, sp=True, dp_shard=4, ep=8, etp=1)
        with pytest.raises(AutoparError):
            self._check(small_moe(num_experts=8), tp=2, sp=True, dp_shard=4, ep=8)


def test_explicit_etp_equal_to_tp_is_unset_etp():
    model, prof = small_moe(), easy_profile()
    tr = TrainingConfig(seq_length=1024, global_batch_size=64)
    a = predict(model, tr, prof, ParallelLayout(tp=2, sp=True, dp_shard=4, ep=2, zero_stage=1))
    b = predict(model, tr, prof, ParallelLayout(tp=2, sp=True, dp_shard=4, ep=2, etp=2, zero_stage=1))
    assert a.model_dump() == b.model_dump()


# ------------------------------------------------------------------ autopar predict --etp
def test_cli_predict_takes_etp():
    from typer.testing import CliRunner

    from planner import cli
    from planner.contracts import Plan

    base = ["predict", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "64",
            "--tp", "4", "--ep", "8", "--zero", "1"]
    result = CliRunner().invoke(cli.app, [*base, "--sp", "--etp", "1", "--json"])
    assert result.exit_code == 0, result.output
    plan = Plan.model_validate_json(result.stdout)
    assert (plan.layout.tp, plan.layout.ep, plan.layout.etp, plan.layout.expert_dp) == (4, 8, 1, 2)
    refused = CliRunner().invoke(cli.app, [*base, "--etp", "1"])  # no --sp
    assert refused.exit_code != 0  # the entry point prints the AutoparError and exits 2
    assert isinstance(refused.exception, AutoparError) and refused.exception.field == "sp"
    assert "--sp" in str(refused.exception)
