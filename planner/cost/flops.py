"""FLOPs of the forward pass, per layer and per step, and the model/hardware FLOP conventions.

A matmul of an (m×k) by (k×n) matrix costs ``2·m·n·k`` FLOPs. Backward costs twice the forward
(gradients with respect to inputs and to weights). Attention-core FLOPs are counted over the full
``s×s`` score matrix, as in the PaLM / Megatron model-FLOP conventions; the time model applies
the causal saving separately (:func:`planner.cost.compute.attention_time_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.contracts import ModelSpec, Recompute
from planner.cost.params import attention_bias_params, attention_params
from planner.cost.sac import kept_linears


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one block for ``tokens`` tokens in sequences of length ``seq_length``."""

    attention_linear: float  # QKV (or MLA projections) + output projection
    attention_core: float  # QK^T and attention-over-values, full s×s
    mlp: float  # dense FFN, or router + shared experts + routed experts (top-k) for MoE
    routed_expert: float  # the routed-expert part of ``mlp`` (0 for dense layers)

    @property
    def total(self) -> float:
        return self.attention_linear + self.attention_core + self.mlp


def attention_linear_flops(model: ModelSpec, tokens: int) -> float:
    """``2 · T · (attention weights)``; biases and norms are negligible and left out."""
    bias = attention_bias_params(model)
    latent_norms = (model.mla.kv_lora_rank + model.mla.q_lora_rank) if model.mla is not None else 0
    return 2.0 * tokens * (attention_params(model) - bias - latent_norms)


def attention_core_flops(model: ModelSpec, batch: int, seq_length: int) -> float:
    """``2·b·s²·a·d_qk`` for scores plus ``2·b·s²·a·d_v`` for attention over values (full matrix)."""
    a = model.num_attention_heads
    return 2.0 * batch * seq_length**2 * a * (model.head_size + model.value_head_size)


def dense_mlp_flops(model: ModelSpec, tokens: int, ffn: int | None = None) -> float:
    """``2·T·(h·f·n)`` with n = 2 matmuls for GeLU, 3 for SwiGLU."""
    h, f = model.hidden_size, ffn or model.ffn_hidden_size
    return 2.0 * tokens * h * f * (3 if model.ffn_kind == "swiglu" else 2)


def moe_flops(model: ModelSpec, tokens: int) -> tuple[float, float]:
    """(total, routed) forward FLOPs of an MoE FFN.

    Router ``2·T·h·E``; shared experts ``S·mlp(f_s)``; routed ``top_k · mlp(f_e)`` per token, times
    ``capacity_factor`` when experts are padded to a fixed capacity (token dropping).
    """
    moe = model.moe
    assert moe is not None
    router = 2.0 * tokens * model.hidden_size * moe.num_experts
    shared = moe.num_shared_experts * dense_mlp_flops(model, tokens, moe.shared_ffn)
    routed = moe.top_k * dense_mlp_flops(model, tokens, moe.expert_ffn_hidden_size)
    if moe.capacity_factor is not None:
        routed *= moe.capacity_factor
    return router + shared + routed, routed


def windowed_work_ratio(seq: int, window: int) -> float:
    """Keys s causal queries attend to through a window of ``window`` keys (each query itself included),
    over those of the whole causal prefix: ``(w(w+1)/2 + (s-w)w) / (s(s+1)/2)`` when w < s, else 1."""
    if window >= seq:
        return 1.0
    return (window * (window + 1) / 2 + (seq - window) * window) / (seq * (seq + 1) / 2)


def attention_window_share(model: ModelSpec, seq: int) -> float:
    """The factor on every block's attention core: the mean over the blocks of :func:`windowed_work_ratio`
    (1 for a block attending to the whole prefix). A mean, so that blocks stay alike for the search (its
    block kinds are MoE and dense); exact for a pipeline stage holding whole periods of
    ``model.global_layer_every``."""
    if model.sliding_window is None:
        return 1.0
    n = model.num_layers
    windowed = sum(model.is_windowed_layer(i) for i in range(n))
    return (windowed * windowed_work_ratio(seq, model.sliding_window) + (n - windowed)) / n


def layer_flops(model: ModelSpec, index: int, batch: int, seq_length: int) -> LayerFlops:
    """Forward FLOPs of block ``index`` for ``batch`` sequences of ``seq_length`` tokens."""
    tokens = batch * seq_length
    if model.is_moe_layer(index):
        mlp, routed = moe_flops(model, tokens)
    else:
        mlp, routed = dense_mlp_flops(model, tokens), 0.0
    window = windowed_work_ratio(seq_length, model.sliding_window) if model.is_windowed_layer(index) else 1.0
    return LayerFlops(
        attention_linear=attention_linear_flops(model, tokens),
        attention_core=attention_core_flops(model, batch, seq_length) * window,
        mlp=mlp,
        routed_expert=routed,
    )


def lm_head_flops(model: ModelSpec, tokens: int) -> float:
    """Output projection ``2·T·h·V`` (the embedding lookup costs no FLOPs)."""
    return 2.0 * tokens * model.hidden_size * model.vocab_size


def forward_flops(model: ModelSpec, batch: int, seq_length: int) -> float:
    """All blocks plus the LM head, forward only: blocks of one kind cost the same but for their attention
    core, which sliding-window blocks shrink (:func:`attention_window_share`, the blocks' mean factor)."""
    moe = model.num_moe_layers
    blocks = 0.0
    for is_moe, n in ((False, model.num_layers - moe), (True, moe)):
        if n:
            lf = layer_flops(model, _first_layer(model, moe=is_moe), batch, seq_length)
            blocks += n * (lf.total - lf.attention_core)
    core = attention_core_flops(model, batch, seq_length)
    blocks += model.num_layers * attention_window_share(model, seq_length) * core
    return blocks + lm_head_flops(model, batch * seq_length)


def _first_layer(model: ModelSpec, *, moe: bool) -> int:
    return next(i for i in range(model.num_layers) if model.is_moe_layer(i) == moe)


def model_flops_per_step(model: ModelSpec, global_batch: int, seq_length: int) -> float:
    """Model FLOPs (PaLM/Megatron convention): ``3 ×`` forward, recompute not counted.

    For a GPT block this is Megatron's ``72·B·s·l·h²·(1 + s/6h + V/12lh)``.
    """
    return 3.0 * forward_flops(model, global_batch, seq_length)


def recompute_flops(model: ModelSpec, kind: Recompute, index: int, batch: int, seq_length: int) -> float:
    """Extra forward FLOPs the backward pass re-executes for block ``index``.

    full: the whole block forward; selective: the attention core only (Korthikanti et al. §4.2); op: the
    block's GEMMs but the kept linears' (:func:`planner.cost.sac.kept_linears`; the attention kernel's output
    is kept too).
    """
    if kind is Recompute.none:
        return 0.0
    lf = layer_flops(model, index, batch, seq_length)
    if kind is Recompute.op:
        kept = sum(lin.flops for lin in kept_linears(model, index, 1)) * batch * seq_length
        return lf.attention_linear + lf.mlp - kept
    return lf.total if kind is Recompute.full else lf.attention_core


def hardware_flops_per_step(
    model: ModelSpec, global_batch: int, seq_length: int, recompute: Recompute
) -> float:
    """FLOPs executed, recompute included: SC21's ``96·B·s·l·h²(1 + s/6h + V/16lh)`` under full recompute."""
    extra = sum(recompute_flops(model, recompute, i, global_batch, seq_length) for i in range(model.num_layers))
    return model_flops_per_step(model, global_batch, seq_length) + extra

