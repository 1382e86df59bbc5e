"""Multi-head latent attention (DeepSeek-V2/V3, Hugging Face ``kv_b_proj``) under tensor parallelism.

MLA projects the hidden states down to latents (``q_a_proj`` -> ``q_a_layernorm``; ``kv_a_proj_with_mqa`` ->
the kv latent, normed by ``kv_a_layernorm``, and one rotary key ``k_rot`` shared by every head) and up to the
heads (``q_b_proj`` or ``q_proj``; ``kv_b_proj``), then runs ordinary attention and ``o_proj``. The TP plan
(:func:`mla_plan`), as Megatron-Core builds it (its down projections ``parallel_mode='duplicated'``):

* the up projections are column-parallel (each TP rank its heads) and ``o_proj`` row-parallel;
* the down projections and their norms stay whole on every TP rank and take the whole input as a plain
  tensor (with SP the layer's input arrives all-gathered as a replicated DTensor and is handed over as its
  local value), so their outputs and weight gradients are the single-process ones on every rank,
  provided the gradient reaching their outputs is the whole one;
* it is for the latents: the up projections' input gradients are summed over TP by their column-parallel
  style. The shared rotary key is not: it goes straight into this rank's heads, so its gradient holds
  only their share. :func:`sum_rotary_key_grad_over_tp` sums that slice of the ``kv_a_proj_with_mqa``
  output's gradient over the TP group (an autograd function: identity forward, all-reduce of the last
  ``qk_rope_head_dim`` columns backward).

Without that sum every gradient upstream of the latent projection is off (1.6e-3 relative on the embedding,
norms and MLP of tests/dist_scripts/hf_grads_check.py's dense MLA family under dp2 x tp2 + SP).
"""

from __future__ import annotations

import torch
from torch import nn

from executor.adapters import HF
from planner.errors import AutoparError

UP = ("q_proj", "q_b_proj", "kv_b_proj")  # column-parallel (whichever of q_proj / q_b_proj the model has)
DOWN = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")  # whole on every TP rank


def check_mla_tp(attention: nn.Module, where: str, tp: int) -> None:
    """Refuse an MLA attention this plan cannot split: its projections as DeepSeek-V3's, heads divisible by tp,
    and no other module with weights."""
    heads = getattr(attention, "num_heads", None)
    if not isinstance(heads, int) or heads % tp:
        raise AutoparError("layout.tp", tp, f"use a tp that divides the {heads} attention heads",
                           problem=f"cannot split the heads of {where}")
    needed = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", HF.o_proj)
    q_path = ("q_proj",) if isinstance(getattr(attention, "q_proj", None), nn.Linear) else (
        "q_a_proj", "q_a_layernorm", "q_b_proj")
    for name in (*needed, *q_path):
        if not isinstance(getattr(attention, name, None), nn.Module):
            raise AutoparError("layout.tp", tp, "use tp=1 for this model",
                               problem=f"cannot split {where}: it has no {name} (MLA as DeepSeek-V3 builds it)")
    for name, module in attention.named_children():
        if name not in (*UP, *DOWN, HF.o_proj) and next(module.parameters(), None) is not None:
            raise AutoparError("layout.tp", tp, "use tp=1 for this model",
                               problem=f"cannot place {where}.{name} ({type(module).__name__}) under TP")


def mla_plan(attention: nn.Module, attn: str) -> dict:
    """TP styles of an MLA attention's projections and norms, by path under the layer (``attn`` its path);
    ``o_proj`` is the caller's (the same as any attention's)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

    whole = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                               use_local_output=True)  # the input as its plain local value
    plan = {f"{attn}.{name}": ColwiseParallel() for name in UP if hasattr(attention, name)
            and isinstance(getattr(attention, name), nn.Linear)}
    plan |= {f"{attn}.{name}": whole for name in DOWN if isinstance(getattr(attention, name, None), nn.Module)}
    return plan


class _SumTailGrad(torch.autograd.Function):
    """``forward(x) = x``; backward: the last ``width`` columns of the gradient summed over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, group) -> torch.Tensor:  # noqa: ANN001 - a ProcessGroup
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import torch.distributed as dist

        from executor.measure import label

        grad = grad.contiguous().clone()
        tail = grad[..., -ctx.width:].contiguous()
        with label("autopar.tp"):
            dist.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.width:] = tail
        return grad, None, None


def sum_rotary_key_grad_over_tp(attention: nn.Module, group) -> None:  # noqa: ANN001 - a ProcessGroup
    """Sum the gradient of the shared rotary key (the last ``qk_rope_head_dim`` outputs of
    ``kv_a_proj_with_mqa``) over the TP group, as the module docstring explains."""
    width = int(attention.qk_rope_head_dim)

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return _SumTailGrad.apply(out, width, group)

    attention.kv_a_proj_with_mqa.register_forward_hook(hook)
