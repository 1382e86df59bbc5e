"""Intervals from held-out residuals by regime, blind-spot notes, ties and robust ranking (planner.uncertainty)."""

from __future__ import annotations

import math

import pytest

from planner.contracts import ParallelLayout, TrainingConfig
from planner.contracts.plan import StepTimeInterval
from planner.cost.predict import predict
from planner.presets import get_preset
from planner.reference import reference_profile
from planner.search.explain import rank_found, ties
from planner.search.price import Found
from planner.uncertainty import (
    MIN_ROWS,
    Regime,
    assess,
    layout_style,
    quantile_table,
    step_time_interval,
    step_time_residual,
)


def test_residual_is_the_step_time_ratio_whatever_the_metric():
    # 10% slow on time is ln(1.1); 10% fast on throughput means the predicted step is shorter: -ln(1.1)
    assert step_time_residual("iteration_time_s", 0.1) == pytest.approx(math.log(1.1))
    assert step_time_residual("tokens_per_s_per_gpu", 0.1) == pytest.approx(-math.log(1.1))
    assert step_time_residual("mfu", -0.2) == pytest.approx(-math.log(0.8))


def test_a_thin_regime_falls_back_to_a_coarser_one():
    fine = Regime("megatron", False, "bf16", "<=64", "3d")
    other = Regime("fsdp", False, "bf16", "<=64", "sharded")
    residuals = [(fine, 0.01 * i) for i in range(MIN_ROWS - 1)] + [(other, -0.01 * i) for i in range(MIN_ROWS)]
    table = quantile_table(residuals)
    assert fine.keys()[0] not in table  # 7 rows: too few for its own interval
    assert other.keys()[0] in table and table[other.keys()[0]]["rows"] == MIN_ROWS
    assert table["*|dense|*|*|*"]["rows"] == 2 * MIN_ROWS - 1
    found = step_time_interval(10.0, fine, {"regimes": table})
    assert found.regime == "*|dense|bf16|*|3d" or found.regime.startswith("*|dense")


def test_interval_bounds_follow_the_percentiles():
    # measured = predicted x exp(-r): r's 90th percentile gives the fast end, its 10th the slow end
    doc = {"regimes": {"*|*|*|*|*": {"rows": 20, "q10": -0.2, "q90": 0.1}}}
    found = step_time_interval(10.0, Regime("fsdp", True, "fp8", ">1024", "dp"), doc)
    assert (found.low_s, found.high_s) == pytest.approx((10 * math.exp(-0.1), 10 * math.exp(0.2)))
    assert found.rows == 20


def test_assess_attaches_the_interval_and_flags_an_mfu_above_every_published_run():
    model, prof = get_preset("llama3-8b"), reference_profile("dgx-h100", 1)
    training = TrainingConfig(seq_length=4096, global_batch_size=64)
    layout = ParallelLayout(dp_shard=8, zero_stage=3)
    raw = predict(model, training, prof, layout)
    doc = {"regimes": {"fsdp|dense|bf16|<=64|sharded": {"rows": 9, "q10": -0.3, "q90": 0.05}},
           "best_mfu": {"hopper|dense|bf16|<13B": {"mfu": raw.mfu / 2, "run_id": "x_1"}}}
    out = assess(raw.model_copy(update={"interval": None, "notes": []}), model, training, prof, layout, "autopar", doc)
    assert out.interval.regime == "fsdp|dense|bf16|<=64|sharded" and out.interval.rows == 9
    assert out.interval.low_s < out.step_time_s < out.interval.high_s
    assert any("above the best published run of its class (dense|bf16|<13B) on hopper" in n for n in out.notes)
    # megatron's residuals judge a megatron plan: no regime here, so no interval
    assert assess(raw.model_copy(update={"interval": None}), model, training, prof, layout, "megatron",
                  doc).interval is None
    assert layout_style(layout) == "sharded"


