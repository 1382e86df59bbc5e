"""planner/cost/predict.py: layout checks, the default layer split, and end-to-end properties of a
prediction for a small GPT-style model on one DGX A100 node (8 GPUs)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from planner.contracts import (
    ClusterProfile,
    ComputeProfile,
    DeviceCheck,
    GemmLayout,
    GemmPoint,
    ModelSpec,
    MoESpec,
    ParallelLayout,
    Precision,
    Prediction,
    Recompute,
    Schedule,
    TrainingConfig,
)
from planner.cost.checks import check_layout, default_layer_split
from planner.cost.predict import predict
from planner.errors import AutoparError
from planner.reference import reference_profile

# GPT-style: 8 layers, h=1024, 16 heads of 64, GeLU FFN 4h, RMSNorm, no biases, RoPE, untied, V=32000
L, Hd, V, SEQ = 8, 1024, 32000, 1024


def small_model(**changes) -> ModelSpec:
    fields = dict(num_layers=L, hidden_size=Hd, num_attention_heads=16, ffn_hidden_size=4 * Hd, ffn_kind="gelu",
                  vocab_size=V, linear_bias=False)
    fields.update(changes)
    return ModelSpec(**fields)


def train(gbs: int = 32, **changes) -> TrainingConfig:
    return TrainingConfig(seq_length=changes.pop("seq_length", SEQ), global_batch_size=gbs, **changes)


@pytest.fixture(scope="module")
def node():
    return reference_profile("dgx-a100-80gb", 1)


def run(profile, gbs: int = 32, model: ModelSpec | None = None, **layout) -> Prediction:
    return predict(model or small_model(), train(gbs), profile, ParallelLayout(**layout))


# ============================================================================================
# check_layout
# ============================================================================================
class TestCheckLayout:
    def _raises(self, field: str, model: ModelSpec, training: TrainingConfig, layout: ParallelLayout, gpus: int = 8):
        with pytest.raises(AutoparError) as info:
            check_layout(model, training, layout, gpus)
        assert info.value.field == field
        assert str(info.value).startswith(f"{field}=")  # the message names the field first
        return str(info.value)

    def test_returns_micro_batches(self):
        # 32 sequences / (dp 4 x micro-batch 2) = 4 micro-batches
        assert check_layout(small_model(), train(32), ParallelLayout(dp_shard=4, tp=2, micro_batch_size=2), 8) == 4

    def test_gpu_count_mismatch(self):
        msg = self._raises("layout", small_model(), train(), ParallelLayout(dp_shard=4))
        assert "4 GPUs" in msg and "8" in msg

    def test_gpu_count_mismatch_through_predict(self, node):
        with pytest.raises(AutoparError, match="layout"):
            run(node, dp_shard=16)

    def test_tp_not_dividing_heads(self):
        model = small_model(hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072)
        msg = self._raises("tp", model, train(), ParallelLayout(tp=8))
        assert "num_attention_heads=12" in msg

    def test_tp_incompatible_with_kv_heads(self):
        # 12 heads, 3 KV heads, tp=4: 4 divides 12, but 3 neither divides nor is a multiple of 4
        model = small_model(hidden_size=768, num_attention_heads=12, num_kv_heads=3, ffn_hidden_size=3072)
        msg = self._raises("tp", model, train(), ParallelLayout(tp=4, dp_shard=2))
        assert "num_kv_heads=3" in msg

    def test_batch_not_divisible(self):
        msg = self._raises("micro_batch_size", small_model(), train(30), ParallelLayout(dp_shard=8))
        assert "global_batch_size=30" in msg

    def test_batch_not_divisible_by_micro_batch(self):
        # dp 8 x micro-batch 3 = 24 does not divide 32
        self._raises("micro_batch_size", small_model(), train(32), ParallelLayout(dp_shard=8, micro_batch_size=3))

    def test_cp_not_splitting_sequence(self):
        # 1020 % 8 != 0
        msg = self._raises("cp", small_model(), train(seq_length=1020), ParallelLayout(cp=8))
        assert "seq_length=1020" in msg

    def test_cp_needs_two_chunks_per_rank(self):
        # 1000 % 8 == 0 but 1000 % 16 != 0 (causal load balancing splits into 2 x cp chunks)
        self._raises("cp", small_model(), train(seq_length=1000), ParallelLayout(cp=8))

    def test_sp_needs_tp_dividing_sequence(self):
        self._raises("sp", small_model(), train(seq_length=1020), ParallelLayout(tp=8, sp=True))

    def test_ep_on_dense_model(self):
        msg = self._raises("ep", small_model(), train(), ParallelLayout(dp_shard=8, ep=2))
        assert "Mixture-of-Experts" in msg

    def test_ep_not_dividing_experts(self):
        model = small_model(moe=MoESpec(num_experts=6, top_k=2, expert_ffn_hidden_size=512))
        self._raises("ep", model, train(), ParallelLayout(dp_shard=8, ep=4))

    def test_ep_not_dividing_dp_shard(self):
        model = small_model(moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=512))
        # ep=8 folded over dp_shard x cp = 4 ranks
        self._raises("ep", model, train(), ParallelLayout(dp_shard=4, tp=2, ep=8))

    def test_interleaved_micro_batches_not_divisible_by_pp(self):
        # 12 sequences / dp 4 = 3 micro-batches, pp = 2
        layout = ParallelLayout(dp_shard=4, pp=2, schedule=Schedule.interleaved_1f1b, virtual_stages=2)
        msg = self._raises("schedule", small_model(), train(12), layout)
        assert "pp=2" in msg

    def test_layers_per_stage_not_summing(self):
        layout = ParallelLayout(dp_shard=4, pp=2, layers_per_stage=[3, 3])
        msg = self._raises("layers_per_stage", small_model(), train(), layout)
        assert "sums to 6" in msg and f"num_layers={L}" in msg

    def test_layers_per_stage_negative(self):
        layout = ParallelLayout(dp_shard=4, pp=2, layers_per_stage=[9, -1])
        self._raises("layers_per_stage", small_model(), train(), layout)

    def test_more_stages_than_layers(self):
        # 4 x 4 virtual = 16 stages for 8 layers
        layout = ParallelLayout(dp_shard=2, pp=4, schedule=Schedule.interleaved_1f1b, virtual_stages=4)
        self._raises("pp x virtual_stages", small_model(), train(), layout)


class TestDefaultLayerSplit:
    def test_extra_layers_go_to_interior_stages(self):
        # 10 = 4 x 2 + 2 extra -> stages 1 and 2 get 3
        assert default_layer_split(10, 4) == [2, 3, 3, 2]

    def test_then_last_stage(self):
        # 11 = 4 x 2 + 3: interior stages 1, 2, then the last
        assert default_layer_split(11, 4) == [2, 3, 3, 3]

    def test_even(self):
        assert default_layer_split(12, 4) == [3, 3, 3, 3]

    def test_two_stages(self):
        assert default_layer_split(5, 2) == [3, 2]

    def test_one_stage(self):
        assert default_layer_split(7, 1) == [7]

    def test_too_many_stages(self):
        with pytest.raises(AutoparError) as info:
            default_layer_split(4, 5)
        assert info.value.field == "pp x virtual_stages"


# ============================================================================================
# end-to-end properties
# ============================================================================================
class TestPredictProperties:
    def test_doubling_global_batch_doubles_the_work(self, node):
        one = run(node, 32, dp_shard=8)
        two = run(node, 64, dp_shard=8)
        # 4 -> 8 micro-batches per GPU: the busy time doubles exactly ...
        assert two.compute_time_s == pytest.approx(2 * one.compute_time_s)
        # ... and the step nearly so (the gradient reduction and optimizer step are per step, not per batch)
        ratio = two.step_time_s / one.step_time_s
        assert 1.6 < ratio < 2.0
        assert two.model_flops_per_step == pytest.approx(2 * one.model_flops_per_step)

    def test_model_state_bytes_by_hand(self, node):
        # parameters: embedding V*h; per layer 4h^2 attention + 2h RMSNorms + 8h^2 GeLU MLP; final norm h + head h*V
        phi = V * Hd + L * (4 * Hd * Hd + 2 * Hd + 8 * Hd * Hd) + Hd + Hd * V
        assert phi == 166_216_704
        # Megatron: 16-bit weights 2, fp32 grads 4, fp32 master + Adam 12 (Rajbhandari et al.)
        zero0 = predict(small_model(), train(32), node, ParallelLayout(dp_shard=8), target="megatron").memory
        assert (zero0.params_bytes, zero0.grads_bytes, zero0.optimizer_bytes) == (2 * phi, 4 * phi, 12 * phi)
        zero3 = predict(small_model(), train(32), node, ParallelLayout(dp_shard=8, zero_stage=3),
                        target="megatron").memory
        assert (zero3.params_bytes, zero3.grads_bytes, zero3.optimizer_bytes) == (
            2 * phi // 8, 4 * phi // 8, 12 * phi // 8)
        # the executor: the fp32 parameter is the master (autocast at ZeRO-0, whose 16-bit casts live through
        # the backward; FSDP2 at ZeRO-3, whose 16-bit weights exist only gathered): weights 4, Adam 8
        zero0 = run(node, dp_shard=8).memory
        assert (zero0.params_bytes, zero0.grads_bytes, zero0.optimizer_bytes) == (4 * phi, 4 * phi, 8 * phi)
        assert zero0.terms["compute_copies"] == 2 * phi
        zero3 = run(node, dp_shard=8, zero_stage=3).memory
        assert (zero3.params_bytes, zero3.grads_bytes, zero3.optimizer_bytes) == (
            4 * phi // 8, 4 * phi // 8, 8 * phi // 8)
        assert "compute_copies" not in zero3.terms

    def test_zero3_lowers_memory(self, node):
        zero0 = run(node, dp_shard=8).memory
        zero1 = run(node, dp_shard=8, zero_stage=1).memory
        zero3 = run(node, dp_shard=8, zero_stage=3).memory
        zero2 = run(node, dp_shard=8, zero_stage=2).memory
        assert zero3.total_bytes < zero1.total_bytes < zero0.total_bytes
        assert zero3.activations_bytes == zero2.activations_bytes
        # ZeRO-0/1 train 16-bit on fp32 parameters under autocast: more activation bytes per formula byte
        a = node.assumptions
        assert zero0.activations_bytes / zero3.activations_bytes == pytest.approx(
            a.autocast_activation_factor / a.activation_memory_factor, rel=1e-6)

    def test_keep_gathered_zero3_holds_every_block(self, node):
        """Without resharding, ZeRO-3 keeps every block's unsharded 16-bit weights from forward to backward:
        the stage's whole parameter count x 2 bytes, against 2 x the biggest block with resharding, beside the
        executor's root unit (embedding, final norm, output: TargetFacts.fsdp_root) held through the backward."""
        reshard = run(node, dp_shard=8, zero_stage=3).memory
        keep = run(node, dp_shard=8, zero_stage=3, reshard_after_forward=False).memory
        phi = V * Hd + L * (4 * Hd * Hd + 2 * Hd + 8 * Hd * Hd) + Hd + Hd * V
        block = 4 * Hd * Hd + 2 * Hd + 8 * Hd * Hd
        assert keep.terms["gathered_weights"] == 2 * phi
        assert reshard.terms["gathered_weights"] == 2 * 2 * block
        root = V * Hd + Hd + Hd * V
        assert reshard.terms["root_weights"] == 2 * root and "root_weights" not in keep.terms
        assert keep.total_bytes > reshard.total_bytes + 2 * phi - 4 * block - 2 * root

    def test_pipelined_fsdp_holds_gathered_weights_and_unsharded_gradients(self, node):
        """torch's pipeline stages turn FSDP's resharding after backward and its gradient reduction off until
        the last micro-batch: a pipelined ZeRO-3 stage holds its blocks' 16-bit weights and fp32 gradients
        whole (per stage: params x 2 and x 4 bytes), where pp=1 holds 2 gathered blocks and 1 block's gradients."""
        flat = run(node, dp_shard=8, zero_stage=3).memory
        piped = run(node, dp_shard=4, pp=2, zero_stage=3).memory
        block = 4 * Hd * Hd + 2 * Hd + 8 * Hd * Hd
        assert flat.terms["gathered_weights"] == 2 * 2 * block and flat.terms["gradient_bucket"] == 4 * block
        assert "held_gradients" not in flat.terms
        gathered = piped.params_bytes * 2  # ZeRO-3 over dp_shard=4 keeps 1/4 of the stage's fp32 parameters
        assert piped.terms["gathered_weights"] == pytest.approx(gathered, rel=1e-6)
        assert piped.terms["held_gradients"] == pytest.approx(2 * gathered, rel=1e-6)  # fp32: twice the bytes
        assert "gradient_bucket" not in piped.terms

    def test_buffers_and_total(self, node):
        mem = run(node, dp_shard=8).memory
        a = node.assumptions
        # the LM head's logits and loss: bytes per logit x 1024 tokens x 32000 / t=1
        loss = a.loss_bytes_per_logit * 1024 * 32000
        # allocated at the peak: states, activations, the loss and the executor's 16-bit casts of its fp32
        # parameters (2 bytes each); the allocator reserves a share beyond it
        copies = mem.params_bytes / 2
        assert mem.terms["compute_copies"] == copies
        allocated = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes + mem.activations_bytes + loss + copies
        # outside the allocator: the runtime, and two NCCL communicators (the world's and dp_shard's)
        fixed = a.runtime_bytes + 2 * a.communicator_bytes + a.reserved_memory_bytes
        assert mem.terms["loss"] == int(loss)
        assert mem.buffers_bytes == pytest.approx(loss + copies + allocated * a.allocator_fragmentation + fixed,
                                                  abs=8)
        parts = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes + mem.activations_bytes + mem.buffers_bytes
        assert abs(mem.total_bytes - parts) <= 5  # parts are truncated to ints separately
        assert mem.capacity_bytes == 80 * 2**30 and mem.fits
        assert mem.headroom_bytes == int(80 * 2**30 * a.memory_headroom)

    def test_activations_by_hand(self, node):
        # 1F1B with pp=1 keeps 1 micro-batch. Per layer (b=1, s=1024, h=1024, no dropout, flash, t=1):
        # 4 saved 2-byte inputs (2 norms, QKV, FC1) 8sbh + Q, K, V, out-proj input 8sbh + GeLU in/out and
        # FC2 input 16sbh = 32sbh, + log-sum-exp 4*s*a; plus the embedding output 2sbh on the first stage
        sbh = 1024 * 1024
        per_layer = 32 * sbh + 4 * 1024 * 16
        factor = node.assumptions.autocast_activation_factor  # ZeRO-0 bf16: fp32 parameters under autocast
        assert run(node, dp_shard=8).memory.activations_bytes == int(factor * (L * per_layer + 2 * sbh))

    def test_full_recompute(self, node):
        none = run(node, dp_shard=8)
        full = run(node, dp_shard=8, recompute=Recompute.full)
        assert full.memory.activations_bytes < none.memory.activations_bytes
        # each block's input (2sbh) plus the embedding output, plus one block's full activations while it
        # is recomputed: flash, no dropout, GeLU 4h, tp=1 -> norms/QKV/MLP inputs 8sbh + Q,K,V,out 8sbh
        # + FFN 2*2*s*b*4h = 16sbh, and the fp32 log-sum-exp 4*s*a
        sbh = 1024 * 1024
        factor = node.assumptions.autocast_activation_factor
        # the kept block inputs are counted exactly (planner.cost.memory.kind_factor); the formula's tensors
        # (the embedding output, the recomputed block) take the measured factor
        assert full.memory.activations_bytes == int(L * 2 * sbh + factor * (2 * sbh + 32 * sbh + 4 * 1024 * 16))
        assert full.step_time_s > none.step_time_s
        assert full.model_flops_per_step == none.model_flops_per_step
        assert full.hardware_flops_per_step > none.hardware_flops_per_step

    def test_selective_recompute_between(self, node):
        none = run(node, dp_shard=8)
        sel = run(node, dp_shard=8, recompute=Recompute.selective)
        full = run(node, dp_shard=8, recompute=Recompute.full)
        assert full.memory.activations_bytes < sel.memory.activations_bytes < none.memory.activations_bytes
        assert none.step_time_s < sel.step_time_s < full.step_time_s

    def test_flops_conventions(self, node):
        B, s, layers, h = 32, SEQ, L, Hd
        megatron = 72 * B * s * layers * h**2 * (1 + s / (6 * h) + V / (12 * layers * h))
        sc21 = 96 * B * s * layers * h**2 * (1 + s / (6 * h) + V / (16 * layers * h))
        full = run(node, dp_shard=8, recompute=Recompute.full)
        assert full.model_flops_per_step == pytest.approx(megatron, rel=1e-12)
        assert full.hardware_flops_per_step == pytest.approx(sc21, rel=1e-12)
        assert full.hfu / full.mfu == pytest.approx(sc21 / megatron)

    def test_too_large_model_does_not_fit(self, node):
        big = small_model(num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8,
                          ffn_hidden_size=28672, ffn_kind="swiglu")  # ~69B parameters, 18 bytes each on DDP
        pred = run(node, 8, model=big, dp_shard=8)
        assert pred.memory.fits is False
        assert pred.memory.total_bytes > pred.memory.capacity_bytes
        assert any("does not fit" in note for note in pred.notes)

    def test_fitting_model_has_no_note(self, node):
        pred = run(node, dp_shard=8)
        assert pred.memory.fits and not any("does not fit" in n for n in pred.notes)

    def test_throughput_and_mfu(self, node):
        pred = run(node, dp_shard=8)
        tokens = 32 * SEQ
        assert pred.tokens_per_s == pytest.approx(tokens / pred.step_time_s)
        assert pred.tokens_per_s_per_gpu == pytest.approx(tokens / pred.step_time_s / 8)
        peak = node.device.peak_tflops[Precision.bf16] * 1e12  # 312 TFLOP/s
        assert pred.mfu == pytest.approx(pred.model_flops_per_step / (pred.step_time_s * 8 * peak))
        assert 0 < pred.mfu <= pred.hfu <= 1
        assert pred.bubble_time_s == 0.0 and pred.bubble_fraction == 0.0

    def test_step_is_at_least_the_busy_time(self, node):
        for layout in (dict(dp_shard=8), dict(dp_shard=4, tp=2, sp=True), dict(dp_shard=4, pp=2)):
            pred = run(node, **layout)
            assert pred.step_time_s >= pred.compute_time_s > 0
            crit = max(pred.stages, key=lambda st: st.forward_s + st.backward_s)
            assert pred.compute_time_s == pytest.approx(
                (32 // (layout["dp_shard"])) * (crit.forward_s + crit.backward_s))

    def test_pipeline_bubble(self, node):
        one = run(node, dp_shard=4, pp=2)
        inter = run(node, dp_shard=4, pp=2, schedule=Schedule.interleaved_1f1b, virtual_stages=2)
        assert one.bubble_time_s > 0
        assert one.bubble_fraction == pytest.approx(one.bubble_time_s / one.step_time_s)
        assert 0 < inter.bubble_time_s < one.bubble_time_s
        assert [s.layers for s in one.stages] == [4, 4]
        assert [s.layers for s in inter.stages] == [4, 4]
        assert any(c.kind == "pp" for c in one.comm)
        # 1F1B: stage i holds p - i; interleaved v=2, p=2: ((v-1)p + 2(p-1-i) + 1)/v = (2+2+1)/2, (2+0+1)/2
        assert [s.microbatches_in_flight for s in one.stages] == [2.0, 1.0]
        assert [s.microbatches_in_flight for s in inter.stages] == [2.5, 1.5]

    def test_zero_bubble_smaller_than_1f1b(self, node):
        one = run(node, dp_shard=4, pp=2)
        zb = run(node, dp_shard=4, pp=2, schedule=Schedule.zero_bubble)
        assert 0 < zb.bubble_time_s < one.bubble_time_s

    def test_tp_reports_tp_comm(self, node):
        pred = run(node, dp_shard=4, tp=2)
        tp = [c for c in pred.comm if c.kind == "tp"]
        assert len(tp) == 1 and tp[0].group_size == 2 and tp[0].level.value == "intra_node"
        # tp_comm_overlap is off: forward collectives are fully exposed (half the TP time without SP);
        # backward input-gradient all-reduces run beside the weight-gradient GEMMs, so partly hidden
        assert tp[0].time_s / 2 <= tp[0].exposed_s < tp[0].time_s
        sp = [c for c in run(node, dp_shard=4, tp=2, sp=True).comm if c.kind == "tp"]
        assert len(sp) == 1 and 0 < sp[0].exposed_s <= sp[0].time_s

    def test_json_round_trip(self, node):
        pred = run(node, dp_shard=4, pp=2)
        again = Prediction.model_validate_json(pred.model_dump_json())
        assert again == pred

    def test_moe_with_expert_parallel(self, node):
        model = small_model(ffn_kind="swiglu", moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=1024))
        pred = run(node, model=model, dp_shard=8, ep=4)
        assert any(c.kind == "ep" for c in pred.comm)
        assert 0 < pred.mfu < 1


def test_pipeline_p2p_without_scatter_gather_sends_tp_times_the_bytes():
    """Megatron sends b·s·h·2/tp bytes per TP rank between stages; DeepSpeed's engine the whole b·s·h·2."""
    two_nodes = reference_profile("dgx-a100-80gb", 2)
    kwargs = dict(dp_shard=2, tp=4, pp=2, micro_batch_size=2)
    split = run(two_nodes, pp_scatter_gather=True, **kwargs)
    whole = run(two_nodes, pp_scatter_gather=False, **kwargs)
    p2p_split = next(c for c in split.comm if c.kind == "pp")
    p2p_whole = next(c for c in whole.comm if c.kind == "pp")
    model, m = small_model(), 32 // (2 * 2)  # micro-batches per pipeline
    per_transfer = 2 * SEQ * model.hidden_size * 2  # b=2 sequences x SEQ tokens x h x 2 bytes
    assert p2p_whole.bytes_per_step == pytest.approx(2 * m * per_transfer)  # forward + backward each micro-batch
    assert p2p_split.bytes_per_step == pytest.approx(2 * m * per_transfer / 4)
    assert p2p_whole.time_s > p2p_split.time_s and whole.step_time_s > split.step_time_s


# ============================================================================================
# the slowest checked device's pace
# ============================================================================================
def _checks(gemm: list[float], bw: list[float]) -> list[DeviceCheck]:
    return [DeviceCheck(rank=r, host=f"node-{r // 4}", local_rank=r % 4, device="NVIDIA A100-SXM4-80GB",
                        memory_bytes=80 << 30, precision=Precision.bf16, gemm=(8192, 8192, 8192), gemm_tflops=g,
                        memory_bandwidth_bytes_per_s=b) for r, (g, b) in enumerate(zip(gemm, bw))]


class TestDevicePace:
    def test_every_device_is_priced_at_a_stragglers_pace(self, node):
        from planner.cost.compute import (
            DevicePace,
            _roofline_gemm_time,
            attention_time_s,
            device_pace,
            gemm_time_s,
            memory_time_s,
        )
        from planner.cost.memo import memoised

        # a GEMM tile's fixed overhead (fitted, in units of K) left out, so a K = 16 GEMM is memory-bound below
        node = node.model_copy(update={"assumptions": node.assumptions.model_copy(update={"gemm_k_overhead": 0.0})})
        # rank 2's GEMM check 20% below the median, rank 3's add 47% below: stragglers (GPU limit 10%)
        slow = node.model_copy(
            update={"device_checks": _checks([250, 260, 200, 255], [1.8e12, 1.7e12, 1.8e12, 0.9e12])})
        pace = device_pace(slow)
        assert pace.compute == pytest.approx(1.25) and pace.compute_rank == 2
        assert pace.memory == pytest.approx(2.0) and pace.memory_rank == 3
        assert gemm_time_s(slow, 4096, 4096, 4096, Precision.bf16) == pytest.approx(
            1.25 * gemm_time_s(node, 4096, 4096, 4096, Precision.bf16))
        # a GEMM with K = 16: its HBM traffic at the memory pace outlasts its compute at the compute pace
        compute = _roofline_gemm_time(node, 8192, 8192, 16, Precision.bf16, DevicePace(compute=1e9)) / 1e9
        traffic = _roofline_gemm_time(node, 8192, 8192, 16, Precision.bf16, DevicePace(memory=1e9)) / 1e9
        assert 1.25 * compute < 2.0 * traffic
        assert gemm_time_s(slow, 8192, 8192, 16, Precision.bf16) == pytest.approx(2.0 * traffic)
        assert memory_time_s(slow, 1e9) == pytest.approx(2.0 * memory_time_s(node, 1e9))
        args = dict(batch=1, q_len=4096, kv_len=4096, heads=16, kv_heads=16, qk_dim=64, v_dim=64,
                    precision=Precision.bf16, causal=True)
        for a, b in zip(attention_time_s(slow, flash=True, **args), attention_time_s(node, flash=True, **args)):
            assert a == pytest.approx(1.25 * b)
        # unfused: two batched GEMMs at their pace and the scores' memory passes at the memory pace, once each
        rows = 4096 * 16
        gemms = gemm_time_s(node, rows, 4096, 64, Precision.bf16, layout=GemmLayout.nt) + gemm_time_s(
            node, rows, 64, 4096, Precision.bf16)
        paced = (gemm_time_s(slow, rows, 4096, 64, Precision.bf16, layout=GemmLayout.nt)
                 + gemm_time_s(slow, rows, 64, 4096, Precision.bf16))
        fwd_fast, _ = attention_time_s(node, flash=False, **args)
        fwd_slow, _ = attention_time_s(slow, flash=False, **args)
        assert fwd_slow == pytest.approx(paced + 2.0 * (fwd_fast - gemms))
        # the memoised path (the search) prices the same
        with memoised(slow):
            assert gemm_time_s(slow, 8192, 8192, 16, Precision.bf16) == pytest.approx(2.0 * traffic)
            assert device_pace(slow) == pace

        from planner.cost.layer import without_host  # the executor's host would hide the device's pace at tp 8

        base, priced = run(without_host(node), tp=8), run(without_host(slow), tp=8)
        assert priced.step_time_s > 1.2 * base.step_time_s
        (note,) = [n for n in priced.notes if n.startswith("priced at the slowest")]
        assert "a device check ran more than 10% below the checks' median" in note
        assert "GEMMs and attention at rank 2's, 1.25x rank 0's time" in note
        assert "memory-bound work at rank 3's, 2.00x rank 0's time" in note
        assert not [n for n in base.notes if n.startswith("priced at the slowest")]

    def test_a_measured_tables_times_are_scaled_too(self, node):
        from planner.cost.compute import gemm_time_s

        table = ComputeProfile(gemm=[GemmPoint(precision=Precision.bf16, m=s, n=s, k=s, layout=lay,
                                               time_s=1e-3 * s / 1024)
                                     for s in (1024, 2048) for lay in GemmLayout])
        measured = node.model_copy(update={"compute": table})
        slow = measured.model_copy(update={"device_checks": _checks([250, 260, 200, 255], [1.8e12] * 4)})
        for lay in GemmLayout:
            assert gemm_time_s(slow, 1024, 1024, 1024, Precision.bf16, layout=lay) == pytest.approx(1.25e-3)
            assert gemm_time_s(measured, 1024, 1024, 1024, Precision.bf16, layout=lay) == pytest.approx(1e-3)

    def test_noise_rank_0_slowest_or_no_checks_change_nothing(self, node):
        from planner.cost.compute import device_pace

        assert device_pace(node) == (1.0, 1.0, None, None)
        # within 10% of the median: timing noise, not a straggler
        noisy = node.model_copy(
            update={"device_checks": _checks([250, 240, 232, 255], [1.8e12, 1.7e12, 1.65e12, 1.8e12])})
        # rank 0 itself the straggler: its tables already run at the slowest pace
        first = node.model_copy(
            update={"device_checks": _checks([200, 250, 245, 260], [0.9e12, 1.8e12, 1.7e12, 1.9e12])})
        for p in (noisy, first):
            assert device_pace(p) == (1.0, 1.0, None, None)
            a, b = run(node, tp=8), run(p, tp=8)
            assert a.step_time_s == b.step_time_s and a.notes == b.notes

    def test_cpu_profiles_allow_more_noise(self, node):
        from planner.cost.compute import device_pace

        cpu = node.model_copy(update={
            "device": node.device.model_copy(update={"name": "CPU: AMD EPYC (1 threads/rank)"}),
            "device_checks": _checks([100, 98, 80, 101], [30e9, 29e9, 28e9, 31e9])})
        assert cpu.is_cpu and device_pace(cpu).compute == 1.0  # 19% below the median: within the CPU limit 25%
        cpu.device_checks[2].gemm_tflops = 60.0
        assert device_pace(cpu).compute == pytest.approx(100 / 60)

    def test_checks_must_include_rank_0_once(self, node):
        body = node.model_dump()
        for ranks, problem in (([1, 2], "has no check of rank 0"), ([0, 1, 1], "repeats rank(s) [1] (ranks"),
                               ([1, 1], "repeats rank(s) [1] and has no check of rank 0")):
            body["device_checks"] = [c.model_dump() | {"rank": r} for c, r in zip(_checks([1.0] * 3, [1.0] * 3), ranks)]
            with pytest.raises(ValidationError, match=re.escape(problem)):
                ClusterProfile.model_validate(body)


def test_mfu_is_against_fp32_where_a_cpu_runs_it_faster_than_bf16(node):
    """A CPU without native bf16 (its profile's bf16 'peak' is torch's fallback rate): MFU against
    its fp32 peak, so an fp32 run's MFU stays below 100% (it was 242% on the AVX2 VM's profile)."""
    from planner.cost.predict import mfu_peak_flops

    gpu = run(node, tp=8)
    assert mfu_peak_flops(node) == pytest.approx(node.device.peak_tflops[Precision.bf16] * 1e12)
    assert not [n for n in gpu.notes if "fp32 peak" in n]
    cpu = node.model_copy(update={"device": node.device.model_copy(update={
        "peak_tflops": {Precision.bf16: node.device.peak_tflops[Precision.bf16] / 4,
                        Precision.fp32: node.device.peak_tflops[Precision.bf16]}})})
    assert mfu_peak_flops(cpu) == pytest.approx(node.device.peak_tflops[Precision.bf16] * 1e12)
    slow = run(cpu, tp=8)
    assert slow.mfu == pytest.approx(slow.model_flops_per_step / (slow.step_time_s * 8 * mfu_peak_flops(cpu)))
    (note,) = [n for n in slow.notes if "fp32 peak" in n]
    assert "its fastest dense precision: its bf16 runs at" in note
