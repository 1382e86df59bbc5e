"""ZeRO-3 / FSDP at hundreds of ranks (issue 23): per-collective latency of NCCL's ring, one call per FSDP
unit, the cadence per micro-batch and what the prefetch leaves exposed. Every expected value is worked by
hand below from the reference DGX H100 profile's link figures (alpha, bus bandwidth) and NCCL's step
latencies, not by calling the cost model's helpers."""

from __future__ import annotations

import pytest

from planner.contracts import Collective, LinkLevel, ParallelLayout, Recompute, TrainingConfig
from planner.cost.comm import GroupPlacement, collective_time_s
from planner.cost.predict import dp_traffic, predict
from planner.cost.stage import unit_exposed_s
from planner.presets import get_preset
from planner.reference import reference_profile
from planner.search.stages import StageModel

US = 1e-6
INTRA_STEP, INTER_STEP = 1.9 * US, 4.0 * US  # NCCL tuning.cc hwLat[NVLINK|NET][RING][LL128]
NET_ALPHA, NVL_ALPHA = 25 * US, 10 * US  # the reference profile's inter-/intra-node all-gather alpha
BUSBW = 370e9  # 8 NICs x 47.5 GB/s = 380 GB/s, capped by NVLink's all-gather busbw 370 GB/s
# the reference links' alpha is the latency of 2 whole nodes (16 ranks): 14 NVLink steps and 1 network step
REF_STEPS = 14 * INTRA_STEP + 1 * INTER_STEP  # 30.6 us
# 512 ranks on 64 nodes: 511 steps, 63 of them across nodes
EXTRA_512 = 448 * INTRA_STEP + 63 * INTER_STEP - REF_STEPS  # 851.2 + 252 - 30.6 = 1072.6 us

# llama3-8b cut to 8 blocks: attention 4096*(4096+1024+1024+4096) = 41,943,040, 2 norms 8,192, SwiGLU
# 3*4096*14336 = 176,160,768 -> 218,112,000 a block; embedding 128,256*4096 = 525,336,576; head 525,336,576
# + final norm 4,096
BLOCK = 218_112_000
EMBEDDING, HEAD = 525_336_576, 525_340_672
TOTAL_8 = 8 * BLOCK + EMBEDDING + HEAD  # 2,795,573,248


def model8():
    return get_preset("llama3-8b").model_copy(update={"num_layers": 8})


def test_llama_block_count_by_hand():
    from planner.cost.params import total_params
    assert total_params(model8()) == TOTAL_8


# ------------------------------------------------------------------ 1. per-collective latency
def test_ring_all_gather_pays_its_steps_beyond_the_measured_group():
    prof = reference_profile("dgx-h100", 64)
    group = GroupPlacement(512, 8)
    one_byte = 511 / 512 / BUSBW
    expected = NET_ALPHA + EXTRA_512 + one_byte
    assert expected == pytest.approx(25e-6 + 1072.6e-6, rel=1e-6)
    for coll in (Collective.all_gather, Collective.reduce_scatter):
        assert collective_time_s(prof, coll, group, 1) == pytest.approx(expected, rel=1e-9)
    # the groups the links' alpha was measured on pay no more: 2 whole nodes, one node
    assert collective_time_s(prof, Collective.all_gather, GroupPlacement(16, 8), 1) == pytest.approx(
        NET_ALPHA + 15 / 16 / BUSBW, rel=1e-9)
    assert collective_time_s(prof, Collective.all_gather, GroupPlacement(8, 8), 1) == pytest.approx(
        NVL_ALPHA + 7 / 8 / BUSBW, rel=1e-9)
    # all-reduce runs as a tree at scale (log of the nodes): its alpha stands
    assert collective_time_s(prof, Collective.all_reduce, group, 1) == pytest.approx(
        NET_ALPHA + 2 * 511 / 512 / (8 * 47.5e9), rel=1e-9)