def test_robust_ranks_by_the_slow_end_and_overlaps_are_ties():
    model, prof = get_preset("llama3-8b"), reference_profile("dgx-h100", 1)
    training = TrainingConfig(seq_length=4096, global_batch_size=64)
    a = predict(model, training, prof, ParallelLayout(dp_shard=8, zero_stage=1))
    b = predict(model, training, prof, ParallelLayout(dp_shard=8, zero_stage=3))
    def interval(low: float, high: float) -> StepTimeInterval:
        return StepTimeInterval(low_s=low, high_s=high, level=0.8, regime="r", rows=10)

    fast_wide = a.model_copy(update={"step_time_s": 1.0, "interval": interval(0.7, 1.6)})
    slow_narrow = b.model_copy(update={"step_time_s": 1.1, "interval": interval(1.05, 1.2)})
    found = [Found(1.0, 0, ParallelLayout(dp_shard=8, zero_stage=1), "f", "OPTIMAL"),
             Found(1.1, 1, ParallelLayout(dp_shard=8, zero_stage=3), "f", "OPTIMAL")]
    nominal, _ = rank_found(found, [fast_wide, slow_narrow], robust=False)
    robust, preds = rank_found(found, [fast_wide, slow_narrow], robust=True)
    assert [f.order for f in nominal] == [0, 1] and [f.order for f in robust] == [1, 0]
    assert ties(fast_wide, slow_narrow)
    apart = slow_narrow.model_copy(update={"interval": interval(1.7, 1.9)})
    assert not ties(fast_wide, apart)


def _result(run_id: str, layout: ParallelLayout, predicted_s: float, measured_s: float,
            metric: str = "iteration_time_s"):
    from types import SimpleNamespace

    from planner.validate import RowResult

    model, prof = get_preset("llama3-8b"), reference_profile("dgx-h100", 1)
    case = SimpleNamespace(run_id=run_id, source="src", model=model, profile=prof, metric=metric, layout=layout,
                           training=TrainingConfig(seq_length=4096, global_batch_size=64))
    error = predicted_s / measured_s - 1 if metric == "iteration_time_s" else measured_s / predicted_s - 1
    return RowResult(case=case, predicted=0.0, error=error, prediction=SimpleNamespace(step_time_s=predicted_s))


def test_layout_order_counts_pairs_of_one_job_beyond_noise():
    from planner.validate import layout_order

    a, b, c = (ParallelLayout(dp_shard=8), ParallelLayout(tp=2, dp_shard=4), ParallelLayout(tp=8, dp_shard=1))
    results = [_result("x_1", a, 1.0, 1.2), _result("x_2", b, 1.1, 1.0, metric="tokens_per_s_per_gpu"),
               _result("x_3", c, 2.0, 1.01 * 1.2)]
    right, total, wrong = layout_order(results)
    # x_1 vs x_2: predicted a faster, measured b faster -> wrong; x_1 vs x_3: measured within 1% -> a tie, skipped;
    # x_2 vs x_3: predicted b faster, measured b faster -> right
    assert (right, total) == (1, 2) and wrong[0].startswith("x_1 vs x_2")


def test_runs_of_other_releases_are_not_the_same_job():
    from planner.validate import release

    assert release("mbridge_26.02_dgx-h100_qwen3_30b_a3b_16gpu_fp8") == "26.02"
    assert release("mlperf_v4.0_gpt3_smc_512gpu") == "v4.0_smc" != release("mlperf_v4.0_gpt3_nvidia_512gpu")
    assert release("korth_22B_full_recompute") == release("korth_22B_present_work") == ""


def test_executor_moe_predictions_say_their_dispatch_waits_on_the_host():
    """The autopar target's MoE plans carry the measured blind spot; Megatron's and dense plans do not."""
    from planner.contracts import ParallelLayout, TrainingConfig
    from planner.cost.predict import predict
    from planner.presets import get_preset
    from planner.reference import reference_profile
    from planner.uncertainty import EXECUTOR_MOE_HOST_NOTE

    prof, tr = reference_profile("dgx-h100", 1), TrainingConfig(global_batch_size=64, seq_length=4096)
    lay = ParallelLayout(ep=8, dp_shard=8, zero_stage=1)
    assert EXECUTOR_MOE_HOST_NOTE in predict(get_preset("qwen3-30b-a3b"), tr, prof, lay, target="autopar").notes
    assert EXECUTOR_MOE_HOST_NOTE not in predict(get_preset("qwen3-30b-a3b"), tr, prof, lay, target="megatron").notes
    dense = predict(get_preset("llama3-8b"), tr, prof, ParallelLayout(dp_shard=8, zero_stage=1), target="autopar")
    assert EXECUTOR_MOE_HOST_NOTE not in dense.notes
