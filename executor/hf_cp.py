"""Context parallelism for Hugging Face models: their attention calls :func:`executor.cp.cp_attention`.

transformers looks each attention function up by ``config._attn_implementation``; this module registers
``"autopar_cp"`` (:data:`IMPLEMENTATION`), which runs the all-gather CP attention of :mod:`executor.cp` on
the query, key and value the model's attention computed, with the model's own scale, sliding window and
score soft-cap (Gemma 2's ``softcap``). transformers makes no mask for an implementation it has no mask
function for; the CP attention builds its own from global positions. The rotary tables follow the rank's
global positions, passed as ``position_ids`` (:func:`set_positions`): the rank holds the load-balanced
chunks ``r`` and ``2·cp-1-r`` of the sequence.

:func:`cp_refusal` names what the CP attention cannot compute, before any process starts: attention sinks
(gpt-oss's learned per-head logits in the softmax).
"""

from __future__ import annotations

import torch
from torch import nn

from executor.adapters import HF
from executor.cp import cp_attention
from executor.hf_pipeline import is_hf_stage

IMPLEMENTATION = "autopar_cp"


def _cp_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:  # noqa: ANN003
    """transformers' attention-function contract: q/k/v [B, H, S_local, D] -> ([B, S_local, H, D], None)."""
    out = cp_attention(query, key, value, positions=module.autopar_cp_positions, group=module.autopar_cp_group,
                       scale=scaling, window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"))
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _cp_attention_forward)


def cp_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s attention cannot run under CP, or None: attention sinks (learned per-head logits joining
    the softmax, gpt-oss) are not in :func:`executor.cp.cp_attention`."""
    for attention in _attentions(model):
        if isinstance(getattr(attention, "sinks", None), torch.nn.Parameter):
            return f"{type(attention).__name__}.sinks: attention sinks join the softmax, which the CP attention omits"
    return None


def _attentions(model: nn.Module):  # noqa: ANN202 - an iterator of modules
    for _, layer in HF.layer_items(model):
        yield HF.attention_of(layer)


def apply_hf_cp(model: nn.Module, group: torch.distributed.ProcessGroup) -> None:
    """Every attention of ``model`` (a whole model or a pipeline chunk) attends over the CP group's whole
    sequence; the model's forward gets the rank's global positions (:func:`set_positions`)."""
    _register()
    model.config._attn_implementation = IMPLEMENTATION
    for attention in _attentions(model):
        attention.autopar_cp_group = group
    model.register_forward_pre_hook(_add_position_ids, with_kwargs=True)


def set_positions(model: nn.Module, positions: torch.Tensor) -> None:
    """This rank's global positions [S_local] (:func:`executor.cp.load_balanced_positions`)."""
    model.autopar_position_ids = positions[None, :]
    for attention in _attentions(model):
        attention.autopar_cp_positions = positions


def _add_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A whole model's forward gets ``position_ids`` (a pipeline chunk passes them itself)."""
    if not is_hf_stage(module):
        ids = module.autopar_position_ids
        kwargs.setdefault("position_ids", ids.to(args[0].device if args else ids.device))
    return args, kwargs
