"""Every supported Hugging Face family under every data/tensor-parallel plan, one gradient step each,
all in the same 4 processes.

    python -m torch.distributed.run --standalone --nproc-per-node 4 hf_grads_check.py OUT_DIR [CASE ...]

A case is ``<family>:<plan>`` (:func:`cases`; all when none are named): the family's tiny model
(:data:`CONFIGS`, random weights from the seed, nothing downloaded) is built on the meta device,
parallelised with :func:`executor.parallelize.parallelize`, loaded with the plan-independent weights
and run forward and backward in fp32 over one global batch of :data:`N_MICRO` micro-batches per
data-parallel rank (loss and reduction as :mod:`executor.train` does them). Every rank then gathers
each gradient whole (``DTensor.full_tensor()``) and writes OUT_DIR/<family>_<plan>/grads<rank>.pt by
plan-independent name; tests/test_executor_hf.py compares every rank's gradients with
:func:`executor.reference.reference_run` on one process. Families in ``NO_TP`` (MoE, fused projections) run only the
plans without TP (:func:`executor.parallelize.check_supported` refuses TP for them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from executor.data import SyntheticTokens, split_batch
from executor.hf import build_hf_model, hf_full_state
from executor.hf_cp import set_positions
from executor.parallelize import (
    GradAllReduce,
    accumulation_cadence,
    build_mesh,
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
from planner.contracts import ParallelLayout, Precision, TrainingConfig

SEED, SEQ, MBS, N_MICRO = 0, 16, 1, 2
BASE = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "tie_word_embeddings": False}
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside the tiny vocabulary
CONFIGS: dict[str, dict] = {
    "llama": {"model_type": "llama", **BASE},
    "mistral": {"model_type": "mistral", **BASE},
    "qwen2": {"model_type": "qwen2", **BASE},
    "qwen3": {"model_type": "qwen3", "head_dim": 8, **BASE},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, **BASE},
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, **BASE},
    # Granite: scalar multipliers away from 1 so that a lost one shows
    "granite": {"model_type": "granite", "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.2, "logits_scaling": 2.0, **BASE, **TOKENS},
    # OLMo 2: no pre-norms, q/k RMSNorms over the whole projection (a TP rank holds part of the row)
    "olmo2": {"model_type": "olmo2", **BASE, **TOKENS},
    # Gemma 2: four norms a layer, scaled embedding, soft-capped scores and logits, alternate sliding windows
    "gemma2": {"model_type": "gemma2", "head_dim": 8, "sliding_window": 8, "query_pre_attn_scalar": 8,
               **BASE, **TOKENS},
    # Gemma 3: per-head q/k norms, local/global layers with their own rotary bases
    "gemma3": {"model_type": "gemma3_text", "head_dim": 8, "sliding_window": 8, "query_pre_attn_scalar": 8,
               "layer_types": ["sliding_attention", "full_attention"], **BASE, **TOKENS},
    # Granite 3 and Gemma tie the head to the embedding: one vocabulary-sharded table under TP
    "granite_tied": {"model_type": "granite", "embedding_multiplier": 3.0, "logits_scaling": 2.0,
                     **BASE, **TOKENS, "tie_word_embeddings": True},
    # DeepSeek-V3 style: MLA (low-rank q and kv, a v head size of its own), a dense first layer, then
    # routed experts with a shared one and group-limited routing
    "deepseek_v3": {"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 16, "first_k_dense_replace": 1, "n_shared_experts": 1,
                    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                    "v_head_dim": 8, "n_group": 2, "topk_group": 1, **BASE, **TOKENS},
    # the same MLA with dense layers only: MLA under TP without SP too (executor.hf_mla)
    "deepseek_v3_dense": {"model_type": "deepseek_v3", "first_k_dense_replace": 2, "kv_lora_rank": 16,
                          "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
                          **BASE, **TOKENS},
    # Phi-3: fused qkv and gate-up projections (tensor parallelism refused, see FUSED)
    "phi3": {"model_type": "phi3", **BASE, **TOKENS},
}
PLANS: dict[str, dict] = {
    "fsdp4": {"dp_shard": 4, "zero_stage": 3},
    "hsdp_2x2": {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3},
    "dp2_tp2_sp": {"dp_shard": 2, "tp": 2, "sp": True},
    "fsdp2_tp2": {"dp_shard": 2, "tp": 2, "zero_stage": 3},
    "cp2_fsdp2": {"cp": 2, "dp_shard": 2, "zero_stage": 3},
    "cp2_tp2_sp": {"cp": 2, "tp": 2, "sp": True},
    "fsdp4_selective": {"dp_shard": 4, "zero_stage": 3, "recompute": "selective"},
    "cp2_tp2_sp_selective": {"cp": 2, "tp": 2, "sp": True, "recompute": "selective"},
    "ep2_dp4": {"dp_shard": 4, "ep": 2},
    "ep4_fsdp4": {"dp_shard": 4, "ep": 4, "zero_stage": 3},
    "ep2_cp2_fsdp2": {"cp": 2, "dp_shard": 2, "ep": 2, "zero_stage": 3},
    "moe_tp2_sp_dp2": {"dp_shard": 2, "tp": 2, "sp": True, "etp": 1},
    "moe_tp2_sp_ep2_fsdp2": {"dp_shard": 2, "tp": 2, "sp": True, "etp": 1, "ep": 2, "zero_stage": 3},
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
NO_TP = ("phi3",)  # refused under TP (fused projections): check_supported says why
NO_CP: tuple[str, ...] = ()  # refused under CP (executor.hf_cp.cp_refusal): none of these families
# families whose code paths another family's plans already cover run these plans only: Mistral and Qwen2 are
# Llama's modules (Qwen2 adds q/k/v biases: the TP plans), the dense MLA model adds MLA under TP without SP
ONLY: dict[str, tuple[str, ...]] = {
    "mistral": ("fsdp4", "dp2_tp2_sp", "cp2_fsdp2"),
    "qwen2": ("hsdp_2x2", "dp2_tp2_sp", "fsdp2_tp2", "cp2_tp2_sp"),
    "deepseek_v3_dense": ("dp2_tp2_sp", "fsdp2_tp2", "cp2_tp2_sp"),
}
# FSDP and HSDP wrap every family alike (fully_shard per layer): beyond these families (Llama's modules, a tied
# head, Gemma 2's eager attention, a MoE of each expert layout) their plans add nothing a TP or CP plan does not
WHOLE_MODEL_PLANS = ("fsdp4", "hsdp_2x2")
SHARDED_ALIKE = ("llama", "granite_tied", "gemma2", "mixtral", "qwen3_moe", "deepseek_v3", "phi3")


def runs(family: str, fields: dict) -> bool:
    """Whether ``family`` runs plan ``fields`` here: no TP for NO_TP, no CP for NO_CP, only ONLY[family] where
    listed; MoE families take TP only with whole experts (etp 1); EP and etp plans are for MoE families only."""
    tp, moe = fields.get("tp", 1) > 1, family in MOE_FAMILIES
    if (tp and family in NO_TP) or ("cp" in fields and family in NO_CP):
        return False
    if family in ONLY:
        return any(PLANS[p] is fields for p in ONLY[family])
    if family not in SHARDED_ALIKE and any(PLANS[p] is fields for p in WHOLE_MODEL_PLANS):
        return False
    if moe:
        return not tp or "etp" in fields
    return "ep" not in fields and "etp" not in fields


def cases() -> list[tuple[str, str]]:
    """(family, plan) pairs: every plan each family runs (:func:`runs`)."""
    return [(family, plan) for family in CONFIGS for plan, fields in PLANS.items() if runs(family, fields)]


def case_dir(out: Path, family: str, plan: str) -> Path:
    return out / f"{family}_{plan}"


def global_batch(layout: ParallelLayout) -> int:
    """Sequences per step: N_MICRO micro-batches of MBS sequences on every data-parallel rank."""
    return layout.dp * N_MICRO * MBS


def run_case(family: str, plan: str, out: Path) -> None:
    layout = ParallelLayout(**PLANS[plan])
    gbs = global_batch(layout)
    training = TrainingConfig(seq_length=SEQ, global_batch_size=gbs, precision=Precision.fp32)
    meshes = build_mesh(layout, dist.get_world_size(), "cpu")
    with torch.device("meta"):
        model = build_hf_model(CONFIGS[family], seed=SEED)
    check_supported(layout, model, training, hf=True)
    wrapped = parallelize(model, layout, meshes, training=training)
    load_full_state(model, hf_full_state(CONFIGS[family], seed=SEED), torch.device("cpu"))
    if layout.cp > 1:
        set_positions(model, cp_shard_batch(torch.zeros(1, SEQ), torch.zeros(1, SEQ), meshes)[2])
    dp_rank, dp_size = data_rank(meshes)
    micro = split_batch(SyntheticTokens(BASE["vocab_size"], SEQ, SEED).batch(0, gbs), dp_rank, dp_size, MBS)
    for i, rows in enumerate(micro):
        accumulation_cadence(wrapped, layout, i == len(micro) - 1)
        tokens, targets, _ = cp_shard_batch(rows[:, :-1], rows[:, 1:], meshes)
        with loss_context(layout):
            loss = lm_loss(wrapped(tokens).logits, targets, gbs * SEQ)
            (loss * loss_scale(meshes)).backward()
    if isinstance(wrapped, GradAllReduce):
        wrapped.sync()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[clean_fqn(name)] = g.detach().clone()
    where = case_dir(out, family, plan)
    where.mkdir(parents=True, exist_ok=True)
    torch.save(grads, where / f"grads{dist.get_rank()}.pt")
    dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    chosen = [tuple(name.split(":")) for name in sys.argv[2:]] or cases()
    dist.init_process_group("gloo")
    for family, plan in chosen:
        run_case(family, plan, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
