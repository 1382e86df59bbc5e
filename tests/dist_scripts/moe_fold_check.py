"""The built-in MoE model with expert parallelism folded over dp_shard x cp x tp, under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 4 moe_fold_check.py OUT_DIR [CASE ...]

Each case of :data:`CASES` runs through :func:`parallel_check.run_case` (the same training loop as the
other layouts: 3 AdamW steps of 2 micro-batches per data-parallel rank, fp32, loss x loss_scale, the
first step's reduced gradients as full tensors in OUT_DIR/<case>/grads.pt) on the MoE models of
:data:`SPECS`; tests/test_executor_moe_fold.py compares every parameter's gradient and the losses with
:func:`executor.reference.reference_run` on one process. For the cases of :data:`PARAM_CASES` each rank
also writes OUT_DIR/<case>/params_rank<r>.json: every parameter's local (shard) element count and
element size after :func:`parallelize`, which the test holds against the cost model's memory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import parallel_check
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from executor.parallelize import build_mesh, clean_fqn, parallelize
from planner.contracts import ModelSpec, MoESpec, ParallelLayout

# 2 MoE layers with a shared expert (parallel_check's "moe"); 3 layers, the first dense, capacity 0.75
# (ceil(0.75 x 16 tokens x top-2 / 4 experts) = 6 of the 32 assignments per expert: some drop)
SPECS: dict[str, ModelSpec] = {
    "moe": parallel_check.MOE,
    "moe_cap": ModelSpec(name="tiny-moe-cap", num_layers=3, hidden_size=32, num_attention_heads=4,
                         num_kv_heads=2, ffn_hidden_size=64, vocab_size=128,
                         moe=MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=32, num_shared_experts=1,
                                     first_dense_layers=1, capacity_factor=0.75)),
}
# two shared experts of their own width (48, not the routed 32), SwiGLU and GeLU
_SHARED2 = MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=32, num_shared_experts=2,
                   shared_expert_ffn_hidden_size=48)
SPECS["moe_shared2"] = parallel_check.MOE.model_copy(update={"name": "tiny-moe-shared2", "moe": _SHARED2})
SPECS["moe_gelu"] = SPECS["moe_shared2"].model_copy(update={"name": "tiny-moe-gelu", "ffn_kind": "gelu"})
TP_SP = {"tp": 2, "sp": True}
# name -> (model, layout fields, per-stage recompute)
CASES: dict[str, tuple[str, dict, None]] = {
    # (a) context parallel: EP over dp_shard x cp
    "cp2_ep4": ("moe", {"dp_shard": 2, "cp": 2, "ep": 4}, None),
    "cp2_ep2": ("moe", {"dp_shard": 2, "cp": 2, "ep": 2}, None),
    "cp2_ddp_no_ep": ("moe", {"dp_shard": 2, "cp": 2}, None),
    # (b) EP over dp_shard x tp, experts whole (etp = 1), each TP rank routing its SP share
    "tp2_ep2_etp1": ("moe", {"dp_shard": 2, **TP_SP, "ep": 2, "etp": 1}, None),
    "tp2_ep4_etp1": ("moe", {"dp_shard": 2, **TP_SP, "ep": 4, "etp": 1}, None),
    "tp2_ep1_etp1": ("moe", {"dp_shard": 2, **TP_SP, "etp": 1}, None),
    "cp2_tp2_ep4_etp1": ("moe", {"cp": 2, **TP_SP, "ep": 4, "etp": 1}, None),
    # (c) ZeRO-2/3 and HSDP: the experts FSDP-sharded over the expert-dp ranks
    "zero3_cp2_ep4": ("moe", {"dp_shard": 2, "cp": 2, "ep": 4, "zero_stage": 3}, None),
    "zero3_tp2_ep2_etp1": ("moe", {"dp_shard": 2, **TP_SP, "ep": 2, "etp": 1, "zero_stage": 3}, None),
    "hsdp_tp2_ep2_etp1": ("moe", {"dp_replicate": 2, **TP_SP, "ep": 2, "etp": 1, "zero_stage": 2}, None),
    # (d) capacity (dropping) with shared experts and a dense first layer
    "cap_cp2_ep4": ("moe_cap", {"dp_shard": 2, "cp": 2, "ep": 4}, None),
    "cap_tp2_ep4_etp1": ("moe_cap", {"dp_shard": 2, **TP_SP, "ep": 4, "etp": 1}, None),
    "cap_zero3_cp2_tp2_ep2_etp1": ("moe_cap", {"cp": 2, **TP_SP, "ep": 2, "etp": 1, "zero_stage": 3}, None),
    # (e) expert tensor parallel etp = tp: each expert's FFN split over the TP group
    "tp2_ep2_etp2": ("moe", {"dp_shard": 2, **TP_SP, "ep": 2}, None),
    "tp2_ep1_etp2": ("moe", {"dp_shard": 2, **TP_SP}, None),
    "zero3_tp2_ep2_etp2": ("moe", {"dp_shard": 2, **TP_SP, "ep": 2, "zero_stage": 3}, None),
    "cap_cp2_tp2_ep2_etp2": ("moe_cap", {"cp": 2, **TP_SP, "ep": 2}, None),
    # (f) shared experts split over TP: two of their own width, SwiGLU under ZeRO-3, GeLU under ZeRO-0
    "shared2_zero3_tp2_ep2_etp2": ("moe_shared2", {"dp_shard": 2, **TP_SP, "ep": 2, "zero_stage": 3}, None),
    "gelu_shared2_tp2_ep4_etp1": ("moe_gelu", {"dp_shard": 2, **TP_SP, "ep": 4, "etp": 1}, None),
}
# ZeRO-0 cases whose per-rank parameter shards are recorded (params_rank<r>.json)
PARAM_CASES = ("tp2_ep2_etp1", "tp2_ep1_etp2", "gelu_shared2_tp2_ep4_etp1")


def local_params(name: str) -> dict[str, list[int]]:
    """Each parameter's [local element count, element size] on this rank once the case's layout is
    applied (on the meta device: no data, no collectives beyond the mesh's)."""
    kind, fields, _ = CASES[name]
    layout = ParallelLayout(**fields)
    meshes = build_mesh(layout, dist.get_world_size(), "cpu")
    model, _ = parallel_check.build(kind, "meta")
    parallelize(model, layout, meshes, training=None)
    return {clean_fqn(n): [(p.to_local() if isinstance(p, DTensor) else p).numel(), p.element_size()]
            for n, p in model.named_parameters()}


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(CASES)
    parallel_check.SPECS.update(SPECS)
    parallel_check.CASES.update(CASES)
    dist.init_process_group("gloo")
    torch.manual_seed(parallel_check.SEED)
    for name in names:
        parallel_check.run_case(name, out)
        if name in PARAM_CASES:
            path = out / name / f"params_rank{dist.get_rank()}.json"
            path.write_text(json.dumps(local_params(name)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
