"""Calibration from a cluster's own runs (planner/run_calibration.py): the factors by hand, the cost model applying
them everywhere it prices (predict and the search's stage model alike), and, on runs recorded on this
machine (tests/data/cpu_runs, benchmarks/run_calibration.py --record), a lower error on runs it was not fitted on."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from planner.contracts import ClusterProfile, ParallelLayout, Plan, RunReport, TrainingConfig
from planner.contracts.cluster import RunCalibration, TermFactor
from planner.cost.predict import predict
from planner.errors import AutoparError
from planner.presets import get_preset
from planner.reference import reference_profile
from planner.run_calibration import CalibrationRun, calibrate, fit_factors, measured_terms, step_errors
from planner.search.stages import StageModel

RUNS = Path(__file__).parent / "data" / "cpu_runs"


def recorded() -> tuple[ClusterProfile, list[CalibrationRun]]:
    profile = ClusterProfile.model_validate_json((RUNS / "profile.json").read_text())
    runs = [CalibrationRun(f.name, Plan.model_validate_json((f / "plan.json").read_text()),
                           RunReport.model_validate_json((f / "report.json").read_text()))
            for f in sorted(RUNS.iterdir()) if (f / "report.json").is_file()]
    return profile, runs


def test_each_factor_is_the_least_squares_fit_of_its_runs_shrunk_toward_the_step() -> None:
    pairs = [({"gemm": 1.0, "tp": 2.0, "loss": 0.0}, {"gemm": 2.0, "tp": 1.0, "loss": 5.0}),
             ({"gemm": 1.0, "tp": 1.0}, {"gemm": 4.0, "tp": 100.0}),
             ({"gemm": 2.0}, {"gemm": 2.0})]
    f = fit_factors(pairs)
    prior = sorted([8.0 / 3.0, 104.0 / 2.0, 1.0])[1]  # the steps' measured / predicted: the median, 8/3
    # gemm: sum(m p) / sum(p^2) = (2 + 4 + 4) / (1 + 1 + 4) over 3 runs, against 3 runs' worth of the prior
    assert f["gemm"].factor == pytest.approx((10 / 6 * prior) ** 0.5)
    assert (f["gemm"].low, f["gemm"].high, f["gemm"].runs) == (1.0, 4.0, 3)
    assert f["tp"].high == 50.0  # 100x is clipped to 50 in the spread
    own = min((2 * 1 + 1 * 100) / (4 + 1), 50.0)  # least squares: 20.4, within the bounds
    assert f["tp"].factor == pytest.approx(own ** 0.4 * prior ** 0.6)
    assert "loss" not in f  # never predicted: no factor (1)
    assert "gemm" not in fit_factors(pairs, skip=("gemm",))


def test_measured_terms_scale_the_profiled_shares_to_the_median_step() -> None:
    report = RunReport.model_validate({
        "layout": {}, "device": "cpu", "num_ranks": 2, "warmup_steps": 0,
        "steps": [{"step": 0, "loss": 1.0, "time_s": 1.0}], "median_step_time_s": 1.0, "tokens_per_s": 1.0,
        "peak_memory_bytes_per_rank": [1, 1],
        "breakdown": [{"rank": 0, "step_s": 2.0, "terms": {"gemm": 1.5, "other": 0.5}},
                      {"rank": 1, "step_s": 2.0, "terms": {"gemm": 0.5, "other": 1.5}}]})
    m = measured_terms(report)
    assert m["gemm"] == pytest.approx(0.5) and m["other"] == pytest.approx(0.5) and m["tp"] == 0
    with pytest.raises(AutoparError, match="--profile-steps 1 or more"):
        measured_terms(report.model_copy(update={"breakdown": []}))


def _calibrated(profile: ClusterProfile, **factors: float) -> ClusterProfile:
    cal = RunCalibration(factors={t: TermFactor(factor=v, low=v, high=v, runs=1) for t, v in factors.items()},
                         runs=["hand"], fitted_median_error=0.0, uncalibrated_median_error=0.0)
    return profile.model_copy(update={"calibration": cal})


def test_the_cost_model_multiplies_each_term_by_its_factor() -> None:
    model, prof = get_preset("llama3.1-8b"), reference_profile("dgx-h100", 2)
    tr = TrainingConfig(seq_length=4096, global_batch_size=64)
    lay = ParallelLayout(tp=2, pp=2, dp_shard=4, zero_stage=3, micro_batch_size=1)
    base = predict(model, tr, prof, lay)
    cal = predict(model, tr, _calibrated(prof, gemm=2.0, attention=3.0, elementwise=0.5, loss=4.0, optimizer=5.0),
                  lay)
    for term, f in (("gemm", 2.0), ("attention", 3.0), ("elementwise", 0.5), ("loss", 4.0), ("optimizer", 5.0)):
        assert cal.terms[term] == pytest.approx(f * base.terms[term], rel=1e-9), term
    assert cal.step_time_s > base.step_time_s
    ones = predict(model, tr, _calibrated(prof, gemm=1.0), lay)
    assert ones.step_time_s == base.step_time_s  # a factor of 1 changes nothing


def test_the_search_s_stage_model_prices_a_calibrated_profile_as_predict_does() -> None:
    model, prof = get_preset("mixtral-8x7b"), reference_profile("dgx-h100", 4)
    prof = _calibrated(prof, gemm=1.7, tp=2.5, ep=3.0, pp=1.4, dp_grad=0.6, dp_param=2.2, optimizer=4.0, other=9.0)
    tr = TrainingConfig(global_batch_size=64, seq_length=4096)
    sm = StageModel(model, tr, prof, ParallelLayout(tp=2, pp=4, dp_shard=4, ep=4, zero_stage=3))
    rng = random.Random(3)
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, model.num_layers), 3))
        chunks = [b - a for a, b in zip([0, *cuts], [*cuts, model.num_layers])]
        step, _ = sm.evaluate(chunks, [("selective", 1)] * 4)
        assert step == pytest.approx(predict(model, tr, prof, sm.layout_for(chunks, [("selective", 1)] * 4))
                                     .step_time_s, rel=1e-12)


def test_calibrating_on_half_of_this_machine_s_runs_lowers_the_error_on_the_other_half() -> None:
    """The recorded runs (11 layouts of one model on 4 gloo ranks): fitted on a random half, the plans it never
    saw are predicted closer than before in the median over 20 such splits (86% -> 50% over 50 splits when
    recorded), and no split's fit goes unreported."""
    profile, runs = recorded()
    assert len(runs) >= 10
    rng = random.Random(0)
    before, after = [], []
    for _ in range(20):
        order = rng.sample(runs, len(runs))
        fit, held = order[:6], order[6:]
        calibrated = calibrate(profile, fit)
        assert calibrated.calibration.runs == [r.name for r in fit]
        before.append(sorted(step_errors(profile, held))[2])
        after.append(sorted(step_errors(calibrated, held))[2])
    assert sorted(after)[10] < 0.8 * sorted(before)[10], (before, after)
    # in sample it fits better than it predicts a run left out: both are reported
    cal = calibrate(profile, runs).calibration
    assert cal.fitted_median_error < cal.uncalibrated_median_error
    assert cal.held_out_median_error is not None and cal.held_out_median_error > cal.fitted_median_error
    assert profile.calibration is None  # the profile it came from is unchanged: a calibration is a new version


