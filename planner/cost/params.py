"""Parameter counts of a decoder transformer, per block and in total.

Notation: h hidden, a heads, k kv-heads, d head size, f FFN size, V vocab, E experts.
"""

from __future__ import annotations

from planner.contracts import ModelSpec


def attention_params(model: ModelSpec) -> int:
    """Q, K, V and output projections (+ biases).

    MHA/GQA: ``h·a·d + 2·h·k·d + a·d·h``.
    MLA: ``h·r_q + r_q·a·(d_nope+d_rope)`` (or ``h·a·(d_nope+d_rope)`` without q compression)
    ``+ h·(r_kv + d_rope) + r_kv·a·(d_nope + d_v) + a·d_v·h`` plus the two latent norms.
    """
    h, a = model.hidden_size, model.num_attention_heads
    if model.mla is not None:
        m = model.mla
        q = h * m.q_lora_rank + m.q_lora_rank * a * (m.qk_nope_head_dim + m.qk_rope_head_dim) + m.q_lora_rank \
            if m.q_lora_rank else h * a * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + m.kv_lora_rank + a * m.v_head_dim * h
    d, k = model.head_size, model.kv_heads
    weights = h * a * d + 2 * h * k * d + a * d * h
    return weights + attention_bias_params(model)


def attention_bias_params(model: ModelSpec) -> int:
    """Biases of the attention projections (not MLA): ``a·d + 2·k·d`` on Q, K, V (``linear_bias`` or
    ``qkv_bias``), ``+ h`` on the output projection (``linear_bias``)."""
    if model.mla is not None or not model.biased_qkv:
        return 0
    qkv = model.num_attention_heads * model.head_size + 2 * model.kv_heads * model.head_size
    return qkv + (model.hidden_size if model.linear_bias else 0)


def mlp_params(model: ModelSpec, ffn: int | None = None) -> int:
    """One dense FFN: GeLU ``2·h·f`` (+ ``f + h`` bias), SwiGLU ``3·h·f``."""
    h, f = model.hidden_size, ffn or model.ffn_hidden_size
    if model.ffn_kind == "swiglu":
        return 3 * h * f + ((2 * f + h) if model.linear_bias else 0)
    return 2 * h * f + ((f + h) if model.linear_bias else 0)


def norm_params(model: ModelSpec) -> int:
    """One norm: RMSNorm ``h``, LayerNorm ``2h`` (scale and shift)."""
    return model.hidden_size * (2 if model.norm == "layernorm" else 1)


def routed_expert_params(model: ModelSpec) -> int:
    """All routed experts of one MoE layer: ``E · mlp(f_expert)``."""
    assert model.moe is not None
    return model.moe.num_experts * mlp_params(model, model.moe.expert_ffn_hidden_size)


def moe_dense_part_params(model: ModelSpec) -> int:
    """The non-routed part of an MoE FFN: router ``h·E`` and shared experts ``S · mlp(f_shared)``."""
    assert model.moe is not None
    shared = model.moe.num_shared_experts * mlp_params(model, model.moe.shared_ffn)
    return model.hidden_size * model.moe.num_experts + shared