def test_one_rank_per_node_crosses_the_network_every_step():
    """FSDP over the ranks at stride tp=8: 64 ranks on 64 nodes, 63 network steps."""
    prof = reference_profile("dgx-h100", 64)
    nbytes = 800e6  # a 405B block's 16-bit weights over tp 8
    expected = NET_ALPHA + (63 * INTER_STEP - REF_STEPS) + 63 / 64 * nbytes / 47.5e9  # one NIC per rank
    assert 63 * INTER_STEP - REF_STEPS == pytest.approx(221.4e-6, rel=1e-9)
    assert collective_time_s(prof, Collective.all_gather, GroupPlacement(64, 1), nbytes) == pytest.approx(
        expected, rel=1e-9)


def test_a_link_measured_at_64_ranks_pays_only_the_further_steps():
    base = reference_profile("dgx-h100", 64)
    links = [x.model_copy(update={"group_size": 64, "ranks_per_node": 8, "alpha_s": 60e-6})
             if x.level is LinkLevel.inter_node and x.collective is Collective.all_gather else x for x in base.links]
    prof = base.model_copy(update={"links": links})
    measured_steps = 56 * INTRA_STEP + 7 * INTER_STEP  # 64 ranks on 8 nodes: 134.4 us
    at_512 = 448 * INTRA_STEP + 63 * INTER_STEP  # 1,103.2 us
    nbytes = 1e6
    # measured at exactly this group's size and placement: no NVLink bound on the 8 rails (8 x 47.5 GB/s)
    assert collective_time_s(prof, Collective.all_gather, GroupPlacement(64, 8), nbytes) == pytest.approx(
        60e-6 + 63 / 64 * nbytes / 380e9, rel=1e-9)
    assert collective_time_s(prof, Collective.all_gather, GroupPlacement(512, 8), nbytes) == pytest.approx(
        60e-6 + (at_512 - measured_steps) + 511 / 512 * nbytes / BUSBW, rel=1e-9)


def test_latency_outweighs_a_small_models_layer_at_512_ranks():
    """A 1.3B model's block (24 blocks of 50.3M parameters, 16-bit): its bytes take 0.27 ms over 512 ranks,
    the ring's steps 1.07 ms."""
    prof = reference_profile("dgx-h100", 64)
    block_bytes = 2 * 50_331_648
    t = collective_time_s(prof, Collective.all_gather, GroupPlacement(512, 8), block_bytes)
    bytes_part = 511 / 512 * block_bytes / BUSBW
    assert bytes_part == pytest.approx(0.2715e-3, rel=1e-3)
    assert t == pytest.approx(NET_ALPHA + EXTRA_512 + bytes_part, rel=1e-9)
    assert EXTRA_512 > 3 * bytes_part


# ------------------------------------------------------------------ 2. one call per FSDP unit
def test_zero3_gathers_and_reduce_scatters_each_unit_apart():
    prof = reference_profile("dgx-h100", 64)
    tr = TrainingConfig(global_batch_size=512, seq_length=4096)  # bf16 weights, fp32 gradient reduction
    lay = ParallelLayout(dp_shard=512, zero_stage=3)
    units = 9  # 8 blocks and the root (embedding, final norm, head)
    tr_ = dp_traffic(prof, lay, tr, TOTAL_8, 0.0, units, 1)
    per_call = NET_ALPHA + EXTRA_512
    assert tr_.gather_s == pytest.approx(units * per_call + 511 / 512 * 2 * TOTAL_8 / BUSBW, rel=1e-9)
    assert tr_.grad_s == pytest.approx(units * per_call + 511 / 512 * 4 * TOTAL_8 / BUSBW, rel=1e-9)
    assert units * per_call == pytest.approx(9.8784e-3, rel=1e-6)
    # ZeRO-1 (Megatron's distributed optimizer) reduces in buckets: one call a step
    one = dp_traffic(prof, lay.model_copy(update={"zero_stage": 1}), tr, TOTAL_8, 0.0, units, 1)
    assert one.grad_s == pytest.approx(per_call + 511 / 512 * 4 * TOTAL_8 / BUSBW, rel=1e-9)
    # ZeRO-2 (FSDP SHARD_GRAD_OP) reduce-scatters per unit but gathers once a step
    two = dp_traffic(prof, lay.model_copy(update={"zero_stage": 2}), tr, TOTAL_8, 0.0, units, 1)
    assert two.grad_s == pytest.approx(tr_.grad_s, rel=1e-12)
    assert two.gather_s == pytest.approx(per_call + 511 / 512 * 2 * TOTAL_8 / BUSBW, rel=1e-9)


