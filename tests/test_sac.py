"""Per-op selective activation checkpointing (``Recompute.op``, planner/cost/sac.py) by hand: which matmul
outputs it keeps, the bytes a block keeps, what the backward runs again, and which targets run it."""

from __future__ import annotations

import pytest

from planner.contracts import MLASpec, ModelSpec, MoESpec, ParallelLayout, Precision, Recompute
from planner.cost.comm import mesh_groups
from planner.cost.flops import layer_flops, recompute_flops
from planner.cost.layer import MicroBatch, block_cost
from planner.cost.memory import ActivationShape, layer_activation_bytes, recompute_transient
from planner.cost.sac import kept_gemm_share, kept_linears
from planner.presets import get_preset
from planner.reference import reference_profile
from planner.targets.core import Job, refusal

LLAMA = ModelSpec(name="l", num_layers=2, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                  ffn_hidden_size=14336, vocab_size=128256)


def _names(model: ModelSpec, index: int = 0, tp: int = 1) -> list[str]:
    return [lin.name for lin in kept_linears(model, index, tp)]


def test_llama_keeps_wq_wv_w1_w2():
    """wq, wk, wv, wo, w1, w3, w2 in forward order: the 1st, 3rd, 5th and 7th are kept."""
    assert _names(LLAMA) == ["q", "v", "w1", "w2"]


def test_linears_with_a_bias_are_addmm_always_kept_and_not_counted():
    assert _names(LLAMA.model_copy(update={"linear_bias": True})) == ["q", "k", "v", "o", "w1", "w3", "w2"]
    gelu = LLAMA.model_copy(update={"ffn_kind": "gelu"})  # q k v o fc1 fc2: fc2 is the 6th
    assert _names(gelu) == ["q", "v", "fc1"]
    # Qwen2: Q, K, V addmm (kept, uncounted); o, w1, w3, w2 counted from 1: o and w3 kept
    assert _names(LLAMA.model_copy(update={"qkv_bias": True})) == ["q", "k", "v", "o", "w3"]


def test_mla_and_shared_experts_count_in_forward_order():
    mla = LLAMA.model_copy(update={"mla": MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                                  qk_rope_head_dim=64, v_head_dim=128)})
    assert _names(mla) == ["q_a", "kv_a", "o", "w3"]  # q_a q_b kv_a kv_b o | w1 w3 w2
    moe = LLAMA.model_copy(update={"moe": MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=1024,
                                                  num_shared_experts=1)})
    assert _names(moe) == ["q", "v", "shared.w1", "shared.w2"]  # the router and routed experts uncounted


def test_kept_bytes_of_a_llama_block_by_hand():
    """b=1, s=8192, no TP, flash: per token the block's input h, wq h, wv kv·d = 1024, the attention output h
    and its fp32 log-sum-exp 4·32 bytes, w1 f = 14336, w2 h; 2 bytes an element."""
    shape = ActivationShape(batch=1, seq=8192, kv_seq=8192, tp=1, sp=False)
    got = layer_activation_bytes(LLAMA, 0, shape, Recompute.op, flash=True, elt=2)
    per_token = 2 * (4096 + 4096 + 1024 + 4096 + 14336 + 4096) + 4 * 32
    assert got == pytest.approx(8192 * per_token)
    assert got < layer_activation_bytes(LLAMA, 0, shape, Recompute.none, flash=True, elt=2)


def test_kept_bytes_under_tp_and_sp_by_hand():
    """tp=2 with SP: the input h/2, wq h/2, wv 512, output h/2, lse 4·16 bytes, w1 f/2, w2's partial output
    full width h (it is reduce-scattered after), and the two reduce-scatters' outputs h/2 each."""
    shape = ActivationShape(batch=2, seq=4096, kv_seq=4096, tp=2, sp=True)
    got = layer_activation_bytes(LLAMA, 0, shape, Recompute.op, flash=True, elt=2)
    per_token = 2 * (2048 + 2048 + 512 + 2048 + 7168 + 4096 + 2 * 2048) + 4 * 16
    assert got == pytest.approx(2 * 4096 * per_token)


def test_the_recompute_transient_is_what_was_not_kept():
    acts = {Recompute.none: 10.0, Recompute.selective: 8.0, Recompute.full: 1.0, Recompute.op: 4.0}
    assert [recompute_transient(acts, k) for k in (Recompute.none, Recompute.selective, Recompute.full,
                                                    Recompute.op)] == [0.0, 0.0, 10.0, 6.0]


def test_the_backward_runs_again_the_unkept_gemms_and_every_elementwise_op():
    """Kept FLOPs share of a Llama block: (q + v + w1 + w2) / (q + k + v + o + w1 + w3 + w2)
    = (h² + h·kv + 2hf) / (2h² + 2h·kv + 3hf) = 33792 / 53248."""
    share = 33792 / 53248
    assert kept_gemm_share(LLAMA, 0, 1) == pytest.approx(share)
    profile = reference_profile("dgx-h100")
    for sp in (False, True):
        layout = ParallelLayout(tp=2, sp=sp, micro_batch_size=1)
        mb = MicroBatch(1, 8192, 1, 2, sp, Precision.bf16, True)
        bc = block_cost(profile, LLAMA, 0, mb, layout, mesh_groups(layout, 8))
        again = bc.again(Recompute.op)
        assert again.gemm_s == pytest.approx(bc.forward.gemm_s * (1 - share))
        assert again.attention_s == 0.0 and again.memory_s == bc.forward.memory_s
        assert again.comm_s["tp"] == pytest.approx(bc.forward.comm_s["tp"] * (0.5 if sp else 1.0))
        assert (bc.backward_s(Recompute.none) < bc.backward_s(Recompute.op) < bc.backward_s(Recompute.full))


def test_recompute_flops_of_op_are_the_unkept_gemms():
    lf = layer_flops(LLAMA, 0, 1, 8192)
    got = recompute_flops(LLAMA, Recompute.op, 0, 1, 8192)
    h, kv, f = 4096, 1024, 14336
    assert got == pytest.approx(8192 * 2 * (h * kv + h * h + h * f))  # wk, wo, w3
    assert got < lf.attention_linear + lf.mlp


@pytest.mark.parametrize(("target", "runs"), [("autopar", True), ("torchtitan", True), ("megatron", False),
                                              ("deepspeed", False)])
def test_which_targets_run_per_op_checkpointing(target, runs):
    job = Job(get_preset("llama3-8b"), None, ParallelLayout(dp_shard=8, zero_stage=3, recompute="op"))
    err = refusal(target, job)
    assert (err is None) == runs, err
    if not runs:
        assert err.field == "recompute" and "per-op" in str(err)

