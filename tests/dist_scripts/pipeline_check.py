"""Pipeline-parallel layouts under torchrun, one after another in the same 4 processes.

    python -m torch.distributed.run --standalone --nproc-per-node 4 pipeline_check.py OUT_DIR [CASE ...]

For each case of :data:`CASES` (all when none are named) the 4 ranks form a (dp, pp) mesh; every rank
builds the tiny model on the meta device, keeps its chunks (:func:`executor.pipeline.split_model`),
loads the plan-independent weights, and trains 3 AdamW steps (fp32) through the case's torch schedule
(:func:`executor.pipeline.build_schedule` / :func:`pipeline_step`), each data-parallel pipeline on its
own rows of the global batch, gradients summed over dp with a plain all-reduce and divided by dp
(the loss is backpropagated times ``grad_scale = dp``). Each rank writes OUT_DIR/<case>/rank<r>.json
(the step losses: every rank's share all-reduced over the world; the case's wall time; its layer names)
and OUT_DIR/<case>/grads<r>.pt (its own parameters' first-step gradients by name).
tests/test_executor_pipeline.py compares them with :func:`executor.reference.reference_run`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from executor.data import SyntheticTokens, split_batch
from executor.model import build_model, full_state_dict
from executor.pipeline import build_schedule, last_rank, pipeline_step, split_model
from executor.reference import lm_loss, make_optimizer
from planner.contracts import ModelSpec, MoESpec, ParallelLayout

SEED, SEQ, MBS, STEPS, LR = 0, 16, 1, 3, 1e-2


def spec(layers: int, moe: bool = False) -> ModelSpec:
    """The tiny decoder of the checks (``moe``: every block a 4-expert top-2 MoE)."""
    return ModelSpec(name=f"tiny{layers}", num_layers=layers, hidden_size=32, num_attention_heads=4,
                     num_kv_heads=2, ffn_hidden_size=64, vocab_size=128,
                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=32) if moe else None)


# name -> (layers, moe, layout fields, micro-batches per pipeline)
CASES: dict[str, tuple[int, bool, dict, int]] = {
    "pp4_gpipe": (4, False, {"pp": 4, "schedule": "gpipe"}, 4),
    "pp4_1f1b": (4, False, {"pp": 4, "schedule": "1f1b"}, 4),
    "pp4_interleaved_v2": (8, False, {"pp": 4, "schedule": "interleaved_1f1b", "virtual_stages": 2}, 4),
    "pp4_zero_bubble": (4, False, {"pp": 4, "schedule": "zero_bubble"}, 4),
    "pp2_dp2_1f1b": (4, False, {"pp": 2, "dp_replicate": 2, "schedule": "1f1b"}, 2),
    "pp2_dp2_uneven_1_3": (4, False, {"pp": 2, "dp_replicate": 2, "layers_per_stage": [1, 3]}, 2),
    "pp2_dp2_interleaved_uneven": (6, False, {"pp": 2, "dp_replicate": 2, "schedule": "interleaved_1f1b",
                                              "virtual_stages": 2, "layers_per_stage": [1, 2, 2, 1]}, 4),
    "pp2_dp2_moe_zero_bubble": (4, True, {"pp": 2, "dp_replicate": 2, "schedule": "zero_bubble"}, 2),
    # the V schedules: rank r runs chunks r and 2pp-1-r, rank 0 the embedding and the head
    "pp4_zero_bubble_v": (8, False, {"pp": 4, "schedule": "zero_bubble_v", "virtual_stages": 2}, 4),
    "pp2_dp2_dualpipe_v_uneven": (6, False, {"pp": 2, "dp_replicate": 2, "schedule": "dualpipe_v",
                                             "virtual_stages": 2, "layers_per_stage": [2, 1, 1, 2]}, 4),
    "pp2_dp2_moe_zero_bubble_v": (4, True, {"pp": 2, "dp_replicate": 2, "schedule": "zero_bubble_v",
                                            "virtual_stages": 2}, 2),
}


def case_setup(name: str) -> tuple[ModelSpec, ParallelLayout, int]:
    """(model, layout, global batch in sequences) of case ``name``."""
    layers, moe, fields, n_micro = CASES[name]
    layout = ParallelLayout(micro_batch_size=MBS, **fields)
    return spec(layers, moe), layout, n_micro * layout.dp * MBS


def run_case(name: str, out: Path) -> None:
    model_spec, layout, global_batch = case_setup(name)
    dp, pp = layout.dp, layout.pp
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    is_first, is_last = pp_rank == 0, pp_rank == last_rank(layout)
    n_micro = global_batch // (dp * MBS)

    full = full_state_dict(model_spec, SEED)
    parts = split_model(build_model(model_spec, device="meta"), layout, pp_rank)
    for part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            for pname, p in part.named_parameters():
                p.copy_(full[pname])
    params = [p for part in parts for p in part.parameters()]
    opt = make_optimizer(params, LR)
    global_tokens = global_batch * SEQ
    schedule, stages = build_schedule(
        parts, layout, mesh["pp"].get_group(), n_microbatches=n_micro, device=torch.device("cpu"),
        loss_fn=lambda logits, target: lm_loss(logits, target, global_tokens), grad_scale=dp,
        aux_weight=1.0 / (global_batch // MBS))
    data = SyntheticTokens(model_spec.vocab_size, SEQ, SEED)
    losses, grads = [], {}
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(STEPS):
        rows = torch.cat(split_batch(data.batch(step, global_batch), dp_rank, dp, MBS))
        opt.zero_grad(set_to_none=True)
        share = pipeline_step(schedule, stages, rows[:, :-1], rows[:, 1:], is_first, is_last)
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                p.grad /= dp
        if step == 0:
            grads = {n: p.grad.clone() for part in parts for n, p in part.named_parameters()
                     if p.grad is not None}
        opt.step()
        total = torch.tensor([share], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item())
    seconds = time.perf_counter() - t0
    rank = dist.get_rank()
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(grads, folder / f"grads{rank}.pt")
    names = sorted({n for part in parts for n, _ in part.named_parameters()})
    (folder / f"rank{rank}.json").write_text(json.dumps(
        {"losses": losses, "seconds": seconds, "pp_rank": pp_rank, "dp_rank": dp_rank, "params": names,
         "layers": [sorted(part.layers.keys(), key=int) for part in parts]}))
    dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(CASES)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        for name in names:
            run_case(name, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
