"""Tune jobs: ``POST /v1/tune`` runs ``autopar tune`` (planner/tune.py) on the server's host as a background job;
``GET /v1/tune/{id}`` follows it, ``/tune/{id}`` is its page.

A job plans, runs a handful of differing layouts for a few steps with the executor (each in its own
``python -m executor run`` process, so the service never imports torch), calibrates the profile on half and
judges it on the other half, and re-plans. One job runs at a time: its runs take the machine. When it ends it
has stored each run that wrote a report (a plan row and a run row), the calibrated profile (a measured cluster's
next version; a reference cluster's as cluster ``<name>-calibrated``, the shared reference left as it is) and the
re-planned plan, and keeps the TuneReport; or it says why it failed.

The runs' plans, reports and logs stay in the job's work folder (``workdir``): a new folder under
``AUTOPAR_TUNE_DIR`` when the server was given one, else under the system's temporary directory.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request

from api import store
from api.bodies import FiniteJSONRoute
from api.db import Cluster, Database, TuneJob
from api.deps import AUTH_RESPONSES, DB, Id, Limit, Offset, Writer, aware
from api.planning import resolve_model, resolve_profile
from api.schemas import Page, PlanRequest, TuneJobOut, TuneJobRun, TuneJobSummary, TuneRequest
from planner.contracts import ClusterProfile, ModelSpec, Plan, RunReport, TrainingConfig
from planner.contracts.tune import TuneReport
from planner.errors import AutoparError
from planner.reference import on_gpus
from planner.tune import TuneSettings, autopar_runner, tune

log = logging.getLogger("autopar.tune")
router = APIRouter(route_class=FiniteJSONRoute, tags=["tune"])
make_runner = autopar_runner  # how a job runs a layout (tests replace it to exercise the failure path)


@dataclass(frozen=True)
class TuneInputs:
    """A validated request, resolved: what the job's thread runs."""

    model: ModelSpec
    training: TrainingConfig
    profile_id: int  # the stored profile it started from
    cluster: str  # its cluster (a measured one's calibration is its next version; see :func:`own_cluster`)
    profile: ClusterProfile  # that profile, sized as asked
    settings: TuneSettings


# -- requests --------------------------------------------------------------------------------------

def tune_settings(req: TuneRequest, max_budget_s: float) -> TuneSettings:
    """The request's settings as :class:`TuneSettings`; AutoparError naming ``settings.<field>``."""
    s = req.settings
    if s.time_budget_s > max_budget_s:
        raise AutoparError("settings.time_budget_s", s.time_budget_s, f"ask for at most {max_budget_s:g} s (the "
                           "server's AUTOPAR_PLAN_BUDGET_S)", problem="is above the server's limit")
    try:
        return TuneSettings(plans=s.plans, steps=s.steps, warmup=s.warmup, profile_steps=s.profile_steps,
                            target=s.target.value, max_micro_batch_size=s.max_micro_batch_size,
                            time_budget_s=s.time_budget_s, run_timeout_s=s.run_timeout_s)
    except AutoparError as exc:
        raise AutoparError(f"settings.{exc.field}", exc.value, exc.fix, problem=exc.problem) from None


def resolve(db: Database, req: TuneRequest, max_budget_s: float) -> TuneInputs:
    """Model, profile (sized) and settings of a request, resolved as a plan request's are; AutoparError
    naming the field otherwise."""
    model = resolve_model(req.model)
    if "\x00" in model.name:
        raise AutoparError("model.name", model.name, "remove the NUL character", problem="contains a NUL character")
    as_plan = PlanRequest(model=req.model, training=req.training, profile_id=req.profile_id, cluster=req.cluster,
                          num_nodes=req.num_nodes)
    profile_id, profile = resolve_profile(db, as_plan)
    return TuneInputs(model, req.training, profile_id, profile.name,
                      profile if req.gpus is None else on_gpus(profile, req.gpus), tune_settings(req, max_budget_s))


def job_links(row: TuneJob) -> dict[str, str]:
    links = {"self": f"/v1/tune/{row.id}", "page": f"/tune/{row.id}"}
    if row.calibrated_profile_id:
        links["calibrated_profile"] = f"/v1/profiles/{row.calibrated_profile_id}"
    if row.replanned_plan_id:
        links["replanned_plan"] = f"/v1/plans/{row.replanned_plan_id}"
    return links


def job_summary(row: TuneJob) -> TuneJobSummary:
    return TuneJobSummary(id=row.id, state=row.state, created_at=aware(row.created_at),
                          updated_at=aware(row.updated_at), cluster=row.cluster, profile_id=row.profile_id,
                          model_name=row.model_name, phase=row.phase, done=row.done, total=row.total,
                          message=row.message, error=row.error, calibrated_profile_id=row.calibrated_profile_id,
                          replanned_plan_id=row.replanned_plan_id, links=job_links(row))


