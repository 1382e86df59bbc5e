"""Model-state and activation memory (planner/cost/memory.py) and pipeline schedules
(planner/cost/pipeline.py) against hand calculations.

The activation tests reproduce Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Eq. 1-5 and Table 2) for a GPT layer: MHA, GeLU FFN of 4h, dropout > 0,
unfused attention, 2-byte activations.
"""

from __future__ import annotations

import pytest

from planner.contracts import ModelSpec, MoESpec, Optimizer, Precision, Recompute, Schedule, TrainingConfig
from planner.cost.memory import (
    ActivationShape,
    StateBytes,
    layer_activation_bytes,
    logits_bytes,
    model_state_bytes,
    state_bytes_per_param,
)
from planner.cost.pipeline import head_rank, microbatches_in_flight, pipeline_time_s, rank_chunks


def training(**changes) -> TrainingConfig:
    fields = dict(seq_length=2048, global_batch_size=8)
    fields.update(changes)
    return TrainingConfig(**fields)


# ============================================================================================
# model states
# ============================================================================================
class TestStateBytes:
    def test_bf16_adamw(self):
        # bf16 weights 2, fp32 grads 4, fp32 master 4 + Adam m, v 8 = 12
        assert state_bytes_per_param(training()) == StateBytes(2, 4, 12, master=4)

    def test_bf16_grads(self):
        assert state_bytes_per_param(training(grad_reduce_in_fp32=False)) == StateBytes(2, 2, 12, master=4)

    def test_fp32_training(self):
        # fp32 weights 4 and grads 4; no master copy (the contract turns it off): m, v = 8
        t = training(precision=Precision.fp32)
        assert t.master_weights_fp32 is False
        assert state_bytes_per_param(t) == StateBytes(4, 4, 8)

    def test_sgd(self):
        # master 4 + momentum 4
        assert state_bytes_per_param(training(optimizer=Optimizer.sgd)) == StateBytes(2, 4, 8, master=4)

    def test_no_master_weights(self):
        assert state_bytes_per_param(training(master_weights_fp32=False)) == StateBytes(2, 4, 8)

    def test_fp8_keeps_16bit_weights(self):
        assert state_bytes_per_param(training(precision=Precision.fp8)) == StateBytes(2, 4, 12, master=4)


class TestModelStateBytes:
    PHI = 1e9
    STATE = StateBytes(2, 4, 12)  # bf16 + AdamW, fp32 grads

    def test_zero0(self):
        assert model_state_bytes(self.PHI, self.STATE, 0, 8) == (2e9, 4e9, 12e9)

    def test_zero1(self):
        assert model_state_bytes(self.PHI, self.STATE, 1, 8) == (2e9, 4e9, pytest.approx(12e9 / 8))

    def test_zero2(self):
        assert model_state_bytes(self.PHI, self.STATE, 2, 8) == (2e9, pytest.approx(4e9 / 8), pytest.approx(12e9 / 8))

    def test_zero3(self):
        got = model_state_bytes(self.PHI, self.STATE, 3, 8)
        assert got == pytest.approx((2e9 / 8, 4e9 / 8, 12e9 / 8))

    def test_offload(self):
        assert model_state_bytes(self.PHI, self.STATE, 1, 8, offload_optimizer=True) == (2e9, 4e9, 0.0)
        assert model_state_bytes(self.PHI, self.STATE, 3, 8, offload_optimizer=True) == pytest.approx(
            (2e9 / 8, 4e9 / 8, 0.0))

    def test_shard_of_zero_is_one(self):
        assert model_state_bytes(self.PHI, self.STATE, 3, 0) == (2e9, 4e9, 12e9)

    @pytest.mark.parametrize(
        "stage, expected",
        [
            (0, 16e9),  # 16 Phi
            (1, 4e9 + 12e9 / 64),  # 4 Phi + 12 Phi / N
            (2, 2e9 + 14e9 / 64),  # 2 Phi + 14 Phi / N
            (3, 16e9 / 64),  # 16 Phi / N
        ],
    )
    def test_zero_paper_totals_fp16_grads(self, stage, expected):
        # Rajbhandari et al. (ZeRO) Figure 1: fp16 weights 2 + fp16 grads 2 + optimizer 12 = 16 bytes
        state = state_bytes_per_param(training(grad_reduce_in_fp32=False))
        assert sum(model_state_bytes(self.PHI, state, stage, 64)) == pytest.approx(expected)


