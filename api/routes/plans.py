"""Plans: ``POST /v1/plans`` searches and stores one; the GETs read them back."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from api import store
from api.bodies import FiniteJSONRoute
from api.deps import AUTH_RESPONSES, DB, NO_NUL, Id, Limit, Offset, Writer, aware, link
from api.planning import make_plan
from api.schemas import MAX_ID, Page, PlanOut, PlanRequest, PlanSummary
from planner.contracts import Plan

router = APIRouter(route_class=FiniteJSONRoute, tags=["plans"])


def plan_summary(entry: store.PlanEntry) -> PlanSummary:
    row = entry.plan
    return PlanSummary(id=row.id, created_at=aware(row.created_at), status=row.status, model_name=row.model_name,
                       num_gpus=row.num_gpus, profile_id=row.profile_id, cluster=entry.cluster.name,
                       step_time_s=row.step_time_s)


def plan_out(entry: store.PlanEntry, reused: bool) -> PlanOut:
    row = entry.plan
    return PlanOut(**plan_summary(entry).model_dump(), request=row.request,
                   plan=Plan.model_validate(row.plan) if row.plan else None,
                   explanation=row.explanation, reused=reused)


@router.post("/v1/plans", status_code=201, dependencies=[Writer],
             responses={201: {"links": {**link("GetPlan", "plan_id"), "SubmitRun": {
                 "operationId": "submit_run", "requestBody": {"plan_id": "$response.body#/id"}}}}, **AUTH_RESPONSES})
def create_plan(req: PlanRequest, db: DB, request: Request) -> PlanOut:
    """Search the fastest layout that fits; stored with its alternatives and explanations.

    A request that admits no plan is stored too, with ``status: infeasible`` and an ``explanation``."""
    row, reused = make_plan(db, req, request.app.state.settings.max_plan_budget_s)
    return plan_out(store.get_plan(db, plan_id=row.id), reused)


@router.get("/v1/plans")
def list_plans(db: DB, limit: Limit = 50, offset: Offset = 0,
               model: Annotated[str | None, Query(max_length=200, pattern=NO_NUL,
                                                  description="model name contains")] = None,
               status: Annotated[str | None, Query(pattern="^(ok|infeasible)$")] = None,
               profile_id: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None) -> Page[PlanSummary]:
    page = store.list_plans(db, model=model, status=status, profile_id=profile_id, limit=limit, offset=offset)
    return Page[PlanSummary](items=[plan_summary(e) for e in page.items], total=page.total, limit=limit,
                             offset=offset)


@router.get("/v1/plans/{plan_id}", responses={404: {"description": "no such plan"}})
def get_plan(plan_id: Id, db: DB) -> PlanOut:
    return plan_out(store.get_plan(db, plan_id=plan_id), False)
