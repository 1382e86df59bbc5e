"""The FastAPI application: JSON API under ``/v1`` (one router per resource, :mod:`api.routes`), health
probes, and the human pages at ``/`` (:mod:`api.pages`).

``create_app(settings)`` builds an app bound to one database; ``autopar serve`` and the tests use it.
Every error a client can cause is answered with a JSON body naming the field, the value and the
fix (422), or what was not found (404); anything else is a 500 with an error id, logged with its
traceback on the server and never shown to the client.
"""

from __future__ import annotations

import logging
import math
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import store
from api.bodies import COMMON_RESPONSES, BodyLimit
from api.db import Database
from api.migrate import migrate
from api.pages import router as pages_router
from api.routes import ROUTERS
from api.settings import Settings
from api.slots import Saturated, SearchSlots
from planner.errors import AutoparError

log = logging.getLogger("autopar.api")

API_DESCRIPTION = """Plan how to split a transformer's training over a cluster, store cluster profiles, and compare
predictions with measured runs. Writes (POST) need `Authorization: Bearer <token>` when the server
was started with `AUTOPAR_TOKENS`; reads are open."""


# -- the app ---------------------------------------------------------------------------------------

def create_app(settings: Settings | None = None, db: Database | None = None) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        database = db or Database(settings.database_url)
        migrate(database.engine)
        stale = store.fail_stale_tune_jobs(database)  # their thread died with the process that ran them
        if stale:
            log.warning("tune jobs %s were left unfinished by a previous process: marked failed", stale)
        if settings.load_reference:
            store.load_reference_profiles(database)
        app.state.db = database
        yield
        if db is None:
            database.dispose()

    app = FastAPI(title="autopar", version="1", description=API_DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None, responses=COMMON_RESPONSES,
                  generate_unique_id_function=lambda route: route.name)  # operationId = the function's name
    app.state.settings = settings
    app.state.plan_slots = SearchSlots(settings.plan_workers, settings.plan_queue, settings.max_plan_budget_s)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    _errors(app)
    _offline_docs(app)
    for router in (*ROUTERS, pages_router):
        app.include_router(router)
    return app


DOCS_ASSETS = "/docs-assets"


def _offline_docs(app: FastAPI) -> None:
    """``/docs``: Swagger UI served from the swagger-ui-bundle package (no CDN: the docs work offline)."""
    import swagger_ui_bundle
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="autopar API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")


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
    @app.exception_handler(Saturated)
    async def _saturated(_request: Request, exc: Saturated) -> JSONResponse:
        return JSONResponse(status_code=503, headers={"Retry-After": str(exc.retry_after_s)},
                            content={"detail": f"{exc}; retry after {exc.retry_after_s} s"})

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
