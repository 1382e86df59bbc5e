"""The FastAPI application: JSON API under ``/v1``, health probes, and the human pages at ``/``.

``create_app(settings)`` builds an app bound to one database; ``autopar serve`` and the tests use it.
Every error a client can cause is answered with a JSON body naming the field, the value and the
fix (422), or what was not found (404); anything else is a 500 with an error id, logged with its
traceback on the server and never shown to the client.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import uuid
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from sqlalchemy import text
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import store
from api.db import Database
from api.migrate import migrate
from api.planning import make_plan
from api.schemas import (
    MAX_ID,
    ClusterSummary,
    Page,
    PlanOut,
    PlanRequest,
    PlanSummary,
    PresetOut,
    ProfileOut,
    ProfileSummary,
    ProfileUploaded,
    RunErrorSummary,
    RunOut,
    RunSubmit,
    RunSummary,
)
from api.settings import Settings
from planner.contracts import ClusterProfile, Plan, RunReport
from planner.errors import AutoparError

log = logging.getLogger("autopar.api")

API_DESCRIPTION = """Plan how to split a transformer's training over a cluster, store cluster profiles, and compare
predictions with measured runs. Writes (POST) need `Authorization: Bearer <token>` when the server
was started with `AUTOPAR_TOKENS`; reads are open."""


def aware(dt: datetime) -> datetime:
    """Datetimes read back from SQLite are naive UTC; say so."""
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


# -- request body limit --------------------------------------------------------------------------

class BodyLimit:
    """ASGI middleware: bodies over ``max_bytes`` get 413 (by Content-Length, or counted while streaming)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = JSONResponse(status_code=413, content={
            "detail": f"request body is larger than {self.max_bytes} bytes; send less, or raise "
                      "AUTOPAR_MAX_BODY_BYTES on the server"})
        try:
            if declared is not None and int(declared) > self.max_bytes:
                await too_big(scope, receive, send)
                return
        except ValueError:
            await JSONResponse(status_code=400,
                               content={"detail": "Content-Length is not a number"})(scope, receive, send)
            return
        seen = 0
        answered = False

        async def guarded_send(message: dict) -> None:
            if not answered:  # after the 413 the app's own reply (to a disconnect) is dropped
                await send(message)

        async def counted() -> dict:
            nonlocal seen, answered
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    await too_big(scope, receive, send)
                    answered = True
                    return {"type": "http.disconnect"}
            return message

        try:
            await self.app(scope, counted, guarded_send)
        except Exception:
            if not answered:
                raise


# -- request bodies hold finite numbers -------------------------------------------------------------

class _NonFinite:
    """A number JSON has no place for, where it stood in a body: ``NaN``, ``Infinity``, ``-Infinity``
    (Python's json reads them) or a literal beyond the largest float (``1e999``)."""

    def __init__(self, text: str):
        self.text = text


def _float_or_mark(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def non_finite_field(document: Any) -> tuple[str, str] | None:
    """(dotted path, literal) of the first non-finite number of a document parsed by
    :func:`finite_json`, else None (an explicit stack: bodies may nest as deeply as json reads)."""
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, _NonFinite):
            return path or "body", node.text
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend(reversed([(f"{path}.{k}" if path else str(k), v) for k, v in items]))
    return None


def finite_json(body: bytes) -> Any:
    """The JSON document in ``body``; AutoparError naming the field of a number that is not finite
    (ValueError or RecursionError where ``body`` is no JSON, as :func:`json.loads`)."""
    document = json.loads(body, parse_constant=_NonFinite, parse_float=_float_or_mark)
    found = non_finite_field(document)
    if found is not None:
        field, literal = found
        raise AutoparError(field, literal, "send a finite number (JSON has no NaN or Infinity)",
                           problem="is not a finite number")
    return document


class FiniteJSONRequest(Request):
    """A request whose JSON body is read by :func:`finite_json`, once."""

    async def json(self) -> Any:
        if not hasattr(self, "_finite_json"):
            self._finite_json = finite_json(await self.body())
        return self._finite_json


