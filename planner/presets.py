"""Named model presets: published transformer shapes as ready-made ``ModelSpec`` instances.

Every value comes from the model's paper or its official ``config.json``; the source is noted per
family. ``get_preset`` is forgiving about spelling (``Llama-3.1-405B``, ``llama3_1-405b``) and always
returns a fresh copy, so callers may mutate what they get.
"""

from __future__ import annotations

import re

from planner.contracts.model import MLASpec, ModelSpec, MoESpec
from planner.errors import UnknownNameError


def _gpt(
    name: str, layers: int, hidden: int, heads: int, vocab: int, head_dim: int | None = None
) -> ModelSpec:
    """A GPT-2/3-style block: learned positions, LayerNorm, biased linears, GeLU MLP of 4h, dropout 0.1."""
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        head_dim=head_dim,
        ffn_hidden_size=4 * hidden,
        ffn_kind="gelu",
        vocab_size=vocab,
        tied_embeddings=True,
        position_embedding="learned",
        max_position_embeddings=2048,
        norm="layernorm",
        linear_bias=True,
        dropout=0.1,
    )


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    vocab: int,
    kv_heads: int | None = None,
    **extra: object,
) -> ModelSpec:
    """A Llama-style block: RoPE, RMSNorm, SwiGLU MLP, no biases, untied LM head (``extra`` adds fields)."""
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=ffn,
        ffn_kind="swiglu",
        vocab_size=vocab,
        tied_embeddings=False,
        position_embedding="rope",
        norm="rmsnorm",
        linear_bias=False,
        **extra,
    )


def _build() -> dict[str, ModelSpec]:
    presets: list[ModelSpec] = [
        # GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (n_ctx 2048).
        # The 13B row lists d_model 5140 with 40 heads of d_head 128, hence the explicit head_dim.
        _gpt("gpt3-1.3b", 24, 2048, 16, 50257),
        _gpt("gpt3-6.7b", 32, 4096, 32, 50257),
        _gpt("gpt3-13b", 40, 5140, 40, 50257, head_dim=128),
        _gpt("gpt3-175b", 96, 12288, 96, 50257),
        # Megatron GPT: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
        # Models", Table 3 (also Narayanan et al. SC21); padded vocab 51200, sequence 2048, and
        # Megatron-LM's default of sharing the embedding with the output layer.
        _gpt("megatron-22b", 48, 6144, 64, 51200),
        _gpt("megatron-175b", 96, 12288, 96, 51200),
        _gpt("megatron-530b", 105, 20480, 128, 51200),
        _gpt("megatron-1t", 128, 25600, 160, 51200),
        # Llama 2: Touvron et al. 2023 and the official config.json files (70B uses GQA with 8 KV heads).
        _llama("llama2-7b", 32, 4096, 32, 11008, 32000),
        _llama("llama2-13b", 40, 5120, 40, 13824, 32000),
        _llama("llama2-70b", 80, 8192, 64, 28672, 32000, kv_heads=8),
        # Llama 3 / 3.1: Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3. 3.1 only changes the
        # RoPE scaling / context length, so its shapes equal Llama 3's.
        _llama("llama3-8b", 32, 4096, 32, 14336, 128256, kv_heads=8),
        _llama("llama3.1-8b", 32, 4096, 32, 14336, 128256, kv_heads=8),
        _llama("llama3-70b", 80, 8192, 64, 28672, 128256, kv_heads=8),
        _llama("llama3.1-70b", 80, 8192, 64, 28672, 128256, kv_heads=8),
        _llama("llama3.1-405b", 126, 16384, 128, 53248, 128256, kv_heads=8),
    ]

    # Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts", Table 1, and mistralai/Mixtral-8x7B-v0.1
    # config.json: every layer has 8 SwiGLU experts of 14336, 2 active per token.
    mixtral_moe = MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=14336)
    presets.append(_llama("mixtral-8x7b", 32, 4096, 32, 14336, 32000, kv_heads=8, moe=mixtral_moe))

    # Qwen3-30B-A3B: Qwen/Qwen3-30B-A3B config.json (Qwen3 technical report, 2025). 32 query heads of 128
    # over a 2048-wide residual, so head_dim is explicit; 128 experts of 768, 8 active, no shared expert;
    # an RMSNorm on every query and key head.
    qwen_moe = MoESpec(num_experts=128, top_k=8, expert_ffn_hidden_size=768)
    presets.append(
        _llama("qwen3-30b-a3b", 48, 2048, 32, 6144, 151936, kv_heads=4, head_dim=128, moe=qwen_moe, qk_norm=True)
    )

    # DeepSeek-V3: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", and deepseek-ai/DeepSeek-V3
    # config.json. First 3 layers dense (18432), then 256 routed experts of 2048 (top-8) plus 1 shared;
    # MLA attention. The multi-token-prediction module is not part of the spec.
    deepseek_moe = MoESpec(
        num_experts=256, top_k=8, expert_ffn_hidden_size=2048, num_shared_experts=1, first_dense_layers=3
    )
    deepseek_mla = MLASpec(
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )
    presets.append(
        _llama("deepseek-v3", 61, 7168, 128, 18432, 129280, kv_heads=128, moe=deepseek_moe, mla=deepseek_mla)
    )

    return {spec.name: spec for spec in presets}


PRESETS: dict[str, ModelSpec] = _build()
"""Canonical presets by name. Read-only by convention: use ``get_preset`` for a copy to change."""

# Other names for a preset (same shapes, different release name).
ALIASES: dict[str, str] = {"llama3-405b": "llama3.1-405b"}


def _squash(name: str) -> str:
    """Lookup key: lowercase, without an ``org/`` prefix, a leading ``meta-`` or separators."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = re.sub(r"[\s_\-]+", "", key)
    return key.removeprefix("meta") if key.startswith("metallama") else key


_LOOKUP: dict[str, str] = {_squash(n): n for n in [*PRESETS, *ALIASES]}


def list_presets() -> list[str]:
    """Canonical preset names, sorted."""
    return sorted(PRESETS)


def get_preset(name: str) -> ModelSpec:
    """A fresh copy of the preset called ``name`` (case- and separator-insensitive).

    Raises ``UnknownNameError`` listing the known presets when ``name`` matches none.
    """
    canonical = _LOOKUP.get(_squash(name))
    if canonical is None:
        raise UnknownNameError("model", name, list_presets())
    return PRESETS[ALIASES.get(canonical, canonical)].model_copy(deep=True)
