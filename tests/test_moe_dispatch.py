"""MoE dispatch terms of the cost model, each worked out by hand on a small case.

The easy device: 100 TFLOP/s bf16, 1e12 B/s HBM, every efficiency 1, no GEMM K overhead, no kernel launch
cost unless a test sets one; links: 100 GB/s bus bandwidth inside a node, 10 GB/s per GPU across nodes,
alpha 0 unless a test sets one. A bf16 GEMM takes ``max(2mnk / (1e14 · waves), 2(mk + kn + mn) / 1e12)``
(waves: the useful share of the tile slots, 1 where the device has no SM count).

The small MoE: h = 1024, 8 heads of 128, 2 KV heads, SwiGLU, E = 4 experts of FFN 512, top-2; one
micro-batch of 2 x 1024 tokens (T = 2048). Sources of each term: Megatron-Core's alltoall dispatcher
(megatron/core/transformer/moe/token_dispatcher.py, core_v0.15.0) and Transformer Engine's GroupedLinear
(multi_stream_cublas_gemm, 4 compute streams); see planner/cost/layer.py.
"""

from __future__ import annotations

import pytest

from planner.contracts import (
    Assumptions,
    ClusterProfile,
    Collective,
    DeviceSpec,
    GemmLayout,
    GemmPoint,
    LinkLevel,
    LinkProfile,
    ModelSpec,
    MoESpec,
    ParallelLayout,
    Precision,
    Recompute,
    TrainingConfig,
)
from planner.contracts.cluster import ComputeProfile
from planner.cost.comm import mesh_groups
from planner.cost.compute import grouped_gemm_time_s
from planner.cost.layer import MicroBatch, block_cost, forward_kernel_count


def profile(*, nodes: int = 1, sm_count: int | None = None, tiles=((128, 128),), gemm=(), alpha: float = 0.0,
            inter_alpha: float = 0.0, **assume) -> ClusterProfile:
    values = {"matmul_efficiency": 1.0, "fp8_matmul_efficiency": 1.0, "attention_efficiency": 1.0,
              "memory_bandwidth_efficiency": 1.0, "gemm_k_overhead": 0.0, "kernel_overhead_s": 0.0,
              "async_overlap_efficiency": 1.0, "tp_overlap_efficiency": 1.0, "moe_host_sync_s": 0.0,
              "gemm_tiles": list(tiles)}
    values.update(assume)
    links = [LinkProfile(level=LinkLevel.intra_node, collective=Collective.all_reduce, alpha_s=alpha,
                         busbw_bytes_per_s=100e9),
             LinkProfile(level=LinkLevel.inter_node, collective=Collective.all_reduce, alpha_s=inter_alpha,
                         busbw_bytes_per_s=10e9)]
    return ClusterProfile(
        kind="reference", name="easy",
        device=DeviceSpec(name="easy-gpu", memory_bytes=80 * 2**30, hbm_bandwidth_bytes_per_s=1e12,
                          sm_count=sm_count, peak_tflops={Precision.bf16: 100.0}),
        gpus_per_node=8, num_nodes=nodes, links=links, assumptions=Assumptions(**values),
        compute=ComputeProfile(gemm=list(gemm)),
    )


def moe_model(**moe) -> ModelSpec:
    spec = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 512}
    spec.update(moe)
    return ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=2048,
                     ffn_kind="swiglu", vocab_size=32000, position_embedding="rope", moe=MoESpec(**spec))


def block(lay: ParallelLayout, model: ModelSpec | None = None, prof: ClusterProfile | None = None):
    micro = MicroBatch.of(lay, TrainingConfig(seq_length=1024, global_batch_size=64), batch=2)
    prof = prof or profile()
    return block_cost(prof, model or moe_model(), 0, micro, lay, mesh_groups(lay, prof.gpus_per_node))


