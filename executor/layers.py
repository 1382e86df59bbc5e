"""The building blocks of the built-in decoder (:mod:`executor.model`): norms, rotary embeddings,
grouped-query attention, the dense feed-forward and the pre-norm block.

Attribute names (``attention.wq`` .. ``feed_forward.w2``) are part of the checkpoint contract; tensor
parallelism shards the linears in place, so no module assumes the global head count or FFN width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from planner.contracts import ModelSpec
from planner.cost.compute import sdpa_takes_grouped_kv

ROPE_THETA = 10_000.0
NORM_EPS = 1e-5


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float = ROPE_THETA,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of angle ``pos * theta^(-2i/d)`` for each position (rows) and frequency i (columns).

    Computed from the positions themselves, not from a contiguous cache, so a context-parallel
    shard whose rows are non-contiguous global positions gets the right rotation."""
    inv = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of the last dim of x [B, S, H, D] by the angle of each position."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def make_norm(spec: ModelSpec, dim: int) -> nn.Module:
    """RMSNorm (scale only) or, for ``spec.norm == "layernorm"``, LayerNorm with scale and shift — the
    planner counts 2h parameters for a LayerNorm whatever ``linear_bias`` says."""
    if spec.norm == "layernorm":
        return nn.LayerNorm(dim, eps=NORM_EPS)
    return nn.RMSNorm(dim, eps=NORM_EPS)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE.

    Head counts are read off the local weight shapes (``view(B, S, -1, head_dim)``), so column-wise
    sharded ``wq/wk/wv`` and row-wise sharded ``wo`` (tensor parallel) work unchanged. With
    ``cp_group`` set, attention runs over the whole sequence of the context-parallel group
    (:func:`executor.cp.cp_attention`). With ``recompute_core`` (selective recompute) the
    softmax(QK^T)V core is recomputed in the backward instead of keeping its activations."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d, h, kv, hd = spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.head_size
        self.head_dim = hd
        self.wq = nn.Linear(d, h * hd, bias=spec.biased_qkv)
        self.wk = nn.Linear(d, kv * hd, bias=spec.biased_qkv)
        self.wv = nn.Linear(d, kv * hd, bias=spec.biased_qkv)
        self.wo = nn.Linear(h * hd, d, bias=spec.linear_bias)
        self.cp_group = None
        self.recompute_core = False  # selective recompute: keep no softmax/score activations

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """x [B, S, D], cos/sin [S, head_dim/2] of ``positions`` [S] (global) -> [B, S, D]."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        if self.cp_group is not None:
            from executor.cp import cp_attention

            def core(q, k, v):
                return cp_attention(q, k, v, positions=positions, group=self.cp_group)
        else:
            core = attention_core
        if self.recompute_core and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(core, q, k, v, use_reentrant=False)
        else:
            out = core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v, kv heads shared by groups of query heads.

    Grouped K/V go to SDPA as they are (``enable_gqa``) wherever it has a fused kernel for them, and are
    expanded to the query heads elsewhere (fp32 on CUDA, before Ampere, head dims over 256), by the rule
    ``autopar profile`` times attention by (:func:`planner.cost.compute.sdpa_takes_grouped_kv`), so the
    planner's attention times are this kernel's. Grouped, no expanded copy of K and V is kept for the
    backward (the planner's activation memory counts K/V at the kv heads), and on a CPU the grouped
    flash kernel ran 8-22% faster than on K/V expanded beforehand (fwd + bwd, 8/2 to 32/8 heads, fp32
    and bf16, one thread: ``benchmarks/attention_kernels.py``, which on a GPU also says which kernels
    take each). Under autocast the rule reads the dtype SDPA runs in (autocast's), not the
    inputs' (RoPE's fp32 tables turn q and k to fp32 before it). Context-parallel attention
    (:mod:`executor.cp`) expands after its gather: SDPA's masked kernels take no grouped K/V."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and not sdpa_takes_grouped_kv(q.device.type, _runs_sixteen_bit(q), _sm_major(q), q.shape[-1]):
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        rep = 1
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)


def _runs_sixteen_bit(q: torch.Tensor) -> bool:
    """Whether SDPA on ``q`` runs in a 16-bit format: autocast's dtype where autocast is on, else q's."""
    kind = q.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype
    return dtype in (torch.float16, torch.bfloat16)


def _sm_major(q: torch.Tensor) -> int:
    return torch.cuda.get_device_capability(q.device)[0] if q.is_cuda else 0


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); GeLU: w2(gelu(w1 x))."""

    def __init__(self, dim: int, hidden: int, kind: str = "swiglu", bias: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias) if kind == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)); then + ffn(norm(.)) with a dense MLP or an MoE layer."""

    def __init__(self, spec: ModelSpec, index: int) -> None:
        super().__init__()
        self.attention_norm = make_norm(spec, spec.hidden_size)
        self.attention = Attention(spec)
        self.ffn_norm = make_norm(spec, spec.hidden_size)
        if spec.is_moe_layer(index):
            from executor.moe import MoE

            self.moe = MoE(spec.hidden_size, spec.moe, spec.ffn_kind, spec.linear_bias)
        else:
            self.feed_forward = FeedForward(spec.hidden_size, spec.ffn_hidden_size, spec.ffn_kind,
                                            spec.linear_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, positions)
        if hasattr(self, "moe"):  # routing statistics of a split micro-batch need the rows' positions
            return x + self.moe(self.ffn_norm(x), positions)
        return x + self.feed_forward(self.ffn_norm(x))
