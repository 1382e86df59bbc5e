"""``autopar tune`` (planner/tune.py): which layouts it runs, how it splits and judges them, and the loop end to
end on this machine (4 CPU ranks, marked slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cpu_bench import SPEC, TRAINING  # the CPU benchmarks' model, which tests/data/cpu_runs ran
from planner.contracts import ClusterProfile, ParallelLayout, Recompute, TrainingConfig
from planner.contracts.tune import TuneReport
from planner.errors import AutoparError
from planner.run_calibration import CalibrationRun
from planner.tune import RunFailed, TuneSettings, candidates, choose, features, summarise
from tests.test_run_calibration import RUNS, recorded

ROOT = Path(__file__).resolve().parents[1]


def _profile() -> ClusterProfile:
    return ClusterProfile.model_validate_json((RUNS / "profile.json").read_text())


def test_choose_keeps_the_first_and_adds_the_layout_that_varies_most() -> None:
    from planner.cost.predict import predict

    prof = _profile()
    lays = [ParallelLayout(dp_shard=4, zero_stage=1, micro_batch_size=4),
            ParallelLayout(dp_shard=4, zero_stage=1, micro_batch_size=2),  # one feature new (mb)
            ParallelLayout(dp_shard=2, tp=2, zero_stage=2, micro_batch_size=2, recompute=Recompute.full),  # four
            ParallelLayout(dp_shard=4, zero_stage=1, micro_batch_size=4, recompute=Recompute.full)]  # one
    pool = [(lay, predict(SPEC, TRAINING, prof, lay)) for lay in lays]
    got = [lay for lay, _ in choose(pool, 3)]
    assert got[0] == lays[0] and got[1] == lays[2]
    # then mb=2 and recompute=full are both seen: the faster of the two one-feature layouts is taken
    rest = min(pool[1], pool[3], key=lambda c: c[1].step_time_s)[0]
    assert got[2] == rest
    assert len(choose(pool, 10)) == 4


def test_candidates_fit_run_on_the_target_and_differ_in_every_feature() -> None:
    pool = candidates(SPEC, TRAINING, _profile(), TuneSettings())
    assert len(pool) > 50
    assert all(p.memory.fits for _, p in pool)
    chosen = [lay for lay, _ in choose(pool, 10)]
    for i in range(5):  # structure, schedule, ZeRO, recompute and micro-batch each take several values
        assert len({features(lay)[i] for lay in chosen}) >= 2, i
    assert any(lay.tp > 1 for lay in chosen) and any(lay.pp > 1 for lay in chosen)


def test_settings_refuse_what_cannot_be_split_or_timed() -> None:
    with pytest.raises(AutoparError, match="plans"):
        TuneSettings(plans=1)
    with pytest.raises(AutoparError, match="leaves no step to time"):
        TuneSettings(steps=5, warmup=3, profile_steps=2)
    with pytest.raises(AutoparError, match="target='jax'"):
        TuneSettings(target="jax")
    with pytest.raises(AutoparError, match="run_timeout_s=1 is out of bounds; give 10 to 86400"):
        TuneSettings(run_timeout_s=1)


def test_autopar_tune_names_its_flags_in_errors(tmp_path: Path) -> None:
    spec = tmp_path / "model.json"
    spec.write_text(SPEC.model_dump_json())
    r = subprocess.run([sys.executable, "-m", "executor", "tune", "--model-file", str(spec), "--profile",
                        str(RUNS / "profile.json"), "--global-batch", "16", "--seq", "64", "--steps", "5",
                        "--out-dir", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--steps=5 leaves no step to time" in r.stderr, r.stderr[-500:]
    assert not (tmp_path / "out").exists()  # refused before anything ran or was written


def test_summary_judges_the_held_out_half_on_the_calibration_half_only() -> None:
    """Recorded runs (tests/data/cpu_runs): every other run calibrates; a held-out run's calibrated prediction
    moves toward its measurement, and changing a held-out run's measurement changes no factor."""
    profile, runs = recorded()
    failed = ("zz", runs[0].plan, "exit status 1: out of memory")
    report, final = summarise(profile, [*runs, failed])
    assert report.count("calibration") == 6 and report.count("held_out") == 5 and report.count("failed") == 1
    assert report.runs[-1].error == "exit status 1: out of memory"
    assert report.median_abs_err_after < report.median_abs_err_before
    assert final.calibration is not None and len(final.calibration.runs) == 11
    held = [r for r in runs[1::2]]
    slower = held[0].report.model_copy(update={"median_step_time_s": held[0].report.median_step_time_s * 3})
    moved = [CalibrationRun(r.name, r.plan, slower) if r is held[0] else r for r in runs]
    again, _ = summarise(profile, moved)
    assert [r.calibrated_step_s for r in again.runs if r.role == "held_out"] == \
        [r.calibrated_step_s for r in report.runs if r.role == "held_out"]
    changed = next(r for r in again.runs if r.name == held[0].name)
    assert changed.measured_step_s == pytest.approx(3 * held[0].report.median_step_time_s)
    line = report.line()
    assert line.startswith("tune: plans=11 calibrated_on=6 held_out=5 median_abs_err_before=")
    assert "spearman=" in line and "regret=" in line