# ============================================================================================
# 1. expert tensor parallelism: etp = tp and 1 < etp < tp by one formula
# ============================================================================================
class TestExpertTensorParallel:
    def test_etp_equal_tp_gathers_the_routed_rows_instead_of_the_ffn_pair(self):
        # tp = etp = 2 +SP, ep = 2. Attention's all-gather + reduce-scatter of T x h x 2 B = 4,194,304 B over
        # 2 ranks: 1/2 * 4,194,304 / 100e9 = 2.097152e-5 s each. The experts: a rank's 1024 SP tokens x 2
        # copies come by the all-to-all, and are all-gathered over the TP group: 4096 rows x 1024 x 2 B =
        # 8,388,608 B, 1/2 * 8,388,608 / 100e9 = 4.194304e-5 s for the all-gather and the reduce-scatter.
        # No FFN pair on T x h.
        bc = block(ParallelLayout(tp=2, sp=True, dp_shard=2, ep=2))
        assert bc.forward.comm_s["tp"] == pytest.approx(2 * 2.097152e-5 + 2 * 4.194304e-5)
        assert bc.forward.comm_bytes["tp"] == pytest.approx(2 * 4_194_304 + 2 * 8_388_608)
        # backward: the attention's reduce-scatter, output-gradient gather and input re-gather (3), and the
        # experts' mirrored pair
        assert bc.backward.comm_s["tp"] == pytest.approx(3 * 2.097152e-5 + 2 * 4.194304e-5)

    def test_folded_etp_is_the_same_formula_on_its_own_group(self):
        # tp = 4 +SP, etp = 2, ep = 2 (dp_shard 1): 512 SP tokens x 2 copies per rank, gathered over 2 ranks:
        # 2048 rows x 1024 x 2 B = 4,194,304 B, 1/2 * 4,194,304 / 100e9 = 2.097152e-5 s each way.
        # Attention pair over 4 ranks: 3/4 * 4,194,304 / 100e9 = 3.145728e-5 s each
        bc = block(ParallelLayout(tp=4, sp=True, dp_shard=1, ep=2, etp=2))
        assert bc.forward.comm_s["tp"] == pytest.approx(2 * 3.145728e-5 + 2 * 2.097152e-5)

    def test_shared_experts_keep_the_attention_groups_pair(self):
        # one shared expert of FFN 512: a TP-split MLP, one more pair on T x h: 2 * 2 * 2.097152e-5 + experts
        bc = block(ParallelLayout(tp=2, sp=True, dp_shard=2, ep=2), moe_model(num_shared_experts=1))
        assert bc.forward.comm_s["tp"] == pytest.approx(4 * 2.097152e-5 + 2 * 4.194304e-5)

    def test_without_sequence_parallelism_two_all_reduces_as_a_dense_block(self):
        # tp = 2, no SP (Megatron-Core refuses it for MoE training; priced as a dense block): 2 all-reduces of
        # T x h x 2 B: 2 * (2 * 1/2 * 4,194,304 / 100e9) = 8.388608e-5 s, nothing gathered for the experts
        bc = block(ParallelLayout(tp=2, sp=False, dp_shard=2, ep=2))
        assert bc.forward.comm_s["tp"] == pytest.approx(8.388608e-5)


# ============================================================================================
# 2. host synchronisation and the counts' all-gather (forward only)
# ============================================================================================
class TestHostSync:
    def test_one_sync_per_moe_layer_forward(self):
        bc = block(ParallelLayout(dp_shard=2, ep=2), prof=profile(moe_host_sync_s=26e-6))
        assert bc.forward.overhead_s == pytest.approx(26e-6)
        assert bc.backward.overhead_s == 0.0
        # full recompute re-runs the forward, sync included
        assert bc.backward_s(Recompute.full) - bc.backward_s(Recompute.none) == pytest.approx(bc.forward.total_s)

    def test_no_sync_when_padded_to_capacity(self):
        bc = block(ParallelLayout(dp_shard=2, ep=2), moe_model(capacity_factor=1.25), profile(moe_host_sync_s=26e-6))
        assert bc.forward.overhead_s == 0.0

    def test_sync_beside_another_micro_batch_with_ep_overlap(self):
        # ep_comm_overlap, async efficiency 0.5: half of the 26 us runs beside the other micro-batch's compute
        prof = profile(moe_host_sync_s=26e-6, async_overlap_efficiency=0.5)
        bc = block(ParallelLayout(dp_shard=2, ep=2, ep_comm_overlap=True), prof=prof)
        assert bc.forward.overhead_s == pytest.approx(13e-6)

    def test_counts_all_gather_over_the_tp_ep_group(self):
        # ep = 4 x etp = 1, no TP, one node, alpha 10 us: E = 4 counts x 8 B from each of 4 ranks = 128 B,
        # 10e-6 + 3/4 * 128 / 100e9 = 1.000096e-5 s, forward only (the backward reuses the counts)
        bc = block(ParallelLayout(dp_shard=4, ep=4), prof=profile(alpha=10e-6))
        assert bc.forward.comm_s["ep"] - bc.backward.comm_s["ep"] == pytest.approx(1.000096e-5)
        assert bc.forward.comm_bytes["ep"] - bc.backward.comm_bytes["ep"] == pytest.approx(128)