# ============================================================================================
# activations
# ============================================================================================
def gpt_layer(**changes) -> ModelSpec:
    """Korthikanti's GPT layer: h=1024, a=16 (d=64), GeLU FFN 4h, dropout 0.1, MHA."""
    fields = dict(num_layers=2, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, ffn_kind="gelu",
                  vocab_size=51200, norm="layernorm", linear_bias=True, dropout=0.1)
    fields.update(changes)
    return ModelSpec(**fields)


S, B, H, A, T = 2048, 1, 1024, 16, 4
SBH = S * B * H  # 2,097,152


def gpt_acts(recompute: Recompute, sp: bool, t: int = T, fp8: bool = False) -> float:
    shape = ActivationShape(batch=B, seq=S, kv_seq=S, tp=t, sp=sp)
    return layer_activation_bytes(gpt_layer(), 0, shape, recompute, flash=False, elt=2, fp8=fp8)


class TestKorthikanti:
    def test_no_sp(self):
        # Eq. 2: s*b*h*(10 + 24/t + 5*a*s/(h*t)) = sbh * (10 + 6 + 5*16*2048/(1024*4) = 40)
        expected = SBH * (10 + 24 / T + 5 * A * S / (H * T))
        assert expected == SBH * 56 == 117440512
        assert gpt_acts(Recompute.none, sp=False) == pytest.approx(expected)

    def test_no_tp(self):
        # Eq. 1: s*b*h*(34 + 5*a*s/h) = sbh * (34 + 160)
        assert gpt_acts(Recompute.none, sp=False, t=1) == pytest.approx(SBH * (34 + 5 * A * S / H))

    def test_sp(self):
        # Eq. 4: s*b*h*(34/t + 5*a*s/(h*t)) = sbh * (8.5 + 40)
        expected = SBH * (34 / T + 5 * A * S / (H * T))
        assert expected == 101711872
        assert gpt_acts(Recompute.none, sp=True) == pytest.approx(expected)

    def test_selective_sp(self):
        # Eq. 5: 34*s*b*h/t
        assert gpt_acts(Recompute.selective, sp=True) == pytest.approx(34 * SBH / T)

    def test_selective_no_sp(self):
        # Table 2, "selective recompute" row: s*b*h*(10 + 24/t)
        assert gpt_acts(Recompute.selective, sp=False) == pytest.approx(SBH * (10 + 24 / T))

    def test_full(self):
        # full recompute keeps only the block input: 2*s*b*h, or 2*s*b*h/t with SP
        assert gpt_acts(Recompute.full, sp=False) == pytest.approx(2 * SBH)
        assert gpt_acts(Recompute.full, sp=True) == pytest.approx(2 * SBH / T)

    def test_fp8_saves_linear_inputs_at_one_byte(self):
        # One byte less for each of the four linear inputs:
        #   QKV input s*b*h and FC1 input s*b*h (replicated, no SP),
        #   output-projection input s*b*h/t, FC2 input s*b*4h/t
        saved = SBH * (1 + 1 + 1 / T + 4 / T)  # 3.25 * sbh = 6,815,744
        assert gpt_acts(Recompute.none, sp=False, fp8=True) == pytest.approx(SBH * 56 - saved)
        assert SBH * 56 - saved == 110624768