class FiniteJSONRoute(APIRoute):
    """A route that answers 422, naming the field, a body holding NaN or ±Infinity, before FastAPI
    validates it (whose error would echo ``nan``, which no JSON response can hold)."""

    def get_route_handler(self) -> Any:
        handle = super().get_route_handler()

        async def handler(request: Request) -> Response:
            request = FiniteJSONRequest(request.scope, request.receive)
            try:
                if await request.body():
                    await request.json()
            except AutoparError:
                raise
            except Exception:  # noqa: BLE001 - no JSON, or no whole body: FastAPI answers it as it answers any such
                pass
            return await handle(request)

        return handler


COMMON_RESPONSES: dict = {
    400: {"description": "the body is not valid JSON"},
    413: {"description": "the body is larger than AUTOPAR_MAX_BODY_BYTES"},
}


# -- the app ---------------------------------------------------------------------------------------

def create_app(settings: Settings | None = None, db: Database | None = None) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        database = db or Database(settings.database_url)
        migrate(database.engine)
        if settings.load_reference:
            store.load_reference_profiles(database)
        app.state.db = database
        yield
        if db is None:
            database.dispose()

    app = FastAPI(title="autopar", version="1", description=API_DESCRIPTION, lifespan=lifespan,
                  docs_url="/docs", redoc_url=None, responses=COMMON_RESPONSES,
                  generate_unique_id_function=lambda route: route.name)  # operationId = the function's name
    app.state.settings = settings
    app.router.route_class = FiniteJSONRoute
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    _errors(app)
    _routes(app, settings)
    from api.pages import router as pages_router

    app.include_router(pages_router)
    return app


def _detail(field: str, message: str, value: Any = None, fix: str | None = None) -> dict:
    parts = [] if field == "body" else field.split(".")  # "body": the whole document
    loc: list[Any] = ["body"] + [int(p) if p.isdigit() else p for p in parts]
    item = {"loc": loc, "msg": message, "type": "value_error"}
    if value is not None:  # as JSON can hold it: a float that is not finite as its text
        finite = not isinstance(value, float) or math.isfinite(value)
        item["input"] = value if isinstance(value, (str, int, float, bool)) and finite else str(value)
    if fix:
        item["ctx"] = {"fix": fix}
    return item


