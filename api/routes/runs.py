"""Runs: what the executor measured for a plan, beside the plan's prediction: ``/v1/runs``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import ValidationError

from api import store
from api.bodies import FiniteJSONRoute
from api.deps import AUTH_RESPONSES, DB, Id, Limit, Offset, Writer, aware, link
from api.schemas import MAX_ID, Page, RunErrorSummary, RunOut, RunSubmit, RunSubmitted, RunSummary
from planner.contracts import MemoryBreakdown, RunReport
from planner.errors import AutoparError

router = APIRouter(route_class=FiniteJSONRoute, tags=["runs"])


def _error(predicted_s: float | None, measured_s: float) -> float | None:
    return (predicted_s / measured_s - 1) if predicted_s else None


def run_out(entry: store.RunEntry) -> RunOut:
    row = entry.run
    report = RunReport.model_validate(row.report)
    pred = (entry.plan.plan or {}).get("prediction") or {}
    return RunOut(id=row.id, plan_id=row.plan_id, created_at=aware(row.created_at),
                  predicted_step_s=row.predicted_step_s, measured_step_s=row.measured_step_s,
                  error=_error(row.predicted_step_s, row.measured_step_s),
                  report=report, predicted_tokens_per_s=pred.get("tokens_per_s"),
                  measured_tokens_per_s=report.tokens_per_s,
                  predicted_peak_memory_bytes=predicted_peak(pred, report),
                  measured_peak_memory_bytes=max(report.peak_memory_bytes_per_rank or [0]))


def predicted_peak(pred: dict, report: RunReport) -> int | None:
    """The plan's predicted peak as the run measured it (``MemoryBreakdown.as_measured``): what the API and the
    run's page compare with the measured peak. An older plan whose memory no longer validates as today's
    MemoryBreakdown gives its ``total_bytes`` (as it was predicted), not an error."""
    memory = pred.get("memory")
    if not memory:
        return None
    try:
        return MemoryBreakdown.model_validate(memory).as_measured(report.memory_kind)
    except ValidationError:
        total = memory.get("total_bytes") if isinstance(memory, dict) else None
        return total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None


@router.post("/v1/runs", status_code=201, dependencies=[Writer],
             responses={404: {"description": "no such plan"}, 201: {"links": link("GetRun", "run_id")},
                        200: {"model": RunSubmitted, "description": "this report was stored for the plan before: "
                                                                      "that run (created false)"},
                        **AUTH_RESPONSES})
def submit_run(body: RunSubmit, db: DB, response: Response) -> RunSubmitted:
    """Store what the executor measured for a plan; shown beside the plan's prediction. The same report posted
    again for the plan (a retry) is the run stored first: 200 with ``created`` false, nothing stored twice."""
    if body.report.plan_id is not None and body.report.plan_id != str(body.plan_id):
        raise AutoparError("report.plan_id", body.report.plan_id, f"leave it out or set it to '{body.plan_id}'",
                           problem=f"differs from plan_id={body.plan_id}")
    stored = store.store_run(db, plan_id=body.plan_id, report=body.report)
    if not stored.created:
        response.status_code = 200
    return RunSubmitted(**run_out(store.get_run(db, run_id=stored.row.id)).model_dump(), created=stored.created)


@router.get("/v1/runs/summary")
def run_summary(db: DB) -> RunErrorSummary:
    """Prediction error of step time (predicted / measured - 1) over every stored run."""
    return RunErrorSummary(**store.run_error_summary(db))


@router.get("/v1/runs")
def list_runs(db: DB, limit: Limit = 50, offset: Offset = 0,
              plan_id: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None) -> Page[RunSummary]:
    page = store.list_runs(db, plan_id=plan_id, limit=limit, offset=offset)
    items = [RunSummary(id=r.id, plan_id=r.plan_id, created_at=aware(r.created_at),
                        predicted_step_s=r.predicted_step_s, measured_step_s=r.measured_step_s,
                        error=_error(r.predicted_step_s, r.measured_step_s)) for r in page.items]
    return Page[RunSummary](items=items, total=page.total, limit=limit, offset=offset)


@router.get("/v1/runs/{run_id}", responses={404: {"description": "no such run"}})
def get_run(run_id: Id, db: DB) -> RunOut:
    return run_out(store.get_run(db, run_id=run_id))