# ============================================================================================
# 3. grouped GEMM: one GEMM per local expert, 4 at a time
# ============================================================================================
class TestGroupedGemm:
    # a 4-SM device with 128 x 128 tiles; an expert GEMM of 128 x 256 x 1024 has 2 tiles: half the SMs.
    # Alone: compute 2 * 128 * 256 * 1024 / (1e14 * 0.5) = 1.34217728e-6 s, bytes 2 * (128 * 1024 + 1024 *
    # 256 + 128 * 256) = 851,968 B -> 8.51968e-7 s: 1.34217728e-6 s
    def test_alone_each_expert_leaves_half_the_sms_idle(self):
        p = profile(sm_count=4)
        assert grouped_gemm_time_s(p, 128, 256, 1024, Precision.bf16, 4, 1) == pytest.approx(4 * 1.34217728e-6)

    def test_four_streams_share_the_waves_and_add_their_bytes(self):
        # 4 at once: 8 tiles = 2 full waves, compute 4 * 6.7108864e-7 = 2.68435456e-6 s; their bytes add up:
        # 4 * 8.51968e-7 = 3.407872e-6 s, the bound
        p = profile(sm_count=4)
        assert grouped_gemm_time_s(p, 128, 256, 1024, Precision.bf16, 4, 4) == pytest.approx(3.407872e-6)
        # 6 experts: a round of 4, then 2 at once (4 tiles, one full wave: compute 1.34217728e-6, bytes
        # 1.703936e-6)
        assert grouped_gemm_time_s(p, 128, 256, 1024, Precision.bf16, 6, 4) == pytest.approx(3.407872e-6 + 1.703936e-6)

    def test_measured_table_at_the_per_expert_shape_with_its_tail_shared(self):
        # a table of one point, 128 x 256 x 1024 in 2 us (its rate everywhere); 4 at once fill the waves
        # twice as well (0.5 -> 1): 4 * 2e-6 * 0.5 / 1 = 4e-6 s
        point = GemmPoint(precision=Precision.bf16, m=128, n=256, k=1024, layout=GemmLayout.nt, time_s=2e-6)
        p = profile(sm_count=4, gemm=[point])
        assert grouped_gemm_time_s(p, 128, 256, 1024, Precision.bf16, 4, 4, GemmLayout.nt) == pytest.approx(4e-6)
        assert grouped_gemm_time_s(p, 128, 256, 1024, Precision.bf16, 4, 1, GemmLayout.nt) == pytest.approx(8e-6)

    def test_experts_of_a_block_and_their_launches(self):
        # ep = 2: 2 local experts on 4096 / 2 = 2048 rows each, on the SM-less easy device (no waves):
        # up 2 * 2048 * 1024 * 1024 / 1e14 = 4.294967296e-5, down 2 * 2048 * 1024 * 512 / 1e14 =
        # 2.147483648e-5 per expert. Attention: QKV 2 * 2048 * 1536 * 1024 / 1e14 = 6.442450944e-5,
        # out 4.294967296e-5; router 2048 x 4 x 1024: bytes 2 * (2048 * 1024 + 1024 * 4 + 2048 * 4) =
        # 4,218,880 B -> 4.21888e-6 s (its FLOPs 1.6777216e-7 s)
        bc = block(ParallelLayout(dp_shard=2, ep=2))
        experts = 2 * (4.294967296e-5 + 2.147483648e-5)
        assert bc.forward.gemm_s == pytest.approx(6.442450944e-5 + 4.294967296e-5 + 4.21888e-6 + experts)
        # launches: one per expert GEMM, 2 grouped GEMMs x 2 experts = 4 (the count with 1 expert per rank: 2)
        lay = ParallelLayout(dp_shard=2, ep=2)
        one = ParallelLayout(dp_shard=4, ep=4)
        tr = TrainingConfig(seq_length=1024, global_batch_size=64)
        two_experts = forward_kernel_count(moe_model(), True, MicroBatch.of(lay, tr), lay)
        one_expert = forward_kernel_count(moe_model(), True, MicroBatch.of(one, tr), one)
        # 2 expert GEMM launches and the sort/unsort by local expert (2) go with the second local expert
        assert two_experts - one_expert == 2 + 2