class TestModernLayer:
    def test_flash_swiglu_gqa_no_dropout(self):
        # h=1024, 16 heads of 64, 4 KV heads, SwiGLU f=2816, dropout 0; b=2, s=1024, t=2, no SP, flash
        model = gpt_layer(num_kv_heads=4, ffn_hidden_size=2816, ffn_kind="swiglu", dropout=0.0, norm="rmsnorm",
                          linear_bias=False)
        shape = ActivationShape(batch=2, seq=1024, kv_seq=1024, tp=2, sp=False)
        tokens = 2 * 1024
        # replicated: two norm inputs + QKV input + MLP input, 2 bytes each, no masks
        replicated = 4 * 2 * tokens * 1024  # 16,777,216
        # attention (per rank 8 query heads, 2 KV heads, d=64): Q, K, V + output-projection input
        attention = 2 * tokens * (8 * 64 + 2 * 64 + 2 * 64) + 2 * tokens * 8 * 64  # 5,242,880
        # flash: fp32 log-sum-exp per local head and token
        lse = 4 * tokens * 8  # 65,536
        # SwiGLU: gate, up, product, each tokens * f/t * 2 bytes
        ffn = 3 * 2 * tokens * 2816 / 2  # 17,301,504
        expected = replicated + attention + lse + ffn
        assert expected == 39387136
        got = layer_activation_bytes(model, 0, shape, Recompute.none, flash=True, elt=2)
        assert got == pytest.approx(expected)

    def test_kv_heads_fewer_than_tp_are_replicated(self):
        # 2 KV heads on t=4: each rank keeps 1 KV head (not 0.5)
        model = gpt_layer(num_kv_heads=2, ffn_kind="swiglu", ffn_hidden_size=2816, dropout=0.0)
        shape = ActivationShape(batch=1, seq=1024, kv_seq=1024, tp=4, sp=False)
        tokens = 1024
        replicated = 4 * 2 * tokens * 1024
        attention = 2 * tokens * (4 * 64 + 1 * 64 + 1 * 64) + 2 * tokens * 4 * 64
        lse = 4 * tokens * 4
        ffn = 3 * 2 * tokens * 2816 / 4
        got = layer_activation_bytes(model, 0, shape, Recompute.none, flash=True, elt=2)
        assert got == pytest.approx(replicated + attention + lse + ffn)

    def test_unfused_no_dropout_keeps_only_softmax(self):
        # without dropout the scores cost 2 bytes (softmax output), not 5
        model = gpt_layer(dropout=0.0)
        shape = ActivationShape(batch=B, seq=S, kv_seq=S, tp=T, sp=False)
        got = layer_activation_bytes(model, 0, shape, Recompute.none, flash=False, elt=2)
        # sbh*(8 + 24/t) without the 2 dropout masks, + 2*a*s*s*b/t
        assert got == pytest.approx(SBH * (8 + 24 / T) + 2 * A * S * S * B / T)

    def test_context_parallel_scores_use_full_kv(self):
        # cp=2: this rank holds s/2 queries that attend over all s keys
        shape = ActivationShape(batch=1, seq=1024, kv_seq=2048, tp=1, sp=False)
        got = layer_activation_bytes(gpt_layer(), 0, shape, Recompute.none, flash=False, elt=2)
        sbh = 1024 * 1024
        # 34 * sbh for the local tokens + 5 bytes * a * s_local * s_kv scores, and K and V are kept for
        # all s_kv = 2048 keys, not only the local 1024: + 2 tensors * 2 bytes * (2048 - 1024) * h
        assert got == pytest.approx(34 * sbh + 5 * 16 * 1024 * 2048 + 2 * 2 * (2048 - 1024) * 1024)

    def test_moe_layer(self):
        # h=64, 4 heads of 16, SwiGLU, dropout 0, flash, t=1, b=1, s=8 (8 tokens)
        # MoE: 4 experts of 32, top-2, 1 shared expert of 48
        model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                          vocab_size=100, moe=MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=32,
                                                      num_shared_experts=1, shared_expert_ffn_hidden_size=48,
                                                      first_dense_layers=1))
        shape = ActivationShape(batch=1, seq=8, kv_seq=8, tp=1, sp=False)
        replicated = 4 * 2 * 8 * 64  # 4096
        attention = 2 * 8 * (3 * 64) + 2 * 8 * 64  # 4096
        lse = 4 * 8 * 4  # 128
        # 16 routed token copies: dispatched input 2*h each + gate/up/product 3*2*f_e each
        routed = 16 * (2 * 64 + 3 * 2 * 32)  # 5120
        shared = 8 * 1 * 3 * 2 * 48  # 2304
        router = 4 * 8 * 4  # fp32 probabilities, 128
        moe = layer_activation_bytes(model, 1, shape, Recompute.none, flash=True, elt=2)
        assert moe == pytest.approx(replicated + attention + lse + routed + shared + router)  # 15872
        dense = layer_activation_bytes(model, 0, shape, Recompute.none, flash=True, elt=2)
        assert dense == pytest.approx(replicated + attention + lse + 3 * 2 * 8 * 256)