def job_out(row: TuneJob) -> TuneJobOut:
    return TuneJobOut(**job_summary(row).model_dump(), request=row.request, workdir=row.workdir, log=row.log or [],
                      runs=[TuneJobRun(**r) for r in row.runs or []],
                      result=TuneReport.model_validate(row.result) if row.result else None)


# -- routes ----------------------------------------------------------------------------------------

@router.post("/v1/tune", status_code=202, dependencies=[Writer],
             responses={202: {"links": {"GetTuneJob": {"operationId": "get_tune_job",
                                                       "parameters": {"job_id": "$response.body#/id"}}}},
                        409: {"description": "a tune job is queued or running: one runs at a time"},
                        503: {"description": "this service runs no tune jobs (AUTOPAR_TUNE=0)"},
                        **AUTH_RESPONSES})
def start_tune(req: TuneRequest, db: DB, request: Request) -> TuneJobOut:
    """Start a tune job on the server's host: run ``settings.plans`` differing layouts of the job for a few steps
    each, calibrate the profile on half and judge it on the rest, re-plan on the calibrated profile. Answers at
    once (202); follow it with ``GET /v1/tune/{id}`` or the page ``/tune/{id}``. One job runs at a time (409)."""
    settings = request.app.state.settings
    if not settings.tune_jobs:
        raise HTTPException(503, "this service runs no tune jobs (started with AUTOPAR_TUNE=0): run `autopar tune` "
                            "on the machines to tune, or ask for a service that runs them")
    inputs = resolve(db, req, settings.max_plan_budget_s)
    body = req.model_dump(mode="json", exclude_none=True)
    try:
        row = store.create_tune_job(db, profile_id=inputs.profile_id, cluster=inputs.cluster,
                                    model_name=inputs.model.name, request=body)
    except store.Busy as busy:
        raise HTTPException(409, f"tune job {busy.job_id} is {busy.state} and one job runs at a time (its runs take "
                            f"the machine): wait for it to end, following GET /v1/tune/{busy.job_id}") from None
    base = settings.tune_dir
    try:
        threading.Thread(target=run_job, args=(db, row.id, inputs, base), name=f"tune-{row.id}", daemon=True).start()
    except RuntimeError as exc:  # no thread to run it: the job ends here, not lost
        row = store.update_tune_job(db, job_id=row.id, state="failed", error=f"could not start the job: {exc}")
    return job_out(store.get_tune_job(db, job_id=row.id))


@router.get("/v1/tune")
def list_tune_jobs(db: DB, limit: Limit = 50, offset: Offset = 0,
                   state: Annotated[str | None, Query(pattern="^(queued|running|done|failed)$")] = None,
                   ) -> Page[TuneJobSummary]:
    """Tune jobs, newest first."""
    page = store.list_tune_jobs(db, state=state, limit=limit, offset=offset)
    return Page[TuneJobSummary](items=[job_summary(r) for r in page.items], total=page.total, limit=limit,
                                offset=offset)


@router.get("/v1/tune/{job_id}", responses={404: {"description": "no such tune job"}})
def get_tune_job(job_id: Id, db: DB) -> TuneJobOut:
    """A tune job: its state and progress, its log; when done, the TuneReport and what it stored."""
    return job_out(store.get_tune_job(db, job_id=job_id))


# -- the job ---------------------------------------------------------------------------------------

def workdir(base: str | None, job_id: int) -> Path:
    """A new folder for the job: under ``base`` when given, else under the system's temporary directory."""
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"autopar-tune-{job_id}-", dir=base or None))


def run_job(db: Database, job_id: int, inputs: TuneInputs, base: str | None) -> None:
    """The job's thread: tune, store the outcome; any error ends the job failed with its message."""
    try:
        where = workdir(base, job_id)
        store.update_tune_job(db, job_id=job_id, state="running", workdir=str(where), owner=store.this_process(),
                              log_line=f"{_now()} work folder {where}")
        report, calibrated = tune(inputs.model, inputs.training, inputs.profile, inputs.settings, where,
                                  make_runner(inputs.settings), progress_writer(db, job_id))
        (where / "tune.json").write_text(report.model_dump_json(indent=1))
        store_outcome(db, job_id, inputs, report, calibrated, where)
    except Exception as exc:  # noqa: BLE001 - whatever went wrong, the job says so
        error = str(exc) if isinstance(exc, AutoparError) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, AutoparError):
            log.exception("tune job %s failed", job_id)
        try:
            store.update_tune_job(db, job_id=job_id, state="failed", error=error[:4000],
                                  log_line=f"{_now()} failed: {error[:500]}")
        except Exception:  # noqa: BLE001 - the database is gone: the next start marks the job failed
            log.exception("tune job %s: could not record its failure", job_id)


def _now() -> str:
    return f"{datetime.now(UTC):%H:%M:%S}"


