"""Every non-pipeline plan dimension under torchrun, one layout after another in the same 4 processes.

    python -m torch.distributed.run --standalone --nproc-per-node 4 parallel_check.py OUT_DIR [CASE ...]

For each case of :data:`CASES` (all when none are named) every rank builds the tiny model on the meta
device, applies :func:`executor.parallelize.parallelize` for the case's layout, loads the
plan-independent weights, and trains 3 AdamW steps of 2 micro-batches per data-parallel rank (fp32),
each micro-batch's loss = token-loss sum / global tokens x :func:`loss_scale`, the collectives of each
micro-batch as the executor runs them (:func:`accumulation_cadence`). It writes OUT_DIR/<case>/rank<r>.json
(the step losses, summed over all ranks and divided by tp, so every rank reports the global loss; wall time of
the case; the process groups alive after it) and rank 0 OUT_DIR/<case>/grads.pt: the first step's reduced
gradients as full tensors (``DTensor.full_tensor()``) by plan-independent name. tests/test_executor_parallel.py
compares them with :func:`executor.reference.reference_run` on one process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from executor.data import SyntheticTokens, split_batch
from executor.model import build_model, full_state_dict
from executor.parallelize import (
    GradAllReduce,
    accumulation_cadence,
    add_aux_loss,
    build_mesh,
    build_optimizer,
    check_supported,
    clean_fqn,
    cp_shard_batch,
    data_rank,
    load_full_state,
    loss_context,
    loss_scale,
    parallelize,
)
from executor.reference import lm_loss
from planner.contracts import ModelSpec, MoESpec, ParallelLayout, Precision, StageRecompute, TrainingConfig

SEED, SEQ, MBS, N_MICRO, STEPS, LR = 0, 16, 1, 2, 3, 1e-2
DENSE = ModelSpec(name="tiny", num_layers=2, hidden_size=32, num_attention_heads=8, num_kv_heads=4,
                  ffn_hidden_size=64, vocab_size=128)
MOE = ModelSpec(name="tiny-moe", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                ffn_hidden_size=64, vocab_size=128,
                moe=MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=32, num_shared_experts=1))
SPECS = {"dense": DENSE, "moe": MOE}
# a Hugging Face Llama of the same size (model kind "hf": built by executor.hf with seeded weights)
HF_CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 128,
             "max_position_embeddings": 64, "tie_word_embeddings": False}
# name -> (model, layout fields, per-stage recompute)
CASES: dict[str, tuple[str, dict, StageRecompute | None]] = {
    "ddp4": ("dense", {"dp_replicate": 4}, None),
    "zero1_dp4": ("dense", {"dp_shard": 4, "zero_stage": 1}, None),
    "zero2_dp4": ("dense", {"dp_shard": 4, "zero_stage": 2}, None),
    "zero3_fsdp4": ("dense", {"dp_shard": 4, "zero_stage": 3}, None),
    "hsdp_2x2": ("dense", {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3}, None),
    "zero3_offload_fsdp4": ("dense", {"dp_shard": 4, "zero_stage": 3, "offload_optimizer": True}, None),
    "tp4": ("dense", {"tp": 4}, None),
    "dp2_tp2_sp": ("dense", {"dp_shard": 2, "tp": 2, "sp": True}, None),
    "fsdp2_tp2_sp": ("dense", {"dp_shard": 2, "tp": 2, "sp": True, "zero_stage": 3}, None),
    "fsdp2_cp2": ("dense", {"dp_shard": 2, "cp": 2, "zero_stage": 3}, None),
    "ddp2_cp2": ("dense", {"dp_replicate": 2, "cp": 2}, None),
    "ep2_dp4": ("moe", {"dp_shard": 4, "ep": 2}, None),
    "ep2_fsdp4": ("moe", {"dp_shard": 4, "ep": 2, "zero_stage": 3}, None),
    "ep2_hsdp_2x2": ("moe", {"dp_replicate": 2, "dp_shard": 2, "ep": 2, "zero_stage": 2}, None),
    "selective_fsdp4": ("dense", {"dp_shard": 4, "zero_stage": 3, "recompute": "selective"}, None),
    "full_first1_ddp4": ("dense", {"dp_replicate": 4}, StageRecompute(kind="full", num_layers=1)),
    "hf_dp2_tp2_sp": ("hf", {"dp_shard": 2, "tp": 2, "sp": True}, None),
    "hf_fsdp2_tp2_full": ("hf", {"dp_shard": 2, "tp": 2, "zero_stage": 3, "recompute": "full"}, None),
    # per-op selective checkpointing (executor.sac): DTensor matmuls and reduce-scatters, experts, an HF block
    "op_fsdp2_tp2_sp": ("dense", {"dp_shard": 2, "tp": 2, "sp": True, "zero_stage": 3, "recompute": "op"}, None),
    "op_ep2_fsdp4": ("moe", {"dp_shard": 4, "ep": 2, "zero_stage": 3, "recompute": "op"}, None),
    "op_fsdp2_cp2": ("dense", {"dp_shard": 2, "cp": 2, "zero_stage": 3, "recompute": "op"}, None),
    "hf_dp2_tp2_sp_op": ("hf", {"dp_shard": 2, "tp": 2, "sp": True, "recompute": "op"}, None),
}


def build(kind: str, device: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The case's model on ``device`` and its plan-independent weights (HF: with the rotary buffers)."""
    if kind == "hf":
        from executor.hf import build_hf_model, hf_full_state

        with torch.device(device):
            model = build_hf_model(HF_CONFIG, seed=SEED)
        return model, hf_full_state(HF_CONFIG, seed=SEED)
    return build_model(SPECS[kind], device=device), full_state_dict(SPECS[kind], SEED)


