"""Fallback plans for lost nodes (planner/fallback.py): planned with the plan, run after a loss from the checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
from run_plans import SPEC, TRAINING, reference_losses  # noqa: E402

from planner.contracts import RunReport, TrainingConfig  # noqa: E402
from planner.errors import AutoparError  # noqa: E402
from planner.fallback import fallback_plan, fallback_plans  # noqa: E402
from planner.presets import get_preset  # noqa: E402
from planner.reference import reference_profile  # noqa: E402
from planner.search import SearchOptions, search  # noqa: E402


def test_each_lost_node_count_gets_the_fastest_plan_on_the_nodes_left_for_the_same_batch():
    model, prof = get_preset("llama3-8b"), reference_profile("dgx-h100", 4)
    tr = TrainingConfig(seq_length=4096, global_batch_size=96)
    opts = SearchOptions(top_k=2, time_budget_s=10)
    plan = search(model, tr, prof, opts)
    found = fallback_plans(plan, prof, 3, opts)
    assert [f.lost_nodes for f in found] == [1, 2, 3] and [f.num_gpus for f in found] == [24, 16, 8]
    for f in found:
        assert f.layout is not None and f.layout.num_gpus == f.num_gpus, f.reason
        assert f.prediction.tokens_per_s == pytest.approx(tr.tokens_per_step / f.prediction.step_time_s)
        assert f.slower_by > 0  # fewer GPUs, the same batch: slower steps
    assert fallback_plans(plan, prof.with_nodes(1), 2, opts) == []  # no node would be left


def test_a_model_the_nodes_left_cannot_hold_is_said_and_running_it_is_refused():
    model, prof = get_preset("llama3-70b"), reference_profile("hgx-h200", 2)
    tr = TrainingConfig(seq_length=4096, global_batch_size=16)
    opts = SearchOptions(top_k=1, time_budget_s=10, offload=False)
    plan = search(model, tr, prof, opts)  # 70B on 16 H200 without offload: fits
    (lost,) = fallback_plans(plan, prof, 1, opts)
    assert lost.layout is None and "8 x H200" in lost.reason and "fits" in lost.reason  # on 8 it does not
    with pytest.raises(AutoparError, match=r"--fallback=1 has no layout"):
        fallback_plan(plan.model_copy(update={"fallbacks": [lost]}), 1)
    with pytest.raises(AutoparError, match=r"--fallback=2 has no fallback plan.*--fallbacks 2"):
        fallback_plan(plan.model_copy(update={"fallbacks": [lost]}), 2)


@pytest.mark.slow
def test_a_run_that_loses_a_node_resumes_on_the_node_left_with_its_fallback(tmp_path):
    """4 CPU ranks as 2 nodes of 2 train 2 steps with a checkpoint; one node is "lost"; the fallback plan for
    it resumes on 2 ranks from the checkpoint and continues the single-process loss curve."""
    from test_executor_run import autopar_run

    prof = reference_profile("dgx-a100-80gb", 2).model_copy(update={"gpus_per_node": 2, "name": "cpu-2x2"})
    opts = SearchOptions(top_k=1, time_budget_s=10)
    plan = search(SPEC, TRAINING, prof, opts)
    plan = plan.model_copy(update={"fallbacks": fallback_plans(plan, prof, 1, opts)})
    assert plan.num_gpus == 4 and plan.fallbacks[0].num_gpus == 2
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    ckpt = tmp_path / "ckpt"
    first = autopar_run(str(tmp_path / "plan.json"), "--steps", "2", "--checkpoint-dir", str(ckpt),
                        "--checkpoint-every", "2", "--profile-steps", "0", "--out", str(tmp_path / "a.json"))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    then = autopar_run(str(tmp_path / "plan.json"), "--fallback", "1", "--steps", "4", "--checkpoint-dir", str(ckpt),
                       "--resume", "--profile-steps", "0", "--out", str(tmp_path / "b.json"))
    assert then.returncode == 0, then.stdout[-2000:] + then.stderr[-3000:]
    report = RunReport.model_validate_json((tmp_path / "b.json").read_text())
    assert report.num_ranks == 2 and report.layout == plan.fallbacks[0].layout
    want = reference_losses(4)[0]
    assert [s.loss for s in report.steps] == pytest.approx(want, rel=1e-5)


def test_the_cli_the_api_and_the_page_carry_the_fallbacks(tmp_path):
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from api.app import create_app
    from api.settings import Settings
    from planner import cli

    result = CliRunner().invoke(cli.app, ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                                          "--global-batch", "64", "--fallbacks", "1"])
    assert result.exit_code == 0, result.output
    assert "fallback for 1 lost node(s), 8 GPUs: tp" in result.output
    body = {"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 64},
            "cluster": "dgx-h100", "num_nodes": 2, "options": {"top_k": 1}, "fallbacks": 1}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path}/x.db"))) as c:
        out = c.post("/v1/plans", json=body).json()
        (f,) = out["plan"]["fallbacks"]
        assert f["lost_nodes"] == 1 and f["num_gpus"] == 8 and f["layout"]["tp"] * f["layout"]["pp"] <= 8
        assert "If nodes fail" in c.get(f"/plans/{out['id']}").text
        assert c.post("/v1/plans", json={**body, "fallbacks": 99}).status_code == 422