# ------------------------------------------------------------------ 3. micro-batches per rank
def _comm(pred, kind: str):
    return next(c for c in pred.comm if c.kind == kind)


@pytest.mark.parametrize("m", [1, 4])
def test_without_a_pipeline_each_micro_batch_gathers_twice_and_reduce_scatters(m):
    """FSDP FULL_SHARD with gradient accumulation (Composer and torchtitan do not skip the sync):
    per micro-batch one gather before forward, one before backward and one reduce-scatter, 9 calls each."""
    prof = reference_profile("dgx-h100", 64)
    tr = TrainingConfig(global_batch_size=512 * m, seq_length=2048)
    pred = predict(model8(), tr, prof, ParallelLayout(dp_shard=512, zero_stage=3))
    per_call = NET_ALPHA + EXTRA_512
    gather = 9 * per_call + 511 / 512 * 2 * TOTAL_8 / BUSBW
    rs = 9 * per_call + 511 / 512 * 4 * TOTAL_8 / BUSBW
    param, grad = _comm(pred, "dp_param"), _comm(pred, "dp_grad")
    assert param.bytes_per_step == pytest.approx(m * 2 * 2 * TOTAL_8, rel=1e-12)
    assert grad.bytes_per_step == pytest.approx(m * 4 * TOTAL_8, rel=1e-12)
    assert param.time_s == pytest.approx(m * 2 * gather, rel=1e-9)
    assert grad.time_s == pytest.approx(m * rs, rel=1e-9)


def test_under_a_pipeline_gradients_reduce_once_and_weights_stay_gathered():
    """torch.distributed.pipelining turns FSDP's gradient sync and resharding after backward off until the
    last micro-batch: one reduce-scatter a step; resharding after forward gathers again each micro-batch
    (in its backward), not resharding gathers once a step."""
    prof = reference_profile("dgx-h100", 64)
    m = 8
    tr = TrainingConfig(global_batch_size=256 * m, seq_length=2048)
    for reshard, gathers in ((True, m), (False, 1)):
        lay = ParallelLayout(dp_shard=256, pp=2, zero_stage=3, reshard_after_forward=reshard)
        pred = predict(model8(), tr, prof, lay)
        param, grad = _comm(pred, "dp_param"), _comm(pred, "dp_grad")
        stage_params = grad.bytes_per_step / 4  # the critical rank's: 4 blocks and the embedding or the head
        assert stage_params in (4 * BLOCK + EMBEDDING, 4 * BLOCK + HEAD)
        assert param.bytes_per_step == pytest.approx(gathers * 2 * stage_params, rel=1e-12)
        # a stage's 256 ranks on 32 nodes (pp outermost), 8 a node: 255 steps, 31 across nodes; 5 units
        extra = 224 * INTRA_STEP + 31 * INTER_STEP - REF_STEPS  # 425.6 + 124 - 30.6 = 519 us
        per_gather = 5 * (NET_ALPHA + extra) + 255 / 256 * 2 * stage_params / BUSBW
        assert param.time_s == pytest.approx(gathers * per_gather, rel=1e-9)


# ------------------------------------------------------------------ 4. exposure
def test_unit_exposure_by_hand():
    # 10 ms over 5 units: the first 2 ms show; the other 8 ms hide behind 4/5 of the window, 90% of it
    assert unit_exposed_s(10e-3, 2e-3, 5, 20e-3, 0.9) == pytest.approx(2e-3 + 8e-3 - 0.9 * 8e-3, rel=1e-12)
    assert unit_exposed_s(10e-3, 2e-3, 5, 4e-3, 0.9) == pytest.approx(2e-3 + 8e-3 - 0.9 * 3.2e-3, rel=1e-12)
    assert unit_exposed_s(0.0, 0.0, 5, 4e-3, 0.9) == 0.0


def _with(prof, **assumptions):
    return prof.model_copy(update={"assumptions": prof.assumptions.model_copy(update=assumptions)})


