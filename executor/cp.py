"""Context parallelism on plain collectives (gloo and NCCL alike; torch's own CP is CUDA-only).

Layout. The sequence of length S is cut into 2·cp equal chunks of c = S / (2·cp) tokens; rank r of
the CP group holds chunks r and 2·cp-1-r. Under a causal mask the query rows of chunk j attend to
about (j + 1/2)·c keys, so every rank does (r + 1/2 + 2·cp-1-r + 1/2)·c² = 2·cp·c² score entries:
equal work (the load balancing of Llama 3's context parallelism).

Attention (:func:`cp_attention`, the all-gather variant of Llama 3): all-gather K and V — and the
global positions of their rows — over the group, then one SDPA of the local queries against all
S keys with the boolean mask ``q_pos >= k_pos`` in *global* positions. That is exactly causal
attention over the whole sequence, restricted to the local query rows; the order of the gathered
keys does not matter because the mask follows the positions. In the backward pass the gradient of
the gathered K/V is reduce-scattered (summed over ranks): every rank's queries contribute to the
gradient of every key, and the owner of the key receives the sum.

Memory: the gathered K and V hold all S rows, cp x the local K/V (and GQA heads are repeated after
the gather, another Hq/Hkv factor for the SDPA input); the score matrix is S/cp x S per head.
Communication per attention call: forward one all-gather of 2·B·Hkv·S·Dh elements (+ S positions),
backward one reduce-scatter of the same size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup

from executor.measure import label
from planner.errors import AutoparError

# torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor (the old names warn); same contract.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def load_balanced_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by ``cp_rank`` (int64, ascending): chunks r and 2·cp-1-r of 2·cp equal
    chunks of ``seq_length // (2·cp_size)`` tokens. Over the ranks 0..cp-1 every position appears
    exactly once."""
    if cp_size < 1:
        raise AutoparError("layout.cp", cp_size, "use a context-parallel degree of at least 1",
                           problem="is not a positive group size")
    if not 0 <= cp_rank < cp_size:
        raise AutoparError("cp_rank", cp_rank, f"use a rank in 0..{cp_size - 1} of the cp group",
                           problem=f"is outside the cp group of size {cp_size}")
    if seq_length < 1 or seq_length % (2 * cp_size):
        raise AutoparError("training.seq_length", seq_length,
                           f"use a positive multiple of 2 x cp = {2 * cp_size} (load-balanced causal chunks)",
                           problem=f"does not split into 2 x cp = {2 * cp_size} equal chunks")
    c = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    return torch.cat([first, second])


