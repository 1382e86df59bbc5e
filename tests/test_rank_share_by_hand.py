"""What one rank holds, by hand: the parameters every TP rank keeps whole (planner.cost.params.tp_replicated_params)
and the communicators of an expert mesh (planner.cost.memory.communicator_groups)."""

from __future__ import annotations

from planner.cost.params import dense_per_tp_rank, layer_params, tp_replicated_params
from planner.presets import get_preset


def test_llama_block_keeps_its_two_rmsnorms_whole():
    m = get_preset("llama3-8b")  # h 4096, RMSNorm, no biases
    assert tp_replicated_params(m, 0) == 2 * 4096
    dense = layer_params(m, 0)[0]
    assert dense_per_tp_rank(m, 0, 8) == (dense - 8192) / 8 + 8192


def test_gpt_block_keeps_layernorms_and_row_parallel_biases_whole():
    m = get_preset("gpt3-1.3b")  # h 2048, LayerNorm (scale + shift), biases
    assert tp_replicated_params(m, 0) == 2 * 2 * 2048 + 2048 + 2048


def test_moe_block_keeps_its_router_whole():
    m = get_preset("mixtral-8x7b")  # h 4096, 8 experts, every layer MoE
    assert tp_replicated_params(m, 0) == 2 * 4096 + 4096 * 8


def test_communicators_of_an_expert_mesh_by_hand():
    from planner.contracts import ParallelLayout
    from planner.cost.memory import communicator_groups

    # world, tp, dp_shard, ep; experts: etp 1, expert_dp 4*2/8 = 1, routing statistics over cp x tp = 2
    assert communicator_groups(ParallelLayout(tp=2, sp=True, dp_shard=4, ep=8, etp=1)) == 1 + 3 + 1
    # etp = tp = 2 (a group of its own), expert_dp 16*2/(4*2) = 4, cp x tp = 2
    assert communicator_groups(ParallelLayout(tp=2, sp=True, dp_shard=16, ep=4)) == 1 + 3 + 3
    # dense: world, tp, dp_shard
    assert communicator_groups(ParallelLayout(tp=2, dp_shard=4)) == 3


def test_mla_keeps_its_down_projections_and_latent_norms_whole():
    m = get_preset("deepseek-v3")  # h 7168, q_lora_rank 1536, kv_lora_rank 512, rope 64, RMSNorm, MoE from layer 3
    down = 7168 * 1536 + 7168 * (512 + 64)
    assert tp_replicated_params(m, 0) == 2 * 7168 + 1536 + 512 + down  # a dense layer
    assert tp_replicated_params(m, 3) == 2 * 7168 + 1536 + 512 + down + 7168 * 256  # an MoE layer: + router
