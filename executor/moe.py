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
are not expert-parallel.

Statistics under EP are per rank: capacity and the aux loss use the T tokens of the rank's own
forward, exactly as the same rank computes them without EP (a data-parallel rank is one micro-batch
of the single-process reference, :mod:`executor.reference`). EP therefore changes where experts run,
never which assignments drop or the loss. Consequently the gradient of a local expert shard is the
sum of the gradients from the tokens of *every* rank of its EP group (their rows were computed here
and their output gradients come back through the reverse all-to-all), while the router and shared
experts get only the rank's own tokens' gradient — the data-parallel reduction does the rest.

Token groups (:func:`apply_token_split`): under context parallelism (and tensor parallelism, whose
sequence-parallel shard each TP rank routes on its own) one micro-batch of the reference is spread
over a group of ranks, each routing its own rows. Its statistics are then those of the whole
micro-batch, as in the single-process run: the per-expert assignment counts and router-probability
sums are all-reduced over the group (so f and P cover every token; each rank's ``aux_loss`` carries
the gradient of its own tokens' share ``coef E sum_e f_e P_e^(rank)``, the shares summing to the
micro-batch's aux loss), and with a capacity the top-k choices of the group are all-gathered, so
the same assignments drop, first come first served in (row, global position, k) order.

Expert tensor parallelism (``etp`` > 1, :func:`apply_expert_parallel` on a 2-D (ep, etp) mesh): each
expert's FFN dimension is split over the etp ranks (``w1``/``w3`` ``Shard(1)``, ``w2`` ``Shard(2)``).
After the EP all-to-all the rows received by the etp ranks of one expert group are gathered (each
rank sends its rows to every peer), every rank runs its FFN slice on all of them, and the partial
outputs go back to the rank whose rows they are, summed (a reduce-scatter written as an
all-to-all). The routing stays per rank, as with etp = 1.

Shared experts under tensor parallelism (:func:`shard_shared_experts`, the TP plan's
:class:`SharedExpertsParallel`): a TP-split MLP as in Megatron-Core, ``w1``/``w3`` ``Shard(1)`` and
``w2`` ``Shard(2)`` over the TP mesh. The MoE input under TP is the rank's sequence-parallel rows; the
shared experts all-gather the TP group's rows, run their FFN slice on all of them and reduce-scatter
the partial outputs back to their rows (backward: the reverse pair). The router stays whole on every
TP rank (its gradient, from the rank's rows, is summed over TP by the TP plan).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from executor.cp import _all_gather_single, _reduce_scatter_single
from executor.measure import label
from planner.contracts import MoESpec
from planner.errors import AutoparError

AUX_LOSS_COEF = 0.01
INIT_STD = 0.02
FFN_KINDS = ("swiglu", "gelu")


GROUP_ALIGN = 8
"""Rows each expert's group is padded to a multiple of for ``torch._grouped_mm``: 16 bytes of bf16, the
alignment torchtitan pads its token groups to (TOKEN_GROUP_ALIGN_SIZE_M = 8 for bf16); never an empty group
(empty groups hung the kernel in torch 2.8, pytorch/pytorch#150374)."""


def grouped_mm_dtype(x: torch.Tensor) -> torch.dtype | None:
    """bf16 where ``torch._grouped_mm`` runs the experts of rows ``x``: an NVIDIA GPU of compute capability 9.x
    or 10.x (its CUTLASS kernels; ``planner.targets.GROUPED_MM_GPUS`` prices the same GPUs) and bf16 operands,
    directly or under autocast; else None (the loop)."""
    if not x.is_cuda or not hasattr(torch, "_grouped_mm") or torch.version.hip is not None:
        return None  # ROCm reports MI200/MI300 as major 9: not the kernels meant here
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    if dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
        return None
    return dtype


def _padded_rows(counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(destination of each row in the padded layout, the groups' int32 end offsets, padded rows) for rows
    sorted by expert, ``counts[e]`` of expert e, each group padded to a multiple of :data:`GROUP_ALIGN`."""
    padded = [max(-(-c // GROUP_ALIGN), 1) * GROUP_ALIGN for c in counts]
    ends = torch.tensor(padded, dtype=torch.int64).cumsum(0)
    shift = ends - torch.tensor(padded) - (torch.tensor(counts).cumsum(0) - torch.tensor(counts))
    total = sum(counts)
    dest = torch.arange(total) + shift.repeat_interleave(torch.tensor(counts), output_size=total)
    return dest.to(device), ends.to(device, torch.int32), int(ends[-1])


_ROUTED_LOOP: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_routed_loop", default=False)


def in_routed_expert_loop() -> bool:
    """Whether the matmuls running now are the routed experts' one GEMM per expert (no grouped GEMM here):
    per-op checkpointing (:mod:`executor.sac`) treats them as the grouped GEMM they stand for, run again in the
    backward and not counted by its every-second-matmul rule, as the planner prices them."""
    return _ROUTED_LOOP.get()


@contextlib.contextmanager
def _routed_loop() -> Iterator[None]:
    token = _ROUTED_LOOP.set(True)
    try:
        yield
    finally:
        _ROUTED_LOOP.reset(token)


class GroupedExperts(nn.Module):
    """E independent MLPs as stacked weights: ``w1``, ``w3`` [E, F, D] (w3: SwiGLU only), ``w2`` [E, D, F]."""

    def __init__(self, num_experts: int, dim: int, hidden: int, kind: str = "swiglu") -> None:
        super().__init__()
        self.kind = kind
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim)) if kind == "swiglu" else None
        self.tp_group: dist.ProcessGroup | None = None  # shared experts split over TP: shard_shared_experts
        self.use_grouped_mm = True  # False: always one GEMM per expert (the tests' reference on a GPU)

    def local(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(w1, w2, w3) held here: the local shard under expert or tensor parallelism."""
        def loc(w: torch.Tensor | None) -> torch.Tensor | None:
            return w.to_local() if isinstance(w, DTensor) else w
        return loc(self.w1), loc(self.w2), loc(self.w3)

    def per_expert(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...] | None]:
        """:meth:`local`'s weights as one tensor per expert, by ``unbind``: its backward stacks the experts'
        gradients into one tensor. Indexing ``w[e]`` per expert would instead give each expert's gradient
        as a zero-filled tensor of the whole stack, summed E times: E x the weights' bytes written per
        backward (on an H100, a 2-layer Qwen3-30B-A3B step took 1.83 s, 18x its prediction)."""
        w1, w2, w3 = self.local()
        return w1.unbind(0), w2.unbind(0), None if w3 is None else w3.unbind(0)

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
        the autograd graph on every rank (zero gradients, and the backward all-to-all always runs).
        One grouped GEMM per linear layer where :func:`grouped_mm_dtype` allows, else one GEMM per expert."""
        dtype = grouped_mm_dtype(x) if self.use_grouped_mm else None
        if dtype is not None:
            return self._grouped_mm(x, counts, dtype)
        w1, w2, w3 = self.per_expert()
        with _routed_loop():
            outs = [self.run(rows, w1[e], w2[e], None if w3 is None else w3[e], self.kind)
                    for e, rows in enumerate(x.split(counts))]
        return torch.cat(outs)

    def _grouped_mm(self, x: torch.Tensor, counts: list[int], dtype: torch.dtype) -> torch.Tensor:
        """:meth:`forward_grouped` as three ``torch._grouped_mm`` calls (one kernel each, all experts' tiles
        in its waves: what torchtitan runs). Each expert's rows are padded with zero rows to a multiple of
        :data:`GROUP_ALIGN` (at least one such group, none empty); zero rows add nothing to any gradient."""
        w1, w2, w3 = self.local()
        dest, offs, rows = _padded_rows(counts, x.device)
        buf = x.new_zeros(rows, x.shape[-1], dtype=dtype).index_copy(0, dest, x.to(dtype))

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # a [rows, in] by expert, w [E, out, in]
            return torch._grouped_mm(a, w.to(dtype).transpose(1, 2), offs=offs)

        h = mm(buf, w1)
        h = F.silu(h) * mm(buf, w3) if self.kind == "swiglu" else F.gelu(h, approximate="tanh")
        return mm(h, w2)[dest]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' call: :meth:`forward_all` (through ``__call__``, so FSDP's hooks run)."""
        return self.forward_all(x)

    def forward_all(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every expert applied to all rows x [T, D] (the shared experts). Split over TP
        (``tp_group``, :func:`shard_shared_experts`) x is this rank's sequence-parallel rows: the TP
        group's rows are all-gathered, every rank runs its FFN slice of every expert on all of them, and
        the partial sums are reduce-scattered back to the ranks whose rows they are (one collective
        each way for all the shared experts; backward: the reverse pair)."""
        if self.tp_group is not None:
            x = _GatherRows.apply(x, self.tp_group)
        w1, w2, w3 = self.per_expert()
        y = self.run(x, w1[0], w2[0], None if w3 is None else w3[0], self.kind)
        for e in range(1, len(w1)):
            y = y + self.run(x, w1[e], w2[e], None if w3 is None else w3[e], self.kind)
        return y if self.tp_group is None else _ReduceScatterRows.apply(y, self.tp_group)


def _gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Rows x [n, ...] of every rank of ``group`` -> [size n, ...], in rank order."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x [size n, ...] on every rank of ``group`` -> rows [r n, (r+1) n) summed over the group, on rank r."""
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out


class _GatherRows(torch.autograd.Function):
    """The sequence-parallel all-gather of rows; the gradient is reduce-scattered back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_rows(grad, ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    """Partial sums of every rank's rows summed onto the rank owning them; the gradient is all-gathered."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_rows(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits; the gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        with label("autopar.ep"):
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        with label("autopar.ep"):
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
        self.etp_group: dist.ProcessGroup | None = None  # expert TP: ranks holding FFN slices of my experts
        self.token_group: dist.ProcessGroup | None = None  # ranks routing the other rows of my micro-batch
        self.seq_shard: tuple[int, int] | None = None  # (index, count): my rows are this chunk of positions
        self.aux_value_scale = 1.0  # see apply_token_split
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, D] -> [B, S, D]; sets ``self.aux_loss``. ``positions`` [S] (or, under sequence
        parallelism, the positions of every TP rank's rows, of which mine are chunk ``seq_shard``): the
        global sequence positions of the rows, needed with a capacity under a token group."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights, probs = self.route(x)
        self.aux_loss = self._aux(ids, probs)
        # kept assignments, sorted by expert (stable: by token within an expert)
        flat_ids = ids.reshape(-1)
        tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        w = weights.reshape(-1)
        keep = self._keep(ids, shape, positions)
        if keep is not None:
            m = keep.reshape(-1)
            flat_ids, tok, w = flat_ids[m], tok[m], w[m]
        order = flat_ids.argsort(stable=True)
        flat_ids, tok, w = flat_ids[order], tok[order], w[order]
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        if self.ep_group is None:
            out = self._run_local(x[tok], counts)
        else:
            out = self._dispatch_combine(x[tok], counts)
        y = torch.zeros_like(x).index_add(0, tok, out * w[:, None])
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape)

    def _aux(self, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of ids [T, k], probs [T, E]. Under a token group: this rank's share
        (gradient) of the micro-batch's loss from the group's all-reduced counts and probability sums,
        its value replaced by ``aux_value_scale`` x the whole micro-batch's loss (module docstring)."""
        coef = self.aux_loss_coef * self.num_experts
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts).float()
        psum = probs.sum(0)
        if self.token_group is None:
            return coef * (counts / ids.numel() * probs.mean(0)).sum()
        stats = torch.cat([counts, psum.detach()])
        with label("autopar.ep"):
            dist.all_reduce(stats, group=self.token_group)
        tokens = ids.shape[0] * dist.get_world_size(self.token_group)
        frac = stats[:self.num_experts] / (tokens * self.top_k)
        part = coef * (frac * psum).sum() / tokens
        whole = coef * (frac * stats[self.num_experts:]).sum() / tokens
        return part + (whole * self.aux_value_scale - part).detach()

    def _keep(self, ids: torch.Tensor, shape: torch.Size, positions: torch.Tensor | None) -> torch.Tensor | None:
        """:meth:`_keep_mask` of this rank's ids [T, k]; under a token group decided on the whole
        micro-batch (ids and positions all-gathered, ordered by (row, global position))."""
        if self.capacity(1) is None or self.token_group is None:
            return self._keep_mask(ids)
        if positions is None:
            raise AutoparError("positions", None, "pass the rows' global sequence positions to MoE.forward",
                               problem="are needed to drop by capacity across a token group")
        if self.seq_shard is not None:
            index, count = self.seq_shard
            positions = positions.reshape(count, -1)[index]
        rows, seq, k = shape[0], shape[1], self.top_k
        group, size = self.token_group, dist.get_world_size(self.token_group)
        pos = positions.to(ids.device, torch.long).contiguous()
        all_ids = [torch.empty_like(ids) for _ in range(size)]
        all_pos = [torch.empty_like(pos) for _ in range(size)]
        with label("autopar.ep"):
            dist.all_gather(all_ids, ids.contiguous(), group=group)
            dist.all_gather(all_pos, pos, group=group)
        total = seq * size
        if not torch.equal(torch.cat(all_pos).sort().values, torch.arange(total, device=pos.device)):
            raise AutoparError("positions", "of the token group", "give each rank its own share of 0..S-1",
                               problem=f"do not cover the {total} positions of the sequence exactly once")
        whole = ids.new_empty(rows, total, k)
        for got, p in zip(all_ids, all_pos):
            whole[:, p] = got.view(rows, seq, k)
        return self._keep_mask(whole.reshape(-1, k)).view(rows, total, k)[:, pos].reshape(-1, k)

    def _dispatch_combine(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallel: :func:`dispatch_combine` over the EP group with this block's local experts."""
        return dispatch_combine(rows, counts, self.ep_group, self._run_local)

    def _run_local(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The local experts on rows [N, D] sorted by local expert (``counts`` per local expert); with
        expert TP on the rows of every etp peer, outputs summed over the FFN slices (module docstring)."""
        if self.etp_group is None:
            return self.experts.forward_grouped(rows, counts.tolist())
        group, etp, n = self.etp_group, dist.get_world_size(self.etp_group), rows.shape[0]
        peers = [torch.empty_like(counts) for _ in range(etp)]
        with label("autopar.ep"):
            dist.all_gather(peers, counts.contiguous(), group=group)
        peer_counts = torch.stack(peers)  # [peer, local expert]
        sizes = peer_counts.sum(1).tolist()
        gathered = all_to_all(rows.repeat(etp, 1), sizes, [n] * etp, group)  # by peer, sorted by expert
        by_expert = _by_expert(peer_counts)
        partial = self.experts.forward_grouped(gathered[by_expert], peer_counts.sum(0).tolist())
        back = all_to_all(partial[by_expert.argsort()], [n] * etp, sizes, group)  # my rows' partials
        return back.view(etp, n, rows.shape[-1]).sum(0)

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


def dispatch_combine(rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup,
                     run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Expert parallel: rows [N, D] sorted by global expert (``counts`` [E] per expert) -> each row's
    expert output, same order, computed on the rank of ``group`` owning the expert (rank r owns experts
    [r E/ep, (r+1) E/ep)) by ``run_local(rows sorted by local expert, counts per local expert)``."""
    ep = dist.get_world_size(group)
    send = counts.view(ep, counts.numel() // ep)  # [destination rank, its local expert]
    recv = torch.empty_like(send)
    with label("autopar.ep"):
        dist.all_to_all_single(recv, send.contiguous(), group=group)  # [source rank, my local expert]
    in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    got = all_to_all(rows, out_splits, in_splits, group)
    # received: by source rank, each block sorted by my local expert -> regroup by local expert
    by_expert = _by_expert(recv)
    out = run_local(got[by_expert], recv.sum(0))
    return all_to_all(out[by_expert.argsort()], in_splits, out_splits, group)


def _by_expert(counts: torch.Tensor) -> torch.Tensor:
    """Rows laid out by source, each source's block sorted by local expert (``counts`` [source,
    local expert]) -> the permutation that sorts them by local expert (stable: by source within one)."""
    sources, local_e = counts.shape
    expert_of_row = torch.arange(local_e, device=counts.device).repeat(sources).repeat_interleave(
        counts.reshape(-1))
    return expert_of_row.argsort(stable=True)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard the routed experts of every :class:`MoE` in ``model`` over ``ep_mesh``: 1-D (ep), or 2-D
    (ep, etp) for expert tensor parallelism (the FFN dimension split over etp).

    ``experts.w1/w2/w3`` become ``Shard(0)`` DTensors over ep (and ``Shard(1)`` / ``Shard(2)`` over
    etp; distributed from the full replicated values, same parameter names) and the forward switches
    to all-to-all dispatch over the ep group (none when ep = 1). The router and the shared experts
    are left as they are (the TP plan's). Works on meta tensors (materialise later).
    """
    if ep_mesh.ndim not in (1, 2):
        raise AutoparError("ep_mesh", tuple(ep_mesh.shape),
                           "pass the expert-parallel sub-mesh, e.g. mesh['ep'] or mesh['ep', 'etp']",
                           problem="is not a 1-D (ep) or 2-D (ep, etp) device mesh")
    ep, etp = ep_mesh.size(0), (ep_mesh.size(1) if ep_mesh.ndim == 2 else 1)
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        _check_split(module, ep, etp)
        for name in ("w1", "w2", "w3"):
            w = getattr(module.experts, name)
            if w is None:
                continue
            placements = [Shard(0)] if ep_mesh.ndim == 1 else [Shard(0), Shard(2 if name == "w2" else 1)]
            setattr(module.experts, name, nn.Parameter(distribute_tensor(w.data, ep_mesh, placements)))
        module.ep_group = ep_mesh.get_group(0) if ep > 1 else None
        module.etp_group = ep_mesh.get_group(1) if etp > 1 else None


def _check_split(module: MoE, ep: int, etp: int) -> None:
    """AutoparError unless ep divides the experts and etp their FFN width."""
    if module.num_experts % ep:
        divisors = [d for d in range(1, module.num_experts + 1) if module.num_experts % d == 0]
        raise AutoparError(
            "layout.ep", ep, f"choose an ep that divides moe.num_experts={module.num_experts} "
            f"(one of {divisors}) or change moe.num_experts to a multiple of {ep}",
            problem=f"does not divide moe.num_experts={module.num_experts}, "
            "so the experts cannot be split evenly over the EP ranks")
    hidden = module.spec.expert_ffn_hidden_size
    if hidden % etp:
        raise AutoparError("layout.etp", etp, f"choose an etp that divides moe.expert_ffn_hidden_size={hidden}",
                           problem=f"does not divide moe.expert_ffn_hidden_size={hidden}")


class SharedExpertsParallel(ParallelStyle):
    """TP style of a MoE block's ``shared_experts`` (:func:`shard_shared_experts`), for ``parallelize_module``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, GroupedExperts):
            raise AutoparError("tp plan", type(module).__name__, "apply SharedExpertsParallel to MoE.shared_experts",
                               problem="is not the GroupedExperts of a MoE block")
        shard_shared_experts(module, device_mesh, self.src_data_rank)
        return module


def shard_shared_experts(experts: GroupedExperts, tp_mesh: DeviceMesh, src_data_rank: int | None = 0) -> None:
    """Split the shared experts over the 1-D ``tp_mesh`` as a TP MLP (Megatron-Core's shared experts are
    its TP-split MLP): ``w1``/``w3`` [S, F, D] column-split (``Shard(1)``, FFN rows), ``w2`` [S, D, F]
    row-split (``Shard(2)``), names unchanged; the forward gathers the sequence-parallel rows and
    reduce-scatters the output (:meth:`GroupedExperts.forward_all`). Each rank holds 1/tp of the weights
    and their whole gradient over its slice: nothing to sum over TP. Works on meta tensors."""
    tp, hidden = tp_mesh.size(), experts.w1.shape[1]
    if hidden % tp:
        raise AutoparError("layout.tp", tp, f"use a tp that divides the shared experts' FFN width {hidden} "
                           "(moe.shared_expert_ffn_hidden_size, else moe.expert_ffn_hidden_size)",
                           problem=f"does not divide the shared experts' FFN width {hidden}")
    for name in ("w1", "w2", "w3"):
        w = getattr(experts, name)
        if w is not None:
            dt = distribute_tensor(w.data, tp_mesh, [Shard(2 if name == "w2" else 1)], src_data_rank=src_data_rank)
            setattr(experts, name, nn.Parameter(dt))
    experts.tp_group = tp_mesh.get_group() if tp > 1 else None


def apply_token_split(model: nn.Module, group: dist.ProcessGroup | None, seq_shard: tuple[int, int] | None,
                      aux_value_scale: float) -> None:
    """Every :class:`MoE` of ``model`` routes its rows as part of a micro-batch spread over ``group``
    (context parallel ranks, times the TP ranks under sequence parallelism): statistics over the group
    (module docstring). ``seq_shard`` (index, count): the rows are chunk ``index`` of ``count`` of the
    positions the block passes (the TP rank's sequence-parallel share), or None. ``aux_value_scale``:
    each rank's ``aux_loss`` value is the micro-batch's loss times this (its gradient is its share),
    so that the executor's loss accounting (a sum over data and context ranks, averaged over TP
    ranks) counts the micro-batch's aux loss once: 1 / cp."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.token_group, module.seq_shard = group, seq_shard
            module.aux_value_scale = aux_value_scale