def global_batch(layout: ParallelLayout) -> int:
    """Sequences per step: N_MICRO micro-batches of MBS sequences on every data-parallel rank."""
    return layout.dp * N_MICRO * MBS


def run_case(name: str, out: Path) -> None:
    kind, fields, stage = CASES[name]
    layout, hf = ParallelLayout(**fields), kind == "hf"
    gbs = global_batch(layout)
    training = TrainingConfig(seq_length=SEQ, global_batch_size=gbs, precision=Precision.fp32)
    start = time.perf_counter()
    meshes = build_mesh(layout, dist.get_world_size(), "cpu")
    model, full_sd = build(kind, "meta")
    check_supported(layout, model, training, hf=hf)
    wrapped = parallelize(model, layout, meshes, training=training, stage_recompute=stage)
    load_full_state(model, full_sd, torch.device("cpu"))
    opt = build_optimizer(model, layout, meshes, LR)
    dp_rank, dp_size = data_rank(meshes)
    vocab = HF_CONFIG["vocab_size"] if hf else SPECS[kind].vocab_size
    data = SyntheticTokens(vocab, SEQ, SEED)
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        micro = split_batch(data.batch(step, gbs), dp_rank, dp_size, MBS)
        opt.zero_grad(set_to_none=True)
        local = 0.0
        for i, rows in enumerate(micro):
            tokens, targets, positions = cp_shard_batch(rows[:, :-1], rows[:, 1:], meshes)
            accumulation_cadence(wrapped, layout, i == len(micro) - 1)
            with loss_context(layout):
                logits = wrapped(tokens).logits if hf else wrapped(tokens, positions)
                loss = lm_loss(logits, targets, gbs * SEQ)
                if kind != "hf" and SPECS[kind].moe is not None:
                    loss = add_aux_loss(loss, model.aux_loss() / (gbs // MBS))
                value = loss.full_tensor() if isinstance(loss, DTensor) else loss
                local += float(value.detach())
                (loss * loss_scale(meshes)).backward()
        if isinstance(wrapped, GradAllReduce):
            wrapped.sync()
        if step == 0:
            for pname, p in model.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[clean_fqn(pname)] = g.detach().clone()
        opt.step()
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / layout.tp)  # the TP ranks of a data shard computed the same loss
    rank = dist.get_rank()
    case_dir = out / name
    case_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(grads, case_dir / "grads.pt")
    (case_dir / f"rank{rank}.json").write_text(json.dumps(
        {"losses": losses, "global_batch": gbs, "seconds": time.perf_counter() - start,
         "wrapper": type(wrapped).__name__,
         "process_groups": len(dist.distributed_c10d._world.pg_map)}))
    dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(CASES)
    dist.init_process_group("gloo")
    torch.manual_seed(SEED)
    for name in names:
        run_case(name, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
