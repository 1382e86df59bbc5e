"""Tune jobs of the service (``POST /v1/tune``, api/routes/tune.py): bad requests named by field, writes guarded,
one job at a time, progress readable while it runs, a job whose runs all fail ends failed with each run's reason,
jobs a stopped service left behind end failed; and (slow) a real job on this host's CPU ranks that stores its
runs, the calibrated profile and the re-planned plan."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api import store
from api.app import create_app
from api.routes import tune as tune_route
from api.settings import Settings
from benchmarks import cpu_bench
from planner.tune import RunFailed

ROOT = Path(__file__).resolve().parents[1]
CPU_PROFILE = json.loads((ROOT / "tests/data/cpu_runs/profile.json").read_text())
SPEC = cpu_bench.SPEC.model_dump(mode="json", exclude_defaults=True)  # the CPU benchmarks' model, as a JSON body
TRAINING = cpu_bench.TRAINING.model_dump(mode="json", exclude_defaults=True)
SETTINGS = {"plans": 2, "steps": 6, "warmup": 2, "profile_steps": 2, "time_budget_s": 5.0}


def tune_body(**changes: object) -> dict:
    return {"model": {"spec": SPEC}, "training": TRAINING, "cluster": CPU_PROFILE["name"],
            "settings": dict(SETTINGS), **changes}


@pytest.fixture
def client(database_url: str, tmp_path: Path):  # noqa: ANN201
    settings = Settings(database_url=database_url, load_reference=False, tune_dir=str(tmp_path / "tune"))
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/profiles", json=CPU_PROFILE).status_code == 201
        yield c
        c.app.state.db.dispose()


def wait_for(client: TestClient, job_id: int, states: tuple[str, ...] = ("done", "failed"),
             timeout_s: float = 120) -> dict:
    """The job once its state is one of ``states``; fails after ``timeout_s`` with the job as it was."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"/v1/tune/{job_id}").json()
        if job["state"] in states:
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']} after {timeout_s} s: {job}"
        time.sleep(0.2)


def failing_runner(gate: threading.Event | None = None):  # noqa: ANN201
    """A runner factory whose runs cannot start: each waits for ``gate`` (when given), then raises RunFailed."""
    def factory(_settings):  # noqa: ANN001, ANN202
        def run(plan_file: Path, report_file: Path, log_file: Path) -> None:
            if gate is not None:
                assert gate.wait(60)
            log_file.write_text("torchrun: not here\n")
            raise RunFailed(f"exit status 1: torchrun could not start for {plan_file.parent.name}")
        return run
    return factory


# -- requests --------------------------------------------------------------------------------------

def _loc(r) -> list:  # noqa: ANN001
    return [item["loc"] for item in r.json()["detail"]]


@pytest.mark.parametrize("body, loc, words", [
    (tune_body(settings={**SETTINGS, "plans": 1}), ["body", "settings", "plans"], "greater than or equal to 2"),
    (tune_body(settings={**SETTINGS, "plans": 65}), ["body", "settings", "plans"], "less than or equal to 64"),
    (tune_body(settings={**SETTINGS, "plans": "4"}), ["body", "settings", "plans"], "valid integer"),
    (tune_body(settings={**SETTINGS, "steps": True}), ["body", "settings", "steps"], "valid integer"),
    (tune_body(settings={**SETTINGS, "speed": 2}), ["body", "settings", "speed"], "Extra inputs"),
    (tune_body(bogus=1), ["body", "bogus"], "Extra inputs"),
    (tune_body(profile_id=1), ["body"], "exactly one of profile_id or cluster"),
    ({k: v for k, v in tune_body().items() if k != "cluster"}, ["body"], "exactly one of profile_id or cluster"),
    (tune_body(num_nodes=1, gpus=4), ["body"], "at most one of num_nodes or gpus"),
    (tune_body(settings={**SETTINGS, "steps": 4}), ["body", "settings", "steps"], "leaves no step to time"),
    (tune_body(settings={**SETTINGS, "time_budget_s": 61.0}), ["body", "settings", "time_budget_s"],
     "AUTOPAR_PLAN_BUDGET_S"),
    (tune_body(cluster="nowhere"), ["body", "cluster"], "is not stored"),
    (tune_body(gpus=2), ["body", "gpus"], "cannot change a measured profile"),
    (tune_body(num_nodes=2), ["body", "num_nodes"], "cannot change a measured profile"),
])
def test_bad_tune_requests_name_the_field(client: TestClient, body: dict, loc: list, words: str) -> None:
    r = client.post("/v1/tune", json=body)
    assert r.status_code == 422, r.text
    assert loc in _loc(r), r.text
    assert words in r.text
    assert client.get("/v1/tune").json()["total"] == 0  # nothing was started


