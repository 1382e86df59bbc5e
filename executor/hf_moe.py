"""Expert parallelism for Hugging Face MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3 and their kin).

transformers 5 keeps a layer's routed experts in one module (``mlp.experts``) holding two 3-D weights,
``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F], called as ``experts(x [T, D], top_k_index
[T, k], top_k_weights [T, k])``: expert e computes ``down_e(act(gate_e x) * up_e x)`` with gate and up
the two halves of ``gate_up_proj[e] x``, and the outputs are summed weighted by the router's weights.
The router, the shared experts (DeepSeek) and everything else stay as the model has them.

:func:`apply_hf_expert_parallel` shards both weights ``Shard(0)`` over the EP mesh (rank r owns experts
[r E/ep, (r+1) E/ep); names unchanged, so checkpoints move between plans) and gives the module a forward
that sorts the rank's assignments by expert, sends each row to its expert's owner with the same
differentiable all-to-all as the built-in MoE (:func:`executor.moe.dispatch_combine`), runs the local
experts with the module's own activation, sends the outputs back and sums them with the router's
weights: the single-process result, the expert weights' gradient summed over the tokens of every rank
of the EP group. An experts module of another shape (biases, another activation scheme) is refused for
EP before any process starts (:func:`ep_refusal`).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from executor.adapters import HF
from executor.moe import dispatch_combine

WEIGHTS = ("gate_up_proj", "down_proj")


def ep_refusal(experts: nn.Module) -> str | None:
    """Why ``experts`` cannot be dispatched as described in the module docstring, or None."""
    params = dict(experts.named_parameters(recurse=False))
    if set(params) != set(WEIGHTS) or not hasattr(experts, "act_fn"):
        return (f"holds {sorted(params)} (expected exactly {list(WEIGHTS)} and an act_fn): not the transformers "
                "experts layout the dispatch computes")
    gu, down = params["gate_up_proj"], params["down_proj"]
    e, two_f, d = gu.shape
    if down.shape != (e, d, two_f // 2):
        return f"has gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)}: not [E, 2F, D] and [E, D, F]"
    return None


def _experts_modules(model: nn.Module):  # noqa: ANN202 - an iterator of modules
    for _, layer in HF.layer_items(model):
        if HF.is_moe(layer):
            yield HF.ffn_of(layer).experts


def apply_hf_expert_parallel(model: nn.Module, ep_mesh) -> None:  # noqa: ANN001 - a 1-D DeviceMesh
    """Every routed-experts module of ``model`` sharded over ``ep_mesh`` and dispatched by all-to-all."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for experts in _experts_modules(model):
        for name in WEIGHTS:
            w = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(w.data, ep_mesh, [Shard(0)])))
        experts.autopar_ep_group = ep_mesh.get_group()
        experts.forward = types.MethodType(_ep_forward, experts)


def _ep_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for the rank's rows ``hidden`` [T, D], experts computed where they live."""
    num_experts = self.gate_up_proj.shape[0]
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)
    token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)[order]
    counts = torch.bincount(flat, minlength=num_experts)
    out = dispatch_combine(hidden[token], counts, self.autopar_ep_group, lambda rows, c: _run_local(self, rows, c))
    weights = top_k_weights.reshape(-1)[order]
    return torch.zeros_like(hidden).index_add_(0, token, (out * weights[:, None]).to(hidden.dtype))


def _run_local(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The local experts on ``rows`` sorted by local expert (``counts`` per local expert)."""
    gate_up, down = (getattr(experts, n) for n in WEIGHTS)
    gate_up = gate_up.to_local() if hasattr(gate_up, "to_local") else gate_up
    down = down.to_local() if hasattr(down, "to_local") else down
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        x = rows[start:start + n]
        start += n
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(experts.act_fn(gate) * up, down[e]))
    return torch.cat(outs) if outs else rows[:0]


# ---------------------------------------------------------------- under tensor (+ sequence) parallelism
def tp_block_style():  # noqa: ANN201 - a ParallelStyle
    """The MoE block of a layer under TP + SP (the target table requires SP): it takes this rank's
    sequence shard as a plain tensor and routes it itself, as the built-in MoE does; its output goes back
    to the residual stream as a ``Shard(1)`` DTensor."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                    use_local_input=True, output_layouts=(Shard(1),),
                                    desired_output_layouts=(Shard(1),), use_local_output=False)


def sum_router_grad_over_tp(router: nn.Module, group) -> None:  # noqa: ANN001 - a ProcessGroup
    """The router's weight is whole on every TP rank, which routes only its own rows: its gradient is
    summed over the TP group as it is computed (a hook on the tensor the forward uses: FSDP2's gathered
    parameter, or the parameter itself), so every TP rank holds the micro-batch's gradient."""
    router.autopar_tp_group = group
    router.autopar_hooked = set()
    router.register_forward_pre_hook(_hook_router_weight)


def _hook_router_weight(router: nn.Module, args: tuple) -> None:
    w = router.weight
    if id(w) in router.autopar_hooked or not w.requires_grad:
        return
    router.autopar_hooked.add(id(w))
    group = router.autopar_tp_group
    w.register_hook(lambda g: _all_reduced(g, group))


def _all_reduced(grad: torch.Tensor, group) -> torch.Tensor:  # noqa: ANN001 - a ProcessGroup
    import torch.distributed as dist

    from executor.measure import label

    out = grad.contiguous().clone()
    with label("autopar.tp"):
        dist.all_reduce(out, group=group)
    return out