# ============================================================================================
# 4. router kernels and token permutation: HBM traffic
# ============================================================================================
class TestPermutation:
    def test_forward_memory_of_a_folded_block(self):
        # tp = 2 +SP, ep = 4, etp = 1 (1 local expert: nothing to sort), 2 B elements, no dropout.
        # E = 2048 x 1024 = 2,097,152 elements, split over tp by SP:
        #   2 norms 2 * (2 * 2 * E / 2) = 8,388,608; 2 residual adds 2 * (3 * 2 * E / 2) = 12,582,912
        #   SwiGLU over the routed copies 3 * 2 * 2048 * (512 * 2) / 2 = 6,291,456
        #   RoPE on 4 + 1 local heads 2 * 2 * 2048 * 5 * 128 = 5,242,880
        #   router: 22 B per score of the 1024 local tokens x 4 experts = 90,112
        #   permute: each of the 1024 tokens read once, its 2 copies written: 3 * 1024 * 1024 * 2 = 6,291,456
        #   unpermute: the 2 copies read, their sum written: 6,291,456
        total = 8_388_608 + 12_582_912 + 6_291_456 + 5_242_880 + 90_112 + 6_291_456 + 6_291_456
        bc = block(ParallelLayout(tp=2, sp=True, dp_shard=2, ep=4, etp=1))
        assert bc.forward.memory_s == pytest.approx(total / 1e12)
        assert bc.backward.memory_s == pytest.approx(1.25 * total / 1e12)

    def test_sorting_by_local_expert_and_padding_to_capacity(self):
        # no TP, ep = 2 (2 local experts), capacity factor 1.5: 3 copies per token.
        #   norms 2 * 2 * 2 * E = 16,777,216; adds 2 * 3 * 2 * E = 25,165,824 (E = 2,097,152)
        #   SwiGLU 3 * 2 * 2048 * (512 * 3) = 18,874,368; RoPE 2 * 2 * 2048 * 10 * 128 = 10,485,760
        #   router 22 * 2048 * 4 = 180,224; permute (1 + 3) * 2048 * 1024 * 2 = 16,777,216; unpermute the same
        #   sort and unsort the 2048 * 3 = 6144 rows a rank computes: 2 * (2 * 6144 * 1024 * 2) = 50,331,648
        total = (16_777_216 + 25_165_824 + 18_874_368 + 10_485_760 + 180_224 + 2 * 16_777_216 + 50_331_648)
        bc = block(ParallelLayout(dp_shard=2, ep=2), moe_model(capacity_factor=1.5))
        assert bc.forward.memory_s == pytest.approx(total / 1e12)


# ============================================================================================
# 5. expert-parallel all-to-all across nodes
# ============================================================================================
class TestAllToAllAcrossNodes:
    def test_ep16_spans_two_nodes(self):
        # 16 experts, top-2, ep = 16 over 2 nodes of 8 (etp = 1: consecutive ranks, 8 per node), alpha 25 us
        # across nodes. A rank's buffer: 2048 tokens x 2 copies x 1024 x 2 B = 8,388,608 B; it sends
        # (16 - 8)/16 through its NIC, 8,388,608 * 8/16 / 10e9 = 4.194304e-4 s, and 7/16 over NVLink,
        # 3.670016e-5 s, at once: 25e-6 + 4.194304e-4 = 4.444304e-4 s per all-to-all, dispatch + combine.
        # The probabilities: 4096 x 4 B = 16,384 B -> 25e-6 + 16,384 * 8/16 / 10e9 = 2.58192e-5 s.
        model = moe_model(num_experts=16)
        bc = block(ParallelLayout(dp_shard=16, ep=16), model, profile(nodes=2, inter_alpha=25e-6))
        assert bc.backward.comm_s["ep"] == pytest.approx(2 * 4.444304e-4 + 2.58192e-5)
        # forward also gathers the counts over the 16 ranks: 16 x 8 B x 16 = 2048 B; 8 per node, so 8 rails:
        # min(100e9, 8 * 10e9) = 80e9 B/s, 25e-6 + 15/16 * 2048 / 80e9 = 2.5024e-5 s
        assert bc.forward.comm_s["ep"] == pytest.approx(2 * 4.444304e-4 + 2.58192e-5 + 2.5024e-5)

    def test_ep8_stays_on_the_node(self):
        # ep = 8 on one node: 7/8 * 8,388,608 / 100e9 = 7.340032e-5 s per all-to-all; probabilities
        # 7/8 * 16,384 / 100e9 = 1.4336e-7 s
        bc = block(ParallelLayout(dp_shard=16, ep=8), moe_model(num_experts=16), profile(nodes=2, inter_alpha=25e-6))
        assert bc.backward.comm_s["ep"] == pytest.approx(2 * 7.340032e-5 + 1.4336e-7)