def test_a_runner_that_fails_is_kept_with_why(tmp_path: Path) -> None:
    from planner.tune import plan_for, run_layouts

    def runner(plan: Path, report: Path, log: Path) -> None:
        raise RunFailed("exit status 2: error: this host has 2 cores")

    plan = plan_for(SPEC, TRAINING, ParallelLayout(dp_shard=4), _profile())
    got = run_layouts([plan], tmp_path, runner, lambda *a: None)
    assert got == [("00", plan, "exit status 2: error: this host has 2 cores")]
    assert (tmp_path / "00" / "plan.json").is_file()


@pytest.mark.slow
def test_tune_runs_calibrates_and_replans_end_to_end(tmp_path: Path) -> None:
    spec = tmp_path / "model.json"
    spec.write_text(SPEC.model_dump_json())
    cmd = [sys.executable, "-m", "executor", "tune", "--model-file", str(spec), "--profile",
           str(RUNS / "profile.json"), "--global-batch", "16", "--seq", "64", "--precision", "fp32", "--plans", "4",
           "--steps", "6", "--warmup", "2", "--out-dir", str(tmp_path / "out")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].startswith("tune: plans=4 calibrated_on=2 held_out=2")
    report = TuneReport.model_validate_json((tmp_path / "out" / "tune.json").read_text())
    assert all(x.measured_step_s and x.role != "failed" for x in report.runs)
    calibrated = ClusterProfile.model_validate_json((tmp_path / "out" / "profile.calibrated.json").read_text())
    assert calibrated.calibration is not None and len(calibrated.calibration.runs) == 4
    assert report.replanned is not None and json.loads((tmp_path / "out" / "plan.json").read_text())["layout"]
    for i in range(4):
        assert (tmp_path / "out" / f"{i:02d}" / "report.json").is_file()


GPU_RUNS = Path(__file__).parent / "data" / "gpu_runs"  # benchmarks/tune.py --gpu on one H200, 2026-11-27


def _gpu_runs(folder: str) -> list[CalibrationRun]:
    from planner.contracts import Plan, RunReport

    return [CalibrationRun(f.name, Plan.model_validate_json((f / "plan.json").read_text()),
                           RunReport.model_validate_json((f / "report.json").read_text()))
            for f in sorted((GPU_RUNS / folder).iterdir()) if (f / "report.json").is_file()]


