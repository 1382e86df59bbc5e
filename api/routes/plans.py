"""Plans: ``POST /v1/plans`` searches and stores one; the GETs read them back."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from api import store
from api.bodies import FiniteJSONRoute
from api.deps import AUTH_RESPONSES, DB, NO_NUL, Id, Limit, Offset, Writer, aware, link
from api.planning import keyed_plan, make_plan
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
                 "operationId": "submit_run", "requestBody": {"plan_id": "$response.body#/id"}}}},
                        200: {"model": PlanOut, "description": "a retry: the plan stored for this Idempotency-Key"},
                        503: {"description": "every plan search slot and the queue are busy: retry after the "
                                             "Retry-After header's seconds"}, **AUTH_RESPONSES})
def create_plan(req: PlanRequest, db: DB, request: Request, response: Response,
                idempotency_key: Annotated[str | None, Header(
                    max_length=200, pattern=r"^[\x21-\x7e]+$", description="a retry of a request sent with this "
                    "key is answered with the plan stored for it (200), nothing stored twice")] = None) -> PlanOut:
    """Search the fastest layout that fits; stored with its alternatives and explanations.

    A request that admits no plan is stored too, with ``status: infeasible`` and an ``explanation``."""
    retried = keyed_plan(db, req, idempotency_key)
    if retried is not None:
        response.status_code = 200
        return plan_out(store.get_plan(db, plan_id=retried.id), True)
    with request.app.state.plan_slots.slot():  # bounded: a saturated service answers 503 (api/slots.py)
        row, reused = make_plan(db, req, request.app.state.settings.max_plan_budget_s, idempotency_key)
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
