"""Expert parallelism under torchrun: each rank runs its own tokens through an EP-sharded MoE.

    python -m torch.distributed.run --standalone --nproc-per-node 4 ep_check.py OUT_DIR

For every case of :data:`CASES` each rank builds the same full MoE (:func:`build_moe`), applies
``apply_expert_parallel`` on its EP sub-mesh (EP=4: 1-D mesh; EP=2: the "ep" dim of a (dp, ep) = (2, 2)
mesh, groups {0, 1} and {2, 3}), feeds ITS OWN tokens (:func:`rank_inputs`, different per rank as data
parallelism does), backpropagates loss_r = sum(y * c_r) + aux_loss and writes OUT_DIR/<case>/rank<r>.json:
output, aux loss, router / shared-expert gradients and the gradients of its local expert shards.
Then a meta-built MoE is sharded, allocated and initialised (OUT_DIR/meta/rank<r>.json: largest
difference of each shard from the full draw), and a 6-expert MoE on the 4-rank mesh must be refused
(the message goes to OUT_DIR/errors/rank<r>.json).
The pytest (tests/test_executor_moe.py) recomputes everything with the unsharded module in one process.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from executor.moe import MoE, apply_expert_parallel
from planner.contracts import MoESpec
from planner.errors import AutoparError

DIM, BATCH, SEQ = 16, 2, 6
# name -> (ep, shared experts, capacity factor, skewed router: experts 6, 7 never chosen)
CASES: dict[str, tuple[int, int, float | None, bool]] = {
    "ep4": (4, 0, None, False),
    "ep4_shared": (4, 1, None, False),
    "ep2": (2, 0, None, False),
    "ep2_shared": (2, 1, None, False),
    "ep4_capacity": (4, 1, 1.0, False),
    "ep2_capacity": (2, 0, 1.0, False),
    "ep4_idle_rank": (4, 0, None, True),
}


def build_moe(case: str) -> MoE:
    """The full (unsharded) MoE of ``case``: 8 experts, top-2, SwiGLU, weights from a per-name seed."""
    _, shared, cf, skew = CASES[case]
    spec = MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=8, num_shared_experts=shared,
                   shared_expert_ffn_hidden_size=12 if shared else None, capacity_factor=cf)
    moe = MoE(DIM, spec)

    def gen_for(name: str) -> torch.Generator:
        return torch.Generator().manual_seed(zlib.crc32(f"{case}/{name}".encode()))

    moe.init_weights(gen_for)
    if skew:  # feature 0 of every token is 5 (rank_inputs): logits of experts 6, 7 drop by 25
        with torch.no_grad():
            moe.gate.weight[6:, 0] = -5.0
    return moe


def rank_inputs(case: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens x [BATCH, SEQ, DIM] of ``rank`` and the output weights c of its loss sum(y * c)."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(BATCH, SEQ, DIM, generator=g)
    if CASES[case][3]:
        x[..., 0] = 5.0
    return x, torch.randn(BATCH, SEQ, DIM, generator=g)


def run_case(case: str, out: Path) -> None:
    ep = CASES[case][0]
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep == world:
        ep_mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    else:
        ep_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))["ep"]
    moe = build_moe(case)
    apply_expert_parallel(moe, ep_mesh)
    x, c = rank_inputs(case, rank)
    x.requires_grad_(True)
    y = moe(x)
    ((y * c).sum() + moe.aux_loss).backward()
    record = {
        "rank": rank,
        "ep_rank": ep_mesh.get_local_rank(),
        "ep_group": ep_mesh.mesh.tolist(),
        "output": y.detach().tolist(),
        "aux_loss": moe.aux_loss.item(),
        "x_grad": x.grad.tolist(),
        "grads": {name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).tolist()
                  for name, p in moe.named_parameters()},
        "local_shapes": {name: list(p.to_local().shape) for name, p in moe.experts.named_parameters()},
    }
    (out / case).mkdir(parents=True, exist_ok=True)
    (out / case / f"rank{rank}.json").write_text(json.dumps(record))


def check_meta_init(out: Path) -> None:
    """Build on meta, shard, allocate, init_weights: each local shard equals its slice of the full draw."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    with torch.device("meta"):
        moe = MoE(DIM, MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=8))
    apply_expert_parallel(moe, mesh)
    moe.to_empty(device="cpu")

    def gen_for(name: str) -> torch.Generator:
        return torch.Generator().manual_seed(zlib.crc32(name.encode()))

    moe.init_weights(gen_for)
    full = MoE(DIM, MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=8))
    full.init_weights(gen_for)
    lo = 2 * mesh.get_local_rank()
    diff = {name: (p.to_local() - getattr(full.experts, name)[lo:lo + 2]).abs().max().item()
            for name, p in moe.experts.named_parameters()}
    diff["gate.weight"] = (moe.gate.weight - full.gate.weight).abs().max().item()
    (out / "meta").mkdir(parents=True, exist_ok=True)
    (out / "meta" / f"rank{dist.get_rank()}.json").write_text(json.dumps(diff))


def check_refusal(out: Path) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    moe = MoE(DIM, MoESpec(num_experts=6, top_k=2, expert_ffn_hidden_size=8))
    try:
        apply_expert_parallel(moe, mesh)
        message = None
    except AutoparError as err:
        message = str(err)
    (out / "errors").mkdir(parents=True, exist_ok=True)
    (out / "errors" / f"rank{dist.get_rank()}.json").write_text(json.dumps({"message": message}))


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for case in CASES:
        run_case(case, out)
    check_meta_init(out)
    check_refusal(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
