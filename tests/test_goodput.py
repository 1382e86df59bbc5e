"""Time-to-train terms (planner/cost/goodput.py) against hand calculations, and the ranking by them."""

from __future__ import annotations

import math

import pytest

from planner.contracts import CheckpointCost, CheckpointLine, TrainingConfig, TrainingGoal
from planner.contracts.goodput import LLAMA3_FAILURES_PER_GPU_HOUR
from planner.cost.goodput import (
    MAX_LINE_RATE,
    CheckpointTimes,
    checkpoint_bytes_per_param,
    checkpoint_times,
    choose_checkpoint,
    daly_interval_s,
    expected_wall_s,
    fit_line,
    job_mtbf_s,
    largest_replicated_item_bytes,
    state_tensors_per_rank,
    steps_to_train,
    written_bytes,
    young_interval_s,
)


def test_the_job_fails_as_often_as_all_its_gpus_together():
    assert job_mtbf_s(1e-5, 1000) == pytest.approx(360_000.0)  # 3600 / (1e-5 x 1000)
    # Llama 3 405B: 419 interruptions in 54 days on 16,384 GPUs -> one every 3.09 h
    assert job_mtbf_s(LLAMA3_FAILURES_PER_GPU_HOUR, 16_384) == pytest.approx(54 * 24 * 3600 / 419)


def test_young_and_daly_intervals():
    assert young_interval_s(2.0, 10_000.0) == pytest.approx(200.0)  # sqrt(2 x 2 x 10000)
    # Daly: x = sqrt(2 / 20000) = 0.01; 200 (1 + 0.01/3 + 0.0001/9) - 2
    assert daly_interval_s(2.0, 10_000.0) == pytest.approx(200 * (1 + 0.01 / 3 + 0.0001 / 9) - 2)
    assert daly_interval_s(30_000.0, 10_000.0) == 10_000.0  # delta >= 2M: checkpoint once per MTBF


def test_expected_wall_time_is_daly_s_and_tends_to_the_checkpoint_overhead_without_failures():
    t_s, tau, delta, r, m = 1e6, 200.0, 2.0, 600.0, 10_000.0
    by_hand = m * math.exp(r / m) * (math.exp((tau + delta) / m) - 1) * t_s / tau
    assert expected_wall_s(t_s, tau, delta, r, m) == pytest.approx(by_hand)
    assert expected_wall_s(t_s, tau, delta, r, 1e15) == pytest.approx(t_s * (1 + delta / tau), rel=1e-6)
    # the optimum: Daly's interval beats one 2x either side
    best = daly_interval_s(delta, m)
    assert all(expected_wall_s(t_s, best, delta, r, m) < expected_wall_s(t_s, t, delta, r, m)
               for t in (best / 2, best * 2))


def test_checkpoint_bytes_per_parameter():
    bf16 = TrainingConfig(seq_length=4096, global_batch_size=8)
    assert checkpoint_bytes_per_param(bf16, master_in_param=True) == 12  # fp32 master + Adam m, v
    assert checkpoint_bytes_per_param(bf16, master_in_param=False) == 14  # + the 16-bit weights
    fp32 = TrainingConfig(seq_length=4096, global_batch_size=8, precision="fp32")
    assert checkpoint_bytes_per_param(fp32, master_in_param=True) == 12  # no master: the fp32 weights + m, v


def test_async_blocks_for_the_copy_only_and_waits_for_the_write():
    m, r = 10_000.0, 600.0
    times = CheckpointTimes(sync_s=20.5, copy_s=0.5, write_s=20.0, source="by hand")
    sync = choose_checkpoint("sync", times, 1e6, r, m)
    asyn = choose_checkpoint("async", times, 1e6, r, m)
    assert sync.blocking_s == 20.5 and asyn.blocking_s == 0.5
    assert sync.interval_s == pytest.approx(daly_interval_s(20.5, m))
    assert asyn.interval_s == pytest.approx(max(daly_interval_s(0.5, m), 20.0))
    assert asyn.wall_s == pytest.approx(expected_wall_s(1e6, asyn.interval_s, 0.5, r + 20.0, m))
    assert asyn.goodput > sync.goodput
    slow_write = choose_checkpoint("async", CheckpointTimes(5000.5, 0.5, 5_000.0, "by hand"), 1e6, r, m)
    assert slow_write.interval_s == 5_000.0  # the next checkpoint waits for the write