def test_a_term_seen_in_few_runs_is_shrunk_toward_the_step_s_overall_ratio() -> None:
    """One run shows TP 8x slower than predicted while the steps are 4x (the median of 4.5, 1 and 4): the TP
    factor moves a quarter of the way (in log space) from 4 to 8; the GEMM factor of three runs half of the way
    from 4 to its own least-squares fit, (1 + 1 + 4) / 3 = 2."""
    pairs = [({"gemm": 1.0, "tp": 1.0}, {"gemm": 1.0, "tp": 8.0}), ({"gemm": 1.0}, {"gemm": 1.0}),
             ({"gemm": 1.0}, {"gemm": 4.0})]
    f = fit_factors(pairs)
    prior = 4.0
    assert f["tp"].factor == pytest.approx(prior ** 0.75 * 8.0 ** 0.25)
    assert f["gemm"].factor == pytest.approx(prior ** 0.5 * 2.0 ** 0.5)
    assert (f["tp"].low, f["tp"].high, f["tp"].runs) == (8.0, 8.0, 1)


def test_a_calibrated_profile_uploads_and_its_page_says_how_far_to_trust_it(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    profile, runs = recorded()
    calibrated = calibrate(profile, runs[:4])
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 't.db'}"))) as c:
        r = c.post("/v1/profiles", json=calibrated.model_dump(mode="json"))
        assert r.status_code == 201, r.text
        stored = ClusterProfile.model_validate(c.get(f"/v1/profiles/{r.json()['id']}").json()["profile"])
        assert stored.calibration == calibrated.calibration
        page = c.get(f"/profiles/{r.json()['id']}").text
    assert "Calibrated from 4 run(s) on this cluster" in page and "with each run\nleft out of the fit" in page
    offset = calibrated.calibration.memory_offset_bytes
    assert offset and offset > 100 * 2**20 and "beyond the prediction" in page  # a CPU rank's runtime, ~160 MiB
    assert "per kernel it\nlaunches" not in page  # a CPU profile: no host model
    assert all(run.name in page for run in runs[:4])