def _errors(app: FastAPI) -> None:
    @app.exception_handler(AutoparError)
    async def _bad_input(_request: Request, exc: AutoparError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": [_detail(exc.field, str(exc), exc.value, exc.fix)]})

    @app.exception_handler(ValidationError)
    async def _invalid(_request: Request, exc: ValidationError) -> JSONResponse:
        items = [{"loc": ["body", *err["loc"]], "msg": err["msg"], "type": err["type"]} for err in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": items})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        # an unknown page gets the pages' HTML 404; the API keeps JSON
        if exc.status_code == 404 and not request.url.path.startswith("/v1") and request.method == "GET":
            from api.pages import not_found_page

            return not_found_page(request, request.url.path)
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail},
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(store.NotFound)
    async def _missing(_request: Request, exc: store.NotFound) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": str(exc)})

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex[:12]
        log.exception("error %s on %s %s", error_id, request.method, request.url.path)
        return JSONResponse(status_code=500, content={
            "detail": f"internal error {error_id}; the server log has the details"})


def _db(request: Request) -> Database:
    return request.app.state.db


DB = Annotated[Database, Depends(_db)]
Limit = Annotated[int, Query(ge=1, le=500, description="page size")]
Offset = Annotated[int, Query(ge=0, le=10**9, description="rows to skip")]
NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL characters
Id = Annotated[int, Path(ge=1, le=MAX_ID, description="row id")]
bearer = HTTPBearer(auto_error=False, description="needed for writes when the server has AUTOPAR_TOKENS set")


def _writer(request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    tokens = request.app.state.settings.tokens
    if not tokens:
        return
    if creds is None or creds.scheme.lower() != "bearer":
        raise HTTPException(401, "this server needs a bearer token for writes: send 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    if not any(secrets.compare_digest(creds.credentials.encode(), t.encode()) for t in tokens):
        raise HTTPException(403, "the bearer token is not one of the server's AUTOPAR_TOKENS")


Writer = Depends(_writer)
AUTH_RESPONSES: dict = {401: {"description": "no bearer token (server has AUTOPAR_TOKENS)"},
                        403: {"description": "unknown bearer token"}, 413: {"description": "body too large"}}


def _link(operation: str, param: str) -> dict:
    """OpenAPI link: the created resource's id feeds the GET of it (clients and schemathesis follow it)."""
    op = {"GetProfile": "get_profile", "GetPlan": "get_plan", "GetRun": "get_run"}[operation]
    return {operation: {"operationId": op, "parameters": {param: "$response.body#/id"}}}


def profile_summary(p: Any, c: Any) -> ProfileSummary:
    return ProfileSummary(id=p.id, cluster=c.name, version=p.version, kind=p.kind, gpu_name=p.gpu_name,
                          gpus_per_node=p.gpus_per_node, num_nodes=p.num_nodes, measured_at=aware(p.measured_at),
                          uploaded_at=aware(p.uploaded_at), content_hash=p.content_hash)


def plan_summary(row: Any, cluster: Any) -> dict:
    return dict(id=row.id, created_at=aware(row.created_at), status=row.status, model_name=row.model_name,
                num_gpus=row.num_gpus, profile_id=row.profile_id, cluster=cluster.name, step_time_s=row.step_time_s)


def run_out(row: Any, plan_row: Any) -> RunOut:
    report = RunReport.model_validate(row.report)
    pred = (plan_row.plan or {}).get("prediction") or {}
    return RunOut(id=row.id, plan_id=row.plan_id, created_at=aware(row.created_at),
                  predicted_step_s=row.predicted_step_s, measured_step_s=row.measured_step_s,
                  error=(row.predicted_step_s / row.measured_step_s - 1) if row.predicted_step_s else None,
                  report=report, predicted_tokens_per_s=pred.get("tokens_per_s"),
                  measured_tokens_per_s=report.tokens_per_s,
                  predicted_peak_memory_bytes=(pred.get("memory") or {}).get("total_bytes"),
                  measured_peak_memory_bytes=max(report.peak_memory_bytes_per_rank or [0]))


def _utc(dt: datetime | None, db: Database) -> datetime | None:
    if dt is None:
        return None
    dt = dt.astimezone(UTC) if dt.tzinfo else dt.replace(tzinfo=UTC)
    return dt.replace(tzinfo=None) if db.dialect == "sqlite" else dt


def _routes(app: FastAPI, settings: Settings) -> None:
    @app.get("/healthz", tags=["health"])
    def healthz() -> dict:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"description": "database unreachable"}})
    def readyz(db: DB) -> Response:
        """The database answers."""
        try:
            with db.read() as s:
                s.execute(text("SELECT 1"))
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            log.warning("readyz: %s", exc)
            return JSONResponse(status_code=503, content={"status": "database unreachable"})
        return JSONResponse({"status": "ready", "database": db.dialect})

    @app.get("/v1/auth", tags=["health"], dependencies=[Writer],
             responses={k: v for k, v in AUTH_RESPONSES.items() if k != 413})
    def auth(request: Request) -> dict:
        """Whether this request may write (POST): 200 when writes are open or its bearer token is one of
        the server's AUTOPAR_TOKENS, 401/403 as a POST would get. `autopar profile` and `autopar run`
        ask before measuring, so a refused upload does not come after an hour's work."""
        return {"writes": "token accepted" if request.app.state.settings.tokens else "open"}

    # -- presets
    @app.get("/v1/presets", tags=["models"])
    def presets() -> list[PresetOut]:
        """Model presets a plan request can name (``model.preset``)."""
        from planner.presets import get_preset, list_presets

        return [PresetOut(name=n, spec=get_preset(n)) for n in list_presets()]

    @app.get("/v1/presets/{name}", tags=["models"], responses={404: {"description": "unknown preset"}})
    def preset(name: Annotated[str, Path(max_length=200)]) -> PresetOut:
        from planner.presets import get_preset

        try:
            return PresetOut(name=name, spec=get_preset(name))
        except AutoparError:
            raise store.NotFound("preset", name) from None

    # -- profiles and clusters
    @app.post("/v1/profiles", tags=["profiles"], status_code=201, dependencies=[Writer],
              responses={200: {"description": "the same content was stored before: that profile",
                               "model": ProfileUploaded},
                         201: {"links": _link("GetProfile", "profile_id")}, **AUTH_RESPONSES})
    def upload_profile(profile: ClusterProfile, db: DB, response: Response) -> ProfileUploaded:
        """Store a ClusterProfile (measured or reference) as the next version of its cluster (``name``).

        Profiles are immutable; the same content uploaded again returns the stored one (200, ``created: false``)."""
        for field, value in (("name", profile.name), ("device.name", profile.device.name)):
            if "\x00" in value:
                raise AutoparError(field, value, "remove the NUL character", problem="contains a NUL character")
        if profile.created_at.tzinfo is None:
            profile.created_at = profile.created_at.replace(tzinfo=UTC)
        row, cluster, created = store.upload_profile(db, profile)
        if not created:
            response.status_code = 200
        return ProfileUploaded(**profile_summary(row, cluster).model_dump(),
                               profile=ClusterProfile.model_validate(row.body), created=created)

    @app.get("/v1/profiles", tags=["profiles"])
    def list_profiles(db: DB, limit: Limit = 50, offset: Offset = 0,
                      gpu: Annotated[str | None, Query(max_length=200, pattern=NO_NUL,
                                                       description="device name contains (any case)")] = None,
                      kind: Annotated[str | None, Query(pattern="^(measured|reference)$")] = None,
                      cluster: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
                      since: Annotated[datetime | None, Query(description="measured at or after (ISO 8601)")] = None,
                      until: Annotated[datetime | None, Query(description="measured at or before (ISO 8601)")] = None,
                      ) -> Page[ProfileSummary]:
        """Stored profiles, newest upload first."""
        rows, total = store.list_profiles(db, gpu=gpu, kind=kind, cluster=cluster, since=_utc(since, db),
                                          until=_utc(until, db), limit=limit, offset=offset)
        return Page[ProfileSummary](items=[profile_summary(p, c) for p, c in rows], total=total, limit=limit,
                                    offset=offset)

    @app.get("/v1/profiles/{profile_id}", tags=["profiles"], responses={404: {"description": "no such profile"}})
    def get_profile(profile_id: Id, db: DB) -> ProfileOut:
        row, cluster = store.get_profile(db, profile_id)
        return ProfileOut(**profile_summary(row, cluster).model_dump(), profile=ClusterProfile.model_validate(row.body))

    @app.get("/v1/clusters", tags=["profiles"])
    def list_clusters(db: DB, limit: Limit = 50, offset: Offset = 0,
                      gpu: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
                      kind: Annotated[str | None, Query(pattern="^(measured|reference)$")] = None,
                      ) -> Page[ClusterSummary]:
        """Clusters with their newest profile."""
        rows, total = store.list_clusters(db, gpu=gpu, kind=kind, limit=limit, offset=offset)
        items = [ClusterSummary(name=c.name, latest_profile_id=p.id, versions=n, kind=p.kind, gpu_name=p.gpu_name,
                                gpus_per_node=p.gpus_per_node, num_nodes=p.num_nodes) for c, p, n in rows]
        return Page[ClusterSummary](items=items, total=total, limit=limit, offset=offset)

    @app.get("/v1/clusters/{name}/profiles", tags=["profiles"], responses={404: {"description": "no such cluster"}})
    def cluster_history(name: Annotated[str, Path(max_length=200, pattern=NO_NUL)], db: DB) -> list[ProfileSummary]:
        """Every version of a cluster's profile, oldest first."""
        return [profile_summary(p, c) for p, c in store.cluster_history(db, name)]

    # -- plans
    @app.post("/v1/plans", tags=["plans"], status_code=201, dependencies=[Writer],
              responses={201: {"links": {**_link("GetPlan", "plan_id"), "SubmitRun": {
                  "operationId": "submit_run", "requestBody": {"plan_id": "$response.body#/id"}}}}, **AUTH_RESPONSES})
    def create_plan(req: PlanRequest, db: DB) -> PlanOut:
        """Search the fastest layout that fits; stored with its alternatives and explanations.

        A request that admits no plan is stored too, with ``status: infeasible`` and an ``explanation``."""
        row, reused = make_plan(db, req, settings.max_plan_budget_s)
        _, cluster = store.get_plan(db, row.id)
        return _plan_out(row, cluster, reused)

    @app.get("/v1/plans", tags=["plans"])
    def list_plans(db: DB, limit: Limit = 50, offset: Offset = 0,
                   model: Annotated[str | None, Query(max_length=200, pattern=NO_NUL,
                                                      description="model name contains")] = None,
                   status: Annotated[str | None, Query(pattern="^(ok|infeasible)$")] = None,
                   profile_id: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None) -> Page[PlanSummary]:
        rows, total = store.list_plans(db, model=model, status=status, profile_id=profile_id, limit=limit,
                                       offset=offset)
        return Page[PlanSummary](items=[PlanSummary(**plan_summary(r, c)) for r, c in rows], total=total, limit=limit,
                                 offset=offset)

    @app.get("/v1/plans/{plan_id}", tags=["plans"], responses={404: {"description": "no such plan"}})
    def get_plan(plan_id: Id, db: DB) -> PlanOut:
        row, cluster = store.get_plan(db, plan_id)
        return _plan_out(row, cluster, False)

    # -- runs
    @app.post("/v1/runs", tags=["runs"], status_code=201, dependencies=[Writer],
              responses={404: {"description": "no such plan"}, 201: {"links": _link("GetRun", "run_id")},
                         **AUTH_RESPONSES})
    def submit_run(body: RunSubmit, db: DB) -> RunOut:
        """Store what the executor measured for a plan; shown beside the plan's prediction."""
        if body.report.plan_id is not None and body.report.plan_id != str(body.plan_id):
            raise AutoparError("report.plan_id", body.report.plan_id, f"leave it out or set it to '{body.plan_id}'",
                               problem=f"differs from plan_id={body.plan_id}")
        row = store.store_run(db, body.plan_id, body.report)
        run, plan_row = store.get_run(db, row.id)
        return run_out(run, plan_row)

    @app.get("/v1/runs/summary", tags=["runs"])
    def run_summary(db: DB) -> RunErrorSummary:
        """Prediction error of step time (predicted / measured - 1) over every stored run."""
        return RunErrorSummary(**store.run_error_summary(db))

    @app.get("/v1/runs", tags=["runs"])
    def list_runs(db: DB, limit: Limit = 50, offset: Offset = 0,
                  plan_id: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None) -> Page[RunSummary]:
        rows, total = store.list_runs(db, plan_id=plan_id, limit=limit, offset=offset)
        items = [RunSummary(id=r.id, plan_id=r.plan_id, created_at=aware(r.created_at),
                            predicted_step_s=r.predicted_step_s, measured_step_s=r.measured_step_s,
                            error=(r.predicted_step_s / r.measured_step_s - 1) if r.predicted_step_s else None)
                 for r in rows]
        return Page[RunSummary](items=items, total=total, limit=limit, offset=offset)

    @app.get("/v1/runs/{run_id}", tags=["runs"], responses={404: {"description": "no such run"}})
    def get_run(run_id: Id, db: DB) -> RunOut:
        return run_out(*store.get_run(db, run_id))


def _plan_out(row: Any, cluster: Any, reused: bool) -> PlanOut:
    return PlanOut(**plan_summary(row, cluster), request=row.request,
                   plan=Plan.model_validate(row.plan) if row.plan else None,
                   explanation=row.explanation, reused=reused)