def test_compute_bound_fsdp_shows_one_gather_and_one_reduce_scatter_per_micro_batch():
    """Long sequences (a block's compute far above its collectives) and a perfect overlap: per micro-batch
    only the forward's first gather and the backward's last reduce-scatter (1/9 of each) show."""
    prof = _with(reference_profile("dgx-h100", 64), async_overlap_efficiency=1.0)
    m = 2
    tr = TrainingConfig(global_batch_size=512 * m, seq_length=8192)
    pred = predict(model8(), tr, prof, ParallelLayout(dp_shard=512, zero_stage=3))
    per_call = NET_ALPHA + EXTRA_512
    gather = 9 * per_call + 511 / 512 * 2 * TOTAL_8 / BUSBW
    rs = 9 * per_call + 511 / 512 * 4 * TOTAL_8 / BUSBW
    fwd = pred.stages[0].forward_s
    assert 2 * gather < fwd  # the window holds the rest by far (precondition)
    exposed = _comm(pred, "dp_param").exposed_s + _comm(pred, "dp_grad").exposed_s
    assert exposed == pytest.approx(m * (gather / 9 + rs / 9), rel=1e-9)


def test_latency_bound_fsdp_exposes_what_one_units_compute_cannot_hide():
    """Short sequences at 512 ranks: a block's forward is shorter than its gather, so beyond the first
    gather each gather shows what its unit's compute does not hide: ``fill + rest - min(rest, 8/9 fwd)``."""
    base = reference_profile("dgx-h100", 64)
    prof = _with(base, async_overlap_efficiency=1.0)
    tr = TrainingConfig(global_batch_size=512, seq_length=128)
    lay = ParallelLayout(dp_shard=512, zero_stage=3, reshard_after_forward=False)  # one gather, in forward
    free = [x.model_copy(update={"alpha_s": 0.0, "busbw_bytes_per_s": 1e24}) if x.level is not LinkLevel.host_device
            else x for x in base.links]
    compute = predict(model8(), tr, _with(prof.model_copy(update={"links": free}), ring_step_intra_node_s=0.0,
                                          ring_step_inter_node_s=0.0), lay)
    fwd = compute.stages[0].forward_s  # the forward's compute alone (nothing else on the forward path)
    pred = predict(model8(), tr, prof, lay)
    gather = 9 * (NET_ALPHA + EXTRA_512) + 511 / 512 * 2 * TOTAL_8 / BUSBW
    rest = gather * 8 / 9
    assert rest > fwd * 8 / 9  # latency bound (precondition)
    assert pred.stages[0].forward_s - fwd == pytest.approx(gather / 9 + rest - fwd * 8 / 9, rel=1e-9)


def test_more_ranks_expose_more_of_the_same_work():
    """Same per-GPU work on 16 and 512 ranks, short sequences: the 512-rank ring's 1.07 ms per call shows."""
    tr16, tr512 = (TrainingConfig(global_batch_size=n, seq_length=128) for n in (16, 512))
    p16 = predict(model8(), tr16, reference_profile("dgx-h100", 2), ParallelLayout(dp_shard=16, zero_stage=3))
    p512 = predict(model8(), tr512, reference_profile("dgx-h100", 64), ParallelLayout(dp_shard=512, zero_stage=3))
    assert p512.step_time_s > p16.step_time_s + 9 * 2 * EXTRA_512 * 0.5


# ------------------------------------------------------------------ the search prices the same
@pytest.mark.parametrize("layout", [{"dp_shard": 512, "zero_stage": 3}, {"dp_shard": 256, "pp": 2, "zero_stage": 3},
                                    {"dp_shard": 256, "pp": 2, "zero_stage": 3, "reshard_after_forward": False},
                                    {"dp_shard": 256, "pp": 2, "zero_stage": 2}])
def test_stage_model_equals_predict_at_512_ranks(layout):
    prof = reference_profile("dgx-h100", 64)
    model, tr = model8(), TrainingConfig(global_batch_size=2048, seq_length=2048)
    sm = StageModel(model, tr, prof, ParallelLayout(**layout))
    n = sm.p * sm.v
    for cut in range(1, 8) if n == 2 else [None]:
        chunks = [8] if cut is None else [cut, 8 - cut]
        rec = [(Recompute.none, 0)] * sm.p
        step, _ = sm.evaluate(chunks, rec)
        assert step == pytest.approx(predict(model, tr, prof, sm.layout_for(chunks, rec)).step_time_s, rel=1e-12)
