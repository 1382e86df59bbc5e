"""ModelSpec: a decoder-only transformer, dense or Mixture-of-Experts, described by its shapes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from planner.contracts.common import SCHEMA_VERSION, Contract, Name
from planner.contracts.limits import (
    MAX_CAPACITY_FACTOR,
    MAX_EXPERTS,
    MAX_FFN,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_SEQ,
    MAX_VOCAB,
)


def _positive(field: str, value: int, limit: int) -> int:
    if value <= 0:
        raise ValueError(f"{field}={value} must be a positive integer")
    if value > limit:
        raise ValueError(f"{field}={value} is larger than {limit:,}, which no real model has; check the units")
    return value


class MoESpec(Contract):
    """Mixture-of-Experts feed-forward layers (Switch/GShard-style top-k routing)."""

    num_experts: int = Field(strict=True, description="routed experts per MoE layer")
    top_k: int = Field(strict=True, description="routed experts each token is sent to")
    expert_ffn_hidden_size: int = Field(strict=True, description="intermediate size of one routed expert")
    num_shared_experts: int = Field(0, ge=0, le=MAX_EXPERTS, strict=True,
                                    description="always-active experts (DeepSeek, Qwen2-MoE)")
    shared_expert_ffn_hidden_size: int | None = Field(
        None, gt=0, le=MAX_FFN, strict=True,
        description="intermediate size of one shared expert; defaults to expert_ffn_hidden_size"
    )
    first_dense_layers: int = Field(0, ge=0, le=MAX_LAYERS, strict=True,
                                    description="leading layers that keep a dense FFN (DeepSeek-V3: 3)")
    layer_frequency: int = Field(1, ge=1, le=MAX_LAYERS, strict=True,
                                 description="every n-th layer after the dense ones is MoE")
    capacity_factor: float | None = Field(
        None, gt=0, le=MAX_CAPACITY_FACTOR, strict=True,
        description="token capacity per expert relative to a perfect balance; None = dropless"
    )

    @field_validator("num_experts")
    @classmethod
    def _experts(cls, v: int) -> int:
        return _positive("moe.num_experts", v, MAX_EXPERTS)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        return _positive("moe.top_k", v, MAX_EXPERTS)

    @field_validator("expert_ffn_hidden_size")
    @classmethod
    def _ffn(cls, v: int) -> int:
        return _positive("moe.expert_ffn_hidden_size", v, MAX_FFN)

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}; "
                f"a token cannot be routed to more experts than exist (use top_k <= {self.num_experts})"
            )
        return self

    @property
    def shared_ffn(self) -> int:
        return self.shared_expert_ffn_hidden_size or self.expert_ffn_hidden_size


class MLASpec(Contract):
    """DeepSeek multi-head latent attention: low-rank compressed queries and keys/values."""

    q_lora_rank: int = Field(0, ge=0, le=MAX_HIDDEN, strict=True,
                             description="query compression rank; 0 = uncompressed queries")
    kv_lora_rank: int = Field(strict=True, description="key/value latent size")
    qk_nope_head_dim: int = Field(strict=True, description="per-head query/key size without rotary part")
    qk_rope_head_dim: int = Field(strict=True, description="per-head rotary query/key size (key part shared by heads)")
    v_head_dim: int = Field(strict=True, description="per-head value size")

    @field_validator("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    @classmethod
    def _pos(cls, v: int, info) -> int:  # noqa: ANN001
        return _positive(f"mla.{info.field_name}", v, MAX_HIDDEN)


class ModelSpec(Contract):
    """A decoder transformer: embedding, ``num_layers`` identical blocks (some MoE), final norm, LM head."""

    schema_version: Literal["1"] = SCHEMA_VERSION
    name: Name = "custom"
    num_layers: int = Field(strict=True)
    hidden_size: int = Field(strict=True)
    num_attention_heads: int = Field(strict=True)
    num_kv_heads: int | None = Field(
        None, strict=True, description="GQA/MQA key-value heads; None = num_attention_heads"
    )
    head_dim: int | None = Field(
        None, strict=True, description="per-head size; None = hidden_size / num_attention_heads"
    )
    ffn_hidden_size: int = Field(strict=True, description="dense FFN intermediate size")
    ffn_kind: Literal["gelu", "swiglu"] = "swiglu"
    vocab_size: int = Field(strict=True)
    tied_embeddings: bool = False
    position_embedding: Literal["rope", "learned", "alibi"] = "rope"
    max_position_embeddings: int | None = Field(None, strict=True, description="rows of a learned position table")
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    linear_bias: bool = Field(False, description="a bias on every linear layer (GPT-2/3, BLOOM)")
    qkv_bias: bool = Field(False, description="a bias on the query, key and value projections only (Qwen2, "
                           "Qwen2.5; Megatron-LM --add-qkv-bias); implied by linear_bias")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, strict=True)
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    sliding_window: int | None = Field(
        None, strict=True, description="keys a windowed layer's query attends to, itself included (Mistral 7B "
        "v0.1: 4096, Gemma 2: 4096, Gemma 3: 1024); None: every layer attends to the whole causal prefix")
    global_layer_every: int | None = Field(
        None, strict=True, description="with sliding_window, block i attends to the whole prefix when (i + 1) % N "
        "== 0 (Gemma 2: 2, Gemma 3: 6); None: every block is windowed")
    extra_norms: int = Field(0, strict=True, ge=0, le=8,
                             description="RMSNorms over the hidden size per block beyond the two (Gemma 2/3: 2)")
    qk_norm: bool = Field(False, description="an RMSNorm on every query and key head (Qwen3, OLMo 2, Gemma 3)")
    logit_softcap: float | None = Field(
        None, gt=0.0, description="tanh soft-capping of the output logits, cap x tanh(logits / cap) (Gemma 2: 30)")

    @property
    def biased_qkv(self) -> bool:
        """Q, K and V carry a bias: every linear does (``linear_bias``) or those three only (``qkv_bias``)."""
        return self.linear_bias or self.qkv_bias

    @field_validator("num_layers")
    @classmethod
    def _layers(cls, v: int) -> int:
        return _positive("num_layers", v, MAX_LAYERS)

    @field_validator("hidden_size")
    @classmethod
    def _hidden(cls, v: int) -> int:
        return _positive("hidden_size", v, MAX_HIDDEN)

    @field_validator("num_attention_heads")
    @classmethod
    def _heads(cls, v: int) -> int:
        return _positive("num_attention_heads", v, MAX_HEADS)

    @field_validator("ffn_hidden_size")
    @classmethod
    def _ffn(cls, v: int) -> int:
        return _positive("ffn_hidden_size", v, MAX_FFN)

    @field_validator("vocab_size")
    @classmethod
    def _vocab(cls, v: int) -> int:
        return _positive("vocab_size", v, MAX_VOCAB)

    @field_validator("num_kv_heads", "head_dim")
    @classmethod
    def _optional_positive(cls, v: int | None, info) -> int | None:  # noqa: ANN001
        return None if v is None else _positive(info.field_name, v, MAX_HIDDEN)

    @field_validator("sliding_window", "global_layer_every")
    @classmethod
    def _window(cls, v: int | None, info) -> int | None:  # noqa: ANN001
        return None if v is None else _positive(info.field_name, v, MAX_SEQ)

    @field_validator("max_position_embeddings")
    @classmethod
    def _positions(cls, v: int | None) -> int | None:
        return None if v is None else _positive("max_position_embeddings", v, MAX_SEQ)

    @model_validator(mode="after")
    def _shapes(self) -> ModelSpec:
        a = self.num_attention_heads
        if self.head_dim is None and self.mla is None and self.hidden_size % a:
            raise ValueError(
                f"num_attention_heads={a} does not divide hidden_size={self.hidden_size}; "
                f"choose a divisor of {self.hidden_size} or give head_dim explicitly"
            )
        k = self.kv_heads
        if k > a or a % k:
            raise ValueError(
                f"num_kv_heads={k} must divide num_attention_heads={a} (GQA groups are equal); "
                f"use a divisor of {a}, e.g. {max(d for d in range(1, min(a, 8) + 1) if a % d == 0)}"
            )
        if self.position_embedding == "learned" and not self.max_position_embeddings:
            raise ValueError("position_embedding='learned' needs max_position_embeddings (rows of the position table)")
        if self.moe is not None and self.moe.first_dense_layers >= self.num_layers:
            raise ValueError(
                f"moe.first_dense_layers={self.moe.first_dense_layers} leaves no MoE layer among "
                f"num_layers={self.num_layers}; lower it or drop the moe section"
            )
        return self

    # ---- derived shapes (plain arithmetic on the fields) ----
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        """Per-head query/key size (MLA: nope + rope part)."""
        if self.mla is not None:
            return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def value_head_size(self) -> int:
        return self.mla.v_head_dim if self.mla is not None else self.head_size

    def is_windowed_layer(self, index: int) -> bool:
        """Whether block ``index`` attends through ``sliding_window`` (see ``global_layer_every``)."""
        if self.sliding_window is None:
            return False
        return self.global_layer_every is None or (index + 1) % self.global_layer_every != 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has routed experts."""
        if self.moe is None or index < self.moe.first_dense_layers:
            return False
        return (index - self.moe.first_dense_layers) % self.moe.layer_frequency == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))