def progress_writer(db: Database, job_id: int):  # noqa: ANN201
    """tune's progress callback: phase, done, total and message into the job row, the message into its log.
    A write that fails is logged, not raised: a database hiccup should not end a job of many minutes."""
    def progress(phase: str, done: int, total: int, what: str) -> None:
        try:
            store.update_tune_job(db, job_id=job_id, phase=phase[:16], done=done, total=total, message=what[:2000],
                                  log_line=f"{_now()} {phase} {done}/{total}: {what[:500]}")
        except Exception:  # noqa: BLE001
            log.exception("tune job %s: could not record its progress", job_id)

    return progress


def store_runs(db: Database, job_id: int, inputs: TuneInputs, report: TuneReport, where: Path) -> list[dict]:
    """Each run that wrote a report, stored as a plan row (its Plan, on the profile the job started from) and a
    run row; [{name, role, plan_id, run_id}]."""
    stored = []
    for r in report.runs:
        try:
            plan = Plan.model_validate_json((where / r.name / "plan.json").read_text())
            ran = RunReport.model_validate_json((where / r.name / "report.json").read_text())
        except (OSError, ValueError):
            continue  # no report (the run failed; the TuneReport says why)
        request = {"tune_job": job_id, "run": r.name, "role": r.role}
        row = store.store_plan(db, profile_id=inputs.profile_id, request=request,
                               request_hash=store.canonical_hash(request), status="ok", model_name=plan.model.name,
                               num_gpus=plan.num_gpus, step_time_s=plan.prediction.step_time_s,
                               plan=plan.model_dump(mode="json"), explanation=None)
        run = store.store_run(db, plan_id=row.id, report=ran)
        stored.append({"name": r.name, "role": r.role, "plan_id": row.id, "run_id": run.row.id})
    return stored


CALIBRATED = "-calibrated"  # a reference profile's calibration is stored as cluster ``<name>-calibrated``


def own_cluster(calibrated: ClusterProfile) -> ClusterProfile:
    """The profile to store: a measured cluster's calibration as it is (that cluster's next version); a
    reference profile's renamed ``<name>-calibrated`` (cut to fit the cluster name column), so that tuning on
    this host does not recalibrate a reference cluster every user of the service plans on. A profile already
    so named (a job that started from a calibrated copy) stays that cluster's next version."""
    if calibrated.kind != "reference" or calibrated.name.endswith(CALIBRATED):
        return calibrated
    longest = Cluster.__table__.c.name.type.length
    return calibrated.model_copy(update={"name": calibrated.name[:longest - len(CALIBRATED)] + CALIBRATED})


def store_outcome(db: Database, job_id: int, inputs: TuneInputs, report: TuneReport, calibrated: ClusterProfile,
                  where: Path) -> None:
    """Store the runs, the calibrated profile (:func:`own_cluster`), the re-planned plan (on it) and the report;
    the job ends done, or failed when fewer than two runs measured a breakdown (nothing to calibrate on)."""
    runs = store_runs(db, job_id, inputs, report, where)
    profile_id, stored_as = None, ""
    if report.calibration is not None:
        calibrated = own_cluster(calibrated)
        calibrated.created_at = aware(datetime.now(UTC))
        entry = store.upload_profile(db, profile=calibrated).entry
        profile_id = entry.profile.id
        stored_as = (f" (version {entry.profile.version} of cluster '{entry.cluster.name}'"
                     + (f": '{inputs.profile.name}' is a reference cluster, left as it is)"
                        if calibrated.name != inputs.profile.name else ")"))
    plan_id = None
    if report.replanned is not None:
        request = {"tune_job": job_id, "replanned": True}
        replanned = report.replanned.model_copy(update={"cluster": calibrated.name})  # the profile it is stored on
        plan_id = store.store_plan(db, profile_id=profile_id or inputs.profile_id, request=request,
                                   request_hash=store.canonical_hash(request), status="ok",
                                   model_name=replanned.model.name, num_gpus=replanned.num_gpus,
                                   step_time_s=replanned.prediction.step_time_s,
                                   plan=replanned.model_dump(mode="json"), explanation=None).id
    error = None
    if report.plans < 2:
        error = str(AutoparError("runs", report.plans, f"read each run's error in the result and its log in "
                                 f"{where}/NN/run.log", problem=f"of {len(report.runs)} measured a breakdown by term: "
                                 "too few to calibrate on (two are needed)"))
    store.update_tune_job(db, job_id=job_id, state="failed" if error else "done", error=error,
                          result=report.model_dump(mode="json"), runs=runs, calibrated_profile_id=profile_id,
                          replanned_plan_id=plan_id, log_line=f"{_now()} " + (error or (
                              f"stored {len(runs)} runs (plans and runs), calibrated profile {profile_id}{stored_as}, "
                              f"re-planned plan {plan_id}")))
