"""Parameter counts (planner/cost/params.py) and FLOPs (planner/cost/flops.py) against hand calculations.

Every expected value is written out as arithmetic on the configuration's numbers, with the formula
it comes from named in a comment; nothing here calls the function under test to get ``expected``.
"""

from __future__ import annotations

import pytest

from planner.contracts import MLASpec, ModelSpec, MoESpec, Recompute
from planner.cost.flops import (
    attention_core_flops,
    attention_linear_flops,
    dense_mlp_flops,
    forward_flops,
    hardware_flops_per_step,
    layer_flops,
    lm_head_flops,
    model_flops_per_step,
    moe_flops,
    recompute_flops,
)
from planner.cost.params import (
    active_params,
    attention_params,
    embedding_params,
    layer_params,
    lm_head_params,
    mlp_params,
    moe_dense_part_params,
    norm_params,
    routed_expert_params,
    total_params,
)
from planner.presets import get_preset


# --------------------------------------------------------------------------------------------
# small, readable models
# --------------------------------------------------------------------------------------------
def gpt_small(**changes) -> ModelSpec:
    """GPT-2-style block: h=64, 4 heads of 16, GeLU FFN 256, LayerNorm, biases, learned positions
    (128 rows), tied embeddings, V=1000, 2 layers."""
    fields = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, ffn_kind="gelu",
        vocab_size=1000, tied_embeddings=True, position_embedding="learned", max_position_embeddings=128,
        norm="layernorm", linear_bias=True, dropout=0.1,
    )
    fields.update(changes)
    return ModelSpec(**fields)


def llama_small(**changes) -> ModelSpec:
    """Llama-style block: h=64, 8 query heads of 8, 2 KV heads (GQA), SwiGLU FFN 128, RMSNorm, no bias,
    RoPE, untied LM head, V=500, 3 layers."""
    fields = dict(
        num_layers=3, hidden_size=64, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=128,
        ffn_kind="swiglu", vocab_size=500, tied_embeddings=False, norm="rmsnorm", linear_bias=False,
    )
    fields.update(changes)
    return ModelSpec(**fields)


def moe_small(**moe_changes) -> ModelSpec:
    """3 layers, first one dense (SwiGLU 256), then MoE: 4 routed experts of 32 (top-2) + 1 shared of 48.
    h=64, 4 heads of 16 (MHA), RMSNorm, no bias, untied, V=100."""
    moe = dict(num_experts=4, top_k=2, expert_ffn_hidden_size=32, num_shared_experts=1,
               shared_expert_ffn_hidden_size=48, first_dense_layers=1)
    moe.update(moe_changes)
    return ModelSpec(
        num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, ffn_kind="swiglu",
        vocab_size=100, tied_embeddings=False, norm="rmsnorm", linear_bias=False, moe=MoESpec(**moe),
    )