class TestInFlight:
    def test_gpipe_holds_all(self):
        assert microbatches_in_flight(Schedule.gpipe, 0, 4, 8, 1) == 8.0

    def test_1f1b(self):
        # p - i, capped by m
        assert [microbatches_in_flight(Schedule.one_f_one_b, i, 4, 8, 1) for i in range(4)] == [4, 3, 2, 1]
        assert microbatches_in_flight(Schedule.one_f_one_b, 0, 4, 2, 1) == 2.0

    def test_zero_bubble_like_1f1b(self):
        assert [microbatches_in_flight(Schedule.zero_bubble, i, 4, 8, 1) for i in range(4)] == [4, 3, 2, 1]

    def test_interleaved(self):
        # Megatron warm-up: (v-1)*p + 2*(p-1-i) chunk forwards, plus the chunk in progress, each 1/v of a
        # stage: p=4, v=2 -> stage 0: (4 + 6 + 1)/2 = 5.5, 1: (4 + 4 + 1)/2 = 4.5, 2: 3.5, 3: (4 + 0 + 1)/2 = 2.5
        got = [microbatches_in_flight(Schedule.interleaved_1f1b, i, 4, 8, 2) for i in range(4)]
        assert got == pytest.approx([5.5, 4.5, 3.5, 2.5])
        assert got[0] == pytest.approx(4 * (1 + 3 / (4 * 2)))

    def test_v_schedules(self):
        # ZB-V: 2p half-size chunks = p whole stages on every rank (Qi et al. §6); DualPipeV: PP + 1 chunks
        # with PP = 2p, i.e. p + 1/2 (DualPipe's table); both capped by m
        assert [microbatches_in_flight(Schedule.zero_bubble_v, i, 4, 8, 2) for i in range(4)] == [4.0] * 4
        assert [microbatches_in_flight(Schedule.dualpipe_v, i, 4, 8, 2) for i in range(4)] == [4.5] * 4
        assert microbatches_in_flight(Schedule.zero_bubble_v, 0, 4, 3, 2) == 3.0

    def test_interleaved_capped_by_micro_batches(self):
        assert microbatches_in_flight(Schedule.interleaved_1f1b, 0, 4, 4, 2) == 4.0

    def test_logits(self):
        # 6 bytes per logit (bf16 logits + fp32 softmax), vocab split over t: 6 * 2048 * 51200 / 4
        assert logits_bytes(gpt_layer(), 2048, 4) == pytest.approx(157286400)