def test_recorded_gpu_runs_calibrate_the_held_out_half_and_a_model_never_fitted_on() -> None:
    """Nine plans of a 0.5B model on one H200 (micro-batch 1..8, each recompute kind): calibrated on every other
    run, the held-out four fall from 31% to within 10%; a 0.3B model's four runs, predicted with the 0.5B model's
    calibration, fall from 31% to within 25% (issue 25's GPU targets). The profile states a host that keeps
    ahead, as the runs were priced when they were made: the executor's default host time per kernel
    (planner.targets.autopar.EXECUTOR_HOST_S_PER_KERNEL) was fitted on these runs, and with it the uncalibrated
    error is 6% (in sample; last assertion)."""
    from planner.cost.layer import without_host
    from planner.run_calibration import predicted

    recorded = ClusterProfile.model_validate_json((GPU_RUNS / "h200-a" / "profile.json").read_text())
    base = without_host(recorded)
    report, calibrated = summarise(base, _gpu_runs("h200-a"))
    assert report.median_abs_err_before > 0.25 and report.median_abs_err_after <= 0.10
    assert report.spearman >= 0.9 and report.regret <= 0.05 and report.memory_median_abs_err <= 0.15
    host = calibrated.calibration.host_s_per_kernel
    assert host is not None and 5e-5 < host < 5e-4  # the executor's eager host time per launched kernel
    assert "other" not in calibrated.calibration.factors  # on a GPU the idle time is the host's, not a factor
    second = _gpu_runs("h200-b")
    err = [[abs(predicted(r, p)[0] / r.report.median_step_time_s - 1) for r in second] for p in (base, calibrated)]
    import statistics

    assert statistics.median(err[0]) > 0.25 and statistics.median(err[1]) <= 0.25
    assert summarise(recorded, _gpu_runs("h200-a"))[0].median_abs_err_before < 0.10


def test_a_host_bound_run_sets_the_host_time_per_kernel_and_a_device_bound_one_does_not() -> None:
    from planner.run_calibration import fit_host

    k = 3e-6  # kernel_overhead_s: predicted other / k = kernels per step
    host_bound = ({"gemm": 0.05, "other": 1000 * k}, {"gemm": 0.04, "other": 0.06})  # idle 60%: 0.1 s / 1000
    device_bound = ({"gemm": 0.05, "other": 100 * k}, {"gemm": 0.09, "other": 0.001})  # idle 1%: says nothing
    assert fit_host([host_bound, device_bound], k) == pytest.approx(0.1 / 1000)
    assert fit_host([device_bound], k) is None
    assert fit_host([host_bound], 0.0) is None
    cpu = _profile()
    from planner.run_calibration import fit

    assert fit([host_bound, device_bound], cpu)[1] is None  # host and device are one on a CPU


def test_a_gpu_calibrated_profile_page_states_the_host_time_per_kernel(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    base = ClusterProfile.model_validate_json((GPU_RUNS / "h200-a" / "profile.json").read_text())
    _, calibrated = summarise(base, _gpu_runs("h200-a"))
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 't.db'}", load_reference=False))) as c:
        r = c.post("/v1/profiles", json=calibrated.model_dump(mode="json"))
        assert r.status_code == 201, r.text
        page = c.get(f"/profiles/{r.json()['id']}").text
        c.app.state.db.dispose()
    us = calibrated.calibration.host_s_per_kernel * 1e6
    assert f"The host takes {us:.0f} µs per kernel it" in page