def _cpu_and_gpu():  # noqa: ANN202
    from planner.reference import reference_profile

    gpu = reference_profile("dgx-h100", 2)
    return gpu.model_copy(update={"links": [x for x in gpu.links if x.level.value != "host_device"]}), gpu


def test_the_copy_of_cpu_ranks_runs_through_host_memory():
    cpu, gpu = _cpu_and_gpu()
    got = checkpoint_times(cpu, 4e9, 64e9, 100, 16, 1.0)  # 16 GPUs: 2 nodes
    assert got.copy_s == pytest.approx(4e9 / cpu.assumptions.cpu_optimizer_bytes_per_s)
    assert got.write_s == pytest.approx(32.0) and got.sync_s == pytest.approx(got.copy_s + 32.0)
    assert checkpoint_times(gpu, 4e9, 64e9, 100, 16, 1.0).write_s == got.write_s
    # unstated bandwidth without measured lines: Llama 3's 2 TB/s over 2,048 nodes
    assert checkpoint_times(cpu, 4e9, 64e9, 100, 16, None).write_s == pytest.approx(64 / (2 * 2000 / 2048))


MEASURED = CheckpointCost(
    ranks=4, storage="/tmp", points=[],
    sync=CheckpointLine(fixed_s=0.05, per_tensor_s=0.002, bytes_per_s=1e9),
    async_blocking=CheckpointLine(fixed_s=0.02, per_tensor_s=0.0005, bytes_per_s=4e9),
    async_write=CheckpointLine(fixed_s=0.1, per_tensor_s=0.002, bytes_per_s=1e9))


def test_measured_lines_price_each_mode_by_bytes_and_tensors():
    cpu, _ = _cpu_and_gpu()
    prof = cpu.model_copy(update={"checkpoint": MEASURED})
    # 4 ranks write 8e8 B: 2e8 each; the most loaded holds 3e8 (replicated tensors are written once)
    got = checkpoint_times(prof, 3e8, 8e8, 100, 4, None)
    assert got.sync_s == pytest.approx(0.05 + 0.2 + 0.2)  # 0.05 + 100 x 0.002 + 2e8 / 1e9
    assert got.copy_s == pytest.approx(0.02 + 0.05 + 0.075)  # 0.02 + 100 x 0.0005 + 3e8 / 4e9: what it holds
    # the write: that copy, then what the lines put behind it at the written share (0.5 - 0.12)
    assert got.write_s == pytest.approx(got.copy_s + (0.1 + 0.2 + 0.2) - (0.02 + 0.05 + 0.05))
    # a stated storage bandwidth replaces the measured storage, keeping the measured per-save costs
    stated = checkpoint_times(prof, 2e8, 8e8, 100, 1, 2.0)
    copy = 2e8 / cpu.assumptions.cpu_optimizer_bytes_per_s
    assert stated.write_s == pytest.approx(0.4) and stated.copy_s == pytest.approx(0.02 + 0.05 + copy)
    assert stated.sync_s == pytest.approx(0.05 + 0.2 + copy + 0.4)


def test_the_busiest_rank_writes_its_share_and_the_largest_replicated_entry():
    from planner.contracts import ParallelLayout
    from planner.presets import get_preset

    model = get_preset("llama3-8b")  # V·h = 128256 x 4096 parameters, the largest tensor
    table = 128256 * 4096
    # DDP over 4: every entry replicated; the largest is an fp32 state of the table
    assert largest_replicated_item_bytes(model, ParallelLayout(dp_shard=4)) == table * 4
    # TP 2 x DP 2: the table split over TP
    assert largest_replicated_item_bytes(model, ParallelLayout(dp_shard=2, tp=2)) == table * 4 / 2
    # FSDP over all 4: nothing replicated; HSDP 2 x 2: the shards of a replica group
    assert largest_replicated_item_bytes(model, ParallelLayout(dp_shard=4, zero_stage=3)) == 0
    hsdp = ParallelLayout(dp_replicate=2, dp_shard=2, zero_stage=3)
    assert largest_replicated_item_bytes(model, hsdp) == table * 4 / 2
    assert largest_replicated_item_bytes(model, ParallelLayout()) == 0  # one rank
    assert written_bytes(model, ParallelLayout(dp_shard=4), 8e9, 4) == pytest.approx(2e9 + table * 4)
    assert written_bytes(model, ParallelLayout(dp_shard=4), 1e9, 4) == 1e9  # never more than all of it


