"""Time-to-train terms (planner/cost/goodput.py) against hand calculations, and the ranking by them."""

from __future__ import annotations

import math

import pytest

from planner.contracts import TrainingConfig, TrainingGoal
from planner.contracts.goodput import LLAMA3_FAILURES_PER_GPU_HOUR
from planner.cost.goodput import (
    checkpoint_bytes_per_param,
    choose_checkpoint,
    daly_interval_s,
    expected_wall_s,
    job_mtbf_s,
    steps_to_train,
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


def test_async_blocks_for_the_copy_only_and_waits_for_the_write():
    m, r = 10_000.0, 600.0
    sync = choose_checkpoint("sync", 0.5, 20.0, 1e6, r, m)
    asyn = choose_checkpoint("async", 0.5, 20.0, 1e6, r, m)
    assert sync.blocking_s == 20.5 and asyn.blocking_s == 0.5
    assert sync.interval_s == pytest.approx(daly_interval_s(20.5, m))
    assert asyn.interval_s == pytest.approx(max(daly_interval_s(0.5, m), 20.0))
    assert asyn.wall_s == pytest.approx(expected_wall_s(1e6, asyn.interval_s, 0.5, r + 20.0, m))
    assert asyn.goodput > sync.goodput
    slow_write = choose_checkpoint("async", 0.5, 5_000.0, 1e6, r, m)
    assert slow_write.interval_s == 5_000.0  # the next checkpoint waits for the write


def test_the_copy_of_cpu_ranks_runs_through_host_memory():
    from planner.cost.goodput import checkpoint_times
    from planner.reference import reference_profile

    gpu = reference_profile("dgx-h100", 2)
    cpu = gpu.model_copy(update={"links": [x for x in gpu.links if x.level.value != "host_device"]})
    copy, write = checkpoint_times(cpu, 4e9, 64e9, 2, 1.0)
    assert copy == pytest.approx(4e9 / cpu.assumptions.cpu_optimizer_bytes_per_s) and write == pytest.approx(32.0)
    assert checkpoint_times(gpu, 4e9, 64e9, 2, 1.0)[1] == write


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