def test_a_plan_on_a_calibrated_profile_says_how_far_to_trust_it() -> None:
    profile, runs = recorded()
    calibrated = calibrate(profile, runs[::2])
    plan = runs[1].plan
    p = predict(plan.model, plan.training, calibrated, plan.layout)
    cal = calibrated.calibration
    note = next(n for n in p.notes if n.startswith("profile calibrated from"))
    assert f"from {len(runs[::2])} run(s)" in note and f"±{cal.held_out_median_error:.0%}" in note
    assert not any(n.startswith("profile calibrated") for n in predict(plan.model, plan.training, profile,
                                                                          plan.layout).notes)


def test_the_service_calibrates_a_cluster_from_its_stored_runs(tmp_path: Path) -> None:
    """POST /v1/clusters/{name}/calibrate: the cluster's newest profile fitted to the stored runs of its plans
    becomes its next version; with fewer than two runs measured by term it answers 422 naming the fix."""
    from fastapi.testclient import TestClient

    from api import store
    from api.app import create_app
    from api.settings import Settings

    profile, runs = recorded()
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 't.db'}"))) as c:
        first = c.post("/v1/profiles", json=profile.model_dump(mode="json")).json()
        db = c.app.state.db
        for run in runs[:1]:
            plan = store.store_plan(db, profile_id=first["id"], request={}, request_hash=run.name, status="ok",
                                    model_name=run.plan.model.name, num_gpus=run.plan.num_gpus,
                                    step_time_s=run.plan.prediction.step_time_s,
                                    plan=run.plan.model_dump(mode="json"), explanation=None)
            r = c.post("/v1/runs", json={"plan_id": plan.id, "report": run.report.model_dump(mode="json")})
            assert r.status_code == 201, r.text
        few = c.post(f"/v1/clusters/{profile.name}/calibrate")
        assert few.status_code == 422 and "--profile-steps 2" in few.text, few.text
        for run in runs[1:6]:
            plan = store.store_plan(db, profile_id=first["id"], request={}, request_hash=run.name, status="ok",
                                    model_name=run.plan.model.name, num_gpus=run.plan.num_gpus,
                                    step_time_s=run.plan.prediction.step_time_s,
                                    plan=run.plan.model_dump(mode="json"), explanation=None)
            assert c.post("/v1/runs", json={"plan_id": plan.id,
                                            "report": run.report.model_dump(mode="json")}).status_code == 201
        r = c.post(f"/v1/clusters/{profile.name}/calibrate")
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["version"] == 2 and body["created"] is True
        cal = ClusterProfile.model_validate(body["profile"]).calibration
        assert cal is not None and len(cal.runs) == 6 and all(name.startswith("run ") for name in cal.runs)
        assert cal == calibrate(profile, runs[:6]).calibration.model_copy(update={"runs": cal.runs})
        assert c.post("/v1/clusters/nope/calibrate").status_code == 404