def test_a_line_is_fitted_through_its_points():
    exact = [(b, n, 0.1 + 0.001 * n + b / 1e9) for b in (1e6, 1e8, 4e8) for n in (10, 100)]
    line = fit_line(exact)
    assert (line.fixed_s, line.per_tensor_s, line.bytes_per_s) == pytest.approx((0.1, 0.001, 1e9))
    # times that fall with the tensors: that term is left at 0, not made negative
    falling = [(1e8, 10, 0.3), (1e8, 100, 0.25), (4e8, 10, 0.6), (4e8, 100, 0.55)]
    assert fit_line(falling).per_tensor_s == 0.0 and fit_line(falling).fixed_s > 0
    # times that do not grow with the bytes: the contract's largest rate
    assert fit_line([(1e6, 10, 0.2), (1e8, 10, 0.2)]).bytes_per_s == MAX_LINE_RATE


def test_state_tensors_per_rank_counts_the_most_loaded_pipeline_rank():
    from planner.contracts import ParallelLayout, Schedule
    from planner.cost.params import layer_tensors
    from planner.presets import get_preset

    model = get_preset("llama3-8b")  # 32 layers of 2 norms + q, k, v, o + w1, w2, w3 = 9 tensors
    assert layer_tensors(model, 0) == 9
    assert state_tensors_per_rank(model, ParallelLayout()) == 1 + 32 * 9 + 2  # embedding, layers, norm + head
    # 4 stages of 8 layers: the first holds the embedding, the last the final norm and the head
    assert state_tensors_per_rank(model, ParallelLayout(pp=4, micro_batch_size=1)) == 8 * 9 + 2
    inter = ParallelLayout(pp=2, virtual_stages=2, schedule=Schedule.interleaved_1f1b, micro_batch_size=1)
    assert state_tensors_per_rank(model, inter) == 16 * 9 + 2  # rank 1 holds chunks 1 and 3 (the head)


def test_steps_from_tokens_round_up():
    tr = TrainingConfig(seq_length=4096, global_batch_size=8)
    assert steps_to_train(TrainingGoal(tokens=32768 * 10 + 1), tr) == 11
    assert steps_to_train(TrainingGoal(steps=7), tr) == 7


@pytest.mark.parametrize("bad", [{}, {"tokens": 1e9, "steps": 5}, {"tokens": -1.0}, {"steps": 5, "restart_s": -1},
                                 {"steps": 5, "failure_rate_per_gpu_hour": 2.0}])
def test_goals_that_make_no_sense_are_refused(bad):
    with pytest.raises(ValueError):
        TrainingGoal(**bad)


# ------------------------------------------------------------------ the plan, the CLI, the API
def _plan(**goal):  # noqa: ANN202
    from planner.goodput import rank_by_time_to_train
    from planner.presets import get_preset
    from planner.reference import reference_profile
    from planner.search import SearchOptions, search

    model, prof = get_preset("llama3-8b"), reference_profile("dgx-h100", 2)
    tr = TrainingConfig(seq_length=4096, global_batch_size=64)
    plan = search(model, tr, prof, SearchOptions(top_k=3, time_budget_s=10))
    return plan, rank_by_time_to_train(plan, TrainingGoal(**goal), prof), prof


def test_every_plan_gets_its_time_to_train_and_the_soonest_is_the_plan():
    plan, ranked, prof = _plan(tokens=1e11, price_per_gpu_hour=2.0)
    good = ranked.prediction.goodput
    assert good.steps == math.ceil(1e11 / (64 * 4096))
    assert good.train_s == pytest.approx(good.steps * ranked.prediction.step_time_s)
    assert good.mtbf_s == pytest.approx(job_mtbf_s(LLAMA3_FAILURES_PER_GPU_HOUR, 16))
    assert good.gpu_hours == pytest.approx(good.chosen.wall_s / 3600 * 16)
    assert good.cost == pytest.approx(good.gpu_hours * 2.0)
    assert good.chosen.mode == "async" and good.other.mode == "sync"  # the executor saves asynchronously too
    walls = [a.prediction.goodput.chosen.wall_s for a in ranked.alternatives if a.prediction is not None]
    assert all(w >= good.chosen.wall_s for w in walls)
    assert all("time-to-train +" in a.reason for a in ranked.alternatives if a.prediction is not None)
    line = good.summary()
    for key in ("checkpoint_interval_s=", "checkpoint_blocking_s=", "mtbf_s=", "goodput=", "days=", "gpu_hours=",
                "cost="):
        assert key in line