def test_a_plan_on_a_calibrated_profile_takes_its_interval_from_the_cluster_s_own_runs() -> None:
    """Issue 25 part 4: the interval of a prediction on a profile calibrated from nine H200 runs comes from those
    runs' leave-one-run-out residuals, not from published runs, and the note says how far to trust it."""
    import math

    from planner.cost.predict import predict

    base = ClusterProfile.model_validate_json((GPU_RUNS / "h200-a" / "profile.json").read_text())
    runs = _gpu_runs("h200-a")
    _, calibrated = summarise(base, runs)
    res = calibrated.calibration.held_out_residuals
    assert len(res) == len(runs) and all(abs(x) < 1 for x in res)
    run = runs[0]
    p = predict(run.plan.model, run.plan.training, calibrated, run.plan.layout)
    r = sorted(res)  # nine residuals: the 10th percentile lies 0.8 of the way from the first to the second
    q10, q90 = r[0] + 0.8 * (r[1] - r[0]), r[7] + 0.2 * (r[8] - r[7])  # (n - 1) x 0.1 = 0.8, x 0.9 = 7.2
    assert p.interval.regime.startswith("this cluster's 9 runs") and p.interval.rows == 9
    assert p.interval.low_s == pytest.approx(p.step_time_s * math.exp(-q90))
    assert p.interval.high_s == pytest.approx(p.step_time_s * math.exp(-q10))
    assert any("calibrated from 9 run(s) on this cluster" in n and "expected error ±" in n for n in p.notes)
    uncalibrated = predict(run.plan.model, run.plan.training, base, run.plan.layout)
    assert uncalibrated.interval is None or not uncalibrated.interval.regime.startswith("this cluster")


def test_a_calibrated_memory_offset_moves_predict_and_the_search_s_capacity_alike() -> None:
    """The offset a calibration fitted (RunCalibration.memory_offset_bytes) is in every peak predict reports (term
    'calibration') and in what the search lets a plan fill: the uncalibrated best plan (69 GiB) no longer fits
    with 20 GiB more, and the search picks another that does."""
    from planner.contracts.cluster import RunCalibration
    from planner.cost.predict import predict
    from planner.presets import get_preset
    from planner.reference import reference_profile
    from planner.search import search
    from planner.search.options import SearchOptions

    model, tr = get_preset("llama3-8b"), TrainingConfig(seq_length=4096, global_batch_size=64)
    base = reference_profile("dgx-h100", 1)
    first = search(model, tr, base, SearchOptions(top_k=1))
    offset = 20 * 2**30  # 20 GiB the runs held beyond the prediction
    cal = RunCalibration(factors={}, runs=["a", "b"], fitted_median_error=0.0, uncalibrated_median_error=0.0,
                         memory_offset_bytes=offset)
    calibrated = base.model_copy(update={"calibration": cal})
    before, after = predict(model, tr, base, first.layout), predict(model, tr, calibrated, first.layout)
    assert after.memory.total_bytes - before.memory.total_bytes == pytest.approx(offset, abs=2)
    assert after.memory.terms["calibration"] == offset
    assert after.memory.allocated_bytes - before.memory.allocated_bytes == pytest.approx(offset, abs=2)
    plan = search(model, tr, calibrated, SearchOptions(top_k=1))
    assert plan.prediction.memory.fits and plan.prediction.memory.terms["calibration"] == offset
    assert not after.memory.fits and plan.layout != first.layout  # 69 GiB + 20 > 76: another plan, that fits


def test_a_pass_waits_for_a_slower_host_by_hand() -> None:
    """PassCost.calibrated with host_s_per_kernel h: a pass of k kernels whose device time d is below k h
    lasts k h (its launches' overhead grows by k h - d); a pass whose device is slower is unchanged."""
    from planner.contracts.cluster import RunCalibration
    from planner.cost.layer import PassCost
    from planner.reference import reference_profile

    prof = reference_profile("dgx-h100", 1)
    prof = prof.model_copy(update={"calibration": RunCalibration(
        factors={}, runs=["a", "b"], fitted_median_error=0.0, uncalibrated_median_error=0.0, host_s_per_kernel=1e-4)})
    fast = PassCost(gemm_s=2e-3)
    fast.launch(50, prof)  # host 5 ms for 50 kernels, device 2 ms + 50 launches
    device = fast.compute_s
    assert fast.calibrated(prof).compute_s == pytest.approx(5e-3)
    assert fast.overhead_s == pytest.approx(50 * prof.assumptions.kernel_overhead_s + 5e-3 - device)
    slow = PassCost(gemm_s=9e-3)
    slow.launch(50, prof)
    device = slow.compute_s
    assert slow.calibrated(prof).compute_s == pytest.approx(device)