def test_autopar_calibrate_writes_the_profile_and_refuses_what_it_cannot_fit(tmp_path: Path) -> None:
    import json
    import os
    import shutil
    import subprocess
    import sys

    from typer.testing import CliRunner

    from planner.cli import app

    cli = CliRunner()
    out = tmp_path / "cal.json"
    r = cli.invoke(app, ["calibrate", str(RUNS / "profile.json"), str(RUNS / "dp4"), str(RUNS / "tp2dp2"),
                         str(RUNS / "pp2dp2"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "leave-one-run-out" in r.output and ClusterProfile.model_validate_json(out.read_text()).calibration
    bare = tmp_path / "bare"
    shutil.copytree(RUNS / "dp4", bare)
    report = json.loads((bare / "report.json").read_text())
    (bare / "report.json").write_text(json.dumps({**report, "breakdown": []}))
    # error paths through the console entry point: a one-line error and exit 2
    entry = [sys.executable, "-c", "from planner.cli import main; main()", "calibrate"]
    r = subprocess.run([*entry, str(RUNS / "profile.json"), str(bare), "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True, check=False, env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 2 and f"runs[{bare}].report.breakdown=[]" in r.stderr and "--profile-steps" in r.stderr
    assert "Traceback" not in r.stderr
    other = Path(__file__).parents[1] / "planner" / "data" / "measured" / "nvidia-h200-1x1.json"
    r = subprocess.run([*entry, str(other), str(RUNS / "dp4"), "--out", str(tmp_path / "y.json")],
                       capture_output=True, text=True, check=False, env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 2 and "is not the profile's cluster 'nvidia-h200-1x1'" in r.stderr, r.stderr


def test_a_run_without_a_breakdown_says_so_on_its_page(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api import store
    from api.app import create_app
    from api.settings import Settings

    profile, runs = recorded()
    run = runs[0]
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 't.db'}"))) as c:
        pid = c.post("/v1/profiles", json=profile.model_dump(mode="json")).json()["id"]
        plan = store.store_plan(c.app.state.db, profile_id=pid, request={}, request_hash="x", status="ok",
                                model_name=run.plan.model.name, num_gpus=run.plan.num_gpus, step_time_s=1.0,
                                plan=run.plan.model_dump(mode="json"), explanation=None)
        bare = run.report.model_copy(update={"breakdown": []}).model_dump(mode="json")
        posted = c.post("/v1/runs", json={"plan_id": plan.id, "report": bare}).json()
        page = c.get(f"/runs/{posted['id']}").text
    assert "Where the step goes" in page and "this run was not measured by term" in page
    assert "mean over 0 rank(s)" not in page


def test_a_run_s_checkpoints_refit_the_profile_s_checkpoint_lines() -> None:
    """The profiler's lines say 0.1 s + 1 ms a tensor + 1 GB/s; runs whose saves took twice that move the lines
    toward them (sync, async blocking at the bytes held, async write), keeping the profiler's points, and a
    second calibration replaces the first's run points instead of piling them up."""
    from planner.contracts import CheckpointCost, CheckpointPoint
    from planner.contracts.report import CheckpointRecord
    from planner.cost.goodput import fit_checkpoint_cost, line_time_s

    profile, runs = recorded()

    def t(b: float, n: int) -> float:
        return 0.1 + 0.001 * n + b / 1e9

    grid = [(b, n) for b in (4e6, 1.3e8) for n in (16, 64)]
    mine = [CheckpointPoint(mode=m, bytes=int(b), tensors=n, blocking_s=t(b, n), write_s=2 * t(b, n))
            for b, n in grid for m in ("sync", "async")]
    profile = profile.model_copy(update={"checkpoint": fit_checkpoint_cost(mine, 4, "/tmp")})
    run = runs[0]
    held, tensors = 40_000_000, 39
    slow = [CheckpointRecord(step=k, mode=m, blocking_s=2 * t(held, tensors), write_s=4 * t(held, tensors),
                             bytes_per_rank=held, tensors_per_rank=tensors)
            for m in ("sync", "async") for k in range(1, 6)]
    taught = CalibrationRun(run.name, run.plan, run.report.model_copy(update={"checkpoints": slow}))
    done = calibrate(profile, [taught, *runs[1:3]])
    ck: CheckpointCost = done.checkpoint
    assert len([p for p in ck.points if p.run == run.name]) == 8  # 4 saves after the first, per mode
    assert len([p for p in ck.points if p.run is None]) == len(mine)
    before, after = profile.checkpoint, ck
    for line in ("sync", "async_write"):
        written = next(p.bytes for p in ck.points if p.run)
        assert line_time_s(getattr(after, line), written, tensors) > 1.2 * line_time_s(getattr(before, line), written,
                                                                                       tensors), line
    assert line_time_s(after.async_blocking, held, tensors) > 1.2 * line_time_s(before.async_blocking, held, tensors)
    again = calibrate(done, [taught])
    assert len([p for p in again.checkpoint.points if p.run]) == 8
    # runs that saved nothing leave the lines as they were; reports from before tensors were recorded give no points
    assert calibrate(profile, runs[1:3]).checkpoint == profile.checkpoint
    old = [r.model_copy(update={"tensors_per_rank": None}) for r in slow]
    assert calibrate(profile, [CalibrationRun(run.name, run.plan, run.report.model_copy(
        update={"checkpoints": old}))]).checkpoint == profile.checkpoint
