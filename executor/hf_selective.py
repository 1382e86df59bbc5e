"""Selective recompute for Hugging Face models: the attention core of the chosen layers is recomputed.

As for the built-in attention (:func:`executor.parallelize.apply_recompute`), only the core --
softmax(QK^T scale + mask) V, whatever attention function the model runs (SDPA, eager, the CP
attention of :mod:`executor.hf_cp`) -- runs under ``torch.utils.checkpoint``; the projections' inputs
and outputs stay stored. transformers looks the attention function up by
``config._attn_implementation``: this module registers ``"autopar_selective_<inner>"``, which calls
the function the model ran before (:func:`inner_attention`) with that function's masks, checkpointed
for the attentions whose ``recompute_core`` is set (the first N layers of a stage) and directly for
the others.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from executor.adapters import HF

IMPLEMENTATION = "autopar_selective"


def inner_attention(attention: nn.Module):  # noqa: ANN201 - a transformers attention function
    """The attention function ``attention`` ran before selective recompute: a registered one by name, or the
    model's own eager function (transformers does not register those)."""
    from transformers import AttentionInterface

    name = attention.autopar_inner_attention
    if name == "eager":
        return sys.modules[type(attention).__module__].eager_attention_forward
    return AttentionInterface._global_mapping[name]


def _selective_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs) -> tuple:  # noqa: ANN003
    inner = inner_attention(module)
    if getattr(module, "recompute_core", False):
        return checkpoint(inner, module, query, key, value, attention_mask, use_reentrant=False, **kwargs)
    return inner(module, query, key, value, attention_mask, **kwargs)


def apply_hf_selective(model: nn.Module, layers: list[nn.Module]) -> None:
    """The attention cores of ``layers`` (decoder layers of ``model``) recomputed in the backward."""
    inner = model.config._attn_implementation
    if not inner.startswith(IMPLEMENTATION):
        for _, layer in HF.layer_items(model):
            HF.attention_of(layer).autopar_inner_attention = inner
        model.config._attn_implementation = _register(inner)
    for layer in layers:
        HF.attention_of(layer).recompute_core = True


def _register(inner: str) -> str:
    """``autopar_selective_<inner>``, registered with transformers: its attention function
    :func:`_selective_forward`, its masks those of ``inner`` (causal, sliding-window; none for the CP
    attention, which makes its own)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"{IMPLEMENTATION}_{inner}"
    AttentionInterface.register(name, _selective_forward)
    if inner in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[inner])
    return name