# ============================================================================================
# pipeline.py
# ============================================================================================
class TestPipeline:
    # equal stages: f = 1, b = 2, t = 3; p = 4 stages, m = 8 micro-batches
    F, BW = [1.0] * 4, [2.0] * 4

    def test_1f1b_equal(self):
        # (m + p - 1) * t = 11 * 3; bubble (p-1)*t = 9
        assert pipeline_time_s(Schedule.one_f_one_b, self.F, self.BW, 8) == pytest.approx((33.0, 9.0))

    def test_gpipe_equal(self):
        assert pipeline_time_s(Schedule.gpipe, self.F, self.BW, 8) == pytest.approx((33.0, 9.0))

    def test_bubble_fraction_is_p_minus_1_over_m(self):
        total, bubble = pipeline_time_s(Schedule.one_f_one_b, self.F, self.BW, 8)
        assert bubble / (total - bubble) == pytest.approx(3 / 8)  # (p-1)/m, Narayanan et al. 2021

    def test_interleaved_equal(self):
        # (m + (p-1)/v) * t = (8 + 3/2) * 3 = 28.5; bubble 4.5
        assert pipeline_time_s(Schedule.interleaved_1f1b, self.F, self.BW, 8, 2) == pytest.approx((28.5, 4.5))

    def test_zero_bubble_equal(self):
        # m*t + (p-1)*f = 24 + 3 = 27
        assert pipeline_time_s(Schedule.zero_bubble, self.F, self.BW, 8) == pytest.approx((27.0, 3.0))

    def test_zero_bubble_v_equal(self):
        # per chunk F = f/2 = 0.5, B = W = b/4 = 0.5: F = B = W, so (p-1)(F + B - 2W) = 0 (Qi et al. §6)
        assert pipeline_time_s(Schedule.zero_bubble_v, self.F, self.BW, 8, 2) == pytest.approx((24.0, 0.0))
        # f = 2, b = 2: (p-1)(F + B - 2W) = 3 * (1 + 0.5 - 1) = 1.5
        assert pipeline_time_s(Schedule.zero_bubble_v, [2.0] * 4, [2.0] * 4, 8, 2) == pytest.approx((33.5, 1.5))

    def test_dualpipe_v_equal(self):
        # (p-1)(F&B + B_full - 3W), F&B = F + B_full unoverlapped: 3 * (0.5 + 1 + 1 - 1.5) = 3
        assert pipeline_time_s(Schedule.dualpipe_v, self.F, self.BW, 8, 2) == pytest.approx((27.0, 3.0))

    def test_unequal_v(self):
        # slowest rank 1 (t = 6) left out; ZB-V: ranks 0 and 2 each max(0, (3f - t)/4) = max(0, (3 - 3)/4) = 0;
        # DualPipeV: each (f + t)/4 = 1
        assert pipeline_time_s(Schedule.zero_bubble_v, [1, 2, 1], [2, 4, 2], 4, 2) == pytest.approx((24.0, 0.0))
        assert pipeline_time_s(Schedule.dualpipe_v, [1, 2, 1], [2, 4, 2], 4, 2) == pytest.approx((26.0, 2.0))

    def test_v_placement(self):
        # rank r runs chunks r and 2p-1-r: rank 0 holds the first and the last chunk (torch's style="v")
        assert [rank_chunks(Schedule.zero_bubble_v, 4, 2, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
        assert [rank_chunks(Schedule.interleaved_1f1b, 2, 3, r) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
        assert head_rank(Schedule.dualpipe_v, 4, 2) == 0
        assert head_rank(Schedule.interleaved_1f1b, 4, 2) == 3

    def test_unequal_1f1b(self):
        # t = [3, 6, 3]: sum t + (m-1) max t = 12 + 3*6 = 30, bubble = 12 - 6 = 6
        assert pipeline_time_s(Schedule.one_f_one_b, [1, 2, 1], [2, 4, 2], 4) == pytest.approx((30.0, 6.0))

    def test_unequal_interleaved(self):
        # m * max t + (sum t - max t)/v = 24 + 6/2 = 27
        assert pipeline_time_s(Schedule.interleaved_1f1b, [1, 2, 1], [2, 4, 2], 4, 2) == pytest.approx((27.0, 3.0))

    def test_unequal_zero_bubble(self):
        # m * max t + forwards of the other stages = 24 + 1 + 1
        assert pipeline_time_s(Schedule.zero_bubble, [1, 2, 1], [2, 4, 2], 4) == pytest.approx((26.0, 2.0))

    @pytest.mark.parametrize("schedule", list(Schedule))
    def test_single_stage(self, schedule):
        # no pipeline: m * (f + b), no bubble
        assert pipeline_time_s(schedule, [0.5], [1.0], 6) == pytest.approx((9.0, 0.0))
