"""Mixture-of-Experts feed-forward layer and expert parallelism on plain collectives.

Routing of a token x [D] (``MoE.route``): router probabilities p = softmax(x W_gate^T) over the E
experts; the k largest are kept and renormalised to sum to 1 (Mixtral / Qwen-MoE convention — the
output scale then does not shrink as E grows), so

    y = sum_{e in topk(p)} w_e * expert_e(x)  +  sum_s shared_s(x),   w_e = p_e / sum_{topk} p.

An expert is a SwiGLU MLP  (silu(x W1^T) * (x W3^T)) W2^T  or a GeLU MLP  gelu(x W1^T) W2^T.

Load-balancing loss (Switch Transformer), on the T tokens of one forward:
aux = coef * E * sum_e f_e * P_e, where f_e = (assignments routed to e) / (T k) counts every top-k
assignment before any capacity drop and P_e = mean over tokens of p_e. Only P carries a gradient.

Dropless by default: every assignment is computed (assignments sorted by expert, one set of GEMMs
per expert on its slice). With ``capacity_factor`` cf each expert accepts at most
C = ceil(cf * T * k / E) assignments; the rest are dropped (they contribute zero, the token keeps its
other experts and the shared ones). Which ones drop is deterministic: first come first served in
(token index, k) order.

Expert parallelism (:func:`apply_expert_parallel`): ``experts.w1/w2/w3`` become DTensors ``Shard(0)``
over a 1-D EP mesh (names unchanged, so checkpoints move between plans); rank r of the group owns
experts [r E/ep, (r+1) E/ep). Each rank routes its own tokens, all-to-alls the per-expert counts,
sends every kept assignment's row to the owner of its expert (differentiable all-to-all), runs its
local experts and sends the results back with the reverse all-to-all. The router and shared experts
stay replicated.

Statistics under EP are per rank: capacity and the aux loss use the T tokens of the rank's own
forward, exactly as the same rank computes them without EP (a data-parallel rank is one micro-batch
of the single-process reference, :mod:`executor.reference`). EP therefore changes where experts run,
never which assignments drop or the loss. Consequently the gradient of a local expert shard is the
sum of the gradients from the tokens of *every* rank of its EP group (their rows were computed here
and their output gradients come back through the reverse all-to-all), while the router and shared
experts get only the rank's own tokens' gradient — the data-parallel reduction does the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from planner.contracts import MoESpec
from planner.errors import AutoparError

AUX_LOSS_COEF = 0.01
INIT_STD = 0.02
FFN_KINDS = ("swiglu", "gelu")


class GroupedExperts(nn.Module):
    """E independent MLPs as stacked weights: ``w1``, ``w3`` [E, F, D] (w3: SwiGLU only), ``w2`` [E, D, F]."""

    def __init__(self, num_experts: int, dim: int, hidden: int, kind: str = "swiglu") -> None:
        super().__init__()
        self.kind = kind
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim)) if kind == "swiglu" else None

    def local(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(w1, w2, w3) of the experts held here: the local shard under expert parallelism."""
        def loc(w: torch.Tensor | None) -> torch.Tensor | None:
            return w.to_local() if isinstance(w, DTensor) else w
        return loc(self.w1), loc(self.w2), loc(self.w3)

    @staticmethod
    def run(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None,
            kind: str) -> torch.Tensor:
        """One expert on rows x [n, D] with w1 [F, D], w2 [D, F] (and w3 [F, D] for ``kind`` swiglu)."""
        if kind == "swiglu":
            return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
        return F.gelu(x @ w1.T, approximate="tanh") @ w2.T

    def forward_grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows x [sum(counts), D] sorted by local expert (``counts[e]`` rows for expert e) -> outputs
        [sum(counts), D] in the same order. Every expert runs, also on zero rows, so each one is in
        the autograd graph on every rank (zero gradients, and the backward all-to-all always runs)."""
        w1, w2, w3 = self.local()
        outs = [self.run(rows, w1[e], w2[e], None if w3 is None else w3[e], self.kind)
                for e, rows in enumerate(x.split(counts))]
        return torch.cat(outs)

    def forward_all(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every expert applied to all rows x [T, D] (the shared experts)."""
        w1, w2, w3 = self.local()
        y = self.run(x, w1[0], w2[0], None if w3 is None else w3[0], self.kind)
        for e in range(1, w1.shape[0]):
            y = y + self.run(x, w1[e], w2[e], None if w3 is None else w3[e], self.kind)
        return y


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits; the gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Send rows ``x[sum(in_splits[:r]) : +in_splits[r]]`` to rank r of ``group``; return the rows
    received, ``out_splits[r]`` from rank r, in rank order. Differentiable (backward: the reverse)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class MoE(nn.Module):
    """Router ``gate`` [E, D], routed ``experts`` and optional ``shared_experts``; see the module docstring.

    After each forward ``self.aux_loss`` holds the load-balancing loss (already times ``aux_loss_coef``).
    """

    def __init__(self, hidden_size: int, moe: MoESpec, ffn_kind: str = "swiglu", bias: bool = False,
                 aux_loss_coef: float = AUX_LOSS_COEF) -> None:
        super().__init__()
        if bias:
            raise AutoparError("linear_bias", True, "set linear_bias=false for MoE models",
                               problem="is not supported by the MoE experts (they have no bias)")
        if ffn_kind not in FFN_KINDS:
            raise AutoparError("ffn_kind", ffn_kind, f"use one of {', '.join(FFN_KINDS)}",
                               problem="is not an expert MLP kind")
        self.spec = moe
        self.num_experts, self.top_k, self.aux_loss_coef = moe.num_experts, moe.top_k, aux_loss_coef
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = GroupedExperts(moe.num_experts, hidden_size, moe.expert_ffn_hidden_size, ffn_kind)
        self.shared_experts = (GroupedExperts(moe.num_shared_experts, hidden_size, moe.shared_ffn, ffn_kind)
                               if moe.num_shared_experts else None)
        self.ep_group: dist.ProcessGroup | None = None
        self.aux_loss: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (top-k expert ids [T, k], renormalised weights [T, k], router probs [T, E] fp32)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype), probs

    def capacity(self, num_tokens: int) -> int | None:
        """Assignments one expert accepts in a forward of T = ``num_tokens`` tokens: ceil(cf T k / E);
        None when dropless."""
        cf = self.spec.capacity_factor
        return None if cf is None else math.ceil(cf * num_tokens * self.top_k / self.num_experts)

    def _keep_mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Which (token, k) assignments of ids [T, k] their expert accepts (None when dropless): the
        first C of each expert in (token, k) order. An assignment's place at its expert is its index
        in the stable sort by expert minus the number of assignments to lower experts."""
        cap = self.capacity(ids.shape[0])
        if cap is None:
            return None
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        starts = counts.cumsum(0) - counts
        place = torch.empty_like(flat)
        place[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        return (place < cap).reshape(ids.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] -> [B, S, D]; sets ``self.aux_loss``."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights, probs = self.route(x)
        frac = torch.bincount(ids.reshape(-1), minlength=self.num_experts).float() / ids.numel()
        self.aux_loss = self.aux_loss_coef * self.num_experts * (frac * probs.mean(0)).sum()
        # kept assignments, sorted by expert (stable: by token within an expert)
        flat_ids = ids.reshape(-1)
        tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        w = weights.reshape(-1)
        keep = self._keep_mask(ids)
        if keep is not None:
            m = keep.reshape(-1)
            flat_ids, tok, w = flat_ids[m], tok[m], w[m]
        order = flat_ids.argsort(stable=True)
        flat_ids, tok, w = flat_ids[order], tok[order], w[order]
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        if self.ep_group is None:
            out = self.experts.forward_grouped(x[tok], counts.tolist())
        else:
            out = self._dispatch_combine(x[tok], counts)
        y = torch.zeros_like(x).index_add(0, tok, out * w[:, None])
        if self.shared_experts is not None:
            y = y + self.shared_experts.forward_all(x)
        return y.reshape(shape)

    def _dispatch_combine(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallel: rows [N, D] sorted by global expert (``counts`` [E] per expert) -> each
        row's expert output, same order, computed on the rank owning the expert."""
        group = self.ep_group
        ep = dist.get_world_size(group)
        local_e = self.num_experts // ep
        send = counts.view(ep, local_e)  # [destination rank, its local expert]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=group)  # [source rank, my local expert]
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        got = all_to_all(rows, out_splits, in_splits, group)
        # received: by source rank, each block sorted by my local expert -> regroup by local expert
        local_ids = torch.arange(local_e, device=rows.device)
        expert_of_row = local_ids.repeat(ep).repeat_interleave(recv.reshape(-1))
        by_expert = expert_of_row.argsort(stable=True)
        out = self.experts.forward_grouped(got[by_expert], recv.sum(0).tolist())
        return all_to_all(out[by_expert.argsort()], in_splits, out_splits, group)

    def init_weights(self, gen_for: Callable[[str], torch.Generator]) -> None:
        """Fill every parameter with N(0, 0.02) drawn from ``gen_for(local name)``. The FULL tensor is
        drawn (expert shards are then sliced out), so the values never depend on expert parallelism."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                full = torch.empty(p.shape).normal_(0.0, INIT_STD, generator=gen_for(name)).to(p.dtype)
                if isinstance(p, DTensor):
                    # every rank drew the same full tensor: slice the local shard, no communication
                    full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements,
                                             src_data_rank=None)
                p.copy_(full)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard the routed experts of every :class:`MoE` in ``model`` over the 1-D ``ep_mesh``.

    ``experts.w1/w2/w3`` become ``Shard(0)`` DTensors (distributed from the full replicated values,
    same parameter names) and the forward switches to all-to-all dispatch over ``ep_mesh``'s group.
    The router and the shared experts stay replicated. Works on meta tensors (materialise later).
    """
    if ep_mesh.ndim != 1:
        raise AutoparError("ep_mesh", tuple(ep_mesh.shape),
                           "pass the 1-D expert-parallel sub-mesh, e.g. mesh['ep']",
                           problem="is not a 1-D device mesh")
    ep = ep_mesh.size()
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        if module.num_experts % ep:
            divisors = [d for d in range(1, module.num_experts + 1) if module.num_experts % d == 0]
            raise AutoparError(
                "layout.ep", ep, f"choose an ep that divides moe.num_experts={module.num_experts} "
                f"(one of {divisors}) or change moe.num_experts to a multiple of {ep}",
                problem=f"does not divide moe.num_experts={module.num_experts}, "
                "so the experts cannot be split evenly over the EP ranks")
        for name in ("w1", "w2", "w3"):
            w = getattr(module.experts, name)
            if w is not None:
                setattr(module.experts, name, nn.Parameter(distribute_tensor(w.data, ep_mesh, [Shard(0)])))
        module.ep_group = ep_mesh.get_group()