def mla_small() -> ModelSpec:
    """h=64, 4 heads, MLA with q rank 16, kv rank 8, nope 8 + rope 4 query/key dims, value dim 8."""
    return ModelSpec(
        num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100,
        mla=MLASpec(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    )


# ============================================================================================
# params.py
# ============================================================================================
class TestAttentionParams:
    def test_mha_with_bias(self):
        # h=64, a=4, k=4, d=16: Q h*a*d + K,V 2*h*k*d + O a*d*h
        weights = 64 * 4 * 16 + 2 * 64 * 4 * 16 + 4 * 16 * 64  # = 4 * 64 * 64 = 16384
        # biases: q a*d=64, k and v 2*k*d=128, output h=64
        bias = 4 * 16 + 2 * 4 * 16 + 64  # = 256
        assert weights == 16384 and bias == 256
        assert attention_params(gpt_small()) == 16384 + 256

    def test_mha_without_bias(self):
        assert attention_params(gpt_small(linear_bias=False)) == 4 * 64 * 64  # 16384

    def test_gqa(self):
        # h=64, a=8, k=2, d=8: Q 64*8*8=4096, K+V 2*64*2*8=2048, O 8*8*64=4096
        expected = 64 * 8 * 8 + 2 * 64 * 2 * 8 + 8 * 8 * 64
        assert expected == 10240
        assert attention_params(llama_small()) == expected

    def test_gqa_with_bias(self):
        # weights as above + biases a*d=64, 2*k*d=32, h=64
        expected = 10240 + (8 * 8 + 2 * 2 * 8 + 64)
        assert attention_params(llama_small(linear_bias=True)) == expected == 10400

    def test_explicit_head_dim(self):
        # h=64, a=4, k=2, d=32 (not h/a=16): Q 64*4*32, K+V 2*64*2*32, O 4*32*64
        model = llama_small(num_attention_heads=4, num_kv_heads=2, head_dim=32)
        expected = 64 * 128 + 2 * 64 * 64 + 128 * 64
        assert expected == 24576
        assert attention_params(model) == expected

    def test_mla(self):
        # q = h*r_q + r_q (latent norm) + r_q*a*(nope+rope) = 64*16 + 16 + 16*4*12
        q = 64 * 16 + 16 + 16 * 4 * 12  # 1024 + 16 + 768 = 1808
        # kv = h*(r_kv + rope) + r_kv*a*(nope + v) = 64*12 + 8*4*16
        kv = 64 * 12 + 8 * 4 * 16  # 768 + 512 = 1280
        kv_norm = 8
        out = 4 * 8 * 64  # a*d_v*h = 2048
        assert q + kv + kv_norm + out == 5144
        assert attention_params(mla_small()) == 5144


class TestMlpNormParams:
    def test_gelu_bias(self):
        # GeLU: 2*h*f + f + h = 2*64*256 + 256 + 64
        assert mlp_params(gpt_small()) == 32768 + 320

    def test_gelu_no_bias(self):
        assert mlp_params(gpt_small(linear_bias=False)) == 2 * 64 * 256

    def test_swiglu_no_bias(self):
        # SwiGLU: 3*h*f = 3*64*128
        assert mlp_params(llama_small()) == 24576

    def test_swiglu_bias(self):
        # 3*h*f + gate and up biases (2f) + down bias (h) = 24576 + 256 + 64
        assert mlp_params(llama_small(linear_bias=True)) == 24576 + 2 * 128 + 64

    def test_swiglu_has_one_and_a_half_times_gelu_weights(self):
        gelu = mlp_params(llama_small(ffn_kind="gelu"))  # 2*64*128
        swiglu = mlp_params(llama_small())  # 3*64*128
        assert (gelu, swiglu) == (16384, 24576)

    def test_ffn_override(self):
        assert mlp_params(llama_small(), ffn=32) == 3 * 64 * 32  # 6144

    def test_norms(self):
        assert norm_params(gpt_small()) == 2 * 64  # LayerNorm: scale + shift
        assert norm_params(llama_small()) == 64  # RMSNorm: scale only


class TestEmbeddingAndHead:
    def test_embedding_learned_positions(self):
        # V*h + P*h = 1000*64 + 128*64
        assert embedding_params(gpt_small()) == 64000 + 8192

    def test_embedding_rope_has_no_position_table(self):
        assert embedding_params(llama_small()) == 500 * 64  # 32000

    def test_tied_head_is_only_the_final_norm(self):
        assert lm_head_params(gpt_small()) == 2 * 64  # LayerNorm, no extra h*V

    def test_untied_head(self):
        # final RMSNorm h + output projection h*V
        assert lm_head_params(llama_small()) == 64 + 64 * 500

    def test_total_gpt_small(self):
        # per layer: attention 16640 + 2 LayerNorms 256 + GeLU MLP 33088 = 49984
        layer = 16640 + 2 * 128 + 33088
        assert layer == 49984
        assert layer_params(gpt_small(), 0) == (49984, 0)
        # embedding 72192 + 2 layers + final norm 128 (tied: no head matrix)
        assert total_params(gpt_small()) == 72192 + 2 * 49984 + 128 == 172288

    def test_total_llama_small(self):
        # per layer: attention 10240 + 2 RMSNorms 128 + SwiGLU 24576 = 34944
        layer = 10240 + 2 * 64 + 24576
        # embedding 32000 + 3 layers + (final norm 64 + head 32000)
        expected = 32000 + 3 * layer + 64 + 32000
        assert expected == 168896
        assert total_params(llama_small()) == expected
        assert active_params(llama_small()) == expected  # dense: every weight is active

    def test_tying_removes_exactly_one_vocab_matrix(self):
        assert total_params(llama_small()) - total_params(llama_small(tied_embeddings=True)) == 64 * 500


class TestMoEParams:
    def test_routed_experts(self):
        # E * 3*h*f_e = 4 * 3*64*32
        assert routed_expert_params(moe_small()) == 4 * 6144 == 24576

    def test_dense_part(self):
        # router h*E = 64*4 = 256; one shared SwiGLU expert 3*64*48 = 9216
        assert moe_dense_part_params(moe_small()) == 256 + 9216

    def test_shared_defaults_to_expert_size(self):
        model = moe_small(shared_expert_ffn_hidden_size=None)
        assert moe_dense_part_params(model) == 64 * 4 + 3 * 64 * 32  # 256 + 6144

    def test_layer_split(self):
        model = moe_small()
        attn_norms = 4 * 64 * 64 + 2 * 64  # 16384 + 128
        # layer 0 is dense (first_dense_layers=1): + SwiGLU 3*64*256 = 49152
        assert layer_params(model, 0) == (attn_norms + 49152, 0)
        # layers 1, 2 are MoE: non-expert = attn + norms + router + shared; expert = routed
        assert layer_params(model, 1) == (attn_norms + 9472, 24576)
        assert layer_params(model, 2) == (16512 + 9472, 24576)

    def test_layer_frequency(self):
        model = moe_small(first_dense_layers=0, layer_frequency=2)  # MoE at 0 and 2, dense at 1
        assert [layer_params(model, i)[1] for i in range(3)] == [24576, 0, 24576]

    def test_total_and_active(self):
        model = moe_small()
        # embedding 100*64=6400; dense layer 65664; 2 MoE layers of 25984 + 24576; head 64 + 6400
        total = 6400 + 65664 + 2 * (25984 + 24576) + 64 + 6400
        assert total == 179648
        assert total_params(model) == total
        # active: each MoE layer touches top_k=2 of its 4 experts = 2 * 3*64*32 = 12288 routed weights
        active = 6400 + 65664 + 2 * (25984 + 2 * 6144) + 6464
        assert active == 155072
        assert active_params(model) == active

    def test_mixtral_active_params(self):
        # Mixtral 8x7B: 32 layers, h=4096, 32 heads of 128, 8 KV heads, 8 experts of 14336, top-2, V=32000
        attn = 4096 * 4096 + 2 * 4096 * 8 * 128 + 4096 * 4096  # 41,943,040
        norms = 2 * 4096
        router = 4096 * 8
        expert = 3 * 4096 * 14336  # 176,160,768
        emb = head = 32000 * 4096
        total = emb + 32 * (attn + norms + router + 8 * expert) + 4096 + head
        active = emb + 32 * (attn + norms + router + 2 * expert) + 4096 + head
        m = get_preset("mixtral-8x7b")
        assert total_params(m) == total
        assert active_params(m) == active
        # published: ~46.7B total, ~12.9B active
        assert 46.6e9 < total < 46.8e9 and 12.8e9 < active < 13.0e9


# ============================================================================================
# flops.py
# ============================================================================================
class TestLayerFlops:
    def test_attention_linear_excludes_bias(self):
        # 2 * T * (attention weights without biases) = 2 * 10 * 16384
        assert attention_linear_flops(gpt_small(), 10) == 2 * 10 * 16384 == 327680

    def test_attention_linear_gqa(self):
        # 2 * T * (Q + K + V + O weights) = 2 * 7 * 10240
        assert attention_linear_flops(llama_small(), 7) == 2 * 7 * 10240

    def test_attention_linear_mla_excludes_latent_norms(self):
        # 2 * T * (5144 params - 16 q-norm - 8 kv-norm)
        assert attention_linear_flops(mla_small(), 3) == 2 * 3 * (5144 - 16 - 8)

    def test_attention_core(self):
        # 2*b*s^2*a*d_qk + 2*b*s^2*a*d_v with b=2, s=32, a=4, d=16
        expected = 2 * 2 * 32**2 * 4 * 16 + 2 * 2 * 32**2 * 4 * 16
        assert expected == 524288
        assert attention_core_flops(gpt_small(), 2, 32) == expected

    def test_attention_core_counts_query_heads_not_kv_heads(self):
        # a=8 query heads of d=8; GQA does not change the score matrix size
        assert attention_core_flops(llama_small(), 1, 16) == 2 * 1 * 16**2 * 8 * (8 + 8)

    def test_attention_core_mla(self):
        # d_qk = nope + rope = 12, d_v = 8: 2*b*s^2*a*(12 + 8), b=1, s=10, a=4
        assert attention_core_flops(mla_small(), 1, 10) == 2 * 1 * 100 * 4 * 20 == 16000

    def test_dense_mlp_gelu(self):
        # 2 matmuls: 2 * T * h * f * 2 = 2 * 5 * 64 * 256 * 2
        assert dense_mlp_flops(gpt_small(), 5) == 327680

    def test_dense_mlp_swiglu(self):
        # 3 matmuls: 2 * T * h * f * 3 = 2 * 5 * 64 * 128 * 3
        assert dense_mlp_flops(llama_small(), 5) == 245760

    def test_moe_dropless(self):
        model = moe_small()
        T = 10
        router = 2 * T * 64 * 4  # 2*T*h*E = 5120
        shared = 1 * 2 * T * 64 * 48 * 3  # S * SwiGLU(f_s) = 184320
        routed = 2 * (2 * T * 64 * 32 * 3)  # top_k * SwiGLU(f_e) = 245760
        assert moe_flops(model, T) == (router + shared + routed, routed)
        assert (router + shared + routed, routed) == (435200, 245760)

    def test_moe_capacity_factor(self):
        model = moe_small(capacity_factor=1.25)
        T = 10
        routed = 2 * (2 * T * 64 * 32 * 3) * 1.25  # padded to capacity: 307200
        total = 2 * T * 64 * 4 + 1 * 2 * T * 64 * 48 * 3 + routed
        assert moe_flops(model, T) == (pytest.approx(total), pytest.approx(routed))
        assert routed == 307200

    def test_layer_flops_moe_vs_dense_layer(self):
        model = moe_small()
        b, s = 1, 10
        T = b * s
        attn_lin = 2 * T * 4 * 64 * 64  # 327680
        core = 2 * b * s**2 * 4 * (16 + 16)  # 25600
        dense = layer_flops(model, 0, b, s)
        assert (dense.attention_linear, dense.attention_core, dense.mlp, dense.routed_expert) == (
            attn_lin, core, 2 * T * 64 * 256 * 3, 0.0)
        moe = layer_flops(model, 1, b, s)
        assert (moe.mlp, moe.routed_expert) == (435200, 245760)
        assert moe.total == attn_lin + core + 435200

    def test_lm_head(self):
        # 2 * T * h * V = 2 * 3 * 64 * 1000
        assert lm_head_flops(gpt_small(), 3) == 384000


def megatron_gpt(h: int = 512, layers: int = 4, heads: int = 8, vocab: int = 1000) -> ModelSpec:
    """A GPT block as in the Megatron formulas: MHA, GeLU FFN of 4h, no biases (they are not counted)."""
    return ModelSpec(
        num_layers=layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=4 * h, ffn_kind="gelu",
        vocab_size=vocab, tied_embeddings=True, position_embedding="learned", max_position_embeddings=2048,
        norm="layernorm", linear_bias=False, dropout=0.1,
    )


class TestStepFlops:
    B, s, L, h, V = 8, 1024, 4, 512, 1000

    def test_forward(self):
        B, s, L, h, V = self.B, self.s, self.L, self.h, self.V
        T = B * s
        # per layer: QKV+O 2*T*4h^2, core 4*B*s^2*h, MLP 2*T*8h^2; head 2*T*h*V
        per_layer = 2 * T * 4 * h * h + 4 * B * s * s * h + 2 * T * 8 * h * h
        assert forward_flops(megatron_gpt(), B, s) == L * per_layer + 2 * T * h * V

    def test_model_flops_is_megatron_formula(self):
        B, s, L, h, V = self.B, self.s, self.L, self.h, self.V
        # Narayanan et al. (SC21) model FLOPs: 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))
        expected = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
        assert model_flops_per_step(megatron_gpt(), B, s) == pytest.approx(expected, rel=1e-12)

    def test_hardware_flops_full_recompute_is_sc21_formula(self):
        B, s, L, h, V = self.B, self.s, self.L, self.h, self.V
        # SC21 Eq. 3 (with activation recomputation): 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))
        expected = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
        assert hardware_flops_per_step(megatron_gpt(), B, s, Recompute.full) == pytest.approx(expected, rel=1e-12)

    def test_hardware_flops_selective_adds_only_attention_core(self):
        B, s, L, h, V = self.B, self.s, self.L, self.h, self.V
        model_flops = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
        core = 2 * B * s**2 * 8 * (64 + 64)  # 2*B*s^2*a*(d_qk + d_v) per layer = 4*B*s^2*h
        assert core == 4 * B * s**2 * h
        got = hardware_flops_per_step(megatron_gpt(), B, s, Recompute.selective)
        assert got == pytest.approx(model_flops + L * core, rel=1e-12)

    def test_hardware_flops_no_recompute_equals_model_flops(self):
        B, s, L, h, V = self.B, self.s, self.L, self.h, self.V
        expected = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
        assert hardware_flops_per_step(megatron_gpt(), B, s, Recompute.none) == pytest.approx(expected, rel=1e-12)

    def test_recompute_flops_per_layer(self):
        B, s, h = 2, 128, 512
        T = B * s
        block = 2 * T * 12 * h * h + 4 * B * s * s * h  # 24*T*h^2 + 4*B*s^2*h, forward of one block
        assert recompute_flops(megatron_gpt(), Recompute.full, 0, B, s) == block
        assert recompute_flops(megatron_gpt(), Recompute.selective, 0, B, s) == 4 * B * s * s * h
        assert recompute_flops(megatron_gpt(), Recompute.none, 0, B, s) == 0.0

    def test_gpt3_175b_model_flops(self):
        # Megatron GPT-3 175B (h=12288, l=96, V=51200), B=1536, s=2048; the preset has biases, which the
        # FLOP count leaves out, so the formula still holds.
        B, s, L, h, V = 1536, 2048, 96, 12288, 51200
        expected = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
        got = model_flops_per_step(get_preset("megatron-175b"), B, s)
        assert got == pytest.approx(expected, rel=1e-12)
        assert 3.3e18 < got < 3.5e18  # ~6 x 175e9 x 1536 x 2048 = 3.3e18, plus ~3% attention

    def test_six_n_t_for_long_context_free_model(self):
        # a model with s << h and V << l*h: model FLOPs ~ 6 * N * T (N = weights of the blocks)
        model = megatron_gpt(h=4096, layers=8, heads=32, vocab=8)
        B, s = 1, 8
        n_blocks = 8 * 12 * 4096 * 4096  # 12 h^2 weights per GPT block (no biases)
        assert model_flops_per_step(model, B, s) == pytest.approx(6 * n_blocks * B * s, rel=1e-3)