def test_writes_need_a_token_when_the_server_has_tokens(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}", tokens=("tok",), load_reference=False)
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/tune", json=tune_body()).status_code == 401
        assert c.post("/v1/tune", json=tune_body(), headers={"Authorization": "Bearer nope"}).status_code == 403
        assert c.get("/v1/tune").json() == {"items": [], "total": 0, "limit": 50, "offset": 0}  # reads are open
        # the token lets the request through to validation (the cluster is not stored here)
        r = c.post("/v1/tune", json=tune_body(), headers={"Authorization": "Bearer tok"})
        assert r.status_code == 422 and ["body", "cluster"] in _loc(r)
        c.app.state.db.dispose()


def test_unknown_jobs_are_404(client: TestClient) -> None:
    assert client.get("/v1/tune/999").status_code == 404
    assert client.get("/tune/999").status_code == 404 and "tune job" in client.get("/tune/999").text
    assert client.get("/tune/abc").status_code == 404


# -- jobs ------------------------------------------------------------------------------------------

def test_one_job_at_a_time_and_its_progress_is_readable_while_it_runs(client: TestClient,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    monkeypatch.setattr(tune_route, "make_runner", failing_runner(gate))
    first = client.post("/v1/tune", json=tune_body())
    assert first.status_code == 202, first.text
    job = first.json()
    assert job["state"] in ("queued", "running") and job["links"] == {"self": f"/v1/tune/{job['id']}",
                                                                       "page": f"/tune/{job['id']}"}
    try:
        running = wait_for(client, job["id"], ("running",))
        deadline = time.monotonic() + 60
        while running["phase"] != "run":  # the search and the candidates come first
            assert time.monotonic() < deadline, running
            time.sleep(0.2)
            running = client.get(f"/v1/tune/{job['id']}").json()
        assert running["total"] == 2 and running["done"] == 0 and running["message"].startswith("layout 00: ")
        assert running["workdir"].startswith(str(client.app.state.settings.tune_dir))
        assert any("searching the best layout" in line for line in running["log"])
        second = client.post("/v1/tune", json=tune_body())
        assert second.status_code == 409
        assert f"tune job {job['id']} is running" in second.json()["detail"]
        assert f"GET /v1/tune/{job['id']}" in second.json()["detail"]
        page = client.get(f"/tune/{job['id']}")
        assert page.status_code == 200 and page.headers["Refresh"] == "2"
        assert '<meta http-equiv="refresh" content="2">' in page.text and '<progress value="0" max="2">' in page.text
        assert "layout 00: " in page.text
    finally:
        gate.set()
    done = wait_for(client, job["id"])
    assert done["state"] == "failed"
    listed = client.get("/v1/tune").json()
    assert listed["total"] == 1 and listed["items"][0]["id"] == job["id"]
    assert client.get("/v1/tune", params={"state": "running"}).json()["total"] == 0
    again = client.post("/v1/tune", json=tune_body())  # the slot is free once the job ended
    assert again.status_code == 202
    wait_for(client, again.json()["id"])


def test_a_job_whose_runs_all_fail_ends_failed_with_each_runs_reason(client: TestClient,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tune_route, "make_runner", failing_runner())
    job = wait_for(client, client.post("/v1/tune", json=tune_body()).json()["id"])
    assert job["state"] == "failed"
    assert job["error"].startswith("runs=0 of 2 measured a breakdown by term: too few to calibrate on")
    runs = job["result"]["runs"]
    assert [r["name"] for r in runs] == ["00", "01"] and all(r["role"] == "failed" for r in runs)
    assert [r["error"] for r in runs] == [f"exit status 1: torchrun could not start for {n}" for n in ("00", "01")]
    assert job["runs"] == [] and job["calibrated_profile_id"] is None and job["replanned_plan_id"] is None
    assert client.get("/v1/runs").json()["total"] == 0
    assert client.get(f"/v1/clusters/{CPU_PROFILE['name']}/profiles").json()["total"] == 1  # no new version
    page = client.get(f"/tune/{job['id']}").text
    assert "Failed: runs=0 of 2" in page and "torchrun could not start for 01" in page and "Refresh" not in page


DP4_REPORT = json.loads((ROOT / "tests/data/cpu_runs/dp4/report.json").read_text())  # a real run, CPU profile


def copying_runner(_settings):  # noqa: ANN001, ANN201
    """A runner factory whose runs 'measure' the recorded dp4 run of the CPU profile, relabelled with the plan's
    layout: enough for a job to calibrate and store what it found (the slow test below runs for real)."""
    def run(plan_file: Path, report_file: Path, log_file: Path) -> None:
        layout = json.loads(plan_file.read_text())["layout"]
        report_file.write_text(json.dumps({**DP4_REPORT, "layout": layout}))
        log_file.write_text("copied tests/data/cpu_runs/dp4/report.json\n")
    return run


@pytest.mark.parametrize("kind, stored_as", [("reference", "cpu-ref-calibrated"), ("measured", "cpu-ref")])
def test_a_reference_clusters_calibration_is_a_cluster_of_its_own_a_measured_ones_its_next_version(
        client: TestClient, monkeypatch: pytest.MonkeyPatch, kind: str, stored_as: str) -> None:
    monkeypatch.setattr(tune_route, "make_runner", copying_runner)
    base = client.post("/v1/profiles", json={**CPU_PROFILE, "kind": kind, "name": "cpu-ref"})
    assert base.status_code == 201, base.text
    base = base.json()
    job = wait_for(client, client.post("/v1/tune", json=tune_body(cluster="cpu-ref")).json()["id"])
    assert job["state"] == "done", (job.get("error"), job.get("log"))
    calibrated = client.get(f"/v1/profiles/{job['calibrated_profile_id']}").json()
    assert (calibrated["cluster"], calibrated["kind"]) == (stored_as, kind)
    assert calibrated["profile"]["calibration"] == job["result"]["calibration"] is not None
    history = [p["id"] for p in client.get("/v1/clusters/cpu-ref/profiles").json()["items"]]
    page = client.get(f"/tune/{job['id']}").text
    if kind == "reference":  # the shared reference cluster keeps its versions; the calibration is a new cluster
        assert history == [base["id"]]
        own = client.get(f"/v1/clusters/{stored_as}/profiles").json()["items"]
        assert [p["id"] for p in own] == [job["calibrated_profile_id"]]
        assert ("(version 1 of cluster 'cpu-ref-calibrated': 'cpu-ref' is a reference cluster, left as it is)"
                in job["log"][-1])
        assert "of its own cluster <code>cpu-ref-calibrated</code>" in page
    else:
        assert history == [base["id"], job["calibrated_profile_id"]]
        assert "(version 2 of cluster 'cpu-ref')," in job["log"][-1]
        assert "the cluster's newest version: plans use it next" in page
    replanned = client.get(f"/v1/plans/{job['replanned_plan_id']}").json()
    assert replanned["profile_id"] == job["calibrated_profile_id"] and replanned["plan"]["cluster"] == stored_as
    assert [client.get(f"/v1/plans/{r['plan_id']}").json()["profile_id"] for r in job["runs"]] == [base["id"]] * 2
    assert job["result"]["spearman"] is None  # one held-out plan: no rank correlation
    assert 'n/a <span class="muted">(needs 3 held-out plans)</span>' in page and "spearman=n/a" in page


def test_the_page_says_why_the_search_found_no_plan_on_the_calibrated_profile(client: TestClient) -> None:
    from planner.contracts.tune import TuneReport

    db = client.app.state.db
    profile_id = client.get(f"/v1/clusters/{CPU_PROFILE['name']}/profiles").json()["items"][0]["id"]
    job = store.create_tune_job(db, profile_id=profile_id, cluster=CPU_PROFILE["name"], model_name="bench",
                                request={})
    why = "global_batch_size=16 has no layout that fits on 4 GPUs"
    report = TuneReport(cluster=CPU_PROFILE["name"], model="bench", num_gpus=4, runs=[], replan_error=why)
    store.update_tune_job(db, job_id=job.id, state="done", result=report.model_dump(mode="json"))
    page = client.get(f"/tune/{job.id}").text
    assert ("The search found no plan on the calibrated profile (the runs and the calibration stand): " + why
            in page)
    assert "— (no plan on the calibrated profile: see above)" in page


def test_a_run_of_an_older_plan_is_served_and_pages_compare_the_peak_as_measured(client: TestClient) -> None:
    """GET /v1/runs/{id} and /runs/{id} give the predicted peak as the run measured it (allocated, for a CUDA
    run); a plan stored under an older memory contract gives its total, not a 500."""
    from api.charts import fmt_bytes
    from planner.contracts import ModelSpec, ParallelLayout, RunReport, TrainingConfig
    from planner.reference import reference_profile
    from planner.tune import plan_for

    db = client.app.state.db
    profile_id = client.get(f"/v1/clusters/{CPU_PROFILE['name']}/profiles").json()["items"][0]["id"]
    plan = plan_for(ModelSpec(**SPEC), TrainingConfig(**TRAINING), ParallelLayout(**DP4_REPORT["layout"]),
                    reference_profile("dgx-h100", gpus=4))
    memory = plan.prediction.memory
    assert memory.allocated_bytes < memory.total_bytes  # the two figures differ here
    older = plan.model_dump(mode="json")
    older["prediction"]["memory"] = {"total_bytes": 123_456_789, "weights_bytes": 1}  # an older contract's
    report = RunReport.model_validate({**DP4_REPORT, "memory_kind": "cuda_max_allocated"})
    expected = {"today": memory.allocated_bytes, "older": 123_456_789}
    for name, body in (("today", plan.model_dump(mode="json")), ("older", older)):
        row = store.store_plan(db, profile_id=profile_id, request={"n": name}, request_hash=name, status="ok",
                               model_name="bench", num_gpus=4, step_time_s=plan.prediction.step_time_s, plan=body,
                               explanation=None)
        run_id = store.store_run(db, plan_id=row.id, report=report).row.id
        got = client.get(f"/v1/runs/{run_id}")
        assert got.status_code == 200, got.text
        assert got.json()["predicted_peak_memory_bytes"] == expected[name]
        page = client.get(f"/runs/{run_id}").text
        assert f'<td class="num">{fmt_bytes(expected[name])}</td>' in page
    assert fmt_bytes(memory.total_bytes) != fmt_bytes(memory.allocated_bytes)


def test_jobs_left_running_by_a_stopped_service_end_failed(database_url: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tune_route, "make_runner", failing_runner())
    settings = Settings(database_url=database_url, load_reference=False)
    with TestClient(create_app(settings)) as c:
        db = c.app.state.db
        profile_id = c.post("/v1/profiles", json=CPU_PROFILE).json()["id"]
        job = store.create_tune_job(db, profile_id=profile_id, cluster=CPU_PROFILE["name"], model_name="bench",
                                    request={})
        store.update_tune_job(db, job_id=job.id, state="running", phase="run", owner="elsewhere:1")
        db.dispose()
    with TestClient(create_app(settings)) as c:
        got = c.get(f"/v1/tune/{job.id}").json()
        assert got["state"] == "failed" and got["phase"] == "run"
        assert got["error"].startswith("the service stopped during the job (it was running, phase run)")
        r = c.post("/v1/tune", json=tune_body())
        assert r.status_code == 202, r.text  # the slot is free: no 409
        assert wait_for(c, r.json()["id"])["state"] == "failed"  # (its runs cannot start here)
        c.app.state.db.dispose()


def test_the_api_does_not_import_torch() -> None:
    code = ("import sys, api.app, api.routes.tune, api.pages; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# -- a real job ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_real_tune_job_stores_runs_the_calibrated_profile_and_the_new_plan(tmp_path: Path) -> None:
    """Two layouts of the small CPU model on 4 gloo ranks, each run by ``python -m executor run``."""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}", load_reference=False,
                        tune_dir=str(tmp_path / "tune"))
    with TestClient(create_app(settings)) as c:
        base = c.post("/v1/profiles", json=CPU_PROFILE).json()
        r = c.post("/v1/tune", json=tune_body())
        assert r.status_code == 202, r.text
        job = wait_for(c, r.json()["id"], timeout_s=300)
        assert job["state"] == "done", (job.get("error"), job.get("log"))
        report = job["result"]
        assert len(report["runs"]) == 2 and {x["role"] for x in report["runs"]} == {"calibration", "held_out"}
        assert all(x["measured_step_s"] > 0 and x["calibrated_step_s"] > 0 for x in report["runs"])
        # the runs and their plans are stored
        assert [x["name"] for x in job["runs"]] == ["00", "01"]
        runs = c.get("/v1/runs").json()
        assert sorted(x["id"] for x in runs["items"]) == sorted(x["run_id"] for x in job["runs"])
        for stored, ran in zip(job["runs"], report["runs"]):
            plan = c.get(f"/v1/plans/{stored['plan_id']}").json()
            assert plan["request"] == {"tune_job": job["id"], "run": stored["name"], "role": ran["role"]}
            assert plan["plan"]["layout"] == ran["layout"] and plan["profile_id"] == base["id"]
            run = c.get(f"/v1/runs/{stored['run_id']}").json()
            assert run["plan_id"] == stored["plan_id"] and run["measured_step_s"] == ran["measured_step_s"]
        # the calibrated profile is the cluster's next version
        history = c.get(f"/v1/clusters/{CPU_PROFILE['name']}/profiles").json()["items"]
        assert [p["id"] for p in history] == [base["id"], job["calibrated_profile_id"]]
        calibrated = c.get(f"/v1/profiles/{job['calibrated_profile_id']}").json()["profile"]
        assert calibrated["calibration"] is not None and calibrated["calibration"] == report["calibration"]
        replanned = c.get(f"/v1/plans/{job['replanned_plan_id']}").json()
        assert replanned["profile_id"] == job["calibrated_profile_id"]
        assert replanned["plan"]["layout"] == report["replanned"]["layout"]
        from planner.contracts.tune import TuneReport

        page = c.get(f"/tune/{job['id']}")
        assert page.status_code == 200 and "Refresh" not in page.headers
        assert TuneReport.model_validate(report).line() in page.text
        assert f'href="/profiles/{job["calibrated_profile_id"]}"' in page.text
        assert f'href="/plans/{job["replanned_plan_id"]}"' in page.text
        assert f'href="/tune/{job["id"]}"' in c.get(f"/profiles/{base['id']}").text
        assert Path(job["workdir"]).parent == tmp_path / "tune"  # AUTOPAR_TUNE_DIR (Settings.tune_dir)
        assert (Path(job["workdir"]) / "00" / "run.log").is_file() and (Path(job["workdir"]) / "tune.json").is_file()
        c.app.state.db.dispose()


def test_a_service_started_without_tune_jobs_refuses_them(database_url: str) -> None:
    from api.settings import Settings as S

    assert S.from_env({"AUTOPAR_TUNE": "0"}).tune_jobs is False
    assert S.from_env({"AUTOPAR_TUNE_DIR": "/srv/tune"}).tune_dir == "/srv/tune"
    with TestClient(create_app(S(database_url=database_url, load_reference=False, tune_jobs=False))) as c:
        assert c.post("/v1/profiles", json=CPU_PROFILE).status_code == 201
        r = c.post("/v1/tune", json=tune_body())
        assert r.status_code == 503 and "AUTOPAR_TUNE=0" in r.text
        assert c.get("/v1/tune").json()["total"] == 0
        c.app.state.db.dispose()