def test_a_profile_s_measured_checkpoint_lines_price_the_plan_and_a_run_is_compared_with_them():
    from planner.contracts import RunReport
    from planner.contracts.report import CheckpointRecord
    from planner.cost.goodput import checkpoint_sizes, plan_goodput
    from planner.goodput import checkpoint_comparison

    plan, _, prof = _plan(steps=1000)
    measured = prof.model_copy(update={"checkpoint": MEASURED})
    good = plan_goodput(plan.model, plan.training, measured, plan.layout, 16, plan.prediction, TrainingGoal(steps=9),
                        "autopar")
    assert any("measured checkpoint lines (/tmp)" in n for n in good.notes), good.notes
    total, held = checkpoint_sizes(plan.model, plan.training, plan.layout, plan.prediction, True)
    tensors = state_tensors_per_rank(plan.model, plan.layout)
    sync = next(c for c in (good.chosen, good.other) if c.mode == "sync")
    written = written_bytes(plan.model, plan.layout, total, 16)  # the busiest rank's share
    assert sync.blocking_s == pytest.approx(0.05 + 0.002 * tensors + written / 1e9)
    asyn = next(c for c in (good.chosen, good.other) if c.mode == "async")
    assert asyn.blocking_s == pytest.approx(0.02 + 0.0005 * tensors + held / 4e9)  # the copy of what it holds
    # a run's saves beside it: the median of those after the first, the first apart
    saves = [CheckpointRecord(step=k, mode="sync", blocking_s=b, write_s=b, bytes_per_rank=10, tensors_per_rank=5)
             for k, b in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 1.5))]
    report = RunReport(layout=plan.layout, device="cpu", num_ranks=16, warmup_steps=0, median_step_time_s=1.0, steps=[],
                       tokens_per_s=1.0, peak_memory_bytes_per_rank=[1], checkpoints=saves)
    (row,) = checkpoint_comparison(report, good)
    assert (row["mode"], row["saves"], row["blocking_s"], row["first_blocking_s"]) == ("sync", 4, 1.5, 3.0)
    assert row["predicted_blocking_s"] == sync.blocking_s and row["predicted_write_s"] == sync.write_s
    assert checkpoint_comparison(report, None)[0]["predicted_blocking_s"] is None


def test_a_slow_restart_on_a_failing_cluster_lowers_the_goodput():
    _, calm, _ = _plan(steps=1000)
    _, rough, _ = _plan(steps=1000, failure_rate_per_gpu_hour=1e-3, restart_s=3600)
    assert rough.prediction.goodput.chosen.goodput < calm.prediction.goodput.chosen.goodput < 1


def test_autopar_plan_prints_the_goodput_line(tmp_path):
    from typer.testing import CliRunner

    from planner import cli

    result = CliRunner().invoke(cli.app, ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                                          "--global-batch", "64", "--tokens", "1e10", "--price-per-gpu-hour", "3",
                                          "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    assert "goodput: checkpoint_interval_s=" in result.output and "cost=" in result.output
    from planner.contracts import Plan

    stored = Plan.model_validate_json((tmp_path / "p.json").read_text())
    assert stored.goal is not None and stored.prediction.goodput is not None
    both = CliRunner().invoke(cli.app, ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                                        "--global-batch", "64", "--tokens", "1e10", "--steps", "5"])
    assert "--steps=5 is given with --tokens" in str(both.exception)  # the console script exits 2 with it


def test_the_api_ranks_by_time_to_train_when_given_a_goal(tmp_path):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    body = {"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 64},
            "cluster": "dgx-h100", "num_nodes": 1, "options": {"top_k": 2}, "goal": {"steps": 10000}}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path}/x.db"))) as c:
        out = c.post("/v1/plans", json=body).json()
        assert out["plan"]["goal"]["steps"] == 10000
        assert 0 < out["plan"]["prediction"]["goodput"]["chosen"]["goodput"] <= 1
        plain = c.post("/v1/plans", json={k: v for k, v in body.items() if k != "goal"}).json()
        assert plain["plan"]["prediction"].get("goodput") is None and plain["id"] != out["id"]
        bad = c.post("/v1/plans", json={**body, "goal": {"steps": 10, "restart_s": -5}})
        assert bad.status_code == 422 and "restart_s" in bad.text
        page = c.get(f"/plans/{out['id']}").text
        assert "Time to train" in page and "goodput" in page