def layer_params(model: ModelSpec, index: int) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of block ``index``: attention, 2 norms, FFN."""
    base = attention_params(model) + 2 * norm_params(model)
    if model.is_moe_layer(index):
        return base + moe_dense_part_params(model), routed_expert_params(model)
    return base + mlp_params(model), 0


def tp_replicated_params(model: ModelSpec, index: int) -> int:
    """Parameters of block ``index`` every TP rank holds whole (Megatron-Core and the executor alike):
    its two norms; MLA's two latent norms and its down projections ``h·r_q + h·(r_kv + d_rope)``
    (Megatron-Core core_v0.19.0 multi_latent_attention.py builds them ``parallel_mode='duplicated'``, and
    the compute model prices them unsplit); the MoE router ``h·E``; the biases added after a row-parallel
    projection (attention output ``h``; dense FFN or shared experts' down projection ``h``)."""
    h = model.hidden_size
    whole = 2 * norm_params(model)
    if model.mla is not None:
        m = model.mla
        whole += m.kv_lora_rank + m.q_lora_rank + h * m.q_lora_rank + h * (m.kv_lora_rank + m.qk_rope_head_dim)
    if model.linear_bias:
        whole += h  # attention output
        if not model.is_moe_layer(index):
            whole += h
        elif model.moe is not None:
            whole += model.moe.num_shared_experts * h
    if model.is_moe_layer(index) and model.moe is not None:
        whole += h * model.moe.num_experts
    return whole


def dense_per_tp_rank(model: ModelSpec, index: int, tp: int) -> float:
    """Non-expert parameters of block ``index`` on one of ``tp`` ranks: the split part over tp, the
    replicated part (:func:`tp_replicated_params`) whole."""
    whole = tp_replicated_params(model, index)
    return (layer_params(model, index)[0] - whole) / tp + whole


def head_per_tp_rank(model: ModelSpec, tp: int, tied: int = 0) -> float:
    """The last stage's final norm (whole) and output projection (plus ``tied``, a copy of the tied
    embedding on a pipeline's last stage), on one of ``tp`` ranks."""
    return (lm_head_params(model) - norm_params(model) + tied) / tp + norm_params(model)


def embedding_params(model: ModelSpec) -> int:
    """Token table ``V·h`` plus a learned position table ``P·h`` if the model has one."""
    positions = (model.max_position_embeddings or 0) if model.position_embedding == "learned" else 0
    return model.vocab_size * model.hidden_size + positions * model.hidden_size


def lm_head_params(model: ModelSpec) -> int:
    """Final norm plus the output projection ``h·V`` (zero extra weights when tied to the embedding)."""
    return norm_params(model) + (0 if model.tied_embeddings else model.hidden_size * model.vocab_size)


def total_params(model: ModelSpec) -> int:
    layers = sum(sum(layer_params(model, i)) for i in range(model.num_layers))
    return embedding_params(model) + layers + lm_head_params(model)


def active_params(model: ModelSpec) -> int:
    """Parameters touched by one token: routed experts count ``top_k / E`` of their weight."""
    if model.moe is None:
        return total_params(model)
    routed = model.num_moe_layers * routed_expert_params(model)
    return total_params(model) - routed + routed * model.moe.top_k // model.moe.num_experts


def _norm_tensors(model: ModelSpec) -> int:
    """One norm's tensors: RMSNorm its scale, LayerNorm scale and shift."""
    return 2 if model.norm == "layernorm" else 1


def _attention_tensors(model: ModelSpec) -> int:
    """Attention's tensors: q, k, v and output (MLA: the low-rank q path ``q_a``, its norm, ``q_b`` (one ``q``
    without it), ``kv_a``, its norm, ``kv_b``, output), their biases, and a q and a k norm."""
    if model.mla is not None:
        count = (3 if model.mla.q_lora_rank else 1) + 4
    else:
        count = 4 + (3 if model.biased_qkv else 0)
    return count + (1 if model.linear_bias else 0) + (2 if model.qk_norm else 0)


def _ffn_tensors(model: ModelSpec) -> int:
    """A dense FFN's (or one stacked expert group's) tensors: w1, w2 (and w3 with SwiGLU), with their biases."""
    weights = 3 if model.ffn_kind == "swiglu" else 2
    return weights * (2 if model.linear_bias else 1)


def layer_tensors(model: ModelSpec, index: int) -> int:
    """Parameter tensors of block ``index`` as the executor builds it: its two norms, attention
    (:func:`_attention_tensors`), and a dense FFN or the MoE's router, routed experts (stacked: one tensor per
    projection for all of them) and shared experts. A framework that fuses q, k and v (Megatron-LM's
    ``linear_qkv``) holds fewer: the count prices a checkpoint's per-tensor cost from above."""
    count = 2 * _norm_tensors(model) + _attention_tensors(model)
    if not model.is_moe_layer(index):
        return count + _ffn_tensors(model)
    assert model.moe is not None
    return count + 1 + _ffn_tensors(model) + (_ffn_tensors(model) if model.moe.num_shared_experts else 0)


def embedding_tensors(model: ModelSpec) -> int:
    """The token table and a learned position table if the model has one."""
    return 1 + (1 if model.position_embedding == "learned" else 0)


def head_tensors(model: ModelSpec) -> int:
    """The final norm and the output projection (none when tied to the embedding)."""
    return _norm_tensors(model) + (0 if model.tied_embeddings else 1)
