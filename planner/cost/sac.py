"""Per-op selective activation checkpointing (``Recompute.op``): what a block keeps for its backward and
what the backward runs again. The one home of that policy: memory (:mod:`planner.cost.memory`), time
(:mod:`planner.cost.layer`) and FLOPs (:mod:`planner.cost.flops`) read it, and the executor's policy
(``executor/sac.py``) saves the same ops.

The policy is torchtitan's ``SelectiveAC`` (0.3.0, ``torchtitan/distributed/activation_checkpoint.py``;
the same rule since its first per-op SAC, Dec 2024): each transformer block runs under a non-reentrant
checkpoint whose policy keeps the outputs of the compute-intensive ops (``torch._functorch.partitioners``'
default list: mm, addmm, bmm, the SDPA kernels, _scaled_mm), of reduce-scatters and all-to-alls, and of
topk and max, except every second bias-free matmul (``aten.mm``), counted in forward order within the
block. The MoE router's gate matmul is always recomputed and not counted
(``force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]``). Everything else runs again in the
backward: the norms, activations, RoPE, the all-gathers and all-reduces, and the routed experts' grouped
GEMMs (``torch._grouped_mm`` is not in the list).

For a Llama block (wq, wk, wv, wo, w1, w3, w2 in forward order) the kept matmul outputs are wq, wv, w1
and w2; wk, wo and w3 run again. A linear layer with a bias is an ``addmm``: kept, not counted (Qwen2's biased
Q, K and V: all three kept, then wo, w3 kept and w1, w2 run again).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.contracts import ModelSpec


@dataclass(frozen=True)
class Linear:
    """One linear layer of a block on one TP rank, per token: its output elements and forward FLOPs."""

    name: str
    out: float  # output elements per token (a row-parallel layer's output is the full width before its reduction)
    flops: float  # forward FLOPs per token, 2 · in · out
    counted: bool = True  # a bias-free matmul: counted by the every-second rule (else always kept)


def _linear(name: str, k: float, n: float, bias: bool) -> Linear:
    return Linear(name, n, 2.0 * k * n, counted=not bias)


def _attention_linears(model: ModelSpec, t: int) -> list[Linear]:
    """The attention projections in forward order (MLA: its down projections whole on every TP rank)."""
    h, a, b = model.hidden_size, model.num_attention_heads, model.linear_bias
    if model.mla is not None:
        m = model.mla
        dqk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = ([_linear("q_a", h, m.q_lora_rank, b), _linear("q_b", m.q_lora_rank, a * dqk / t, b)]
             if m.q_lora_rank else [_linear("q", h, a * dqk / t, b)])
        return [*q, _linear("kv_a", h, m.kv_lora_rank + m.qk_rope_head_dim, b),
                _linear("kv_b", m.kv_lora_rank, a * (m.qk_nope_head_dim + m.v_head_dim) / t, b),
                _linear("o", a * m.v_head_dim / t, h, b)]
    d, dv, kv = model.head_size, model.value_head_size, model.kv_heads
    qkv = model.biased_qkv  # Qwen2: Q, K and V are addmm, the output projection an mm
    return [_linear("q", h, a * d / t, qkv), _linear("k", h, kv * d / t, qkv), _linear("v", h, kv * dv / t, qkv),
            _linear("o", a * dv / t, h, b)]


def _mlp_linears(model: ModelSpec, ffn: float, t: int, prefix: str = "") -> list[Linear]:
    """An MLP's linears in forward order: SwiGLU w1 (gate), w3 (up), w2 (down); GeLU fc1, fc2."""
    h, b = model.hidden_size, model.linear_bias
    if model.ffn_kind == "swiglu":
        return [_linear(f"{prefix}w1", h, ffn / t, b), _linear(f"{prefix}w3", h, ffn / t, b),
                _linear(f"{prefix}w2", ffn / t, h, b)]
    return [_linear(f"{prefix}fc1", h, ffn / t, b), _linear(f"{prefix}fc2", ffn / t, h, b)]


def block_linears(model: ModelSpec, index: int, tp: int) -> list[Linear]:
    """Block ``index``'s matmuls the policy sees, in forward order, on one of ``tp`` ranks: attention, then the
    MLP, or an MoE layer's shared experts (the router's gate is never counted; routed experts are grouped GEMMs)."""
    out = _attention_linears(model, tp)
    if not model.is_moe_layer(index):
        return out + _mlp_linears(model, model.ffn_hidden_size, tp)
    moe = model.moe
    assert moe is not None
    if moe.num_shared_experts:
        out += _mlp_linears(model, moe.shared_ffn * moe.num_shared_experts, tp, "shared.")
    return out


def kept_linears(model: ModelSpec, index: int, tp: int) -> list[Linear]:
    """The linears whose outputs per-op SAC keeps: every one with a bias, and the 1st, 3rd, 5th, ... counted one."""
    kept, count = [], 0
    for lin in block_linears(model, index, tp):
        count += lin.counted
        if not lin.counted or count % 2 == 1:
            kept.append(lin)
    return kept


def kept_gemm_share(model: ModelSpec, index: int, tp: int, other_flops: float = 0.0) -> float:
    """Share of the block's forward GEMM FLOPs whose outputs are kept (not run again); ``other_flops`` per token
    are the block's GEMMs the policy never keeps (router, routed experts)."""
    total = sum(lin.flops for lin in block_linears(model, index, tp)) + other_flops
    return sum(lin.flops for lin in kept_linears(model, index, tp)) / total if total > 0 else 0.0


def kept_linear_elements(model: ModelSpec, index: int, tp: int) -> float:
    """Output elements per token of the kept linears (their 16-bit outputs are what the policy stores)."""
    return sum(lin.out for lin in kept_linears(model, index, tp))
