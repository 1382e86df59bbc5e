"""Per-op selective activation checkpointing (``Recompute.op``) with torch's own building blocks.

The policy the planner prices (:mod:`planner.cost.sac`, torchtitan's ``SelectiveAC``): each chosen block
runs under a non-reentrant ``checkpoint_wrapper`` whose ``create_selective_checkpoint_contexts`` policy keeps
the outputs of the compute-intensive ops (torch's partitioner list: mm, addmm, bmm, the SDPA kernels,
_scaled_mm; the CPU flash kernel too), of reduce-scatters and all-to-alls, of topk and max, except every
second ``aten.mm`` counted in forward order within the block; the MoE router's matmul (right-hand shape
``(hidden, experts)``) is always run again and not counted. Everything else runs again in the backward.

On a GPU the routed experts are one grouped GEMM (not counted, as priced); on the CPU they are one matmul
per expert, which the policy treats as that grouped GEMM (:func:`executor.moe.in_routed_expert_loop`): run
again, not counted.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from executor.moe import in_routed_expert_loop


@functools.cache
def kept_ops() -> frozenset:
    """The ops whose outputs the policy keeps (besides the counted matmuls' odd ones)."""
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    ops |= {aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default,
            aten.topk.default, aten.max.default,
            c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default}
    return frozenset(ops)


def _policy(force_recompute: frozenset[tuple[int, int]]):  # noqa: ANN202 - a checkpoint policy
    """A fresh policy for one block's forward (and its recompute): its own matmul counters."""
    counts = {False: 0, True: 0}  # by ctx.is_recompute
    mm, kept = torch.ops.aten.mm.default, kept_ops()

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001, ANN003
        if func is mm:
            if tuple(args[1].shape) in force_recompute or in_routed_expert_loop():
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[ctx.is_recompute] += 1
            return (CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 == 1
                    else CheckpointPolicy.PREFER_RECOMPUTE)
        return CheckpointPolicy.MUST_SAVE if func in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def router_shapes(block: nn.Module) -> frozenset[tuple[int, int]]:
    """Right-hand ``(in, out)`` shapes of the block's MoE router matmuls (a ``gate`` linear beside experts)."""
    shapes = set()
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] == "gate":
            parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
            if hasattr(parent, "experts"):
                shapes.add((module.in_features, module.out_features))
    return frozenset(shapes)


def op_checkpoint(block: nn.Module) -> nn.Module:
    """``block`` wrapped for per-op selective checkpointing."""
    force = router_shapes(block)
    return checkpoint_wrapper(block, preserve_rng_state=False,
                              context_fn=lambda: create_selective_checkpoint_contexts(_policy(force)))
