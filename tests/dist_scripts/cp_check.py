"""Context-parallel attention under torchrun, checked against full causal attention in one process.

    python -m torch.distributed.run --standalone --nproc-per-node 4 cp_check.py OUT_DIR

For every case of :data:`CASES` (cp group of 4 = all ranks; two cp groups of 2 made with
``new_group``, strided {0, 2} and {1, 3} as a (cp, tp) mesh gives them, or contiguous {0, 1} and
{2, 3}; each with GQA Hq=4/Hkv=2 and MHA Hq=Hkv=4) every rank draws the same full q, k, v and loss
weight w from a fixed seed, computes the full causal SDPA and the gradients of loss = sum(out * w)
in-process (the reference), then runs :func:`executor.cp.cp_attention` on its own shard and
backpropagates sum(out_local * w_local). It writes OUT_DIR/<case>/rank<r>.json with the max abs error
of the local output and of the local q/k/v gradients against the reference rows at its positions,
and the error of plain local causal attention (no CP) as a negative control that must be large.
Last, bad inputs must be refused: the messages go to OUT_DIR/errors/rank<r>.json.
The pytest (tests/test_executor_cp.py) asserts on these files.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from executor.cp import cp_attention, load_balanced_positions, shard_for_cp
from planner.errors import AutoparError

BATCH, SEQ, HEAD_DIM = 2, 32, 16
# name -> (cp groups as lists of global ranks, query heads, kv heads)
CASES: dict[str, tuple[list[list[int]], int, int]] = {
    "cp4_gqa": ([[0, 1, 2, 3]], 4, 2),
    "cp4_mha": ([[0, 1, 2, 3]], 4, 4),
    "cp2_strided_gqa": ([[0, 2], [1, 3]], 4, 2),
    "cp2_strided_mha": ([[0, 2], [1, 3]], 4, 4),
    "cp2_contiguous_gqa": ([[0, 1], [2, 3]], 4, 2),
}


def full_inputs(hq: int, hkv: int) -> dict[str, torch.Tensor]:
    """q [B, Hq, S, Dh], k/v [B, Hkv, S, Dh], w [B, Hq, S, Dh]: the same on every rank (fixed seed)."""
    g = torch.Generator().manual_seed(1234 + 10 * hq + hkv)
    return {"q": torch.randn(BATCH, hq, SEQ, HEAD_DIM, generator=g),
            "k": torch.randn(BATCH, hkv, SEQ, HEAD_DIM, generator=g),
            "v": torch.randn(BATCH, hkv, SEQ, HEAD_DIM, generator=g),
            "w": torch.randn(BATCH, hq, SEQ, HEAD_DIM, generator=g)}


def causal_reference(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Full single-process causal SDPA (kv heads repeated) and d sum(out * w) / d q, k, v."""
    q, k, v = (x[n].clone().requires_grad_(True) for n in "qkv")
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         is_causal=True)
    (out * x["w"]).sum().backward()
    return out.detach(), {"q": q.grad, "k": k.grad, "v": v.grad}


def run_case(case: str, out_dir: Path) -> None:
    groups_ranks, hq, hkv = CASES[case]
    rank = dist.get_rank()
    groups = [dist.new_group(ranks) for ranks in groups_ranks]  # every rank creates every group
    mine = next(i for i, ranks in enumerate(groups_ranks) if rank in ranks)
    group, cp = groups[mine], len(groups_ranks[mine])
    cp_rank = dist.get_rank(group)
    x = full_inputs(hq, hkv)
    ref_out, ref_grad = causal_reference(x)
    pos = load_balanced_positions(SEQ, cp, cp_rank)
    local = {n: shard_for_cp(x[n], 2, cp, cp_rank).requires_grad_(n != "w") for n in "qkvw"}

    dist.barrier(group)
    start = time.perf_counter()
    out = cp_attention(local["q"], local["k"], local["v"], positions=pos, group=group)
    (out * local["w"]).sum().backward()
    seconds = time.perf_counter() - start

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a - b).abs().max().item()

    rep = hq // hkv
    no_cp = F.scaled_dot_product_attention(local["q"].detach(), local["k"].detach().repeat_interleave(rep, 1),
                                           local["v"].detach().repeat_interleave(rep, 1), is_causal=True)
    result = {
        "rank": rank, "cp": cp, "cp_rank": cp_rank, "group": groups_ranks[mine],
        "positions": pos.tolist(), "out_shape": list(out.shape),
        "max_abs_err": {"out": err(out.detach(), ref_out[:, :, pos]),
                        **{f"grad_{n}": err(local[n].grad, ref_grad[n][:, :, pos]) for n in "qkv"}},
        "no_cp_out_err": err(no_cp, ref_out[:, :, pos]),
        "fwd_bwd_s": seconds,
    }
    (out_dir / case).mkdir(parents=True, exist_ok=True)
    (out_dir / case / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    for g in groups:
        dist.destroy_process_group(g)


def bad_inputs(out_dir: Path) -> None:
    """Each bad call must raise AutoparError (before any collective); record its message."""
    q, kv = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    calls = {
        "heads": lambda: cp_attention(q, torch.zeros(1, 3, 8, 16), torch.zeros(1, 3, 8, 16),
                                      positions=torch.arange(8), group=dist.group.WORLD),
        "positions": lambda: cp_attention(q, kv, kv, positions=torch.arange(6), group=dist.group.WORLD),
        "not_4d": lambda: cp_attention(q[0], kv, kv, positions=torch.arange(8), group=dist.group.WORLD),
        "seq_length": lambda: load_balanced_positions(30, 4, 0),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = None
        except AutoparError as exc:
            messages[name] = str(exc)
    (out_dir / "errors").mkdir(parents=True, exist_ok=True)
    (out_dir / "errors" / f"rank{dist.get_rank()}.json").write_text(json.dumps(messages, indent=1))


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    try:
        for case in CASES:
            run_case(case, out_dir)
        bad_inputs(out_dir)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
