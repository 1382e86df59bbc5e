"""Cost terms worked out by hand: data-parallel traffic, optimizer-step traffic, cross-node
all-to-all, the parts of one transformer block, the embedding and LM head, kernel counts and the
interleaved schedule's micro-batches in flight.

Every expected value is written out as arithmetic on the numbers of an easy profile:
100 TFLOP/s bf16 (200 FP8), 1e12 B/s HBM, every efficiency 1, no GEMM K overhead, no wave
quantisation (sm_count None), one bus bandwidth of 100 GB/s inside a node (10 GB/s per GPU
across nodes on the two-node profile), alpha 0, no kernel launch cost. A bf16 GEMM then takes
``max(2mnk / 1e14, 2(mk + kn + mn) / 1e12)`` seconds (FP8: ``max(2mnk / 2e14, (mk + kn + 2mn) / 1e12)``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.contracts import (
    Assumptions,
    ClusterProfile,
    Collective,
    ComputeProfile,
    DeviceSpec,
    GemmLayout,
    GemmPoint,
    LinkLevel,
    LinkProfile,
    ModelSpec,
    MoESpec,
    Optimizer,
    ParallelLayout,
    Precision,
    Schedule,
    TrainingConfig,
)
from planner.cost.comm import GroupPlacement, collective_time_s, mesh_groups
from planner.cost.layer import (
    MicroBatch,
    PassCost,
    block_cost,
    embedding_cost,
    forward_kernel_count,
    lm_head_cost,
)
from planner.cost.memory import optimizer_step_bytes_per_param
from planner.cost.pipeline import microbatches_in_flight
from planner.cost.predict import dp_traffic

INTRA_BUSBW, INTER_BUSBW = 100e9, 10e9


def easy_links(intra: float = INTRA_BUSBW, inter: float = INTER_BUSBW,
               inter_alpha: float = 0.0) -> list[LinkProfile]:
    """All-reduce entries only: every other collective falls back to them (same busbw)."""
    return [
        LinkProfile(level=LinkLevel.intra_node, collective=Collective.all_reduce, alpha_s=0.0,
                    busbw_bytes_per_s=intra),
        LinkProfile(level=LinkLevel.inter_node, collective=Collective.all_reduce, alpha_s=inter_alpha,
                    busbw_bytes_per_s=inter),
    ]


def easy_profile(*, nodes: int = 1, links: list[LinkProfile] | None = None, **assume) -> ClusterProfile:
    values = {"matmul_efficiency": 1.0, "fp8_matmul_efficiency": 1.0, "attention_efficiency": 1.0,
              "memory_bandwidth_efficiency": 1.0, "gemm_k_overhead": 0.0, "kernel_overhead_s": 0.0,
              "async_overlap_efficiency": 1.0, "tp_overlap_efficiency": 1.0}
    values.update(assume)
    return ClusterProfile(
        kind="reference", name="easy",
        device=DeviceSpec(name="easy-gpu", memory_bytes=80 * 2**30, hbm_bandwidth_bytes_per_s=1e12,
                          sm_count=None, peak_tflops={Precision.bf16: 100.0, Precision.fp8: 200.0}),
        gpus_per_node=8, num_nodes=nodes, links=links or easy_links(), assumptions=Assumptions(**values),
    )


def train(**changes) -> TrainingConfig:
    return TrainingConfig(seq_length=1024, global_batch_size=64, **changes)


# A small Llama-style layer: h=1024, 8 heads of 128, 2 KV heads (GQA), SwiGLU FFN 2048, RoPE, no dropout.
H, HEADS, KV, FFN, VOCAB = 1024, 8, 2, 2048, 32000  # head size 1024 / 8 = 128


def llama(**changes) -> ModelSpec:
    fields = {"num_layers": 4, "hidden_size": H, "num_attention_heads": HEADS, "num_kv_heads": KV,
              "ffn_hidden_size": FFN, "ffn_kind": "swiglu", "vocab_size": VOCAB, "position_embedding": "rope"}
    fields.update(changes)
    return ModelSpec(**fields)


def small_moe(**moe) -> ModelSpec:
    spec = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 512}
    spec.update(moe)
    return llama(moe=MoESpec(**spec))


def micro(batch: int = 2, seq: int = 1024, cp: int = 1, tp: int = 1, sp: bool = False,
          precision: Precision = Precision.bf16, flash: bool = True) -> MicroBatch:
    return MicroBatch(batch, seq, cp, tp, sp, precision, flash)


def block(model: ModelSpec, mb: MicroBatch, profile: ClusterProfile | None = None, **layout):
    lay = ParallelLayout(tp=mb.tp, sp=mb.sp, cp=mb.cp, **layout)
    return block_cost(profile or easy_profile(), model, 0, mb, lay, mesh_groups(lay, 8))


# ============================================================================================
# 1. dp_traffic
# ============================================================================================
class TestDPTraffic:
    """bf16 + fp32 gradient reduction: 4 bytes of gradient and 2 bytes of weight per parameter."""

    def test_zero0_all_reduce_over_dp_ranks_stride_tp(self):
        # tp=2, dp_shard=4: the dp group is ranks 0,2,4,6 of the node: 4 ranks, intra-node
        # all-reduce 2(n-1)/n = 1.5 of 1e9 params * 4 B = 4e9 B at 100 GB/s: 1.5 * 4e9 / 100e9 = 0.06 s
        tr = dp_traffic(easy_profile(), ParallelLayout(tp=2, dp_shard=4), train(), 1e9, 0.0)
        assert tr.grad_s == pytest.approx(0.06)
        assert tr.grad_bytes == pytest.approx(4e9)
        assert (tr.replica_s, tr.gather_s, tr.gather_bytes) == (0.0, 0.0, 0.0)

    def test_zero0_all_reduce_covers_cp_and_replicas(self):
        # dp_replicate=2 x dp_shard=2 x cp=2 = 8 ranks hold the same weights (stride tp=1), one node:
        # all-reduce 2*7/8 = 1.75 of 4e9 B: 1.75 * 4e9 / 100e9 = 0.07 s; no separate replica step
        layout = ParallelLayout(dp_replicate=2, dp_shard=2, cp=2)
        tr = dp_traffic(easy_profile(), layout, train(), 1e9, 0.0)
        assert tr.grad_s == pytest.approx(0.07)
        assert tr.replica_s == 0.0

    def test_zero0_fp16_gradients(self):
        # grad_reduce_in_fp32=False: 2 B per gradient -> 2e9 B; 8 ranks: 1.75 * 2e9 / 100e9 = 0.035 s
        cfg = train(grad_reduce_in_fp32=False)
        tr = dp_traffic(easy_profile(), ParallelLayout(dp_shard=8), cfg, 1e9, 0.0)
        assert tr.grad_bytes == pytest.approx(2e9)
        assert tr.grad_s == pytest.approx(0.035)

    def test_zero1_reduce_scatter_and_all_gather(self):
        # dp_shard=8 (one node): reduce-scatter (n-1)/n = 7/8 of 4e9 B: 0.875 * 4e9 / 100e9 = 0.035 s;
        # all-gather of the 2-byte weights: 0.875 * 2e9 / 100e9 = 0.0175 s
        tr = dp_traffic(easy_profile(), ParallelLayout(dp_shard=8, zero_stage=1), train(), 1e9, 0.0)
        assert tr.grad_s == pytest.approx(0.035)
        assert tr.gather_s == pytest.approx(0.0175)
        assert tr.grad_bytes == pytest.approx(4e9)
        assert tr.gather_bytes == pytest.approx(2e9)
        assert tr.replica_s == 0.0  # no replicas

    def test_zero3_shard_group_is_dp_shard_times_cp(self):
        # tp=2, cp=2, dp_shard=2: shard group = dp_shard*cp = 4 ranks, stride tp=2 (ranks 0,2,4,6), intra.
        # reduce-scatter 3/4 * 4e9 / 100e9 = 0.03 s; all-gather 3/4 * 2e9 / 100e9 = 0.015 s
        layout = ParallelLayout(tp=2, cp=2, dp_shard=2, zero_stage=3)
        tr = dp_traffic(easy_profile(), layout, train(), 1e9, 0.0)
        assert tr.grad_s == pytest.approx(0.03)
        assert tr.gather_s == pytest.approx(0.015)

    def test_hsdp_replica_all_reduce_of_the_shard(self):
        # dp_replicate=2 x dp_shard=4 on one node, ZeRO-3. Shard group 4 ranks (stride 1):
        # reduce-scatter 3/4 * 4e9 / 100e9 = 0.03 s; all-gather 3/4 * 2e9 / 100e9 = 0.015 s.
        # Replicas (stride 4, both on the node) all-reduce the 4e9/4 = 1e9 B shard:
        # 2*1/2 * 1e9 / 100e9 = 0.01 s
        layout = ParallelLayout(dp_replicate=2, dp_shard=4, zero_stage=3)
        tr = dp_traffic(easy_profile(), layout, train(), 1e9, 0.0)
        assert tr.grad_s == pytest.approx(0.03)
        assert tr.gather_s == pytest.approx(0.015)
        assert tr.replica_s == pytest.approx(0.01)

    def test_experts_sharded_over_dp_shard_cp_over_ep_stride_tp_ep(self):
        # tp=2, dp_shard=4, ep=2, ZeRO-1, one node; 1e9 dense and 0.5e9 expert params.
        # dense: 4 ranks, stride 2 -> intra; RS 3/4 * 4e9 / 100e9 = 0.03; AG 3/4 * 2e9 / 100e9 = 0.015
        # experts: 4 / ep 2 = 2 ranks, stride tp*ep = 4 -> intra; grads 0.5e9 * 4 = 2e9 B, weights 1e9 B:
        #   RS 1/2 * 2e9 / 100e9 = 0.01; AG 1/2 * 1e9 / 100e9 = 0.005
        layout = ParallelLayout(tp=2, dp_shard=4, ep=2, zero_stage=1)
        tr = dp_traffic(easy_profile(), layout, train(), 1e9, 0.5e9)
        assert tr.grad_s == pytest.approx(0.03 + 0.01)
        assert tr.gather_s == pytest.approx(0.015 + 0.005)
        assert tr.grad_bytes == pytest.approx(4e9 + 2e9)
        assert tr.gather_bytes == pytest.approx(2e9 + 1e9)

    def test_experts_zero0(self):
        # same mesh, ZeRO-0: dense all-reduce over 4 ranks 1.5 * 4e9 / 100e9 = 0.06;
        # experts over 2 ranks: 2*1/2 * 2e9 / 100e9 = 0.02
        tr = dp_traffic(easy_profile(), ParallelLayout(tp=2, dp_shard=4, ep=2), train(), 1e9, 0.5e9)
        assert tr.grad_s == pytest.approx(0.06 + 0.02)

    def test_only_experts(self):
        # no dense params on this stage: only the expert term (dp_shard=8, ep=8 -> 1 rank: nothing to reduce)
        tr = dp_traffic(easy_profile(), ParallelLayout(dp_shard=8, ep=8, zero_stage=1), train(), 0.0, 1e9)
        assert tr.grad_s == 0.0 and tr.gather_s == 0.0
        assert tr.grad_bytes == pytest.approx(4e9)  # still counted as this stage's gradient bytes

    def test_inter_node_zero0(self):
        # two nodes, tp=2, dp_shard=8: dp ranks 0,2,...,14 -> 4 per node on 2 nodes.
        # busbw = min(4 rails * 10 GB/s, 100 GB/s) = 40 GB/s; all-reduce 2*7/8 = 1.75:
        # 1.75 * 4e9 / 40e9 = 0.175 s
        tr = dp_traffic(easy_profile(nodes=2), ParallelLayout(tp=2, dp_shard=8), train(), 1e9, 0.0)
        assert tr.grad_s == pytest.approx(0.175)

    def test_inter_node_experts_one_per_node(self):
        # two nodes, tp=2, dp_shard=8, ep=4, ZeRO-1; 1e9 dense + 1e9 expert params.
        # dense: 8 ranks, 4 per node, 40 GB/s: RS 7/8 * 4e9 / 40e9 = 0.0875; AG 7/8 * 2e9 / 40e9 = 0.04375
        # experts: 8/4 = 2 ranks, stride 2*4 = 8 -> one per node, 10 GB/s:
        #   RS 1/2 * 4e9 / 10e9 = 0.2; AG 1/2 * 2e9 / 10e9 = 0.1
        layout = ParallelLayout(tp=2, dp_shard=8, ep=4, zero_stage=1)
        tr = dp_traffic(easy_profile(nodes=2), layout, train(), 1e9, 1e9)
        assert tr.grad_s == pytest.approx(0.0875 + 0.2)
        assert tr.gather_s == pytest.approx(0.04375 + 0.1)

    def test_inter_node_hsdp_replicas(self):
        # two nodes, dp_replicate=2 x dp_shard=8, ZeRO-3: each shard group is one node (8 ranks, intra):
        # RS 7/8 * 4e9 / 100e9 = 0.035; AG 7/8 * 2e9 / 100e9 = 0.0175.
        # replicas one node apart (1 per node): all-reduce 2*1/2 of 4e9/8 = 5e8 B at 10 GB/s = 0.05 s
        layout = ParallelLayout(dp_replicate=2, dp_shard=8, zero_stage=3)
        tr = dp_traffic(easy_profile(nodes=2), layout, train(), 1e9, 0.0)
        assert tr.grad_s == pytest.approx(0.035)
        assert tr.gather_s == pytest.approx(0.0175)
        assert tr.replica_s == pytest.approx(0.05)


# ============================================================================================
# 2. optimizer_step_bytes_per_param: 6g + 2o + (3*4 + w with an fp32 master, else 2w)
# ============================================================================================
class TestOptimizerStepBytes:
    def test_mixed_precision_adamw(self):
        # g = 4 (fp32 reduce), o = 8 (m, v), master: 6*4 + 2*8 + 3*4 + 2 = 24 + 16 + 12 + 2 = 54
        assert optimizer_step_bytes_per_param(train()) == 54

    def test_fp32_training_adamw_has_no_master(self):
        # w = g = 4, no master: 6*4 + 2*8 + 2*4 = 24 + 16 + 8 = 48
        cfg = train(precision=Precision.fp32)
        assert cfg.master_weights_fp32 is False
        assert optimizer_step_bytes_per_param(cfg) == 48

    def test_sgd(self):
        # o = 4 (momentum): 6*4 + 2*4 + 3*4 + 2 = 24 + 8 + 12 + 2 = 46
        assert optimizer_step_bytes_per_param(train(optimizer=Optimizer.sgd)) == 46

    def test_16bit_gradients(self):
        # g = 2: 6*2 + 2*8 + 3*4 + 2 = 12 + 16 + 12 + 2 = 42
        assert optimizer_step_bytes_per_param(train(grad_reduce_in_fp32=False)) == 42

    def test_bf16_without_master(self):
        # g = 4, no master, w = 2: 6*4 + 2*8 + 2*2 = 24 + 16 + 4 = 44
        assert optimizer_step_bytes_per_param(train(master_weights_fp32=False)) == 44


# ============================================================================================
# 3. collective_time_s: all-to-all across nodes
# ============================================================================================
class TestAllToAllAcrossNodes:
    def test_nic_bound(self):
        # n=16 ranks, g=8 per node, 1.6e9 B, alpha 20 us:
        # off-node 1.6e9 * (16-8)/16 / 10e9 = 0.08 s; on-node 1.6e9 * 7/16 / 100e9 = 0.007 s
        # t = 2e-5 + max(0.08, 0.007) = 0.08002 s
        p = easy_profile(nodes=2, links=easy_links(inter_alpha=2e-5))
        t = collective_time_s(p, Collective.all_to_all, GroupPlacement(16, 8), 1.6e9)
        assert t == pytest.approx(2e-5 + 0.08)

    def test_not_the_rail_scaled_ring_formula(self):
        # the ring formula would give 15/16 * 1.6e9 / min(8 * 10e9, 100e9) = 1.5e9 / 80e9 = 0.01875 s
        t = collective_time_s(easy_profile(nodes=2), Collective.all_to_all, GroupPlacement(16, 8), 1.6e9)
        assert t == pytest.approx(0.08)
        assert t != pytest.approx(0.01875)

    def test_nvlink_bound(self):
        # slow NVLink (5 GB/s), fast NIC (100 GB/s): off-node 1.6e9 * 8/16 / 100e9 = 0.008 s,
        # on-node 1.6e9 * 7/16 / 5e9 = 0.14 s -> 0.14 s
        p = easy_profile(nodes=2, links=easy_links(intra=5e9, inter=100e9))
        t = collective_time_s(p, Collective.all_to_all, GroupPlacement(16, 8), 1.6e9)
        assert t == pytest.approx(0.14)

    def test_four_per_node(self):
        # n=16, g=4 (stride 2, four nodes): off-node 1.6e9 * 12/16 / 10e9 = 0.12 s;
        # on-node 1.6e9 * 3/16 / 100e9 = 0.003 s
        t = collective_time_s(easy_profile(nodes=4), Collective.all_to_all, GroupPlacement(16, 4), 1.6e9)
        assert t == pytest.approx(0.12)

    def test_one_per_node(self):
        # n=4, g=1: nothing over NVLink; 1.6e9 * 3/4 / 10e9 = 0.12 s
        t = collective_time_s(easy_profile(nodes=4), Collective.all_to_all, GroupPlacement(4, 1), 1.6e9)
        assert t == pytest.approx(0.12)


# ============================================================================================
# 4. block_cost
# ============================================================================================
# Default micro-batch: batch 2 x seq 1024 = 2048 tokens; one bf16 activation of the hidden size is
# 2048 * 1024 * 2 = 4,194,304 B.


class TestBlockGemms:
    def test_forward_gemms_dense_tp1(self):
        # (m, n, k): QKV (2048, (8 + 2*2)*128 = 1536, 1024), out (2048, 1024, 1024),
        # FC1 gate+up (2048, 2*2048 = 4096, 1024), FC2 (2048, 1024, 2048).
        # All compute bound, e.g. QKV: 2*2048*1536*1024 = 6.44e9 FLOP -> 6.44e-5 s vs
        # 2*(2048*1024 + 1024*1536 + 2048*1536) = 1.36e7 B -> 1.36e-5 s.
        qkv = 2 * 2048 * 1536 * 1024 / 100e12
        out = 2 * 2048 * 1024 * 1024 / 100e12
        fc1 = 2 * 2048 * 4096 * 1024 / 100e12
        fc2 = 2 * 2048 * 1024 * 2048 / 100e12
        assert qkv + out + fc1 + fc2 == pytest.approx(2 * 2048 * 1024 * 8704 / 100e12)  # 3.6507e-4 s
        bc = block(llama(), micro())
        assert bc.forward.gemm_s == pytest.approx(qkv + out + fc1 + fc2)

    def test_backward_gemms_dense_tp1(self):
        # dgrad (m, k_in, n_out) + wgrad (k_in, n_out, m) of each linear: same FLOPs as forward each,
        # all compute bound here -> 2 x 3.6507e-4 s
        dgrad = (2 * 2048 * 1024 * 1536 + 2 * 2048 * 1024 * 1024 + 2 * 2048 * 1024 * 4096
                 + 2 * 2048 * 2048 * 1024) / 100e12
        wgrad = (2 * 1024 * 1536 * 2048 + 2 * 1024 * 1024 * 2048 + 2 * 1024 * 4096 * 2048
                 + 2 * 2048 * 1024 * 2048) / 100e12
        bc = block(llama(), micro())
        assert bc.backward.gemm_s == pytest.approx(dgrad + wgrad)

    def test_tp2_splits_every_gemm(self):
        # QKV n=1536/2, out k=1024/2, FC1 n=4096/2, FC2 k=2048/2: half the FLOPs, still compute bound
        bc = block(llama(), micro(tp=2))
        assert bc.forward.gemm_s == pytest.approx(2 * 2048 * 1024 * 8704 / 2 / 100e12)
        assert bc.backward.gemm_s == pytest.approx(2 * 2 * 2048 * 1024 * 8704 / 2 / 100e12)

    def test_fp8_memory_bound_backward_uses_its_own_shapes(self):
        # 64 tokens, FP8 (1-byte inputs, 2-byte outputs, 200 TFLOP/s): every GEMM memory bound,
        # bytes = m*k + k*n + 2*m*n.
        # forward: QKV (64,1536,1024): 65,536 + 1,572,864 + 196,608 = 1,835,008
        #          out (64,1024,1024): 65,536 + 1,048,576 + 131,072 = 1,245,184
        #          FC1 (64,4096,1024): 65,536 + 4,194,304 + 524,288 = 4,784,128
        #          FC2 (64,1024,2048): 131,072 + 2,097,152 + 131,072 = 2,359,296
        fwd = (1_835_008 + 1_245_184 + 4_784_128 + 2_359_296) / 1e12
        # largest compute time (FC1) 2*64*4096*1024 / 2e14 = 2.68e-6 s < its 4.78e-6 s of traffic
        # backward dgrad (m, k_in, n_out) / wgrad (k_in, n_out, m):
        #   QKV  (64,1024,1536): 98,304 + 1,572,864 + 131,072 = 1,802,240
        #        (1024,1536,64): 65,536 + 98,304 + 3,145,728 = 3,309,568
        #   out  (64,1024,1024): 1,245,184;  (1024,1024,64): 65,536 + 65,536 + 2,097,152 = 2,228,224
        #   FC1  (64,1024,4096): 262,144 + 4,194,304 + 131,072 = 4,587,520
        #        (1024,4096,64): 65,536 + 262,144 + 8,388,608 = 8,716,288
        #   FC2  (64,2048,1024): 65,536 + 2,097,152 + 262,144 = 2,424,832
        #        (2048,1024,64): 131,072 + 65,536 + 4,194,304 = 4,390,912
        bwd = (1_802_240 + 3_309_568 + 1_245_184 + 2_228_224 + 4_587_520 + 8_716_288 + 2_424_832
               + 4_390_912) / 1e12
        assert fwd == pytest.approx(1.0223616e-5) and bwd == pytest.approx(2.8704768e-5)
        bc = block(llama(), micro(batch=1, seq=64, precision=Precision.fp8))
        assert bc.forward.gemm_s == pytest.approx(fwd)
        assert bc.backward.gemm_s == pytest.approx(bwd)  # 2.8x forward, not 2x


class TestBlockTensorParallel:
    # tp=2 on one node: all-reduce factor 2*1/2 = 1, all-gather / reduce-scatter 1/2, 100 GB/s.
    # backward GEMMs at tp=2: 2 * 2*2048*1024*8704/2 / 1e14 = 3.6507e-4 s, half of it 1.8254e-4 s
    BWD_GEMM = 2 * 2048 * 1024 * 8704 / 100e12

    def test_forward_two_all_reduces_without_sp(self):
        # 2 all-reduces of T*h*2 = 4,194,304 B: 2 * 1 * 4,194,304 / 100e9 = 8.388608e-5 s, all exposed
        bc = block(llama(), micro(tp=2))
        assert bc.forward.comm_s["tp"] == pytest.approx(2 * 4_194_304 / 100e9)
        assert bc.forward.exposed_comm_s["tp"] == pytest.approx(8.388608e-5)
        assert bc.forward.comm_bytes["tp"] == pytest.approx(2 * 4_194_304)

    @pytest.mark.parametrize("busbw", [100e9, 10e9])
    def test_backward_all_reduces_beside_wgrad(self, busbw):
        # 2 all-reduces beside the weight-gradient GEMMs (half the backward GEMM time):
        # exposed = total - eff * min(total, bwd_gemm / 2), eff = 0.5.
        # 100 GB/s: total 8.388608e-5 < 1.8254e-4 -> 8.388608e-5 * (1 - 0.5) = 4.194304e-5
        # 10 GB/s:  total 8.388608e-4 > 1.8254e-4 -> 8.388608e-4 - 0.5 * 1.8254e-4 = 7.4759e-4
        p = easy_profile(links=easy_links(intra=busbw), async_overlap_efficiency=0.5)
        bc = block(llama(), micro(tp=2), p)
        total = 2 * 4_194_304 / busbw
        half = self.BWD_GEMM / 2
        assert bc.backward.gemm_s == pytest.approx(self.BWD_GEMM)
        assert bc.backward.comm_s["tp"] == pytest.approx(total)
        assert bc.backward.exposed_comm_s["tp"] == pytest.approx(total - 0.5 * min(total, half))
        assert bc.backward.comm_bytes["tp"] == pytest.approx(2 * 4_194_304)
        expected = {100e9: 4.194304e-5, 10e9: 8.388608e-4 - 0.5 * 2048 * 1024 * 8704 / 100e12}[busbw]
        assert bc.backward.exposed_comm_s["tp"] == pytest.approx(expected)

    def test_backward_all_reduces_hidden_by_the_weight_gradient_gemms_alone(self):
        # a measured table whose weight-gradient (tn) GEMMs run 4x faster than its input-gradient (nn)
        # ones: the backward GEMMs split 4:1, and the all-reduces beside the weight gradient hide
        # behind its fifth, not half of the backward. 10 GB/s: total 8.388608e-4 s > that fifth
        rates = {GemmLayout.nt: 100e12, GemmLayout.nn: 100e12, GemmLayout.tn: 400e12}
        pts = [GemmPoint(precision=Precision.bf16, m=1024, n=1024, k=1024, layout=lay, time_s=2 * 1024**3 / r)
               for lay, r in rates.items()]
        p = easy_profile(links=easy_links(intra=10e9), async_overlap_efficiency=0.5)
        p = p.model_copy(update={"compute": ComputeProfile(gemm=pts)})
        bc = block(llama(), micro(tp=2), p)
        assert bc.backward.gemm_s == pytest.approx(self.BWD_GEMM / 2 + self.BWD_GEMM / 8)
        wgrad = self.BWD_GEMM / 8
        total = 2 * 4_194_304 / 10e9
        assert bc.backward.exposed_comm_s["tp"] == pytest.approx(total - 0.5 * wgrad)

    def test_backward_fully_hidden_with_efficiency_1(self):
        # eff 1, comm 8.39e-5 < half 1.83e-4: everything hidden
        bc = block(llama(), micro(tp=2))
        assert bc.backward.exposed_comm_s["tp"] == pytest.approx(0.0, abs=1e-12)

    def test_tp_comm_overlap_hides_forward(self):
        # decomposed GEMMs hide tp_overlap_efficiency 0.6 of min(comm, gemm):
        # forward 8.388608e-5 * (1 - 0.6) = 3.3554432e-5 (forward GEMMs 1.8254e-4 s > comm)
        # backward: max(async 0.5 * 8.39e-5, decomposed 0.6 * 8.39e-5) hidden -> same 3.3554432e-5
        p = easy_profile(async_overlap_efficiency=0.5, tp_overlap_efficiency=0.6)
        bc = block(llama(), micro(tp=2), p, tp_comm_overlap=True)
        assert bc.forward.exposed_comm_s["tp"] == pytest.approx(3.3554432e-5)
        assert bc.backward.exposed_comm_s["tp"] == pytest.approx(3.3554432e-5)

    def test_sequence_parallel(self):
        # one all-gather or reduce-scatter: 1/2 * 4,194,304 / 100e9 = 2.097152e-5 s
        # forward 2 * (AG + RS) = 8.388608e-5 s, 4 buffers; backward 6 collectives = 1.2582912e-4 s,
        # 6 buffers; hidden: eff 0.5 * (min(2 RS, half) + min(2 AG, half)) = 0.5 * 8.388608e-5
        # -> exposed 1.2582912e-4 - 4.194304e-5 = 8.388608e-5 s
        one = 0.5 * 4_194_304 / 100e9
        bc = block(llama(), micro(tp=2, sp=True), easy_profile(async_overlap_efficiency=0.5))
        assert bc.forward.comm_s["tp"] == pytest.approx(4 * one)
        assert bc.forward.exposed_comm_s["tp"] == pytest.approx(4 * one)
        assert bc.forward.comm_bytes["tp"] == pytest.approx(4 * 4_194_304)
        assert bc.backward.comm_s["tp"] == pytest.approx(6 * one)
        assert bc.backward.exposed_comm_s["tp"] == pytest.approx(6 * one - 0.5 * 4 * one)
        assert bc.backward.comm_bytes["tp"] == pytest.approx(6 * 4_194_304)

    def test_no_tp_no_comm(self):
        bc = block(llama(), micro())
        assert bc.forward.comm_s == {} and bc.backward.comm_s == {}


class TestBlockContextParallel:
    def test_kv_all_gather(self):
        # cp=2, tp=1: K and V of the full sequence for the 2 local KV heads:
        # batch 2 * seq 1024 * 2 heads * (128 + 128) * 2 B = 2,097,152 B;
        # all-gather over 2 ranks: 1/2 * 2,097,152 / 100e9 = 1.048576e-5 s, not hidden
        bc = block(llama(), micro(cp=2))
        assert bc.forward.comm_s["cp"] == pytest.approx(1.048576e-5)
        assert bc.forward.exposed_comm_s["cp"] == pytest.approx(1.048576e-5)
        assert bc.forward.comm_bytes["cp"] == pytest.approx(2_097_152)
        # backward: reduce-scatter of the same buffer
        assert bc.backward.comm_s["cp"] == pytest.approx(1.048576e-5)
        assert bc.backward.comm_bytes["cp"] == pytest.approx(2_097_152)

    def test_kv_heads_split_by_tp(self):
        # cp=2, tp=2: 2 KV heads / 2 = 1 local: 2 * 1024 * 1 * 256 * 2 = 1,048,576 B -> 5.24288e-6 s
        bc = block(llama(), micro(cp=2, tp=2))
        assert bc.forward.comm_bytes["cp"] == pytest.approx(1_048_576)
        assert bc.forward.comm_s["cp"] == pytest.approx(5.24288e-6)


class TestBlockMoE:
    # 4 experts, top-2, expert FFN 512, ep=2; 2048 tokens -> 4096 routed copies
    def _block(self, ep: int = 2):
        return block(small_moe(), micro(), dp_shard=ep, ep=ep)

    def test_expert_parallel_all_to_alls(self):
        # dispatch + combine of tokens * top_k * h * 2 B = 2048 * 2 * 1024 * 2 = 8,388,608 B over 2 ranks:
        # each 1/2 * 8,388,608 / 100e9 = 4.194304e-5 s; 2 per pass = 8.388608e-5 s, all exposed; the
        # routing probabilities' all-to-all, 4096 copies x 4 B = 16,384 B: 1/2 * 16,384 / 100e9 = 8.192e-8 s;
        # forward only, the tokens-per-expert all-gather over the 2 ranks: 4 experts x 8 B x 2 = 64 B,
        # 1/2 * 64 / 100e9 = 3.2e-10 s
        bc = self._block()
        for pc, gather, meta in ((bc.forward, 3.2e-10, 64), (bc.backward, 0.0, 0)):
            assert pc.comm_s["ep"] == pytest.approx(8.388608e-5 + 8.192e-8 + gather)
            assert pc.exposed_comm_s["ep"] == pytest.approx(8.388608e-5 + 8.192e-8 + gather)
            assert pc.comm_bytes["ep"] == pytest.approx(2 * 8_388_608 + 16_384 + meta)

    def test_no_ep_no_all_to_all(self):
        assert "ep" not in self._block(ep=1).forward.comm_s

    def test_memory_includes_permute_traffic(self):
        # E = 2048 * 1024 = 2,097,152 elements, 2 B each, no dropout, no SP:
        #   norms 4*2*E + residual adds 2*3*2*E = 20E B = 41,943,040
        #   SwiGLU over the routed copies: 3 * 2 * 2048 * (512 * 2) = 12,582,912
        #   RoPE on 8 query + 2 key heads: 2 * 2 * 2048 * 10 * 128 = 10,485,760
        #   dispatch (2 local experts): router 22 B x 2048 tokens x 4 experts = 180,224; permute (1 + 2) *
        #   2048 * 1024 * 2 = 12,582,912; sort and unsort the 4096 received rows 2 * (2 * 4096 * 1024 * 2)
        #   = 33,554,432; unpermute (2 + 1) * 2048 * 1024 * 2 = 12,582,912: 58,900,480
        total = 41_943_040 + 12_582_912 + 10_485_760 + 58_900_480  # 123,912,192 B
        bc = self._block()
        assert bc.forward.memory_s == pytest.approx(total / 1e12)
        assert bc.backward.memory_s == pytest.approx(1.25 * total / 1e12)

    def test_dense_memory_has_no_permute(self):
        # dense: 41,943,040 + SwiGLU 3 * 2 * 2048 * 2048 = 25,165,824 + RoPE 10,485,760
        bc = block(llama(), micro())
        assert bc.forward.memory_s == pytest.approx((41_943_040 + 25_165_824 + 10_485_760) / 1e12)


class TestPassCostAddComm:
    def test_accumulates_by_kind(self):
        pc = PassCost()
        pc.add_comm("tp", 2.0, 0.5, 100.0)
        pc.add_comm("tp", 1.0, 1.0, 50.0)
        pc.add_comm("cp", 3.0, 3.0, 10.0)
        assert pc.comm_s == {"tp": 3.0, "cp": 3.0}
        assert pc.exposed_comm_s == {"tp": 1.5, "cp": 3.0}
        assert pc.comm_bytes == {"tp": 150.0, "cp": 10.0}
        # only the exposed part joins the pass time: 0 compute + 1.5 + 3.0
        assert pc.total_s == pytest.approx(4.5)


# ============================================================================================
# 5. embedding_cost and lm_head_cost
# ============================================================================================
class TestLMHead:
    # tp=2: vocab 32000 / 2 = 16000 columns; 2048 tokens -> 2048 * 16000 = 32,768,000 local logits
    def test_head_gemm(self):
        # (m, n, k) = (2048, 16000, 1024): 2*2048*16000*1024 = 6.7109e10 FLOP -> 6.7109e-4 s, compute bound
        # (bytes 2*(2048*1024 + 1024*16000) + 2*2048*16000 = 102,498,304 -> 1.02e-4 s); backward 2 GEMMs
        fwd, bwd = lm_head_cost(easy_profile(), llama(), micro(tp=2), mesh_groups(ParallelLayout(tp=2), 8))
        assert fwd.gemm_s == pytest.approx(2 * 2048 * 16000 * 1024 / 100e12)
        assert bwd.gemm_s == pytest.approx(2 * 2 * 2048 * 16000 * 1024 / 100e12)

    def test_cross_entropy_traffic_without_sp(self):
        # final norm 2 * 2 * 2048 * 1024 = 8,388,608 B (replicated); CE forward 14 B per bf16 logit (upcast:
        # read 2, write 4; fp32 log-softmax: read 4, write 4), 8 backward:
        # forward 8,388,608 + 14 * 32,768,000 = 467,140,608 B;
        # backward 2 * 8,388,608 + 8 * 32,768,000 = 278,921,216 B
        fwd, bwd = lm_head_cost(easy_profile(), llama(), micro(tp=2), mesh_groups(ParallelLayout(tp=2), 8))
        assert fwd.memory_s == pytest.approx(467_140_608 / 1e12)
        assert bwd.memory_s == pytest.approx(278_921_216 / 1e12)

    def test_tp_without_sp_all_reduce_backward_only(self):
        # head input replicated: backward all-reduce of 2048 * 1024 * 2 = 4,194,304 B: 1 * 4,194,304 / 100e9
        fwd, bwd = lm_head_cost(easy_profile(), llama(), micro(tp=2), mesh_groups(ParallelLayout(tp=2), 8))
        assert fwd.comm_s == {}
        assert bwd.comm_s["tp"] == pytest.approx(4.194304e-5)
        assert bwd.exposed_comm_s["tp"] == pytest.approx(4.194304e-5)
        assert bwd.comm_bytes["tp"] == pytest.approx(4_194_304)

    def test_tp_with_sp_gather_forward_scatter_backward(self):
        # all-gather forward, reduce-scatter backward: 1/2 * 4,194,304 / 100e9 = 2.097152e-5 s each;
        # norm split by SP: 8,388,608 / 2 = 4,194,304 B -> forward 4,194,304 + 14 * 32,768,000 B
        layout = ParallelLayout(tp=2, sp=True)
        fwd, bwd = lm_head_cost(easy_profile(), llama(), micro(tp=2, sp=True), mesh_groups(layout, 8))
        assert fwd.comm_s["tp"] == pytest.approx(2.097152e-5)
        assert bwd.comm_s["tp"] == pytest.approx(2.097152e-5)
        assert fwd.comm_bytes["tp"] == bwd.comm_bytes["tp"] == pytest.approx(4_194_304)
        assert fwd.memory_s == pytest.approx((4_194_304 + 458_752_000) / 1e12)

    def test_no_tp(self):
        # full vocab: (2048, 32000, 1024) GEMM; 14 * 2048 * 32000 = 917,504,000 B of CE forward
        fwd, bwd = lm_head_cost(easy_profile(), llama(), micro(), mesh_groups(ParallelLayout(), 8))
        assert fwd.gemm_s == pytest.approx(2 * 2048 * 32000 * 1024 / 100e12)
        assert fwd.memory_s == pytest.approx((8_388_608 + 917_504_000) / 1e12)
        assert fwd.comm_s == {} and bwd.comm_s == {}


class TestEmbedding:
    # T*h*2 = 4,194,304 B: forward writes it (2x traffic), backward scatter-adds (3x)
    def test_memory(self):
        fwd, bwd = embedding_cost(easy_profile(), llama(), micro(), mesh_groups(ParallelLayout(), 8))
        assert fwd.memory_s == pytest.approx(2 * 4_194_304 / 1e12)
        assert bwd.memory_s == pytest.approx(3 * 4_194_304 / 1e12)
        assert fwd.comm_s == {} and bwd.comm_s == {}

    def test_tp_without_sp_all_reduce_forward(self):
        # all-reduce over 2: 2*1/2 * 4,194,304 / 100e9 = 4.194304e-5 s forward; nothing backward
        fwd, bwd = embedding_cost(easy_profile(), llama(), micro(tp=2), mesh_groups(ParallelLayout(tp=2), 8))
        assert fwd.comm_s["tp"] == pytest.approx(4.194304e-5)
        assert fwd.exposed_comm_s["tp"] == pytest.approx(4.194304e-5)
        assert fwd.comm_bytes["tp"] == pytest.approx(4_194_304)
        assert bwd.comm_s == {}

    def test_tp_with_sp_scatter_forward_gather_backward(self):
        # reduce-scatter forward, all-gather backward: 1/2 * 4,194,304 / 100e9 = 2.097152e-5 s each
        layout = ParallelLayout(tp=2, sp=True)
        fwd, bwd = embedding_cost(easy_profile(), llama(), micro(tp=2, sp=True), mesh_groups(layout, 8))
        assert fwd.comm_s["tp"] == pytest.approx(2.097152e-5)
        assert bwd.comm_s["tp"] == pytest.approx(2.097152e-5)
        assert bwd.comm_bytes["tp"] == pytest.approx(4_194_304)

    def test_launch_overheads(self):
        # 1 us per kernel: lookup (+ collective with TP) forward; 2 backward (+ gather with SP)
        p = easy_profile(kernel_overhead_s=1e-6)
        f1, b1 = embedding_cost(p, llama(), micro(), mesh_groups(ParallelLayout(), 8))
        groups = mesh_groups(ParallelLayout(tp=2, sp=True), 8)
        f2, b2 = embedding_cost(p, llama(), micro(tp=2, sp=True), groups)
        assert (f1.overhead_s, b1.overhead_s) == pytest.approx((1e-6, 2e-6))
        assert (f2.overhead_s, b2.overhead_s) == pytest.approx((2e-6, 3e-6))


# ============================================================================================
# 6. forward_kernel_count
# ============================================================================================
class TestKernelCount:
    def _count(self, model: ModelSpec, mb: MicroBatch, **layout) -> int:
        lay = ParallelLayout(tp=mb.tp, sp=mb.sp, cp=mb.cp, **layout)
        return forward_kernel_count(model, model.moe is not None, mb, lay)

    def test_dense_llama(self):
        # 2 norms + 2 residual adds + RoPE 1 + QKV/out projections 2 + flash 1 + FC1, FC2 2 + SwiGLU 1 = 11
        assert self._count(llama(), micro()) == 2 + 2 + 1 + 2 + 1 + 2 + 1 == 11

    def test_tp2_sp(self):
        # + 4 collectives (2 all-gathers, 2 reduce-scatters): 11 + 4 = 15
        assert self._count(llama(), micro(tp=2, sp=True)) == 15

    def test_tp2_without_sp(self):
        # + 2 all-reduces: 13
        assert self._count(llama(), micro(tp=2)) == 13

    def test_fp8(self):
        # FP8 input casts are fused into the norm / activation kernels: no extra launches, still 11
        assert self._count(llama(), micro(precision=Precision.fp8)) == 11

    def test_unfused_attention_and_cp(self):
        # unfused core: 2 batched GEMMs + softmax + dropout = 4 instead of 1 -> 14; CP gather + 1 -> 15
        assert self._count(llama(), micro(flash=False)) == 14
        assert self._count(llama(), micro(flash=False, cp=2)) == 15

    def test_moe_with_ep(self):
        # 2 norms + 2 adds + RoPE + 2 projections + flash = 8; router GEMM 1 + score/top-k/aux-loss 3 +
        # permute/unpermute 2 + sort/unsort 2 (2 local experts) + one GEMM per local expert in each of the
        # 2 grouped GEMMs 4 + activation 1 + tokens' and probabilities' all-to-alls 3 + counts' all-gather 1
        assert self._count(small_moe(), micro(), dp_shard=2, ep=2) == 8 + 1 + 3 + 2 + 2 + 4 + 1 + 3 + 1 == 25

    def test_moe_without_ep(self):
        # 4 local experts: 8 GEMM launches; no all-to-all, no all-gather: 8 + 1 + 3 + 2 + 2 + 8 + 1 = 25
        assert self._count(small_moe(), micro()) == 25

    def test_moe_shared_expert_adds_three(self):
        # docstring: shared experts 3 each (2 GEMMs + activation): 25 + 3 = 28
        model = small_moe(num_shared_experts=1)
        assert self._count(model, micro(), dp_shard=2, ep=2) == 28


# ============================================================================================
# 7. microbatches_in_flight, interleaved 1F1B
# ============================================================================================
class TestInterleavedInFlight:
    def test_p4_v3(self):
        # Megatron warm-up (v-1)*p + 2*(p-1-i) chunk forwards + the one in progress, 1/v stage each:
        # i=0: (2*4 + 2*3 + 1)/3 = 15/3 = 5;  i=1: (8 + 4 + 1)/3 = 13/3
        # i=2: (8 + 2 + 1)/3 = 11/3;          i=3: (8 + 0 + 1)/3 = 9/3 = 3
        got = [microbatches_in_flight(Schedule.interleaved_1f1b, i, 4, 12, 3) for i in range(4)]
        assert got == pytest.approx([5.0, 13 / 3, 11 / 3, 3.0])
        # Korthikanti et al. §3: stage 0 holds p * (1 + (p-1)/(p*v)) = 4 * (1 + 3/12) = 5
        assert got[0] == pytest.approx(4 * (1 + 3 / 12))

    def test_p4_v3_capped_by_micro_batches(self):
        # m=4: 4*3 = 12 chunk forwards in all < 15 warm-up: every micro-batch is in flight -> 4
        assert microbatches_in_flight(Schedule.interleaved_1f1b, 0, 4, 4, 3) == 4.0
        assert microbatches_in_flight(Schedule.interleaved_1f1b, 3, 4, 4, 3) == pytest.approx(3.0)


def test_ep_all_to_all_overlapped_with_another_micro_batch():
    """ep_comm_overlap hides eff * min(all-to-all, the pass's own compute) of the expert all-to-all."""
    prof = easy_profile(async_overlap_efficiency=0.5)
    plain = block(small_moe(), micro(), prof, dp_shard=2, ep=2)
    overlapped = block(small_moe(), micro(), prof, dp_shard=2, ep=2, ep_comm_overlap=True)
    a2a = plain.forward.comm_s["ep"]
    assert plain.forward.exposed_comm_s["ep"] == pytest.approx(a2a)
    expected = a2a - 0.5 * min(a2a, overlapped.forward.compute_s)
    assert overlapped.forward.exposed_comm_s["ep"] == pytest.approx(expected)
    assert expected < a2a


def test_moe_load_imbalance_scales_the_busiest_ranks_routed_work():
    """Dropless routing: the busiest expert rank handles T·top_k·imbalance copies; capacity-padded
    experts always handle T·top_k·capacity_factor (tokens beyond capacity are dropped)."""
    from planner.cost.layer import routed_token_count

    dropless = small_moe()
    assert routed_token_count(dropless.moe, 1000, 1.5) == 1000 * dropless.moe.top_k * 1.5
    padded = small_moe(capacity_factor=1.25)
    assert routed_token_count(padded.moe, 1000, 1.5) == 1000 * padded.moe.top_k * 1.25
    balanced = block(small_moe(), micro(), dp_shard=2, ep=2)
    skewed = block(small_moe(), replace(micro(), moe_imbalance=2.0), dp_shard=2, ep=2)
    assert skewed.forward.comm_s["ep"] > balanced.forward.comm_s["ep"]
    assert skewed.forward.gemm_s > balanced.forward.gemm_s


# ============================================================================================
# What a model family adds (planner.hf_config): sliding windows, extra norms, q/k norms, soft-capping
# ============================================================================================
class TestWhatAFamilyAdds:
    def test_a_window_prices_the_keys_each_query_attends_to(self):
        from planner.cost.flops import attention_window_share, windowed_work_ratio

        assert windowed_work_ratio(8, 3) == pytest.approx(21 / 36)  # keys 1,2,3,3,3,3,3,3 of 1+2+...+8
        assert windowed_work_ratio(8, 8) == 1.0
        s, w = 1024, 256
        ratio = (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)
        gemma = llama(sliding_window=w, global_layer_every=2)  # blocks 0 and 2 windowed, 1 and 3 global
        share = (2 * ratio + 2) / 4
        assert attention_window_share(gemma, s) == pytest.approx(share)
        assert attention_window_share(llama(sliding_window=w), s) == pytest.approx(ratio)  # every block
        full, windowed = block(llama(), micro()), block(gemma, micro())
        assert windowed.forward.attention_s == pytest.approx(full.forward.attention_s * share)
        assert windowed.backward.attention_s == pytest.approx(full.backward.attention_s * share)
        assert windowed.forward.gemm_s == full.forward.gemm_s

    def test_model_flops_count_the_keys_a_window_leaves(self):
        """MFU's model FLOPs: a windowed block's attention core times its window ratio, the rest unchanged."""
        from planner.cost.flops import attention_core_flops, layer_flops, model_flops_per_step, windowed_work_ratio

        s, w = 1024, 256
        gemma, plain = llama(sliding_window=w, global_layer_every=2), llama()
        core = attention_core_flops(plain, 2, s)
        assert layer_flops(gemma, 0, 2, s).attention_core == pytest.approx(core * windowed_work_ratio(s, w))
        assert layer_flops(gemma, 1, 2, s).attention_core == core  # every second block attends to the whole prefix
        saved = 3 * 2 * core * (1 - windowed_work_ratio(s, w))  # 3 x forward, two windowed blocks of four
        assert model_flops_per_step(plain, 2, s) - model_flops_per_step(gemma, 2, s) == pytest.approx(saved)

    def test_extra_norms_and_qk_norms_are_bandwidth_passes(self):
        base, more = block(llama(), micro()), block(llama(extra_norms=2, qk_norm=True), micro())
        tokens = 2 * 1024
        norms = 2 * (2 * 2 * tokens * H) / 1e12  # two more norms, each reading and writing tokens x H in bf16
        qk = 2 * 2 * tokens * (HEADS + KV) * 128 / 1e12  # every query and key head, read and written
        assert more.forward.memory_s - base.forward.memory_s == pytest.approx(norms + qk)

    def test_soft_capped_logits_are_three_passes_over_them(self):
        groups = mesh_groups(ParallelLayout(tp=2), 8)
        base = lm_head_cost(easy_profile(), llama(), micro(tp=2), groups)
        capped = lm_head_cost(easy_profile(), llama(logit_softcap=30.0), micro(tp=2), groups)
        passes = 3 * 2 * 2 * (2 * 1024) * VOCAB / 2 / 1e12  # divide, tanh, multiply: read + write bf16 logits
        assert capped[0].memory_s - base[0].memory_s == pytest.approx(passes)
        assert capped[1].memory_s - base[1].memory_s == pytest.approx(passes)