def shard_for_cp(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The rows of ``t`` along ``dim`` (its sequence dimension) that ``cp_rank`` holds, in the order of
    :func:`load_balanced_positions` — for tokens, targets, or q/k/v in tests."""
    return t.index_select(dim, load_balanced_positions(t.shape[dim], cp_size, cp_rank).to(t.device))


class _AllGatherKV(torch.autograd.Function):
    """(k, v) [B, H, S_local, Dh] each -> (k_all, v_all) [B, H, cp·S_local, Dh], ranks in group order.

    Forward: one all-gather of K and V stacked sequence-first ([S_local, 2, B, H, Dh]), so the result
    is a concatenation along the sequence and k_all/v_all are strided views of it (no copy of the
    gathered data). Backward: d k_local = sum over ranks of that rank's d k_all rows owned here, i.e.
    one reduce-scatter (SUM) of the stacked gradients. (gloo implements reduce-scatter in torch >= 2.2
    as all-reduce + own chunk; same result.)"""

    @staticmethod
    def forward(ctx: FunctionCtx, k: torch.Tensor, v: torch.Tensor,
                group: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.group = group
        cp = dist.get_world_size(group)
        local = torch.stack([k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)], dim=1)  # [S_l, 2, B, H, Dh]
        gathered = local.new_empty((cp * local.shape[0], *local.shape[1:]))
        with label("autopar.cp"):
            _all_gather_single(gathered, local, group=group)
        return gathered[:, 0].permute(1, 2, 0, 3), gathered[:, 1].permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_k_all: torch.Tensor,
                 grad_v_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        cp = dist.get_world_size(ctx.group)
        stacked = torch.stack([grad_k_all.permute(2, 0, 1, 3), grad_v_all.permute(2, 0, 1, 3)], dim=1)
        own = stacked.new_empty((stacked.shape[0] // cp, *stacked.shape[1:]))
        with label("autopar.cp"):
            _reduce_scatter_single(own, stacked, op=dist.ReduceOp.SUM, group=ctx.group)
        return own[:, 0].permute(1, 2, 0, 3), own[:, 1].permute(1, 2, 0, 3), None


def _all_gather_positions(positions: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[S_local] int64 -> [cp·S_local], ranks in group order (the order of :class:`_AllGatherKV`)."""
    local = positions.to(torch.int64).contiguous()
    gathered = local.new_empty(dist.get_world_size(group) * local.numel())
    with label("autopar.cp"):
        _all_gather_single(gathered, local, group=group)
    return gathered


def _check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            positions: torch.Tensor) -> None:
    """Shapes of :func:`cp_attention`'s inputs, each violation named with its value and fix."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise AutoparError(f"cp_attention.{name}.shape", tuple(t.shape),
                               "pass [batch, heads, local seq, head_dim] (transpose after the projection)",
                               problem="is not 4-D")
    if k.shape[:3] != v.shape[:3]:
        raise AutoparError("cp_attention.v.shape", tuple(v.shape), f"give v the batch, heads and rows of k "
                           f"{tuple(k.shape)}", problem="differs from k")
    b, hq, s, dh = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, dh):
        raise AutoparError("cp_attention.k.shape", tuple(k.shape),
                           f"use batch {b}, local seq {s} and head_dim {dh} like q {tuple(q.shape)}",
                           problem="does not match q in batch, local sequence or head_dim")
    if hq % k.shape[1]:
        raise AutoparError("cp_attention.k.shape[1]", k.shape[1],
                           f"use a number of kv heads that divides the {hq} query heads (GQA groups)",
                           problem=f"does not divide the query heads {hq}")
    if positions.dim() != 1 or positions.numel() != s:
        raise AutoparError("cp_attention.positions.shape", tuple(positions.shape),
                           f"pass the {s} global positions of the local rows (load_balanced_positions)",
                           problem=f"is not [{s}] (the local sequence length of q)")


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, positions: torch.Tensor,
                 group: ProcessGroup, scale: float | None = None, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the local query rows over the whole sequence held by the CP ``group``.

    q [B, Hq, S_local, Dh], k/v [B, Hkv, S_local, Dh] with Hq a multiple of Hkv (GQA heads not
    repeated: query head h uses kv head h // (Hq/Hkv)), ``positions`` [S_local] the global positions
    of the local rows (any order; :func:`load_balanced_positions` in practice). Returns
    [B, Hq, S_local, Dh]:

        out[:, h, i] = sum_j softmax_j(q_i · k_j / sqrt(Dh) over {j : pos_j <= pos_i}) v_j

    over all S = cp·S_local rows j of the group, i.e. rows ``positions`` of full causal attention.
    ``scale`` replaces 1/sqrt(Dh) (Hugging Face models pass theirs); ``window`` keeps only the keys with
    ``pos_i - pos_j < window`` (sliding-window layers); v may have its own head size (MLA); ``softcap``
    soft-caps the scores, ``softcap · tanh(score / softcap)`` before the mask and softmax (Gemma 2), which
    SDPA cannot: the scores are then computed explicitly ([B, Hq, S_local, S], as the model's own eager
    attention does).
    Differentiable in q, k and v (the K/V gradient is summed back to the rank owning each row).
    Memory: the gathered K/V are cp x the local K/V (see the module docstring)."""
    _check_attention_inputs(q, k, v, positions)
    dk, dv = k.shape[-1], v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    if dv < dk:  # one gather of equal shapes: v's zero columns give zero output columns, cut below
        v = F.pad(v, (0, dk - dv))
    elif dv > dk:  # zero columns of q and k leave every score as it was
        q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))
    k_all, v_all = _AllGatherKV.apply(k, v, group)
    k_pos = _all_gather_positions(positions.to(q.device), group)
    behind = positions.to(q.device)[:, None] - k_pos[None, :]  # [S_local, S], broadcast over B, H
    mask = behind >= 0 if window is None else (behind >= 0) & (behind < window)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # after the gather, so the collective moves Hkv heads only
        k_all, v_all = k_all.repeat_interleave(rep, dim=1), v_all.repeat_interleave(rep, dim=1)
    if softcap is not None:
        return _capped_attention(q, k_all, v_all, mask, scale, softcap)[..., :dv]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)[..., :dv]


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float) -> torch.Tensor:
    """``softmax(softcap · tanh(q kᵀ · scale / softcap), masked) v``, the scores in fp32 like the eager models."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
